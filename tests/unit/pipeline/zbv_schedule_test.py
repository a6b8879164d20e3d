"""ZB-V (zbv_schedule.py) and schedules that place cells other than k mod D.

The schedule owns placement: cell k's variables and ops go to `schedule.device_of_cell(k)`,
for the V-shaped ZB-V and for a CustomSchedule written as text with a hand-written mapping.
Gradients are checked against the unpipelined model (pipeline_test's reference).
"""

from __future__ import annotations

import collections

import graph_structure
import tensorflow as tf
from absl.testing import parameterized
from pipeline_models import (
    ATOL,
    RTOL,
    make_batch,
    make_pipeline,
    mlp_layers,
    pipeline_loss_and_grads,
    reference_loss_and_grads,
)

from lingvo_lite.core import fprop_context
from lingvo_lite.pipeline.schedules import custom_schedule, schedule, zbv_schedule
from lingvo_lite.pipeline.schedules.schedule import Phase


class ZeroBubbleVStructureTest(parameterized.TestCase):

    @parameterized.product(num_devices=[1, 2, 3, 4], num_micro_batches=[1, 2, 4, 8, 9])
    def test_every_action_once_in_a_v(self, num_devices, num_micro_batches):
        sched = schedule.make_schedule("zbv", 2 * num_devices, num_micro_batches)
        self.assertIsInstance(sched, zbv_schedule.ZeroBubbleVSchedule)
        D, T = num_devices, num_micro_batches
        self.assertEqual(D, sched.num_devices)
        # Device d holds cells d and 2D-1-d: the first and the last cell share device 0.
        self.assertEqual(tuple(list(range(D)) + list(reversed(range(D)))), sched.cell_devices)
        counts = collections.Counter(sched.actions())
        self.assertEqual(3 * 2 * D * T, len(counts))
        self.assertEqual({1}, set(counts.values()))
        sched.validate()  # Raises on a deadlock.
        for d, order in enumerate(sched.device_orders()):
            self.assertEqual({d}, {sched.device_of_cell(a.cell) for a in order})
            # 1F1B's activation memory: at most 2D half-stage cells' forwards await their B.
            waiting = peak = 0
            for a in order:
                waiting += {Phase.FORWARD: 1, Phase.BACKWARD: -1}.get(a.phase, 0)
                peak = max(peak, waiting)
            self.assertLessEqual(peak, 2 * D)

    @parameterized.parameters((2, 2), (2, 4), (2, 8), (4, 4), (4, 8))
    def test_fewer_idle_ticks_than_zero_bubble_and_interleaved(self, num_devices, T):
        # Unit time per action; ZB-V's cells are half as large, so compare fractions.
        zbv = schedule.make_schedule("zbv", 2 * num_devices, T).bubble_fraction()
        zb_h1 = schedule.make_schedule("zero_bubble", num_devices, T).bubble_fraction()
        interleaved = schedule.make_schedule("interleaved", 2 * num_devices, T,
                                             virtual_stages=2).bubble_fraction()
        self.assertLess(zbv, zb_h1)
        self.assertLess(zbv, interleaved)

    def test_odd_cells_and_virtual_stages_refused(self):
        with self.assertRaisesRegex(ValueError, "num_cells=3: the zbv schedule puts two cells"):
            schedule.make_schedule("zbv", 3, 2)
        with self.assertRaisesRegex(ValueError, "always puts two cells on each device"):
            schedule.make_schedule("zbv", 4, 2, virtual_stages=3)

    def test_registered_by_name(self):
        self.assertIn("zbv", schedule.schedule_classes())
        with self.assertRaisesRegex(ValueError, "valid names: .*zbv"):
            schedule.make_schedule("zbw", 4, 2)


def _ops_by_cell_device(pipe, batch) -> dict[int, set[str]]:
    """The devices of every op the step places in each cell's scope."""

    @tf.function(autograph=False)
    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss, grads.Flatten()

    graph = step.get_concrete_function(batch).graph
    devices = collections.defaultdict(set)
    for op in graph.get_operations():
        parts = op.name.split("/")
        if not parts[0].startswith("cell_") or op.type in ("Placeholder", "ReadVariableOp"):
            continue
        if op.type in graph_structure.CALL_OPS or op.device:
            devices[int(parts[0].split("_")[1])].add(op.device)
    return devices


class SchedulePlacesCellsTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batch = make_batch()
        cls.ref_loss, cls.ref_grads = reference_loss_and_grads(
            make_pipeline(mlp_layers()), cls.batch, 3)

    def _check_gradients(self, pipe):
        loss, grads = pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)
        self.assertAllClose(self.ref_loss, loss, rtol=RTOL, atol=ATOL)
        self.assertLen(grads, len(self.ref_grads))
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)

    def _check_placement(self, pipe, expected_devices):
        self.assertEqual(tuple(expected_devices), pipe.cell_devices)
        for k, d in enumerate(expected_devices):
            variables = pipe.cell_variables(k)
            self.assertNotEmpty(variables)
            for v in variables:
                self.assertEndsWith(v.device, f"CPU:{d}", msg=f"cell {k}: {v.name}")
        for k, devices in _ops_by_cell_device(pipe, self.batch).items():
            self.assertEqual({f"/device:CPU:{expected_devices[k]}"},
                             {d.replace("/job:localhost/replica:0/task:0", "")
                              for d in devices}, f"cell {k}")

    @parameterized.product(config=[(4, 1), (4, 2), (4, 4), (6, 8), (8, 8)],
                           remat=["always", "except_last", "never"])
    def test_zbv_gives_the_unpipelined_gradients(self, config, remat):
        num_cells, num_micro_batches = config
        pipe = make_pipeline(mlp_layers(), num_cells, num_micro_batches, remat, schedule="zbv")
        self._check_gradients(pipe)

    def test_zbv_places_every_variable_and_op_on_the_schedules_device(self):
        pipe = make_pipeline(mlp_layers(), 4, 4, "except_last", schedule="zbv")
        self._check_placement(pipe, [0, 1, 1, 0])

    def test_custom_schedule_from_text_trains_on_its_own_mapping(self):
        text = ("device 0: 1F0 1F1 1B1 1B0   # cell 1 on device 0\n"
                "device 1: 0F0 0F1 0B1 0B0   # cell 0 on device 1\n")
        sched = custom_schedule.CustomSchedule(text, device_of_cell=[1, 0])
        pipe = make_pipeline(mlp_layers(), 2, 2, "except_last", schedule=sched)
        self._check_placement(pipe, [1, 0])
        self._check_gradients(pipe)

    def test_schedule_object_for_another_step_refused_in_one_line(self):
        sched = custom_schedule.CustomSchedule("device 0: F0 F1 B1 B0\ndevice 1: F0 F1 B1 B0")
        with self.assertRaisesRegex(ValueError, r"^pipe: the schedule object has 2 cells, but "
                                    r"the partition made 3; set num_cells=2"):
            make_pipeline(mlp_layers(), 3, 2, schedule=sched)
        pipe = make_pipeline(mlp_layers(), 2, 4, schedule=sched)
        with self.assertRaisesRegex(ValueError, "built for 2 micro-batches, but the step runs 4"):
            pipeline_loss_and_grads(pipe, self.batch, 3, graph=False)


if __name__ == "__main__":
    tf.test.main()
