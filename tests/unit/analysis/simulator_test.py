"""Schedule simulator against closed forms derived here, independently of its code.

A GPipe step without recomputation is two flow shops of T identical jobs through K machines:
the forward wave over cells 0..K-1, then, once the last cell has run its last forward, the
backward wave over cells K-1..0. A flow shop of T identical jobs whose stage k takes p_k ends
after sum_k p_k + (T - 1) max_k p_k (the critical path runs every stage once and the slowest
stage T - 1 more times).
"""

from __future__ import annotations

import doctest

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite.analysis import simulator
from lingvo_lite.pipeline.partition import partition
from lingvo_lite.pipeline.schedules import schedule
from lingvo_lite.pipeline.schedules.schedule import Action, Phase


def flow_shop(stage_times, num_jobs: int) -> float:
    return sum(stage_times) + (num_jobs - 1) * max(stage_times)


class ClosedFormTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(k=[1, 2, 4, 8], t=[1, 2, 4, 16])
    def test_balanced_gpipe_step_and_bubble(self, k, t):
        f, b = 1.5, 3.0
        step = simulator.simulate(schedule.make_schedule("gpipe", k, t),
                                  simulator.PhaseCosts.uniform(k, f, b), remat="never")
        self.assertAllClose((t + k - 1) * (f + b), step.step_time)
        breakdown = step.breakdown()
        self.assertAllClose((k - 1) / (t + k - 1), breakdown.bubble)
        self.assertAllClose(0.0, breakdown.load_imbalance, atol=1e-12)
        self.assertAllClose(1.0, breakdown.compute + breakdown.bubble)

    @parameterized.parameters((3, 4), (4, 8), (5, 2))
    def test_unbalanced_gpipe_is_two_flow_shops(self, k, t):
        rng = np.random.default_rng(k * 10 + t)
        forward = rng.uniform(0.5, 2.0, k)
        backward = rng.uniform(1.0, 4.0, k)
        costs = simulator.PhaseCosts(tuple(forward), tuple(backward))
        step = simulator.simulate(schedule.make_schedule("gpipe", k, t), costs, remat="never")
        want = flow_shop(forward, t) + flow_shop(backward, t)
        self.assertAllClose(want, step.step_time)
        busy = [t * (f + b) for f, b in zip(forward, backward)]
        self.assertAllClose((max(busy) - np.mean(busy)) / want,
                            step.breakdown().load_imbalance)

    def test_transfer_adds_to_every_crossing_of_the_critical_path(self):
        k, t, f, b, c = 4, 4, 1.0, 2.0, 0.25
        step = simulator.simulate(schedule.make_schedule("gpipe", k, t),
                                  simulator.PhaseCosts.uniform(k, f, b, transfer=c),
                                  remat="never")
        # Each wave's critical path crosses K - 1 boundaries.
        self.assertAllClose((t + k - 1) * (f + b) + 2 * (k - 1) * c, step.step_time)

    def test_1f1b_takes_as_long_as_gpipe_when_balanced(self):
        for k, t in ((2, 8), (4, 8), (4, 16)):
            costs = simulator.PhaseCosts.uniform(k, 1.0, 2.0)
            gpipe = simulator.simulate(schedule.make_schedule("gpipe", k, t), costs, "never")
            ofob = simulator.simulate(schedule.make_schedule("1f1b", k, t), costs, "never")
            self.assertAllClose(gpipe.step_time, ofob.step_time)

    def test_recomputation_policies(self):
        k, t, f, b = 2, 4, 1.0, 2.0
        gpipe = schedule.make_schedule("gpipe", k, t)
        costs = simulator.PhaseCosts.uniform(k, f, b)
        always = simulator.simulate(gpipe, costs, "always")
        except_last = simulator.simulate(gpipe, costs, "except_last")
        # 'always' re-runs every forward: T per cell; 'except_last' all but micro-batch T-1.
        self.assertEqual(k * t, len(always.recomputed))
        self.assertEqual(k * (t - 1), len(except_last.recomputed))
        self.assertNotIn(Action(Phase.BACKWARD, 0, t - 1), except_last.recomputed)
        self.assertAllClose([t * f] * k, always.recompute_time)
        # Recomputing adds f to each backward: a balanced pipeline with b' = b + f.
        self.assertAllClose((t + k - 1) * (f + b + f), always.step_time)
        self.assertAllClose(t * f / always.step_time, always.breakdown().recompute)

    def test_every_action_waits_for_its_dependencies_and_its_device(self):
        sched = schedule.make_schedule("1f1b", 4, 8)
        rng = np.random.default_rng(0)
        durations = {a: rng.uniform(0.1, 1.0) for a in sched.actions()}
        step = simulator.simulate(sched, durations.__getitem__, transfer=0.05)
        for a in sched.actions():
            self.assertAllClose(durations[a], step.end[a] - step.start[a])
            for d in schedule.dependencies(a, 4):
                crossing = 0.05 if d.cell != a.cell else 0.0
                self.assertGreaterEqual(step.start[a] + 1e-12, step.end[d] + crossing)
        for k in range(4):
            runs = step.device_timeline(k)
            for (_, _, prev_end), (_, start, _) in zip(runs, runs[1:]):
                self.assertGreaterEqual(start + 1e-12, prev_end)

    def test_128_cells_and_512_micro_batches(self):
        step = simulator.simulate(schedule.make_schedule("gpipe", 128, 512),
                                  simulator.PhaseCosts.uniform(128, 1.0, 2.0), "never")
        self.assertAllClose(127 / 639, step.breakdown().bubble)
        self.assertAllClose(639 * 3.0, step.step_time)

    def test_bad_costs_are_refused(self):
        with self.assertRaisesRegex(ValueError, "one forward and one backward cost per cell"):
            simulator.PhaseCosts((1.0, 1.0), (1.0,))
        with self.assertRaisesRegex(ValueError, "PhaseCosts has 2 cells, the schedule 3"):
            simulator.simulate(schedule.make_schedule("gpipe", 3, 2),
                               simulator.PhaseCosts.uniform(2, 1.0, 1.0))
        with self.assertRaisesRegex(ValueError, "remat='sometimes'"):
            simulator.simulate(schedule.make_schedule("gpipe", 2, 2),
                               simulator.PhaseCosts.uniform(2, 1.0, 1.0), "sometimes")

    def test_prediction_from_a_partition(self):
        part = partition.make_partition([f"l{i}" for i in range(4)], [1.0, 2.0, 2.0, 1.0], 2)
        self.assertEqual([3.0, 3.0], part.cell_costs)
        prediction = simulator.predict(part, [1.0, 2.0, 2.0, 1.0], 4, "gpipe", "never")
        # Each cell: forward 3/4, backward 2 x 3/4 per micro-batch; T + K - 1 = 5 slots.
        self.assertAllClose(5 * 2.25, prediction.step.step_time)
        self.assertAllClose(3 * 6.0, prediction.one_device_time)
        self.assertAllClose(18.0 / 11.25, prediction.speedup)
        self.assertIn("bubble 20.0%", prediction.summary())
        with self.assertRaisesRegex(ValueError, "3 layer costs for a partition of 4 layers"):
            simulator.predict(part, [1.0, 1.0, 1.0], 4)

    def test_split_backward_by_hand(self):
        # K=2, T=1 zero-bubble: each cell runs F0 B0 W0. forward 1, backward 3 of which
        # weight 1, so B takes 2 and W 1. Cell 0: F 0-1; cell 1: F 1-2, B 2-4, W 4-5;
        # cell 0: B 4-6, W 6-7.
        zb = schedule.make_schedule("zero_bubble", 2, 1)
        costs = simulator.PhaseCosts((1.0, 1.0), (3.0, 3.0), weight=(1.0, 1.0))
        step = simulator.simulate(zb, costs, remat="never")
        w, b = Phase.WEIGHT, Phase.BACKWARD
        self.assertEqual({Action(b, 1, 0): 2.0, Action(w, 1, 0): 4.0, Action(b, 0, 0): 4.0,
                          Action(w, 0, 0): 6.0},
                         {a: step.start[a] for a in step.start if a.phase is not Phase.FORWARD})
        self.assertAllClose(7.0, step.step_time)
        # Re-computation belongs to B: each B takes one more forward (B 2-5, W 5-6, B 5-8,
        # W 8-9), and W stays 1.
        always = simulator.simulate(zb, costs, remat="always")
        self.assertAllClose(9.0, always.step_time)
        self.assertEqual({Action(b, 0, 0), Action(b, 1, 0)}, set(always.recomputed))
        self.assertAllClose((1.0, 1.0), always.recompute_time)
        self.assertAllClose(1.0, always.end[Action(w, 0, 0)] - always.start[Action(w, 0, 0)])
        # A schedule that does not split runs the whole backward (3) as B: 0-1, 1-2, 2-5, 5-8.
        ofob = simulator.simulate(schedule.make_schedule("1f1b", 2, 1), costs, remat="never")
        self.assertAllClose(8.0, ofob.step_time)

    def test_weight_defaults_to_half_the_backward(self):
        costs = simulator.PhaseCosts.uniform(3, 1.0, 4.0)
        self.assertEqual((2.0, 2.0, 2.0), costs.weight_costs)
        with self.assertRaisesRegex(ValueError, "one weight cost per cell"):
            simulator.PhaseCosts((1.0, 1.0), (1.0, 1.0), weight=(0.5,))
        with self.assertRaisesRegex(ValueError, "must be >= 0 and <= backward"):
            simulator.PhaseCosts((1.0,), (1.0,), weight=(2.0,))

    def test_interleaved_counts_devices_not_cells(self):
        # One device holding both cells: no crossing pays the transfer. T = K = 1: Megatron
        # runs 0F0 1F0 1B0 0B0 back to back: 2 x 1 + 2 x 2.
        sched = schedule.make_schedule("interleaved", 2, 1, virtual_stages=2)
        step = simulator.simulate(sched, simulator.PhaseCosts.uniform(2, 1.0, 2.0, 0.5),
                                  remat="never")
        self.assertAllClose(6.0, step.step_time)
        self.assertEqual(1, len(step.breakdown().device_busy))
        # K=2 devices, v=2, T=2, unit times: the unit-time chart has 10 ticks and every
        # device idles 2 of them (schedule_test's to_text case): bubble 2/10.
        sched = schedule.make_schedule("interleaved", 4, 2, virtual_stages=2)
        step = simulator.simulate(sched, simulator.PhaseCosts.uniform(4, 1.0, 1.0), "never")
        self.assertAllClose(10.0, step.step_time)
        self.assertAllClose(0.2, step.breakdown().bubble)
        self.assertAllClose([8.0, 8.0], [step.device_busy_time(d) for d in range(2)])
        self.assertEqual(sched.device_order(1), [a for a, _, _ in step.device_timeline(1)])

    def test_prediction_with_virtual_stages(self):
        part = partition.make_partition([f"l{i}" for i in range(4)], [1.0] * 4, 4)
        prediction = simulator.predict(part, [1.0] * 4, 4, "interleaved", "never",
                                       virtual_stages=2)
        self.assertEqual(2, prediction.step.schedule.num_devices)
        self.assertIn("K=4 on 2 devices", prediction.summary())

    def test_each_device_updates_after_its_own_last_action(self):
        # K=2, T=1, forward 1 and backward 2 per cell: F0 [0, 1], F1 [1, 2], B1 [2, 4],
        # B0 [4, 6]. Device 1 updates from 4, device 0 from 6.
        sched = schedule.make_schedule("gpipe", 2, 1)

        def duration(a: Action) -> float:
            return 1.0 if a.phase is Phase.FORWARD else 2.0

        for update, step in (([3.0, 3.0], 9.0), ([1.0, 5.0], 9.0), ([0.5, 1.0], 6.5),
                             (3.0, 9.0)):
            with self.subTest(update=update):
                sim = simulator.simulate(sched, duration, remat="never", update_time=update)
                self.assertAlmostEqual(sim.step_time, step)
                self.assertAlmostEqual(sim.update_time, step - 6.0)
        with self.assertRaisesRegex(ValueError, "update_time has 3 per-device times"):
            simulator.simulate(sched, duration, update_time=[1.0, 1.0, 1.0])

    def test_zbv_by_hand_crosses_devices_where_its_v_does(self):
        # ZB-V, 4 cells on 2 devices (device 0: cells 0 and 3, device 1: cells 1 and 2),
        # T=1, forward 1, B 1, W 1. The chain F0 F1 F2 F3 B3 B2 B1 B0 W0 is 9 long and
        # crosses devices 4 times (F0->F1, F2->F3, B3->B2, B1->B0), not 6 as under k % 2.
        sched = schedule.make_schedule("zbv", 4, 1)
        costs = simulator.PhaseCosts.uniform(4, forward=1.0, backward=2.0)
        step = simulator.simulate(sched, costs, remat="never")
        self.assertAlmostEqual(9.0, step.step_time)
        self.assertAllClose([6 / 9, 6 / 9], step.breakdown().device_busy)
        with_transfers = simulator.simulate(sched, costs, remat="never", transfer=0.5)
        self.assertAlmostEqual(9.0 + 4 * 0.5, with_transfers.step_time)

    def test_predict_takes_a_schedule_object(self):
        part = partition.make_partition([f"l{i}" for i in range(4)], [1.0] * 4, 4)
        by_name = simulator.predict(part, [4.0] * 4, 4, "zbv", remat="never")
        by_object = simulator.predict(part, [4.0] * 4, 4, schedule.make_schedule("zbv", 4, 4),
                                      remat="never")
        self.assertEqual(2, by_name.step.num_devices)
        self.assertAlmostEqual(by_name.step.step_time, by_object.step.step_time)
        self.assertIn("K=4 on 2 devices, T=4, zbv", by_name.summary())

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(simulator).failed)


if __name__ == "__main__":
    tf.test.main()
