"""Issue 12, point 4: FPropAndGrads' API for a new user (clear errors or natural behaviour).

References are independent of the pipeline: a plain GradientTape over the unpipelined
layers (as in pipeline_test.py) or numpy.
"""

from __future__ import annotations

import numpy as np
import pipeline_models as pt
import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite.core import base_layer, fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, structural
from lingvo_lite.pipeline import pipelining_layer


class _AddFloatLeaf(base_layer.BaseLayer):
    """Passes x through and adds a Python float to the boundary map (a user mistake)."""

    def FProp(self, theta, inputs):
        return NestedMap(x=inputs.x, labels=inputs.labels, scale=0.5)


class _WeightedLoss(base_layer.BaseLayer):
    """loss = mean(x^2) and a `num_examples` output given by p.weight_fn(x)."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define("weight_fn", None, "x -> the num_examples output.")
        return p

    def FProp(self, theta, inputs):
        return NestedMap(loss=tf.reduce_mean(tf.square(inputs.x)),
                         num_examples=self.params.weight_fn(inputs.x))


def _uniform_pipeline(layers, num_micro_batches=2):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=2, partition_method="uniform",
        num_micro_batches=num_micro_batches, random_seed=7).Instantiate()


def _train(pipe, batch, **kwargs):
    with fprop_context.fprop_context(training=True, step_seed=3):
        return pipe.FPropAndGrads(pipe.theta, batch, **kwargs)


class InputGradientsTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, 4, "always", False), (3, 8, "except_last", True),
                              (1, 1, "never", False), (2, 4, "always", True, True))
    def test_input_gradients_equal_a_plain_tape(self, num_cells, num_micro, remat, graph,
                                                serial=False):
        batch = pt.make_batch()
        pipe = pt.make_pipeline(pt.mlp_layers(), num_cells, num_micro, remat,
                                serial_devices=serial)
        with fprop_context.fprop_context(training=True, step_seed=3):
            with tf.GradientTape() as tape:
                tape.watch(batch.x)
                out = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
            want_dx, *want_grads = tape.gradient(out.loss, [batch.x] + pipe.theta.Flatten())

        def step(b):
            return _train(pipe, b, return_input_grads=True)

        loss_out, grads, dinputs = (tf.function(step, autograph=False) if graph else step)(batch)
        self.assertIsInstance(dinputs, NestedMap)
        self.assertIsNone(dinputs.labels)  # int labels have no gradient.
        self.assertAllClose(want_dx, dinputs.x, rtol=pt.RTOL, atol=pt.ATOL)
        for w, g in zip(want_grads, grads.Flatten()):
            self.assertAllClose(w, g, rtol=pt.RTOL, atol=pt.ATOL)
        self.assertAllClose(out.loss, loss_out.loss, rtol=pt.RTOL)

    def test_default_return_is_still_a_pair(self):
        pipe = pt.make_pipeline(pt.mlp_layers(), 2, 2)
        self.assertLen(_train(pipe, pt.make_batch()), 2)


class TrainingOnlyTest(tf.test.TestCase):

    def test_outside_a_training_context_is_an_error(self):
        pipe = pt.make_pipeline(pt.mlp_layers(), 2, 2)
        with self.assertRaisesRegex(ValueError, r"FPropAndGrads trains: call it inside "
                                    r"fprop_context.fprop_context\(training=True"):
            pipe.FPropAndGrads(pipe.theta, pt.make_batch())
        with fprop_context.fprop_context(training=False):
            with self.assertRaisesRegex(ValueError, "training=True"):
                pipe.FPropAndGrads(pipe.theta, pt.make_batch())


class BatchNormUpdatesTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(False, True)
    def test_moving_averages_update_without_a_collector(self, graph):
        pipe = pt.make_pipeline(pt.bn_layers(), num_cells=2, num_micro_batches=4)
        batch = pt.make_batch()
        proj = pipe.theta.layers[0].sub
        h = batch.x.numpy() @ proj.w.numpy() + proj.b.numpy()  # The batch norm's input.
        step = lambda b: _train(pipe, b)[0].loss  # noqa: E731
        (tf.function(step, autograph=False) if graph else step)(batch)
        bn = pipe.layers[1].sub
        self.assertAllClose(0.1 * h.mean(0), bn.moving_mean, rtol=1e-5, atol=1e-6)
        self.assertAllClose(0.9 + 0.1 * h.var(0), bn.moving_variance, rtol=1e-5)

    def test_a_callers_collector_is_left_to_the_caller(self):
        pipe = pt.make_pipeline(pt.bn_layers(), num_cells=2, num_micro_batches=4)
        collector = fprop_context.UpdateCollector()
        with fprop_context.fprop_context(training=True, updates=collector):
            pipe.FPropAndGrads(pipe.theta, pt.make_batch())
        bn = pipe.layers[1].sub
        self.assertAllEqual(np.zeros(pt.WIDTH), bn.moving_mean)  # Not applied yet.
        self.assertLen(collector.items()[0][1], 4)


class MicroBatchWeightTest(tf.test.TestCase):

    def _pipe(self, weight_fn):
        ident = structural.IdentityLayer.Params().Set(name="id")
        return _uniform_pipeline([ident, _WeightedLoss.Params().Set(name="loss",
                                                                    weight_fn=weight_fn)])

    def test_non_scalar_weight_is_refused(self):
        pipe = self._pipe(lambda x: tf.ones([tf.shape(x)[0]]))
        batch = NestedMap(x=tf.ones([8, 3]))
        with self.assertRaisesRegex(ValueError, "output 'num_examples' has shape .*reserved "
                                    "for a scalar micro-batch weight"):
            _train(pipe, batch)
        with self.assertRaisesRegex(ValueError, "reserved"):
            pipe.FProp(pipe.theta, batch)

    def test_negative_weight_fails_at_run_time(self):
        pipe = self._pipe(lambda x: -tf.reduce_sum(x[:, 0]))
        batch = NestedMap(x=tf.ones([8, 3]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "must be >= 0"):
            _train(pipe, batch)
        traced = tf.function(lambda b: _train(pipe, b)[0].loss, autograph=False)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "must be >= 0"):
            traced(batch)

    def test_weights_reweigh_the_micro_batches(self):
        # Micro-batch means weighted by num_examples: numpy reference.
        pipe = self._pipe(lambda x: tf.reduce_sum(x[:, 0]))
        x = np.abs(np.random.default_rng(0).normal(size=[8, 3])).astype(np.float32)
        out, _ = _train(pipe, NestedMap(x=tf.constant(x)))
        parts = np.split(x, 2)
        w = np.array([p[:, 0].sum() for p in parts])
        means = np.array([np.mean(p ** 2) for p in parts])
        self.assertAllClose((w * means).sum() / w.sum(), out.loss, rtol=1e-6)


class BoundaryErrorsTest(tf.test.TestCase):

    def test_non_tensor_leaf_names_the_cell_and_the_leaf(self):
        pipe = _uniform_pipeline([_AddFloatLeaf.Params().Set(name="add"), pt._loss(pt.IN_DIM)])
        with self.assertRaisesRegex(ValueError, r"^The output of cell 0 leaf 'scale' is a "
                                    r"float, not a tensor"):
            _train(pipe, pt.make_batch())
        with self.assertRaisesRegex(ValueError, "cell 0 leaf 'scale'"):
            pipe.FProp(pipe.theta, pt.make_batch())

    def test_non_tensor_input_leaf(self):
        pipe = pt.make_pipeline(pt.mlp_layers(), 2, 2)
        batch = pt.make_batch()
        batch.scale = 0.5
        with self.assertRaisesRegex(ValueError, "The pipeline input leaf 'scale' is a float"):
            _train(pipe, batch)


class GradientPlacementTest(tf.test.TestCase, parameterized.TestCase):
    """Every weight gradient is produced on its cell's device (none crosses to another).

    An op without a device lands on the default device; if one sat on the path of a cell's
    gradients, all of them would be copied there and back every step (across hosts in a
    cluster). The softmax loss reports num_examples, so the weighted-mean division runs.
    """

    @parameterized.parameters(1, 2)
    def test_gradients_stay_on_their_cells_devices(self, num_replicas):
        devices = [f"/device:CPU:{i}" for i in range(2 * num_replicas)]
        pipe = pt.make_pipeline(pt.mlp_layers(), 2, 4, "except_last",
                                num_replicas=num_replicas, placement=devices)
        thetas = pipe.replica_thetas(pipe.theta)

        grads = []

        def step(batch):
            with fprop_context.fprop_context(training=True, step_seed=3):
                grads.extend(pipe.FPropAndReplicaGrads(thetas, batch)[1])
            return grads[0].Flatten()[0]

        tf.function(step, autograph=False).get_concrete_function(pt.make_batch())
        checked = 0
        for r, (theta, g) in enumerate(zip(thetas, grads)):
            for k in range(pipe.num_cells):
                want = tf.DeviceSpec.from_string(devices[r * 2 + k])
                for i in pipe.cell_layers(k):
                    for grad in g.layers[i].Flatten():
                        got = tf.DeviceSpec.from_string(grad.op.device)
                        self.assertEqual((want.device_type, want.device_index),
                                         (got.device_type, got.device_index), msg=grad.name)
                        checked += 1
        self.assertGreater(checked, 10)


if __name__ == "__main__":
    tf.test.main()
