"""bench/shared_processors.py: devices time-sharing a host's cores, worked out by hand."""

from __future__ import annotations

import doctest
import os
import sys

import numpy as np
from absl.testing import absltest, parameterized
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import shared_processors  # noqa: E402
from shared_processors import CoRunSlowdown  # noqa: E402

from lingvo_lite.analysis import simulator  # noqa: E402
from lingvo_lite.pipeline.schedules import schedule  # noqa: E402


def simulate(sched, costs, processors=None, co_run_slowdown=None, **kwargs):
    """`simulator.simulate` with the shared-processor replay."""
    return simulator.simulate(
        sched, costs, replay=shared_processors.replay(processors, co_run_slowdown), **kwargs)


class SharedProcessorsTest(parameterized.TestCase):

    def test_devices_sharing_one_processor_by_hand(self):
        # K=2, T=2, gpipe, forward 1 and backward 2, one processor: two actions running at
        # once each run at half speed. F00 [0, 1]; F01 and F10 from 1, 1 of work each at 1/2:
        # [1, 3]; F11 [3, 4]; B11 [4, 6]; B01 and B10 from 6, 2 each at 1/2: [6, 10]; B00
        # [10, 12]. With updates 1 (device 0) and 3 (device 1): device 1 updates from 10
        # beside B00, both at 1/2 until B00 ends at 14 (1 of the update left); then both
        # updates at 1/2 until 16.
        sched = schedule.make_schedule("gpipe", 2, 2)
        costs = simulator.PhaseCosts.uniform(2, forward=1.0, backward=2.0)
        step = simulate(sched, costs, remat="never", processors=1)
        expected = {"F(k=0,t=0)": (0, 1), "F(k=0,t=1)": (1, 3), "F(k=1,t=0)": (1, 3),
                    "F(k=1,t=1)": (3, 4), "B(k=1,t=1)": (4, 6), "B(k=0,t=1)": (6, 10),
                    "B(k=1,t=0)": (6, 10), "B(k=0,t=0)": (10, 12)}
        self.assertEqual(expected, {str(a): (step.start[a], step.end[a]) for a in step.start})
        self.assertAlmostEqual(12.0, step.step_time)
        with_updates = simulate(sched, costs, remat="never", processors=1,
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
        alone = simulate(sched, costs, remat="except_last", update_time=[1.0] * 4)
        for processors in (4, 16):
            shared = simulate(sched, costs, remat="except_last",
                                        update_time=[1.0] * 4, processors=processors)
            self.assertEqual(alone.start, shared.start)
            self.assertAlmostEqual(alone.step_time, shared.step_time)

    @parameterized.product(name=["gpipe", "1f1b", "zero_bubble"], processors=[1, 2, 3])
    def test_shared_processors_keep_order_and_dependencies(self, name, processors):
        sched = schedule.make_schedule(name, 4, 8)
        rng = np.random.default_rng(1)
        costs = simulator.PhaseCosts(tuple(rng.uniform(1, 2, 4)), tuple(rng.uniform(2, 4, 4)))
        alone = simulate(sched, costs, remat="except_last")
        step = simulate(sched, costs, remat="except_last", processors=processors)
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
        slowdown = CoRunSlowdown(actions=lambda a: 1.5)
        step = simulate(sched, costs, remat="never", processors=2,
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
        forwards_only = CoRunSlowdown(
            actions=lambda a: 2.0 if a.phase is schedule.Phase.FORWARD else 1.0)
        step = simulate(sched, costs, remat="never", processors=2,
                                  co_run_slowdown=forwards_only)
        self.assertAlmostEqual(10.0, step.step_time)
        # Updates of 1 each; device 1's 3x slower beside a copy of itself. After B10 ends at
        # 8.5, device 1 updates beside B00, which slow each other by 1 + sqrt(0.5 x 2) = 2:
        # the update [8.5, 10.5]; B00 does 1 of its 2 by then, the rest alone until 11.5;
        # device 0's update (not slowed) then runs alone: [11.5, 12.5].
        with_updates = simulate(
            sched, costs, remat="never", processors=2, update_time=[1.0, 1.0],
            co_run_slowdown=CoRunSlowdown(actions=lambda a: 1.5, updates=(1.0, 3.0)))
        self.assertAlmostEqual(12.5, with_updates.step_time)
        self.assertAlmostEqual(11.5, with_updates.pipeline_time)
        # Beside a job that does not slow down beside its copy (compute-bound), none slows:
        # B00 [8.5, 10.5] beside device 1's update [8.5, 9.5]; device 0's update [10.5, 11.5].
        compute_bound_update = simulate(
            sched, costs, remat="never", processors=2, update_time=[1.0, 1.0],
            co_run_slowdown=CoRunSlowdown(actions=lambda a: 1.5, updates=(1.0, 1.0)))
        self.assertAlmostEqual(11.5, compute_bound_update.step_time)
        self.assertAlmostEqual(10.5, compute_bound_update.pipeline_time)

    def test_co_run_factors_of_mixed_and_many_jobs(self):
        forward = schedule.Action(schedule.Phase.FORWARD, 0, 0)
        backward = schedule.Action(schedule.Phase.BACKWARD, 1, 0)
        slowdown = CoRunSlowdown(
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
        same = CoRunSlowdown(actions=lambda a: 1.0, updates=(1.25,) * 4)
        self.assertEqual({d: 1.75 for d in range(4)}, same.factors(updates, 4))
        self.assertEqual({d: 1.25 for d in range(4)}, same.factors(updates, 2))
        self.assertEqual({0: 1.0, 1: 1.0}, slowdown.factors({0: None, 1: None}, 2))

    @parameterized.parameters("gpipe", "1f1b", "zero_bubble")
    def test_no_co_run_slowdown_changes_nothing(self, name):
        sched = schedule.make_schedule(name, 4, 8)
        rng = np.random.default_rng(2)
        costs = simulator.PhaseCosts(tuple(rng.uniform(1, 2, 4)), tuple(rng.uniform(2, 4, 4)))
        for processors in (2, 4):
            plain = simulate(sched, costs, processors=processors)
            ones = simulate(sched, costs, processors=processors,
                            co_run_slowdown=CoRunSlowdown(lambda a: 1.0))
            self.assertAlmostEqual(plain.step_time, ones.step_time)
            for a in plain.start:
                self.assertAlmostEqual(plain.end[a], ones.end[a])

    def test_co_run_slowdown_is_checked(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        costs = simulator.PhaseCosts.uniform(2, 1.0, 2.0)
        with self.assertRaisesRegex(ValueError, "co_run_slowdown needs processors="):
            simulate(sched, costs,
                               co_run_slowdown=CoRunSlowdown(lambda a: 1.5))
        with self.assertRaisesRegex(ValueError, "co_run_slowdown has 3 update factors"):
            simulate(sched, costs, processors=2, co_run_slowdown=CoRunSlowdown(
                lambda a: 1.5, updates=(1.0, 1.0, 1.0)))

    def test_zero_processors_are_refused(self):
        sched = schedule.make_schedule("gpipe", 2, 2)
        with self.assertRaisesRegex(ValueError, "processors=0"):
            simulate(sched, simulator.PhaseCosts.uniform(2, 1.0, 2.0), processors=0)

    def test_a_zbv_replay_uses_the_schedules_devices(self):
        # ZB-V, 4 cells on 2 devices, one processor: the work of both devices runs one job at
        # a time, so the step is the sum of every action's duration (forward 1, B 1, W 1).
        sched = schedule.make_schedule("zbv", 4, 2)
        costs = simulator.PhaseCosts.uniform(4, forward=1.0, backward=2.0)
        step = simulate(sched, costs, remat="never", processors=1)
        self.assertAlmostEqual(4 * 2 * 3.0, step.step_time)
        for order in sched.device_orders():
            for before, after in zip(order, order[1:]):
                self.assertLessEqual(step.end[before], step.start[after] + 1e-9)

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(shared_processors).failed)


if __name__ == "__main__":
    absltest.main()
