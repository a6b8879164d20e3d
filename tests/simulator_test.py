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
from lingvo_lite.pipeline import partition, schedule
from lingvo_lite.pipeline.schedule import Action, Phase


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

    def test_devices_sharing_one_processor_by_hand(self):
        # K=2, T=2, gpipe, forward 1 and backward 2, one processor: two actions running at
        # once each run at half speed. F00 [0, 1]; F01 and F10 from 1, 1 of work each at 1/2:
        # [1, 3]; F11 [3, 4]; B11 [4, 6]; B01 and B10 from 6, 2 each at 1/2: [6, 10]; B00
        # [10, 12]. With updates 1 (device 0) and 3 (device 1): device 1 updates from 10
        # beside B00, both at 1/2 until B00 ends at 14 (1 of the update left); then both
        # updates at 1/2 until 16.
        sched = schedule.make_schedule("gpipe", 2, 2)
        costs = simulator.PhaseCosts.uniform(2, forward=1.0, backward=2.0)
        step = simulator.simulate(sched, costs, remat="never", processors=1)
        expected = {"F(k=0,t=0)": (0, 1), "F(k=0,t=1)": (1, 3), "F(k=1,t=0)": (1, 3),
                    "F(k=1,t=1)": (3, 4), "B(k=1,t=1)": (4, 6), "B(k=0,t=1)": (6, 10),
                    "B(k=1,t=0)": (6, 10), "B(k=0,t=0)": (10, 12)}
        self.assertEqual(expected, {str(a): (step.start[a], step.end[a]) for a in step.start})
        self.assertAlmostEqual(12.0, step.step_time)
        with_updates = simulator.simulate(sched, costs, remat="never", processors=1,
                                          update_time=[1.0, 3.0])
        self.assertAlmostEqual(16.0, with_updates.step_time)
        self.assertAlmostEqual(14.0, with_updates.pipeline_time)
        self.assertAlmostEqual(2.0, with_updates.update_time)

    @parameterized.parameters("gpipe", "1f1b", "zero_bubble")
    def test_enough_processors_change_nothing(self, name):
        sched = schedule.make_schedule(name, 4, 8)
        rng = np.random.default_rng(0)
        costs = simulator.PhaseCosts(tuple(rng.uniform(1, 2, 4)), tuple(rng.uniform(2, 4, 4)),
                                     transfer=0.1)
        alone = simulator.simulate(sched, costs, remat="except_last", update_time=[1.0] * 4)
        for processors in (4, 16):
            shared = simulator.simulate(sched, costs, remat="except_last",
                                        update_time=[1.0] * 4, processors=processors)
            self.assertEqual(alone.start, shared.start)
            self.assertAlmostEqual(alone.step_time, shared.step_time)

    @parameterized.product(name=["gpipe", "1f1b", "zero_bubble"], processors=[1, 2, 3])
    def test_shared_processors_keep_order_and_dependencies(self, name, processors):
        sched = schedule.make_schedule(name, 4, 8)
        rng = np.random.default_rng(1)
        costs = simulator.PhaseCosts(tuple(rng.uniform(1, 2, 4)), tuple(rng.uniform(2, 4, 4)))
        alone = simulator.simulate(sched, costs, remat="except_last")
        step = simulator.simulate(sched, costs, remat="except_last", processors=processors)
        work = sum(alone.end[a] - alone.start[a] for a in alone.start)
        # No faster than the work spread over the processors, nor than the devices alone; no
        # slower than running every action one after the other (without transfers, some action
        # is always ready, so the processors are never all idle).
        self.assertGreaterEqual(step.step_time, max(work / processors, alone.step_time) - 1e-9)
        self.assertLessEqual(step.step_time, work + 1e-9)
        for order in sched.device_orders():
            for before, after in zip(order, order[1:]):
                self.assertLessEqual(step.end[before], step.start[after] + 1e-9)
        for a in step.start:
            for d in schedule.dependencies(a, sched.num_cells):
                self.assertGreaterEqual(step.start[a], step.end[d] - 1e-9)
            # An action never runs faster than alone.
            self.assertGreaterEqual(step.end[a] - step.start[a],
                                    alone.end[a] - alone.start[a] - 1e-9)
        if processors == 1:
            self.assertAlmostEqual(step.step_time, work)

    def test_co_run_slowdown_by_hand(self):
        # K=2, T=2, gpipe, forward 1 and backward 2, two processors, every action 1.5x slower
        # while the other processor is busy. F00 [0, 1] alone; F01 and F10 side by side, 1 of
        # work each at 1/1.5: [1, 2.5]; F11 [2.5, 3.5] and B11 [3.5, 5.5] alone; B01 and B10
        # 2 each at 1/1.5: [5.5, 8.5]; B00 [8.5, 10.5] alone.
        sched = schedule.make_schedule("gpipe", 2, 2)
        costs = simulator.PhaseCosts.uniform(2, forward=1.0, backward=2.0)
        slowdown = simulator.CoRunSlowdown(actions=lambda a: 1.5)
        step = simulator.simulate(sched, costs, remat="never", processors=2,
                                  co_run_slowdown=slowdown)
        expected = {"F(k=0,t=0)": (0, 1), "F(k=0,t=1)": (1, 2.5), "F(k=1,t=0)": (1, 2.5),
                    "F(k=1,t=1)": (2.5, 3.5), "B(k=1,t=1)": (3.5, 5.5),
                    "B(k=0,t=1)": (5.5, 8.5), "B(k=1,t=0)": (5.5, 8.5),
                    "B(k=0,t=0)": (8.5, 10.5)}
        self.assertEqual(expected.keys(), {str(a) for a in step.start})
        for a in step.start:
            self.assertAlmostEqual(expected[str(a)][0], step.start[a])
            self.assertAlmostEqual(expected[str(a)][1], step.end[a])
        # Only the forwards slow down (2x): F01 and F10 [1, 3]; the backwards side by side
        # at full speed: B01 and B10 [6, 8]; step 10.
        forwards_only = simulator.CoRunSlowdown(
            actions=lambda a: 2.0 if a.phase is schedule.Phase.FORWARD else 1.0)
        step = simulator.simulate(sched, costs, remat="never", processors=2,
                                  co_run_slowdown=forwards_only)
        self.assertAlmostEqual(10.0, step.step_time)
        # Updates of 1 each; device 1's 3x slower beside a copy of itself. After B10 ends at
        # 8.5, device 1 updates beside B00, which slow each other by 1 + sqrt(0.5 x 2) = 2:
        # the update [8.5, 10.5]; B00 does 1 of its 2 by then, the rest alone until 11.5;
        # device 0's update (not slowed) then runs alone: [11.5, 12.5].
        with_updates = simulator.simulate(
            sched, costs, remat="never", processors=2, update_time=[1.0, 1.0],
            co_run_slowdown=simulator.CoRunSlowdown(actions=lambda a: 1.5, updates=(1.0, 3.0)))
        self.assertAlmostEqual(12.5, with_updates.step_time)
        self.assertAlmostEqual(11.5, with_updates.pipeline_time)
        # Beside a job that does not slow down beside its copy (compute-bound), none slows:
        # B00 [8.5, 10.5] beside device 1's update [8.5, 9.5]; device 0's update [10.5, 11.5].
        compute_bound_update = simulator.simulate(
            sched, costs, remat="never", processors=2, update_time=[1.0, 1.0],
            co_run_slowdown=simulator.CoRunSlowdown(actions=lambda a: 1.5, updates=(1.0, 1.0)))
        self.assertAlmostEqual(11.5, compute_bound_update.step_time)
        self.assertAlmostEqual(10.5, compute_bound_update.pipeline_time)

    def test_co_run_factors_of_mixed_and_many_jobs(self):
        forward = schedule.Action(schedule.Phase.FORWARD, 0, 0)
        backward = schedule.Action(schedule.Phase.BACKWARD, 1, 0)
        slowdown = simulator.CoRunSlowdown(
            actions=lambda a: 2.0 if a.phase is schedule.Phase.FORWARD else 1.5,
            updates=(1.25, 0.5))
        # Alone: 1. Beside each other: 1 + sqrt(1 x 0.5) for both.
        self.assertEqual({0: 1.0}, slowdown.factors({0: forward}, 2))
        both = slowdown.factors({0: forward, 1: backward}, 2)
        self.assertAlmostEqual(1 + 0.5 ** 0.5, both[0])
        self.assertAlmostEqual(1 + 0.5 ** 0.5, both[1])
        # Four copies of an update of excess 0.25: on 4 processors each meets the 3 others,
        # 1.75; on 2, one at a time, 1.25. An update of 0.5 (never faster than alone: excess
        # 0) slows nothing and is not slowed.
        updates = {d: None for d in range(4)}
        same = simulator.CoRunSlowdown(actions=lambda a: 1.0, updates=(1.25,) * 4)
        self.assertEqual({d: 1.75 for d in range(4)}, same.factors(updates, 4))
        self.assertEqual({d: 1.25 for d in range(4)}, same.factors(updates, 2))
        self.assertEqual({0: 1.0, 1: 1.0}, slowdown.factors({0: None, 1: None}, 2))

    @parameterized.parameters("gpipe", "1f1b", "zero_bubble")
    def test_no_co_run_slowdown_changes_nothing(self, name):
        sched = schedule.make_schedule(name, 4, 8)
        rng = np.random.default_rng(2)
        costs = simulator.PhaseCosts(tuple(rng.uniform(1, 2, 4)), tuple(rng.uniform(2, 4, 4)))
        for processors in (2, 4):
            plain = simulator.simulate(sched, costs, processors=processors)
            ones = simulator.simulate(sched, costs, processors=processors,
                                      co_run_slowdown=simulator.CoRunSlowdown(lambda a: 1.0))
            self.assertAlmostEqual(plain.step_time, ones.step_time)
            for a in plain.start:
                self.assertAlmostEqual(plain.end[a], ones.end[a])

    def test_co_run_slowdown_is_checked(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        costs = simulator.PhaseCosts.uniform(2, 1.0, 2.0)
        with self.assertRaisesRegex(ValueError, "co_run_slowdown needs processors="):
            simulator.simulate(sched, costs,
                               co_run_slowdown=simulator.CoRunSlowdown(lambda a: 1.5))
        with self.assertRaisesRegex(ValueError, "co_run_slowdown has 3 update factors"):
            simulator.simulate(sched, costs, processors=2, co_run_slowdown=simulator.CoRunSlowdown(
                lambda a: 1.5, updates=(1.0, 1.0, 1.0)))

    def test_zero_processors_are_refused(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        with self.assertRaisesRegex(ValueError, "processors=0"):
            simulator.simulate(sched, simulator.PhaseCosts.uniform(2, 1.0, 2.0), processors=0)

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(simulator).failed)


if __name__ == "__main__":
    tf.test.main()
