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

from lingvo_lite.pipeline import partition, schedule, simulator
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

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(simulator).failed)


if __name__ == "__main__":
    tf.test.main()
