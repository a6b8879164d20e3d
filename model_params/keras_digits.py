"""A model written as plain Keras layers, pipelined and trained by trainer.py like any other."""

from __future__ import annotations

import keras

from lingvo_lite.core import hyperparams
from lingvo_lite.keras import KerasTask, pipeline_params
from lingvo_lite.tasks import learning_rate, model_registry, optimizers
from tasks.image import input_generator

__all__ = ["residual_block", "resnet_layers", "ResNetDigits"]

# Keras' default (0.99) averages over ~100 steps: too slow for a 300-step run.
BN_MOMENTUM = 0.9


def residual_block(filters: int, input_shape: tuple[int, ...], name: str) -> keras.Model:
    """Two 3x3 convolutions with batch norm and an identity shortcut: one Keras model."""
    inputs = keras.Input(input_shape)
    h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=BN_MOMENTUM)(h))
    h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization(momentum=BN_MOMENTUM)(h)
    return keras.Model(inputs, keras.layers.ReLU()(keras.layers.Add()([inputs, h])), name=name)


def resnet_layers(image_size: int = 8, filters: int = 16,
                  num_classes: int = 10) -> list[keras.layers.Layer]:
    """A small ResNet as a list of Keras layers (each residual block is one nested model)."""
    half = image_size // 2
    return [
        keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name="stem_conv"),
        keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name="stem_bn"),
        keras.layers.ReLU(name="stem_relu"),
        residual_block(filters, (image_size, image_size, filters), "block_1"),
        residual_block(filters, (image_size, image_size, filters), "block_2"),
        keras.layers.MaxPooling2D(2, name="pool"),
        keras.layers.Conv2D(2 * filters, 3, padding="same", use_bias=False, name="wide_conv"),
        keras.layers.BatchNormalization(momentum=BN_MOMENTUM, name="wide_bn"),
        keras.layers.ReLU(name="wide_relu"),
        residual_block(2 * filters, (half, half, 2 * filters), "block_3"),
        keras.layers.GlobalAveragePooling2D(name="gap"),
        keras.layers.Dropout(0.2, seed=1, name="dropout"),
        keras.layers.Dense(num_classes, name="logits"),
    ]


@model_registry.register
class ResNetDigits(model_registry.SplitInputModelParams):
    """A small ResNet written as plain Keras layers on the bundled 8x8 digits (K=2, T=2)."""

    BATCH_SIZE = 32
    EVAL_BATCH_SIZE = 40  # Divides the 200 dev and test examples.
    IMAGE_SIZE = 8

    def split_input(self, split: str) -> hyperparams.Params:
        p = input_generator.DigitsInput.Params().Set(
            name=f"digits_{split}", split=split, image_size=self.IMAGE_SIZE, num_channels=1,
            batch_size=self.BATCH_SIZE, random_flip=False)
        if split != "train":
            p.Set(shuffle=False, repeat=False, drop_remainder=True,
                  batch_size=self.EVAL_BATCH_SIZE)
        return p

    def Task(self) -> hyperparams.InstantiableParams:
        p = KerasTask.Params().Set(name="resnet_digits", input_field="image",
                                   label_field="label")
        p.network = pipeline_params(
            lambda: resnet_layers(self.IMAGE_SIZE), (self.IMAGE_SIZE, self.IMAGE_SIZE, 1),
            num_cells=2, num_micro_batches=2,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            cost_batch_size=self.BATCH_SIZE, name="network")
        p.network.layers[-1].sparse_accuracy = True
        p.random_seed = 1
        p.train.Set(
            learning_rate=3e-3, optimizer=optimizers.Adam.Params(),
            lr_schedule=learning_rate.CosineDecay.Params().Set(
                warmup_steps=20, total_steps=400, final_factor=0.05),
            max_steps=400, save_interval_steps=100, summary_interval_steps=10,
            log_interval_steps=25, eval_interval_steps=200)
        return p
