"""A registered model for the planner tests: activation-heavy, so plans differ in memory.

`plan_models.PlanMlp` (reach it as `--model=tests.plan_models.PlanMlp` from the repository root):
eight tanh layers of width 64 on mini-batches of 1,024 examples and a softmax, one pipeline
(`network`). Its activations (256 KiB per layer output) dwarf its 140 KiB of weights, so K, T and
remat decide whether it fits a budget of a few MiB per device.
"""

from __future__ import annotations

import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import dense, structural
from lingvo_lite.tasks import model_registry, optimizers

try:  # In the test process: the module the other tests import (one registration, one class).
    import testdata_models
except ImportError:  # From the repository root, e.g. --model=tests.plan_models.PlanMlp.
    from tests import testdata_models

BATCH_SIZE = 1024
WIDTH = 64
NUM_LAYERS = 8


@model_registry.register
class PlanMlp(testdata_models.TinyMlp):
    """Eight tanh layers of width 64, batch 1,024, momentum SGD (planner tests)."""

    def Train(self) -> hyperparams.Params:
        return testdata_models.SyntheticInput.Params().Set(
            name="train", split="train", num_examples=2 * BATCH_SIZE, batch_size=BATCH_SIZE)

    def Task(self) -> hyperparams.InstantiableParams:
        p = testdata_models.TinyMlpTask.Params().Set(name="plan_mlp")
        layers = [structural.FieldLayer.Params().Set(
            name=f"fc{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
                name="proj", input_dim=testdata_models.INPUT_DIM if i == 0 else WIDTH,
                output_dim=WIDTH, activation="TANH"))
            for i in range(NUM_LAYERS)]
        loss = testdata_models.MapSoftmaxLoss.Params().Set(name="loss")
        loss.softmax.Set(input_dim=WIDTH, num_classes=testdata_models.NUM_CLASSES)
        p.network.Set(
            layers=[*layers, loss], num_cells=1, num_micro_batches=1,
            input_shapes=NestedMap(x=tf.TensorShape([BATCH_SIZE, testdata_models.INPUT_DIM]),
                                   labels=tf.TensorShape([BATCH_SIZE])))
        p.train.optimizer = optimizers.SGD.Params().Set(momentum=0.9)
        p.train.Set(learning_rate=0.01, max_steps=2)
        return p
