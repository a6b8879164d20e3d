"""Test models for tests/e2e/reliability_test.py: TinyMlp variants with randomness, NaNs, other
shapes.

  - `TinyMlpNoisy`: TinyMlp with input augmentation (stateless Gaussian noise seeded by the
    example's position) and a dropout stage, so exact resumption must restore the input position
    and derive every random draw from checkpointed state. Its input's `nan_batches` lists the
    batches (0-based, counted over the whole stream) whose features are NaN.
  - `TinyMlpWide`: TinyMlp with a wider hidden layer (a checkpoint of one does not fit the other).
  - `TinyImageFolderMlp`: TinyMlp on 2x2 grey images read by `ImageFolderInput` from the
    `root_dir` given by `--input_params_override` (bad-image tests).

Reached by fully-qualified path (`--model=tests.reliability_models.TinyMlpNoisy`) or, once this
module is imported, by the registered names `reliability_models.TinyMlpNoisy` etc.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import dropout
from lingvo_lite.tasks import model_registry
from tasks.image import input_generator as image_input

try:  # Under pytest, tests/ is on sys.path; trainer.py imports this module as tests.*.
    import testdata_models
except ModuleNotFoundError:
    from tests import testdata_models


class NoisyInput(testdata_models.SyntheticInput):
    """SyntheticInput plus seeded Gaussian noise on x, and NaN features in `nan_batches`."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("noise_stddev", 0.1, "Stddev of the augmentation noise added to x.")
        p.Define("nan_batches", [], "Batch indices (0-based, whole stream) whose x is all NaN.")
        return p

    def dataset(self) -> tf.data.Dataset:
        p = self.params
        ds = super().dataset()
        if not p.nan_batches:
            return ds
        bad = tf.constant(list(p.nan_batches), dtype=tf.int64)

        def poison(index: tf.Tensor, batch: NestedMap) -> NestedMap:
            is_bad = tf.reduce_any(tf.equal(index, bad))
            x = tf.where(is_bad, tf.fill(tf.shape(batch.x), float("nan")), batch.x)
            return NestedMap(x=x, labels=batch.labels)

        return ds.enumerate().map(poison)

    def _preprocess(self, example: NestedMap, seed: tf.Tensor) -> NestedMap:
        noise = tf.random.stateless_normal(tf.shape(example.x), seed=seed,
                                           stddev=self.params.noise_stddev)
        return NestedMap(x=example.x + noise, labels=example.labels)


class MapDropout(base_layer.BaseLayer):
    """Dropout on `inputs.x` (a pipeline stage); labels pass through."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("dropout", dropout.DropoutLayer.Params().Set(keep_prob=0.8), "The dropout.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self.CreateChild("dropout", self.params.dropout)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        return NestedMap(x=self.dropout.FProp(theta.dropout, inputs.x), labels=inputs.labels)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        meta = p.dropout.cls.FPropMeta(p.dropout, inputs.x)
        return base_layer.fprop_meta(
            meta.flops, NestedMap(x=meta.out_shapes[0], labels=inputs.labels), 0)


@model_registry.register
class TinyMlpNoisy(testdata_models.TinyMlp):
    """TinyMlp with input noise and a dropout stage (exact-resume and NaN tests)."""

    def Train(self) -> hyperparams.Params:
        return NoisyInput.Params().Set(name="train", split="train", num_examples=256)

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        layers = list(p.network.layers)
        p.network.layers = [layers[0], MapDropout.Params().Set(name="drop"), *layers[1:]]
        p.random_seed = 7
        return p


@model_registry.register
class TinyMlpWide(testdata_models.TinyMlp):
    """TinyMlp with 32 hidden units: its checkpoints do not fit TinyMlp."""

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        fc0, fc1, loss = p.network.layers
        fc0.proj.output_dim = 32
        fc1.proj.input_dim = 32
        fc1.proj.output_dim = 32
        loss.softmax.input_dim = 32
        return p


IMAGE_BATCH = 4
IMAGE_FEATURES = 4  # 2 x 2 pixels, 1 channel.


class ImageMlpTask(testdata_models.TinyMlpTask):
    """TinyMlpTask on flattened images: x = image [B, 2 * 2 * 1], labels = label."""

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        x = tf.reshape(input_batch.image, [IMAGE_BATCH, IMAGE_FEATURES])
        return NestedMap(x=x, labels=input_batch.label)


@model_registry.register
class TinyImageFolderMlp(testdata_models.TinyMlp):
    """TinyMlp on a folder of images (`root_dir` set by --input_params_override)."""

    def Train(self) -> hyperparams.Params:
        return image_input.ImageFolderInput.Params().Set(
            name="train", split="train", batch_size=IMAGE_BATCH, image_size=2, num_channels=1,
            augment=False, shuffle_buffer_size=64)

    def Dev(self) -> hyperparams.Params:
        return model_registry.SingleTaskModelParams.Dev(self)

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        p.cls = ImageMlpTask
        fc0 = p.network.layers[0]
        fc0.proj.input_dim = IMAGE_FEATURES
        p.network.input_shapes = NestedMap(
            x=tf.TensorShape([IMAGE_BATCH, IMAGE_FEATURES]),
            labels=tf.TensorShape([IMAGE_BATCH]))
        return p
