"""The executor's plan in plain Python, and the structure of the graphs it builds.

Checks `remat.remat_plan` and `op_names.function_runs` against orders written out by hand, the
op-name parser against hand-classified names, and that a step's graph stops growing with the
number of micro-batches: each cell's functions are traced once and called T times.
"""

from __future__ import annotations

import doctest

import graph_structure
import tensorflow as tf
from absl.testing import parameterized
from conftest import random_xy_batch, tanh_stack_with_loss

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.pipeline import cell_functions, executor, op_names, pipelining_layer, remat
from lingvo_lite.pipeline.schedules import schedule


class RematPlanTest(tf.test.TestCase):

    def test_gpipe_plans_by_hand(self):
        sched = schedule.make_schedule("gpipe", 2, 3)  # Cell order: F0 F1 F2 B2 B1 B0.
        everything = {(k, t) for k in range(2) for t in range(3)}
        self.assertEqual(remat.remat_plan(sched, "never"), everything)
        self.assertEqual(remat.remat_plan(sched, "always"), set())
        self.assertEqual(remat.remat_plan(sched, "except_last"), {(0, 2), (1, 2)})

    def test_1f1b_keeps_only_the_last_cell_which_runs_each_backward_after_its_forward(self):
        # K=3, T=4. Cell 2: F0 B0 F1 B1 F2 B2 F3 B3; cell 1: F0 F1 B0 F2 B1 F3 B2 B3;
        # cell 0: F0 F1 F2 B0 F3 B1 B2 B3. Only cell 2's forwards are directly followed by
        # their own backward.
        sched = schedule.make_schedule("1f1b", 3, 4)
        self.assertEqual(remat.remat_plan(sched, "except_last"),
                         {(2, 0), (2, 1), (2, 2), (2, 3)})

    def test_recomputed_actions_are_the_complement(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        self.assertEqual(remat.recomputed_actions(sched, "except_last"),
                         {schedule.Action(schedule.Phase.BACKWARD, k, 0) for k in range(2)})

    def test_zero_bubble_plans_like_1f1b(self):
        # K=3, T=4 ZB-H1 (schedule_test writes the orders out): cell 2: F0 B0 F1 B1 F2 B2 W0 F3
        # B3 W1 W2 W3, cell 1: F0 F1 B0 F2 B1 W0 ..., cell 0: F0 F1 F2 B0 W0 ... Only cell 2
        # runs each B right after its F.
        sched = schedule.make_schedule("zero_bubble", 3, 4)
        self.assertEqual(remat.remat_plan(sched, "except_last"),
                         {(2, 0), (2, 1), (2, 2), (2, 3)})
        # Re-computation belongs to B: no W action is ever re-computed.
        recomputed = remat.recomputed_actions(sched, "always")
        self.assertEqual(recomputed, {schedule.Action(schedule.Phase.BACKWARD, k, t)
                                      for k in range(3) for t in range(4)})

    def test_interleaved_plans_by_device_order(self):
        # One device, two cells, T=1: 0F0 1F0 1B0 0B0. Cell 1's backward follows its forward
        # on the device; cell 0's does not (cell 1 ran in between), though it does in cell
        # 0's own order (0F0 0B0).
        sched = schedule.make_schedule("interleaved", 2, 1, virtual_stages=2)
        self.assertEqual(remat.remat_plan(sched, "except_last"), {(1, 0)})
        # K=2, v=2, T=4 (Megatron's order in schedule_test): device 1 runs 3F_t 3B_t back to
        # back for every t; device 0 never runs a backward right after its forward.
        sched = schedule.make_schedule("interleaved", 4, 4, virtual_stages=2)
        self.assertEqual(remat.remat_plan(sched, "except_last"),
                         {(3, 0), (3, 1), (3, 2), (3, 3)})

    def test_unknown_mode_names_the_parameter(self):
        with self.assertRaisesRegex(ValueError, r"remat='sometimes'; use one of"):
            remat.remat_plan(schedule.make_schedule("gpipe", 1, 1), "sometimes")

    def test_docstring_example(self):
        self.assertEqual(doctest.testmod(remat).failed, 0)


class OpNamesTest(tf.test.TestCase):

    def test_function_runs_by_hand(self):
        sched = schedule.make_schedule("gpipe", 2, 2)  # F0 F1 B1 B0 on each cell.
        runs = op_names.function_runs(sched, remat.remat_plan(sched, "except_last"))
        for k in range(2):
            # Micro-batch 1 is kept: its forward and its gradient run inline, no function.
            self.assertEqual(runs[(k, "fprop")], [0])
            self.assertEqual(runs[(k, "bprop")], [0])  # Re-computed (adds to the sums).
        # Inline B1, then inline B0, whose gradient is added to B1's at the call site: no
        # function at all.
        self.assertEqual(op_names.function_runs(sched, remat.remat_plan(sched, "never")), {})
        # On serial devices a kept forward is a call and its gradient TensorFlow's gradient
        # function of that call.
        calls = op_names.function_runs(sched, remat.remat_plan(sched, "except_last"),
                                       kept_inline=False)
        for k in range(2):
            self.assertEqual(calls[(k, "fprop")], [0, 1])
            self.assertEqual(calls[(k, "fprop_gradient")], [1])
            self.assertEqual(calls[(k, "bprop")], [0])

    def test_function_runs_of_a_split_backward_by_hand(self):
        # K=2, T=2 zero-bubble: cell 0 F0 F1 B0 W0 B1 W1, cell 1 F0 B0 F1 B1 W0 W1. except_last
        # keeps cell 1's micro-batches (each B right after its F: both inline, adding the
        # gradients of weights not applied through weight_ops at the call site); cell 0's B
        # re-computes (bprop, which adds them itself). Every W computes the deferred weight
        # gradients from B's records (wgrad).
        sched = schedule.make_schedule("zero_bubble", 2, 2)
        runs = op_names.function_runs(sched, remat.remat_plan(sched, "except_last"))
        self.assertEqual(runs, {
            (0, "fprop"): [0, 1], (0, "bprop"): [0, 1], (0, "wgrad"): [0, 1],
            (1, "wgrad"): [0, 1],
        })

    def test_function_runs_with_batched_weight_gradients_by_hand(self):
        # K=2, T=2 GPipe (F0 F1 B1 B0 on each cell), remat except_last: micro-batch 1 is kept
        # (inline). Every backward is a split backward's B: the kept one adds the gradients of
        # weights not applied through weight_ops at the call site, micro-batch 0's is re-computed
        # (bprop). After the last backward, one wgrad call takes the deferred weight gradients
        # of both micro-batches.
        sched = schedule.make_schedule("gpipe", 2, 2)
        runs = op_names.function_runs(sched, remat.remat_plan(sched, "except_last"),
                                      batched_weight_grads=True)
        all_mb = op_names.ALL_MICRO_BATCHES
        for k in range(2):
            self.assertEqual({family: t for (cell, family), t in runs.items() if cell == k}, {
                "fprop": [0], "bprop": [0], "wgrad": [all_mb]})
        # One micro-batch has nothing to batch: the executor runs the plain backward.
        single = schedule.make_schedule("gpipe", 2, 1)
        self.assertEqual(op_names.function_runs(single, remat.remat_plan(single, "never"),
                                                batched_weight_grads=True), {})

    def test_weight_gradient_names(self):
        cases = {
            "cell_2/wgrad_mb_3/MatMul": (2, "W", 3, "wgrad"),
            "cell_1/wgrad/dense/MatMul": (1, "W", None, "wgrad"),
            "gradient_tape/cell_1/wgrad/dense/MatMul": (1, "W", None, "wgrad"),
            "replica_1/cell_0/wgrad_all/concat": (0, "W", op_names.ALL_MICRO_BATCHES, "wgrad"),
        }
        for name, want in cases.items():
            parsed = op_names.parse(name)
            self.assertEqual((parsed.cell, parsed.phase, parsed.micro_batch, parsed.family),
                             want, msg=name)
        self.assertEqual("cell_2/wgrad_mb_7", op_names.action_scope("W", 2, 7))
        self.assertEqual("cell_2/wgrad_all", op_names.batched_weight_gradient_scope(2))
        self.assertIsNone(op_names.parse("cell_2/fprop_all/x"))
        parsed = op_names.parse(op_names.function_scope("wgrad", 4, replica=1) + "/MatMul")
        self.assertEqual((parsed.cell, parsed.phase, parsed.replica), (4, "W", 1))
        with self.assertRaisesRegex(ValueError, "phase='R'"):
            op_names.action_scope("R", 0, 0)

    def test_parse(self):
        cases = {
            "cell_3/fprop_mb_12/dense/MatMul": (3, "F", 12, "fprop"),
            "cell_0/bprop_mb_2/recompute/x": (0, "R", 2, "bprop"),
            "gradient_tape/cell_0/bprop_mb_2/recompute/x": (0, "B", 2, "bprop"),
            "cell_1/fprop/layers/p0/MatMul": (1, "F", None, "fprop"),
            "cell_1/bprop/recompute/layers/p0/MatMul": (1, "R", None, "bprop"),
            "gradient_tape/cell_1/bprop/recompute/layers/p0/MatMul": (1, "B", None, "bprop"),
            "gradient_tape/cell_2/fprop_mb_5/fprop/p0/MatMul/MatMul":
                (2, "B", 5, "fprop_gradient"),
            "cell_0/bprop_mb_1/accumulate/add_3": (0, "B", 1, "accumulate"),
            "task/replica_1/cell_4/fprop/x": (4, "F", None, "fprop"),
        }
        for name, (cell, phase, t, family) in cases.items():
            parsed = op_names.parse(name)
            self.assertEqual((parsed.cell, parsed.phase, parsed.micro_batch, parsed.family),
                             (cell, phase, t, family), msg=name)
        self.assertEqual(op_names.parse("task/replica_1/cell_4/fprop/x").replica, 1)
        for other in ("dense/MatMul", "cell_x/fprop/y", "gradients/AddN", "cell_0/zero_grad"):
            self.assertIsNone(op_names.parse(other), msg=other)

    def test_formats_parse_back(self):
        name = op_names.action_scope("B", 2, 7) + "/AddN"
        self.assertEqual(op_names.parse(name).micro_batch, 7)
        name = op_names.function_scope("bprop", 5, replica=3) + "/recompute/Relu"
        parsed = op_names.parse(name)
        self.assertEqual((parsed.cell, parsed.phase, parsed.replica), (5, "R", 3))

    def test_docstring_examples(self):
        for module in (op_names, cell_functions, executor):
            self.assertEqual(doctest.testmod(module).failed, 0, msg=module.__name__)


def _dense_stack(num_layers: int, width: int = 8) -> list:
    return tanh_stack_with_loss(num_layers, width, 3)


def _stack_pipeline(num_layers: int, num_cells: int, num_micro_batches: int, remat_mode: str,
                    batch: int = 64, width: int = 8) -> pipelining_layer.PipeliningLayer:
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=_dense_stack(num_layers, width), num_cells=num_cells,
        num_micro_batches=num_micro_batches, remat=remat_mode, random_seed=3,
        input_shapes=NestedMap(x=tf.TensorShape([batch, width]),
                               labels=tf.TensorShape([batch]))).Instantiate()


def _batch(batch: int = 64, width: int = 8) -> NestedMap:
    return random_xy_batch(batch, width, 3)


def _step_graph(pipe: pipelining_layer.PipeliningLayer) -> tf.Graph:
    def step(batch):
        with fprop_context.fprop_context(training=True, step_seed=1):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss, grads.Flatten()

    return tf.function(step, autograph=False).get_concrete_function(_batch()).graph


class TracedOnceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters("always", "except_last")
    def test_graph_size_does_not_grow_with_micro_batches(self, remat_mode):
        # 32 layers on 2 cells: at T=32 every layer used to be traced 3 x 32 times (over
        # 20,000 ops); now each action is a few ops calling its cell's functions: the call, a
        # local copy of each boundary tensor (see cell_functions._to_call_argument). With these
        # tiny layers (a dense layer is a few ops) 4 cells come to 1.6x; see the next test.
        counts = {t: graph_structure.total_op_count(
            _step_graph(_stack_pipeline(32, 2, t, remat_mode))) for t in (4, 32)}
        self.assertLess(counts[32], 1.5 * counts[4], msg=str(counts))

    @parameterized.parameters("always", "except_last")
    def test_function_bodies_are_independent_of_micro_batches(self, remat_mode):
        # The function bodies do not grow and each action stays a handful of ops. (remat=
        # 'never' keeps every micro-batch, whose forwards run inline to free their activations
        # layer by layer in the backward: its graph grows with T, the price of not
        # re-computing.)
        sizes = {}
        for t in (4, 32):
            graph_def = _step_graph(_stack_pipeline(32, 4, t, remat_mode)).as_graph_def()
            sizes[t] = (len(graph_def.node),
                        sum(len(f.node_def) for f in graph_def.library.function))
        self.assertEqual(sizes[4][1], sizes[32][1], msg=str(sizes))
        actions_added = 2 * 4 * (32 - 4)
        self.assertLess(sizes[32][0] - sizes[4][0], 10 * actions_added, msg=str(sizes))

    @parameterized.parameters("always", "except_last", "never")
    def test_traces_do_not_depend_on_micro_batches(self, remat_mode):
        # Per cell: the forward, the re-computing backward (a trace for the first weight
        # gradient, another adding to the sums) and the sum of a kept backward: a handful,
        # the same for 2 and for 16 micro-batches.
        counts = {}
        for t in (2, 16):
            pipe = _stack_pipeline(8, 2, t, remat_mode)
            _step_graph(pipe)
            counts[t] = [cell.num_traces for cell in pipe._executor(0)._cells]
        self.assertEqual(counts[2], counts[16])
        self.assertLessEqual(max(counts[16]), 4)

    def test_eager_steps_reuse_the_traces(self):
        pipe = _stack_pipeline(4, 2, 4, "always")
        counts = []
        for seed in (1, 2):
            with fprop_context.fprop_context(training=True, step_seed=seed):
                pipe.FPropAndGrads(pipe.theta, _batch())
            counts.append([c.num_traces for c in pipe._executor(0)._cells])
        self.assertEqual(counts[0], counts[1])


class ScheduleOrderTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(("gpipe", "except_last"), ("1f1b", "always"),
                              ("1f1b", "never"))
    def test_each_cell_runs_its_actions_in_schedule_order(self, schedule_name, remat_mode):
        # Action i+1 of a cell may only start after action i: its call ops (or inline matmuls)
        # must (transitively) wait for the previous action's in the step's graph.
        num_cells, num_micro = 2, 4
        pipe = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=_dense_stack(4), num_cells=num_cells,
            num_micro_batches=num_micro, remat=remat_mode, schedule=schedule_name,
            random_seed=3, input_shapes=NestedMap(x=tf.TensorShape([64, 8]),
                                                  labels=tf.TensorShape([64]))).Instantiate()
        graph = _step_graph(pipe)
        sched = schedule.make_schedule(schedule_name, num_cells, num_micro)
        for k in range(num_cells):
            calls = []
            for action in sched.cell_order(k):
                t = action.micro_batch
                scope = op_names.action_scope(action.phase.value, k, t) + "/"
                # Calls of the cell's functions; a kept micro-batch's forward and its tape
                # gradient run inline, so their matmuls stand for them (those whose result
                # is used: cell 0's unused input gradient is pruned, it never runs).
                inline = op_names.action_scope("F", k, t) + "/"
                if action.phase is schedule.Phase.BACKWARD:
                    inline = "gradient_tape/" + inline
                found = graph_structure.call_ops(graph, scope) + [
                    op for op in graph.get_operations()
                    if op.type == "MatMul" and op.name.startswith(inline)
                    and any(out.consumers() for out in op.outputs)]
                self.assertNotEmpty(found, msg=scope)
                calls.append(found)
            for before, after in zip(calls, calls[1:]):
                ancestors = set().union(*(graph_structure.ancestors(op) for op in after))
                self.assertTrue(all(op in ancestors for op in before),
                                msg=f"{after[0].name} does not wait for {before[0].name}")




if __name__ == "__main__":
    tf.test.main()
