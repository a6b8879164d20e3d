"""Registered image-classification models: AmoebaNet on digits, and GPipe's ImageNet models."""

from __future__ import annotations

from lingvo_lite.core import hyperparams
from lingvo_lite.tasks import learning_rate, model_registry, optimizers
from tasks.image import amoebanet, classifier, input_generator

__all__ = [
    "AmoebaNetB_6_512",
    "AmoebaNetD_12_544",
    "AmoebaNetD_24_512",
    "AmoebaNetD_6_208",
    "AmoebaNetD_6_416",
    "AmoebaNetD_6_544",
    "AmoebaNetDigits",
]

IMAGENET_TRAIN_EXAMPLES = 1_281_167


@model_registry.register
class AmoebaNetDigits(model_registry.SplitInputModelParams):
    """Small AmoebaNet-D on the 1,797 bundled 8x8 digits, pipelined over 2 cells (a few minutes)."""

    BATCH_SIZE = 32
    EVAL_BATCH_SIZE = 40  # Divides the 200 dev and test examples: every one is evaluated.
    IMAGE_SIZE = 16

    def split_input(self, split: str) -> hyperparams.Params:
        p = input_generator.DigitsInput.Params().Set(
            name=f"digits_{split}", split=split, image_size=self.IMAGE_SIZE,
            batch_size=self.BATCH_SIZE)
        if split != "train":
            p.Set(shuffle=False, repeat=False, drop_remainder=True,
                  batch_size=self.EVAL_BATCH_SIZE)
        return p

    def Network(self) -> hyperparams.Params:
        """AmoebaNet-D with a CIFAR-style stem, L=1 normal cell per stack and F=16."""
        return amoebanet.AmoebaNetParams().Set(
            variant="D", num_normal_cells=1, filters=16, image_size=self.IMAGE_SIZE,
            num_channels=1, num_classes=10, stem_type="cifar", stem_filters=16,
            drop_path_keep_prob=1.0, dropout_keep_prob=1.0, label_smoothing=0.1,
            aux_head_weight=0.0, batch_norm_decay=0.9)

    def Task(self) -> hyperparams.InstantiableParams:
        p = classifier.amoebanet_task_params(
            self.Network(), self.BATCH_SIZE, num_cells=2, num_micro_batches=2,
            name="amoebanet_digits")
        p.random_seed = 1
        p.train.Set(
            learning_rate=2e-3, optimizer=optimizers.Adam.Params(),
            lr_schedule=learning_rate.CosineDecay.Params().Set(
                warmup_steps=20, total_steps=400, final_factor=0.05),
            max_steps=400, save_interval_steps=100, summary_interval_steps=10,
            log_interval_steps=25, eval_interval_steps=200)
        return p


class _AmoebaNetImageNet(model_registry.SplitInputModelParams):
    """GPipe's AmoebaNet recipe on ImageNet (tfds `imagenet2012` prepared in DATA_DIR)."""

    VARIANT = "D"
    NUM_NORMAL_CELLS = 6
    FILTERS = 208
    IMAGE_SIZE = 224
    BATCH_SIZE = 256
    NUM_CELLS = 4
    NUM_MICRO_BATCHES = 8
    DATA_DIR = "~/tensorflow_datasets"
    SPLITS = ("train", "dev")

    def split_input(self, split: str) -> hyperparams.Params:
        p = input_generator.TfdsImageInput.Params().Set(
            name=f"imagenet_{split}", dataset_name="imagenet2012", data_dir=self.DATA_DIR,
            split=split, image_size=self.IMAGE_SIZE, num_channels=3, batch_size=self.BATCH_SIZE)
        if split != "train":
            p.Set(shuffle=False, repeat=False)
        return p

    def Network(self) -> hyperparams.Params:
        return amoebanet.AmoebaNetParams().Set(
            variant=self.VARIANT, num_normal_cells=self.NUM_NORMAL_CELLS, filters=self.FILTERS,
            image_size=self.IMAGE_SIZE, num_classes=1000, stem_type="imagenet",
            drop_path_keep_prob=0.7, dropout_keep_prob=0.5, label_smoothing=0.1,
            aux_head_weight=0.4)

    def Task(self) -> hyperparams.InstantiableParams:
        p = classifier.amoebanet_task_params(
            self.Network(), self.BATCH_SIZE, num_cells=self.NUM_CELLS,
            num_micro_batches=self.NUM_MICRO_BATCHES,
            name=f"amoebanet_{self.VARIANT.lower()}_{self.NUM_NORMAL_CELLS}_{self.FILTERS}")
        steps_per_epoch = IMAGENET_TRAIN_EXAMPLES // self.BATCH_SIZE
        p.train.Set(
            learning_rate=0.00125 * self.BATCH_SIZE,
            optimizer=optimizers.RMSProp.Params().Set(decay=0.9, momentum=0.9, epsilon=0.1),
            lr_schedule=learning_rate.ExponentialDecay.Params().Set(
                decay_rate=0.97, decay_steps=3 * steps_per_epoch, staircase=True,
                warmup_steps=steps_per_epoch),
            l2_regularizer_weight=4e-5, max_steps=100 * steps_per_epoch,
            save_interval_steps=5000, summary_interval_steps=100, log_interval_steps=100)
        return p


@model_registry.register
class AmoebaNetD_6_208(_AmoebaNetImageNet):  # noqa: N801 (paper's (L, F) in the name)
    """AmoebaNet-D (L=6, F=208) at 224x224: GPipe's 82M-parameter model."""


@model_registry.register
class AmoebaNetD_6_416(_AmoebaNetImageNet):  # noqa: N801
    """AmoebaNet-D (L=6, F=416) at 224x224: GPipe's 318M-parameter model."""

    FILTERS = 416


@model_registry.register
class AmoebaNetD_6_544(_AmoebaNetImageNet):  # noqa: N801
    """AmoebaNet-D (L=6, F=544) at 224x224: GPipe's 542M-parameter model."""

    FILTERS = 544


@model_registry.register
class AmoebaNetD_12_544(_AmoebaNetImageNet):  # noqa: N801
    """AmoebaNet-D (L=12, F=544) at 224x224: GPipe's 1.05B-parameter model."""

    NUM_NORMAL_CELLS = 12
    FILTERS = 544
    NUM_CELLS = 8


@model_registry.register
class AmoebaNetD_24_512(_AmoebaNetImageNet):  # noqa: N801
    """AmoebaNet-D (L=24, F=512) at 224x224: GPipe's 1.8B-parameter model."""

    NUM_NORMAL_CELLS = 24
    FILTERS = 512
    NUM_CELLS = 8


@model_registry.register
class AmoebaNetB_6_512(_AmoebaNetImageNet):  # noqa: N801
    """AmoebaNet-B (L=6, F=512) at 480x480: GPipe's 557M-parameter, 84.4% top-1 model."""

    VARIANT = "B"
    FILTERS = 512
    IMAGE_SIZE = 480
    BATCH_SIZE = 128
