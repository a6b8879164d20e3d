"""check_equivalence passes on every registered image model at two settings of K, T and schedule.

The translation models are checked in equivalence_mt_models_test.py (with this file's helpers).

The small models (image.AmoebaNetDigits, mt.TransformerSmall) run as registered. GPipe's ImageNet
AmoebaNets and T(L, H, A) Transformers are far too large for a CPU test and their data
(imagenet2012, the user's ~/mt_data) is not here, so each is checked as a subclass that keeps its
architecture (variant, stem, aux head, dropout and drop-path rates, label smoothing, shared
embeddings) and shrinks only sizes and data: 80x80 digits as 3-channel images, F=8, L=1 for the
AmoebaNets; the generated en-de corpus, model dim 16 and L <= 2 for the Transformers.
Shrunk, several registered models become the same configuration (the AmoebaNet-D family differs
only in L, F and K, which the shrinking and the settings replace): each distinct configuration is
checked once, under the first of its names, and the test names the others it stands for.
Shrunk, AmoebaNet-D is AmoebaNet-B's network with AmoebaNetDigits' cells; those two pass at both
settings, so AmoebaNet-D is checked at the first only.
Both sides run eagerly (`use_tf_function=False`) to skip tracing; tests/e2e/equivalence_test.py runs
the traced path through trainer.py.
"""

from __future__ import annotations

import pytest
import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite.analysis import equivalence
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import model_registry
from lingvo_lite.training import model_config
from model_params import image, mt  # noqa: F401 (registers the models)
from tasks.image import input_generator

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

# (K, T, schedule): the second setting runs zero-bubble, whose B defers the weight gradients of
# every matmul, einsum and convolution to W (layers.weight_ops).
SETTINGS = ((2, 2, "gpipe"), (4, 4, "zero_bubble"))


def _small(name: str) -> model_registry.SingleTaskModelParams:
    cls = model_registry.get_class(name)
    if issubclass(cls, image._AmoebaNetImageNet):
        class Small(cls):
            FILTERS, NUM_NORMAL_CELLS, IMAGE_SIZE, BATCH_SIZE = 8, 1, 80, 8

            def Train(self):
                return input_generator.DigitsInput.Params().Set(
                    name="digits_train", split="train", image_size=self.IMAGE_SIZE,
                    num_channels=3, batch_size=self.BATCH_SIZE)
        return Small()
    if issubclass(cls, mt._GPipeTransformer):
        class Small(cls):
            NUM_LAYERS, HIDDEN_DIM, NUM_HEADS, MODEL_DIM = 2, 32, 2, 16
            VOCAB_SIZE, MAX_LENGTH, BATCH_SIZE = 512, 18, 16

            def Train(self):
                return super().Train().Set(data_dir=mt.TransformerSmall.DATA_DIR,
                                           generate="en_de_numbers")
        return Small()
    return cls()


def _configured(name: str, num_cells: int, num_micro_batches: int, schedule: str):
    task_p = _small(name).Model()
    model_config.set_pipeline_fields(task_p, num_cells=num_cells,
                                     num_micro_batches=num_micro_batches)
    for _, pipeline in model_config.iter_pipelining_params(task_p):
        pipeline.schedule = schedule
    return task_p


def distinct_registered(prefix: str) -> list[tuple[str, tuple[str, ...]]]:
    """(name, names with the same configuration) for each distinct shrunk and configured model.

    Two names are the same test when their task params, at every setting, have the same text.
    """
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in sorted(n for n in model_registry.list_models() if n.startswith(prefix)):
        key = tuple(_configured(name, *setting).ToText() for setting in SETTINGS)
        groups.setdefault(key, []).append(name)
    return [(names[0], tuple(names[1:])) for names in groups.values()]


class CheckAllSettings:

    def check_all_settings(self, name: str, same_as: tuple[str, ...] = (),
                           settings: tuple[tuple[int, int, str], ...] = SETTINGS) -> None:
        if same_as:
            print(f"{name} also checks {', '.join(same_as)} (the same shrunk configuration)")
        for num_cells, num_micro_batches, schedule in settings:
            task_p = _configured(name, num_cells, num_micro_batches, schedule)
            task = task_p.Instantiate()
            batch = NestedMap(next(iter(task_p.input.Instantiate().dataset())))
            report = equivalence.check_equivalence(task, batch, use_tf_function=False)
            with self.subTest(num_cells=num_cells, num_micro_batches=num_micro_batches,
                              schedule=schedule):
                print(f"{name} K={num_cells} T={num_micro_batches} {schedule}: loss "
                      f"{report.loss_rel_diff:.1e}, worst gradient "
                      f"{report.worst.max_rel_diff:.1e} ({report.worst.name})")
                self.assertTrue(report.passed, report.format())
                self.assertEqual(report.pipelines[0].num_cells, num_cells)
                self.assertEqual(report.pipelines[0].num_micro_batches, num_micro_batches)
                self.assertGreater(len(report.variables), 10)


class RegisteredImageModelsTest(tf.test.TestCase, parameterized.TestCase, CheckAllSettings):

    @parameterized.parameters(*distinct_registered("image."))
    def test_passes_at_two_settings(self, name: str, same_as: tuple[str, ...]) -> None:
        cls = model_registry.get_class(name)
        if issubclass(cls, image._AmoebaNetImageNet) and cls.VARIANT == "D":
            # Shrunk, AmoebaNet-D is AmoebaNet-B's network (stem, aux head, drop-path, dropout)
            # with AmoebaNetDigits' cells, and both of those pass at both settings: the first
            # setting checks that the two combine.
            self.check_all_settings(name, same_as, SETTINGS[:1])
        else:
            self.check_all_settings(name, same_as)

    def test_the_shrunk_amoebanet_d_family_is_one_configuration(self):
        # What makes checking one of them enough: guards against a shrink that stops covering
        # a registered model's distinguishing field.
        [names] = [[n, *rest] for n, rest in distinct_registered("image.AmoebaNetD_")]
        self.assertLen(names, 5)
