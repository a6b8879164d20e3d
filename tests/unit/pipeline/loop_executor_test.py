"""The micro-batch loop (`micro_batch_loop=True`): the unpipelined model's numbers, a graph
that does not grow with T, GPipe's order on every cell, and no cell waiting for another's call.

References are independent of the loop: the plain model on the whole batch with one tape
(pipeline_test.reference_loss_and_grads; its input gradient taken here the same way), the
schedule object's per-cell order, and graph sizes counted on the traced step. Batch norm and
data-parallel replicas with the loop are checked in mesh_test.py. Tolerances as in
pipeline_test.py.
"""

from __future__ import annotations

import tempfile

import graph_structure
import tensorflow as tf
from absl.testing import parameterized
from conftest import random_xy_batch, tanh_stack_with_loss
from pipeline_models import (
    ATOL,
    RTOL,
    make_batch,
    make_pipeline,
    mlp_layers,
    reference_loss_and_grads,
)
from trace_readers import cell_orders

from lingvo_lite.analysis import trace_analysis
from lingvo_lite.core import fprop_context
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import cell_functions, loop_executor, pipelining_layer
from lingvo_lite.pipeline.schedules import schedule


def _loop_step(pipe, step_seed: int = 3, input_grads: bool = False):
    def step(batch):
        with fprop_context.fprop_context(training=True, step_seed=step_seed):
            out, grads, *dx = pipe.FPropAndGrads(pipe.theta, batch,
                                                 return_input_grads=input_grads)
        return out.loss, grads.Flatten(), dx

    return tf.function(step, autograph=False)


def _reference_input_gradient(pipe, batch, step_seed: int) -> tf.Tensor:
    """d(loss)/d(x) of the plain model on the whole batch (CPU:0, one tape)."""
    with tf.device("/device:CPU:0"), fprop_context.fprop_context(
            training=True, step_seed=step_seed, example_offset=0):
        with tf.GradientTape() as tape:
            tape.watch(batch.x)
            out = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
        return tape.gradient(out.loss, batch.x)


class LoopEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batch = make_batch()
        cls.ref_loss, cls.ref_grads = reference_loss_and_grads(
            make_pipeline(mlp_layers()), cls.batch, 3)

    @parameterized.product(num_cells=[1, 2, 4], num_micro_batches=[1, 2, 8, 32])
    def test_loss_and_gradients_match_unpipelined_model(self, num_cells, num_micro_batches):
        # Traced (the loop is a real tf.while_loop only in a graph), with dropout whose masks
        # are keyed by each example's offset, which the loop computes from its counter.
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, micro_batch_loop=True)
        loss, grads, _ = _loop_step(pipe)(self.batch)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        self.assertLen(grads, len(self.ref_grads))
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    def test_input_gradients_and_eager_execution(self):
        pipe = make_pipeline(mlp_layers(), 3, 4, micro_batch_loop=True)
        want = _reference_input_gradient(pipe, self.batch, 3)
        for run in (_loop_step(pipe, input_grads=True), _loop_step(pipe, input_grads=True)
                    .python_function):
            loss, grads, (dx,) = run(self.batch)
            self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
            self.assertAllClose(want, dx.x, rtol=RTOL, atol=ATOL)
            self.assertIsNone(dx.labels)

    def test_forward_only_outputs_in_micro_batch_order(self):
        pipe = make_pipeline(mlp_layers(), 2, 4, micro_batch_loop=True)
        with fprop_context.fprop_context(training=False):
            loop_out = tf.function(lambda b: pipe.FProp(pipe.theta, b),
                                   autograph=False)(self.batch)
            plain = composite.chain_fprop(pipe.layers, pipe.theta.layers, self.batch)
        self.assertAllClose(plain.loss, loop_out.loss, rtol=RTOL, atol=ATOL)
        self.assertAllClose(plain.logits, loop_out.logits, rtol=RTOL, atol=ATOL)

    def test_small_weight_gradients_travel_packed_and_come_back_shaped(self):
        variables = [tf.zeros([3, 4]), tf.zeros([1 << 17]), tf.zeros([5]), tf.zeros([2, 2])]
        packed = (0, 2, 3)  # The large vector is left out.
        self.assertEqual(packed, loop_executor.packed_leaves(variables))
        grads = [tf.fill(v.shape, float(i + 1)) for i, v in enumerate(variables)]
        flat = cell_functions.pack_gradients(grads, packed)
        self.assertEqual([12 + 5 + 4, 1 << 17], [int(tf.size(f)) for f in flat])
        back = cell_functions.unpack_gradients(flat, packed, variables)
        for g, b in zip(grads, back):
            self.assertAllEqual(g, b)


class LoopGraphTest(tf.test.TestCase):

    def _step_graph(self, num_micro_batches: int) -> tf.Graph:
        pipe = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=tanh_stack_with_loss(32, 8, 3), num_cells=4,
            num_micro_batches=num_micro_batches, remat="always", micro_batch_loop=True,
            partition_method="uniform", random_seed=3).Instantiate()

        def step(batch):
            with fprop_context.fprop_context(training=True, step_seed=1):
                out, grads = pipe.FPropAndGrads(pipe.theta, batch)
            return out.loss, grads.Flatten()

        return tf.function(step, autograph=False).get_concrete_function(
            random_xy_batch(64, 8, 3)).graph

    def test_graph_does_not_grow_with_micro_batches(self):
        graphs = {t: self._step_graph(t) for t in (4, 32)}
        counts = {t: graph_structure.total_op_count(g) for t, g in graphs.items()}
        # Per micro-batch only the merging of the outputs grows (its loss seed, its share of
        # the mean loss: a few ops whatever the number of layers); the cells' calls are in the
        # loops' bodies.
        self.assertLess(counts[32] - counts[4], 4 * (32 - 4), msg=str(counts))

        def cell_calls(graph):
            library = graph.as_graph_def().library.function
            return sum(1 for f in [graph.as_graph_def()] + list(library)
                       for n in (f.node if hasattr(f, "node") else f.node_def)
                       if n.op in graph_structure.CALL_OPS and "cell_" in n.name)
        # Forward and backward: each cell called once, in its loop's body.
        self.assertEqual(2 * 4, cell_calls(graphs[32]))
        self.assertEqual(cell_calls(graphs[4]), cell_calls(graphs[32]))


class LoopScheduleTest(tf.test.TestCase):

    def test_cells_run_gpipes_order(self):
        num_micro = 4
        pipe = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=tanh_stack_with_loss(8, 384, 10, prefix="dense_"), num_cells=2,
            num_micro_batches=num_micro, remat="always", micro_batch_loop=True,
            partition_method="uniform", random_seed=1).Instantiate()
        step = _loop_step(pipe)
        batch = random_xy_batch(256, 384, 10)
        step(batch)
        logdir = tempfile.mkdtemp()
        tf.profiler.experimental.start(logdir)
        with tf.profiler.experimental.Trace(trace_analysis.STEP_TRACE_NAME, step_num=0, _r=1):
            step(batch)[0].numpy()
        tf.profiler.experimental.stop()
        spaces = trace_analysis.load_xspaces(logdir)
        (_, start, end), = trace_analysis.step_windows(spaces)
        events = trace_analysis.events_in(trace_analysis.op_events(spaces), start, end)
        boxes = trace_analysis.boxes_from_events(events, "gpipe", "always")
        want = schedule.make_schedule("gpipe", 2, num_micro)
        orders = cell_orders(boxes)
        for k in range(2):
            self.assertEqual([(a.phase.value, a.micro_batch) for a in want.cell_order(k)],
                             orders[k], msg=f"cell {k}")

    def test_no_iteration_waits_for_another_cells_call(self):
        # What lets the loop pipeline, checked on the graph rather than timed (a 2-core CI
        # machine running two test files may not overlap the cells when profiled): no op in a
        # loop body has a control input and the body has no control outputs, so iteration
        # t + 1's cell 0 waits for data only (its own previous call), never for cell 1's call of
        # iteration t. With TensorFlow's automatic control dependencies left on, every output
        # of the body waited for every call (measured: no overlap at all).
        pipe = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=tanh_stack_with_loss(4, 8, 3), num_cells=2,
            num_micro_batches=4, remat="always", micro_batch_loop=True,
            partition_method="uniform", random_seed=1).Instantiate()
        graph_def = _loop_step(pipe).get_concrete_function(random_xy_batch(16, 8, 3)) \
            .graph.as_graph_def()
        bodies = {n.attr["body"].func.name for n in graph_def.node
                  if n.op in ("While", "StatelessWhile")}
        self.assertLen(bodies, 2)  # The forward loop and the backward loop.
        for function in graph_def.library.function:
            if function.signature.name in bodies:
                waits = [(n.name, i) for n in function.node_def for i in n.input
                         if i.startswith("^")]
                self.assertEqual([], waits, msg=function.signature.name)
                self.assertEqual({}, dict(function.control_ret), msg=function.signature.name)


class LoopConfigTest(tf.test.TestCase):

    def test_unsupported_settings_name_the_parameter(self):
        for setting, pattern in (({"schedule": "1f1b"}, "schedule='gpipe'"),
                                 ({"remat": "except_last"}, "remat='always'"),
                                 ({"weight_gradients": "batched"},
                                  "weight_gradients='per_micro_batch'")):
            kw = {"remat": "always", **setting}
            remat_mode = kw.pop("remat")
            with self.assertRaisesRegex(ValueError, f"micro_batch_loop.*{pattern}"):
                make_pipeline(mlp_layers(), 2, 4, remat_mode, micro_batch_loop=True, **kw)

    def test_default_is_unrolled_and_the_model_analysis_says_which(self):
        from lingvo_lite.analysis import model_analysis

        p = pipelining_layer.PipeliningLayer.Params().Set(
            layers=mlp_layers(), num_cells=2, num_micro_batches=4, remat="always",
            partition_method="uniform")
        self.assertFalse(p.micro_batch_loop)
        self.assertNotIn("while_loop", model_analysis.describe_pipeline("network", p)[0])
        text = model_analysis.describe_pipeline("network", p.Copy().Set(micro_batch_loop=True))[0]
        self.assertIn("schedule=gpipe (micro-batches in a tf.while_loop)", text)


if __name__ == "__main__":
    tf.test.main()
