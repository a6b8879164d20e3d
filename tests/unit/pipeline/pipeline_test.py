"""GPipe's promise: the pipeline computes the unpipelined model's loss and gradients.

The reference is the plain model: the same layers chained with `FProp` on the
whole mini-batch, on one device, differentiated by one GradientTape. The
pipeline splits the batch into T micro-batches, places K cells on K devices,
recomputes forwards in the backward pass and sums per-micro-batch gradients.

Tolerance: float32 with oneDNN off (TF's default on this CPU). The two sides
sum the same terms in a different order (per micro-batch, then across
micro-batches), so results differ by a few units in the last place of the
summed quantities; rtol=2e-5 with atol=2e-7 is ~100x float32 epsilon and far
below any real error (a wrong micro-batch weighting or a missing micro-batch
changes gradients by more than 1e-2 relative).
"""

from __future__ import annotations

import graph_structure
import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from pipeline_models import (
    ATOL,
    BATCH,
    RTOL,
    WIDTH,
    _proj,
    bn_layers,
    make_batch,
    make_pipeline,
    mlp_layers,
    pipeline_loss_and_grads,
    reference_loss_and_grads,
)

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import pipelining_layer

NUM_CELLS, NUM_MICRO_BATCHES, REMAT = [1, 2, 3, 4, 8], [1, 2, 4, 8, 16, 32], [
    "always", "except_last", "never"]
# Every (K, T) pair once, remat rotating so that every (K, remat) and (T, remat) pair occurs
# too: 30 runs cover each pair of the 90 combinations.
COVERING_MATRIX = [(k, t, REMAT[(i + j) % len(REMAT)])
                   for i, k in enumerate(NUM_CELLS) for j, t in enumerate(NUM_MICRO_BATCHES)]


class PipelineEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batch = make_batch()
        ref_pipe = make_pipeline(mlp_layers())
        cls.ref_loss, cls.ref_grads = reference_loss_and_grads(ref_pipe, cls.batch, 3)

    @parameterized.parameters(*COVERING_MATRIX)
    def test_loss_and_gradients_match_unpipelined_model(self, num_cells, num_micro_batches,
                                                        remat):
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat)
        loss, grads = pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        self.assertLen(grads, len(self.ref_grads))
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    @parameterized.product(num_cells=[2, 4], num_micro_batches=[1, 4, 8],
                           remat=["always", "never"])
    def test_1f1b_schedule_gives_the_same_gradients(self, num_cells, num_micro_batches, remat):
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat, schedule="1f1b")
        loss, grads = pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    @parameterized.product(
        config=[("interleaved", 4, 2, 4), ("interleaved", 6, 3, 8), ("zero_bubble", 2, 1, 1),
                ("zero_bubble", 4, 1, 8)],
        remat=["always", "except_last", "never"])
    def test_interleaved_and_zero_bubble_give_the_same_gradients(self, config, remat):
        # (schedule, K cells, v cells per device, T). Interleaved: T a multiple of K / v.
        name, num_cells, virtual_stages, num_micro_batches = config
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat,
                             schedule=name, virtual_stages=virtual_stages)
        self.assertLen(set(pipe.devices), num_cells // virtual_stages)
        loss, grads = pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        self.assertLen(grads, len(self.ref_grads))
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    @parameterized.product(
        config=[("1f1b", 3, 1, 4), ("interleaved", 4, 2, 4)],
        remat=["always", "except_last", "never"])
    def test_batched_weight_gradients_give_the_same_gradients(self, config, remat):
        name, num_cells, virtual_stages, num_micro_batches = config
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat, schedule=name,
                             virtual_stages=virtual_stages, weight_gradients="batched")
        loss, grads = pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    def test_dropout_is_active_and_matters(self):
        # Guards the matrix above against a vacuous pass: masks depend on the step seed.
        pipe = make_pipeline(mlp_layers(), 2, 4)
        loss_a, _ = pipeline_loss_and_grads(pipe, self.batch, 3)
        loss_b, _ = pipeline_loss_and_grads(pipe, self.batch, 4)
        self.assertNotAllClose(loss_a, loss_b)

    @parameterized.parameters((3, 4, "always"), (2, 8, "except_last"), (8, 8, "never"),
                              (4, 16, "always"))
    def test_weights_match_after_twenty_sgd_steps(self, num_cells, num_micro_batches, remat):
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat)
        ref = make_pipeline(mlp_layers())
        learning_rate = 0.5
        for v_pipe, v_ref in zip(pipe.vars.Flatten(), ref.vars.Flatten()):
            self.assertAllEqual(v_pipe, v_ref)  # Same path-seeded initialisation.

        @tf.function(autograph=False)
        def pipe_step(batch, step_seed):
            with fprop_context.fprop_context(training=True, step_seed=step_seed):
                _, grads = pipe.FPropAndGrads(pipe.theta, batch)
            for v, g in zip(pipe.vars.Flatten(), grads.Flatten()):
                v.assign_sub(learning_rate * g)

        for step in range(20):
            batch = make_batch(seed=step)
            pipe_step(batch, tf.constant(step))
            _, ref_grads = reference_loss_and_grads(ref, batch, step)
            for v, g in zip(ref.vars.Flatten(), ref_grads):
                v.assign_sub(learning_rate * g)
        for v_pipe, v_ref in zip(pipe.vars.Flatten(), ref.vars.Flatten()):
            self.assertAllClose(v_ref, v_pipe, rtol=1e-4, atol=1e-5)
        self.assertNotAllClose(ref.vars.Flatten()[0], make_pipeline(mlp_layers()).vars.Flatten()[0])


class PipelineForwardTest(tf.test.TestCase):

    def test_forward_outputs_reassembled_in_order(self):
        pipe = make_pipeline(mlp_layers()[:-1], num_cells=3, num_micro_batches=4)
        batch = make_batch()
        out = pipe.FProp(pipe.theta, batch)  # Eval mode: dropout off.
        ref = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
        self.assertAllClose(ref.x, out.x, rtol=RTOL, atol=ATOL)
        self.assertAllEqual(batch.labels, out.labels)

    def test_eval_metrics_are_mini_batch_means(self):
        pipe = make_pipeline(mlp_layers(), num_cells=2, num_micro_batches=8)
        batch = make_batch()
        out = pipe.FProp(pipe.theta, batch)
        ref = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
        self.assertAllClose(ref.loss, out.loss, rtol=RTOL)
        self.assertAllClose(ref.accuracy, out.accuracy, rtol=RTOL)
        self.assertAllClose(BATCH, out.num_examples)  # Counts add up, they are not averaged.


class PipelineBatchNormTest(tf.test.TestCase, parameterized.TestCase):

    def _numpy_loss(self, pipe, batch, num_micro_batches):
        """Hand-written model: projection, batch norm per micro-batch, softmax xent."""
        theta = pipe.theta.layers
        w, b = theta[0].sub.w.numpy(), theta[0].sub.b.numpy()
        gamma, beta = theta[1].sub.gamma.numpy(), theta[1].sub.beta.numpy()
        weight, bias = theta[2].sub.weight.numpy(), theta[2].sub.bias.numpy()
        h = batch.x.numpy() @ w + b
        normed = []
        for part in np.split(h, num_micro_batches):
            mean, var = part.mean(0), part.var(0)
            normed.append((part - mean) / np.sqrt(var + 1e-3) * gamma + beta)
        logits = np.concatenate(normed) @ weight + bias
        logits -= logits.max(-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        labels = batch.labels.numpy()
        return -log_probs[np.arange(BATCH), labels].mean(), h

    @parameterized.named_parameters(("", False), ("_serial_devices", True))
    def test_per_micro_batch_statistics_and_pooled_moving_averages(self, serial_devices):
        # With serial devices the statistics are computed inside the cells' function
        # calls and must still reach the caller's collector.
        num_micro = 4
        pipe = make_pipeline(bn_layers(), num_cells=2, num_micro_batches=num_micro,
                             serial_devices=serial_devices)
        batch = make_batch()
        collector = fprop_context.UpdateCollector()

        @tf.function(autograph=False)
        def step(batch):
            with fprop_context.fprop_context(training=True, updates=collector):
                out, _ = pipe.FPropAndGrads(pipe.theta, batch)
            with tf.control_dependencies(collector.apply()):
                return tf.identity(out.loss)

        loss = step(batch)
        want_loss, h = self._numpy_loss(pipe, batch, num_micro)
        self.assertAllClose(want_loss, loss, rtol=1e-5)
        bn = pipe.layers[1].sub
        # Moving statistics: one update from the whole mini-batch, pooled exactly.
        self.assertAllClose(0.1 * h.mean(0), bn.moving_mean, rtol=1e-5, atol=1e-6)
        self.assertAllClose(0.9 + 0.1 * h.var(0), bn.moving_variance, rtol=1e-5)
        # Recomputation must not report statistics a second time.
        (layer, stats), = collector.items()
        self.assertIs(layer, bn)
        self.assertLen(stats, num_micro)

    @parameterized.parameters(("gpipe", "per_micro_batch"), ("1f1b", "batched"),
                              ("zero_bubble", "per_micro_batch"))
    def test_bn_gradients_match_micro_batched_reference(self, schedule, weight_gradients):
        # Deferred weight gradients (batched, zero_bubble) keep batch norm's per-micro-batch
        # statistics: nothing is re-run on the whole mini-batch.
        num_micro = 4
        pipe = make_pipeline(bn_layers(), num_cells=3, num_micro_batches=num_micro,
                             schedule=schedule, weight_gradients=weight_gradients)
        batch = make_batch()
        theta = pipe.theta
        with fprop_context.fprop_context(training=True), tf.GradientTape() as tape:
            parts = [composite.chain_fprop(pipe.layers, theta.layers, mb)
                     for mb in (batch.Transform(lambda x, i=i: tf.split(x, num_micro)[i])
                                for i in range(num_micro))]
            ref_loss = tf.add_n([o.loss for o in parts]) / num_micro
        ref_grads = tape.gradient(ref_loss, theta.Flatten())
        loss, grads = pipeline_loss_and_grads(pipe, batch, 0)
        self.assertAllClose(ref_loss, loss, rtol=RTOL)
        for ref_g, g in zip(ref_grads, grads):
            if ref_g is not None:
                self.assertAllClose(ref_g, g, rtol=1e-4, atol=1e-6)

    def test_batched_weight_gradients_refuse_zero_bubble(self):
        pipe = make_pipeline(mlp_layers(), num_cells=2, num_micro_batches=2,
                             schedule="zero_bubble", weight_gradients="batched")
        with self.assertRaisesRegex(ValueError, "already splits each backward"):
            pipeline_loss_and_grads(pipe, make_batch(), 0)


class PartitionAndErrorsTest(tf.test.TestCase):

    def test_equal_layers_split_evenly(self):
        layers = [_proj(f"p{i}", WIDTH, WIDTH) for i in range(8)]
        p = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=layers, num_cells=2,
            input_shapes=NestedMap(x=tf.TensorShape([BATCH, WIDTH])))
        partition = pipelining_layer.PipeliningLayer.ComputePartition(p)
        self.assertEqual((4, 4), tuple(partition.cell_sizes))
        self.assertIn("imbalance", partition.report())

    def test_costs_come_from_fprop_meta(self):
        # p2 and p3 are twice as wide, so their cell gets fewer layers.
        p = make_pipeline(mlp_layers(), num_cells=3).params
        costs = pipelining_layer.PipeliningLayer.ComputePartition(p).layer_costs
        self.assertAllClose(2 * BATCH * WIDTH * 2 * WIDTH, costs[3], rtol=0.2)
        self.assertGreater(costs[3], 1.5 * costs[2])

    def test_bad_inputs_name_the_parameter(self):
        cases = [
            (dict(num_micro_batches=5), "num_micro_batches=5"),
            (dict(num_cells=11), "num_cells"),
            (dict(num_cells=9, partition_method="uniform"), "configure_logical_cpus"),
            (dict(num_cells=2, partition_method="explicit", split_points=[10]), "split_points"),
            (dict(remat="sometimes"), "remat"),
        ]
        for kwargs, message in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, message):
                    pipe = make_pipeline(mlp_layers(), **kwargs)
                    pipe.FPropAndGrads(pipe.theta, make_batch())

    def test_shape_mismatch_between_layers_names_the_layer(self):
        layers = mlp_layers()
        layers[2] = _proj("p1", WIDTH + 1, WIDTH)
        with self.assertRaisesRegex(ValueError,
                                    r"Layer 2 \(p1\) cannot take the output of layer 1"):
            make_pipeline(layers, num_cells=2)


class ExceptLastTest(tf.test.TestCase):

    def _recomputed(self, schedule_name, num_cells, num_micro_batches):
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, "except_last",
                             schedule=schedule_name)

        def step(batch):
            with fprop_context.fprop_context(training=True):
                return pipe.FPropAndGrads(pipe.theta, batch)[0].loss

        graph = tf.function(step, autograph=False).get_concrete_function(make_batch()).graph
        found = set()
        for op in graph_structure.call_ops(graph):
            parts = op.name.split("/")
            k = int(parts[0].split("_")[1])
            if parts[1].startswith("bprop_mb_") and \
                    f"cell_{k}_bprop" in graph_structure.called_function(op):
                found.add((k, int(parts[1].split("_mb_")[1])))
        return found

    def test_gpipe_recomputes_all_but_the_last_micro_batch_of_each_cell(self):
        want = {(k, t) for k in range(3) for t in range(3)}  # T=4: micro-batch 3 is kept.
        self.assertEqual(want, self._recomputed("gpipe", 3, 4))

    def test_1f1b_last_cell_never_recomputes(self):
        # In 1F1B the last cell runs each backward right after its forward.
        self.assertFalse({k for k, _ in self._recomputed("1f1b", 2, 4)} & {1})


class BackwardOrderTest(tf.test.TestCase):

    def test_previous_cell_recomputes_after_the_whole_backward_of_the_next(self):
        # GPipe's memory bound assumes B(k, t) is one unit: if cell k-1 started
        # recomputing micro-batch t before cell k's weight gradients ran, the executor
        # could hold both cells' activations at once.
        pipe = make_pipeline(mlp_layers(), num_cells=2, num_micro_batches=2, remat="always")

        def step(batch):
            with fprop_context.fprop_context(training=True):
                return pipe.FPropAndGrads(pipe.theta, batch)[1].Flatten()

        graph = tf.function(step, autograph=False).get_concrete_function(make_batch()).graph
        for t in range(2):
            # Each backward is one call of the cell's backward function, which re-computes,
            # differentiates and adds the weight gradients to the sums it returns.
            next_cell = [op for op in graph_structure.call_ops(graph, f"cell_1/bprop_mb_{t}/")
                         if "cell_1_bprop" in graph_structure.called_function(op)]
            this_cell = [op for op in graph_structure.call_ops(graph, f"cell_0/bprop_mb_{t}/")
                         if "cell_0_bprop" in graph_structure.called_function(op)]
            self.assertLen(next_cell, 1)
            self.assertLen(this_cell, 1)
            self.assertIn(next_cell[0], graph_structure.ancestors(this_cell[0]),
                          msg=f"cell 0 may re-compute micro-batch {t} before cell 1's backward")


