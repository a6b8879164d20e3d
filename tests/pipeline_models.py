"""The ten-layer MLP with dropout, its batches and pipelines, shared by the pipeline tests
(tests/unit/pipeline/pipeline_test.py and the tests that run the same model elsewhere).

Tolerance: the two sides sum the same float32 terms in a different order (per micro-batch,
then across micro-batches), so results differ by a few units in the last place of the summed
quantities; rtol=2e-5 with atol=2e-7 is ~100x float32 epsilon and far below any real error (a
wrong micro-batch weighting or a missing micro-batch changes gradients by more than 1e-2
relative).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, dense, dropout, losses, normalization, structural
from lingvo_lite.pipeline import pipelining_layer

BATCH = 32
IN_DIM = 6
WIDTH = 12
NUM_CLASSES = 5
RTOL, ATOL = 2e-5, 2e-7


def _field(name, sub):
    return structural.FieldLayer.Params().Set(name=name, field="x", sub=sub)


def _proj(name, in_dim, out_dim, activation="TANH"):
    return _field(name, dense.ProjectionLayer.Params().Set(
        name="proj", input_dim=in_dim, output_dim=out_dim, activation=activation))


def _drop(name, keep_prob=0.8):
    return _field(name, dropout.DropoutLayer.Params().Set(name="drop", keep_prob=keep_prob))


def _loss(in_dim):
    return structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"],
        sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=in_dim, num_classes=NUM_CLASSES))


def mlp_layers() -> list:
    """Ten layers with dropout; widths differ so the cost-based partition is uneven."""
    return [
        _proj("p0", IN_DIM, WIDTH), _drop("d0"), _proj("p1", WIDTH, WIDTH),
        _proj("p2", WIDTH, 2 * WIDTH), _drop("d1"), _proj("p3", 2 * WIDTH, WIDTH),
        _proj("p4", WIDTH, WIDTH), _drop("d2"), _proj("p5", WIDTH, WIDTH), _loss(WIDTH),
    ]


def input_shapes() -> NestedMap:
    return NestedMap(x=tf.TensorShape([BATCH, IN_DIM]), labels=tf.TensorShape([BATCH]))


def make_batch(seed: int = 0) -> NestedMap:
    rng = np.random.default_rng(seed)
    return NestedMap(
        x=tf.constant(rng.normal(size=(BATCH, IN_DIM)), tf.float32),
        labels=tf.constant(rng.integers(0, NUM_CLASSES, size=BATCH), tf.int32))


def make_pipeline(layers, num_cells=1, num_micro_batches=1, remat="always", **kw):
    p = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=num_cells, num_micro_batches=num_micro_batches,
        remat=remat, input_shapes=input_shapes(), random_seed=7, **kw)
    return p.Instantiate()


def reference_loss_and_grads(pipe, batch, step_seed):
    """Plain model: chain every layer's FProp on the whole batch on CPU:0, one tape."""
    theta = pipe.theta
    with tf.device("/device:CPU:0"), fprop_context.fprop_context(
            training=True, step_seed=step_seed, example_offset=0):
        with tf.GradientTape() as tape:
            out = composite.chain_fprop(pipe.layers, theta.layers, batch)
        grads = tape.gradient(out.loss, theta.Flatten())
    return out.loss, grads


def pipeline_loss_and_grads(pipe, batch, step_seed, graph=True):
    """The pipeline's loss and flat gradients, traced as in training or run eagerly.

    Eager execution computes the same values (control dependencies only order
    work) and avoids tracing thousands of ops per configuration.
    """
    def step(batch):
        with fprop_context.fprop_context(training=True, step_seed=step_seed):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss, grads.Flatten()

    return tf.function(step, autograph=False)(batch) if graph else step(batch)


def bn_layers() -> list:
    return [
        _proj("p0", IN_DIM, WIDTH, activation="NONE"),
        _field("bn", normalization.BatchNormLayer.Params().Set(name="bn", dim=WIDTH, decay=0.9)),
        _loss(WIDTH),
    ]
