"""Training batches of varying shape (PipeliningLayer.input_buckets, pipeline/buckets.py).

For each declared bucket the pipeline's loss and gradients equal the plain model's on that batch
(every layer's FProp chained on the whole batch, one GradientTape), for every schedule, the R x K
mesh and the micro-batch loop; each cell's functions are traced once per bucket, however often
the buckets come back; a batch of another shape is refused in one line naming the buckets.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from pipeline_models import ATOL, RTOL, _drop, _proj

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, losses, structural
from lingvo_lite.pipeline import buckets, pipelining_layer

DIM, WIDTH, CLASSES = 6, 10, 5
# (batch, length): fewer sequences when they are longer, as length buckets are batched.
BUCKETS = ((16, 4), (8, 8), (8, 12), (4, 16))


def _bucket_shapes(batch: int, length: int) -> NestedMap:
    return NestedMap(x=[batch, length, DIM], labels=[batch, length])


def _layers() -> list:
    """A per-token model: dense layers over the last axis, dropout, token softmax."""
    return [_proj("p0", DIM, WIDTH), _drop("d0"), _proj("p1", WIDTH, WIDTH),
            _proj("p2", WIDTH, WIDTH), structural.FieldsLayer.Params().Set(
                name="loss", fields=["x", "labels"],
                sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
                    name="xent", input_dim=WIDTH, num_classes=CLASSES))]


def _pipeline(num_cells=2, num_micro_batches=4, remat="except_last", **kw):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=_layers(), num_cells=num_cells,
        num_micro_batches=num_micro_batches, remat=remat, random_seed=3,
        input_buckets=[_bucket_shapes(b, n) for b, n in BUCKETS], **kw).Instantiate()


def _batch(batch: int, length: int, seed: int = 0) -> NestedMap:
    rng = np.random.default_rng(seed + 100 * length)
    return NestedMap(x=tf.constant(rng.normal(size=(batch, length, DIM)), tf.float32),
                     labels=tf.constant(rng.integers(0, CLASSES, size=(batch, length)), tf.int32))


def _reference(pipe, batch):
    with tf.device("/device:CPU:0"), fprop_context.fprop_context(
            training=True, step_seed=5, example_offset=0):
        with tf.GradientTape() as tape:
            out = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
        return out.loss, tape.gradient(out.loss, pipe.theta.Flatten())


def _pipelined(pipe, batch):
    with fprop_context.fprop_context(training=True, step_seed=5):
        if pipe.num_replicas > 1:
            out, grads = pipe.FPropAndReplicaGrads(pipe.replica_thetas(pipe.theta), batch)
            return out.loss, grads[0].Flatten()
        out, grads = pipe.FPropAndGrads(pipe.theta, batch)
    return out.loss, grads.Flatten()


class BucketsTest(tf.test.TestCase, parameterized.TestCase):

    def _check_every_bucket(self, pipe):
        for b, n in BUCKETS:
            batch = _batch(b, n)
            ref_loss, ref_grads = _reference(pipe, batch)
            loss, grads = _pipelined(pipe, batch)
            self.assertAllClose(ref_loss, loss, rtol=RTOL, atol=ATOL, msg=f"bucket {b}x{n}")
            for ref_g, g in zip(ref_grads, grads):
                self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL, msg=f"bucket {b}x{n}")

    @parameterized.parameters(
        dict(schedule="gpipe"), dict(schedule="1f1b"), dict(schedule="zero_bubble"),
        dict(schedule="interleaved", num_cells=4, virtual_stages=2),
        dict(schedule="zbv", num_cells=4),
        dict(schedule="gpipe", remat="always", micro_batch_loop=True),
        dict(schedule="1f1b", num_replicas=2, num_micro_batches=2))
    def test_every_bucket_gives_the_plain_models_loss_and_gradients(self, **kw):
        self._check_every_bucket(_pipeline(**kw))

    def test_each_cell_traced_once_per_bucket_however_often_it_comes_back(self):
        pipe = _pipeline()
        step_traces = []

        @tf.function(autograph=False)
        def step(batch):
            step_traces.append(1)
            return _pipelined(pipe, batch)[0]

        cells = lambda: [c.num_traces for c in pipe._executor(0)._cells]  # noqa: E731
        step(_batch(*BUCKETS[0]))
        per_bucket = cells()
        for _ in range(2):  # Cycling through the 4 buckets twice.
            for b, n in BUCKETS:
                step(_batch(b, n, seed=1))
        self.assertLen(step_traces, len(BUCKETS))
        self.assertEqual([len(BUCKETS) * t for t in per_bucket], cells())

    def test_a_shape_outside_the_buckets_is_refused_in_one_line(self):
        pipe = _pipeline()
        with self.assertRaises(ValueError) as ctx:
            _pipelined(pipe, _batch(8, 10))
        message = str(ctx.exception)
        self.assertNotIn("\n", message)
        self.assertIn("pipe: a training batch of shape {x: [8, 10, 6], labels: [8, 10]} is not "
                      "one of the declared input_buckets ({x: [16, 4, 6], labels: [16, 4]}, ",
                      message)

    def test_partition_planned_for_the_largest_bucket(self):
        declared = [_bucket_shapes(b, n) for b, n in BUCKETS]
        p = _pipeline().params
        self.assertIsNone(p.input_shapes)
        self.assertEqual(buckets.describe(buckets.normalize(declared)[2]),
                         buckets.describe(buckets.planning_shapes(p)))
        with self.assertRaisesRegex(ValueError, r"input_buckets\[1\] has an unknown dimension"):
            _pipeline().params.Copy().Set(
                input_buckets=[_bucket_shapes(4, 4), NestedMap(x=[4, None, DIM])]).Instantiate()


if __name__ == "__main__":
    tf.test.main()
