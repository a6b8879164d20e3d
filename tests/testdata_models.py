"""A tiny registered model for the trainer tests: a pipelined 3-layer MLP on synthetic data.

Registered as `testdata_models.TinyMlp`. It lives outside `model_params/` so it never shows up in a
user's `--mode=list_models`; the trainer reaches it by its fully-qualified class path
(`--model=tests.testdata_models.TinyMlp` from the repository root) or by importing this module
first (`--model_modules=tests.testdata_models`).

The data are Gaussian points labelled by the arg-max of a fixed random projection, so the classes
are linearly separable and the loss falls within a few steps. Everything is seeded.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import dense, dropout, losses
from lingvo_lite.tasks import base_input_generator, model_registry, pipelined_task

INPUT_DIM = 8
HIDDEN_DIM = 16
NUM_CLASSES = 4
BATCH_SIZE = 16
_SPLIT_SEEDS = {"train": 0, "dev": 1, "test": 2}


def synthetic_examples(split: str, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """The (features float32 [n, INPUT_DIM], labels int32 [n]) of a split, deterministically."""
    projection = np.random.default_rng(1234).normal(size=(INPUT_DIM, NUM_CLASSES))
    rng = np.random.default_rng(_SPLIT_SEEDS[split])
    x = rng.normal(size=(num_examples, INPUT_DIM)).astype(np.float32)
    labels = np.argmax(x @ projection, axis=-1).astype(np.int32)
    return x, labels


class SyntheticInput(base_input_generator.BaseInputGenerator):
    """Batches of NestedMap(x=[B, INPUT_DIM] float32, labels=[B] int32)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("split", "train", "'train', 'dev' or 'test'.")
        p.Define("num_examples", 256, "Examples in the split.")
        p.batch_size = BATCH_SIZE
        p.shuffle_buffer_size = 256
        return p

    def _build_examples(self) -> tf.data.Dataset:
        x, labels = synthetic_examples(self.params.split, self.params.num_examples)
        return tf.data.Dataset.from_tensor_slices({"x": x, "labels": labels})

    def num_examples(self) -> int:
        return self.params.num_examples


class MapProjection(base_layer.BaseLayer):
    """A ProjectionLayer on `inputs.x` that passes `inputs.labels` through (a pipeline stage)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("proj", dense.ProjectionLayer.Params(), "The projection applied to x.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self.CreateChild("proj", self.params.proj)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        return NestedMap(x=self.proj.FProp(theta.proj, inputs.x), labels=inputs.labels)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        meta = p.proj.cls.FPropMeta(p.proj, inputs.x)
        return base_layer.fprop_meta(
            meta.flops, NestedMap(x=meta.out_shapes[0], labels=inputs.labels), meta.num_params)


class MapSoftmaxLoss(base_layer.BaseLayer):
    """Softmax cross-entropy of `inputs.x` against `inputs.labels`: NestedMap(loss, accuracy)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("softmax", losses.SoftmaxCrossEntropyLayer.Params(), "The softmax layer.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self.CreateChild("softmax", self.params.softmax)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        out = self.softmax.FProp(theta.softmax, inputs.x, inputs.labels)
        return NestedMap(loss=out.loss, accuracy=out.accuracy)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        meta = p.softmax.cls.FPropMeta(p.softmax, inputs.x)
        scalar = tf.TensorShape([])
        return base_layer.fprop_meta(
            meta.flops, NestedMap(loss=scalar, accuracy=scalar), meta.num_params)


class TinyMlpTask(pipelined_task.PipelinedTask):
    """Classifier whose whole network is one PipeliningLayer (`network`)."""

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        return NestedMap(x=input_batch.x, labels=input_batch.labels)


def _projection(name: str, input_dim: int, output_dim: int) -> hyperparams.Params:
    p = MapProjection.Params().Set(name=name)
    p.proj.Set(input_dim=input_dim, output_dim=output_dim, activation="RELU")
    return p


@model_registry.register
class TinyMlp(model_registry.SingleTaskModelParams):
    """Pipelined 3-layer MLP on synthetic Gaussian data (trainer tests)."""

    def Train(self) -> hyperparams.Params:
        return SyntheticInput.Params().Set(name="train", split="train", num_examples=256)

    def Dev(self) -> hyperparams.Params:
        return SyntheticInput.Params().Set(
            name="dev", split="dev", num_examples=64, shuffle=False, repeat=False)

    def Test(self) -> hyperparams.Params:
        return SyntheticInput.Params().Set(
            name="test", split="test", num_examples=64, shuffle=False, repeat=False)

    def Task(self) -> hyperparams.InstantiableParams:
        p = TinyMlpTask.Params().Set(name="tiny_mlp")
        loss = MapSoftmaxLoss.Params().Set(name="loss")
        loss.softmax.Set(input_dim=HIDDEN_DIM, num_classes=NUM_CLASSES)
        p.network.Set(
            layers=[
                _projection("fc0", INPUT_DIM, HIDDEN_DIM),
                _projection("fc1", HIDDEN_DIM, HIDDEN_DIM),
                loss,
            ],
            num_cells=2,
            num_micro_batches=2,
            input_shapes=NestedMap(
                x=tf.TensorShape([BATCH_SIZE, INPUT_DIM]), labels=tf.TensorShape([BATCH_SIZE])),
        )
        p.train.Set(
            learning_rate=0.01, max_steps=20, save_interval_steps=5, summary_interval_steps=2,
            log_interval_steps=2, eval_interval_steps=5, max_checkpoints_to_keep=3)
        return p


@model_registry.register
class TinyMlpNoDev(TinyMlp):
    """TinyMlp without a Dev split (to test --eval_splits errors)."""

    def Dev(self) -> hyperparams.Params:
        return model_registry.SingleTaskModelParams.Dev(self)


class MicroBatchDropout(base_layer.BaseLayer):
    """A deliberately broken dropout on `inputs.x`: its mask ignores the example's offset.

    Every micro-batch draws the mask of the mini-batch's first examples, so the pipelined model
    (T > 1) is not the unpipelined one; check_equivalence must catch it.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("keep_prob", 0.5, "Probability of keeping an element.")
        return p

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        ctx = fprop_context.current()
        if not ctx.training:
            return inputs
        x = dropout.dropout(inputs.x, self.params.keep_prob, seed=(5, 6),
                            step_seed=ctx.step_seed, example_offset=0)  # The bug.
        return NestedMap(x=x, labels=inputs.labels)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        return base_layer.fprop_meta(0.0, inputs)


@model_registry.register
class TinyMlpBrokenDropout(TinyMlp):
    """TinyMlp with MicroBatchDropout after its first layer (check_equivalence must fail)."""

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        layers = list(p.network.layers)
        p.network.layers = layers[:1] + [MicroBatchDropout.Params().Set(name="bad_drop")] + \
            layers[1:]
        return p
