"""The schedule's predicted timeline with measured durations."""

from __future__ import annotations

import unittest

from lingvo_lite.analysis import ideal_timeline, trace_analysis
from lingvo_lite.pipeline.schedules import schedule


class PredictTest(unittest.TestCase):

    def test_unit_durations_reproduce_the_schedules_own_ticks(self):
        for name, K, T in (("gpipe", 4, 6), ("1f1b", 4, 6), ("1f1b", 3, 2)):
            sched = schedule.make_schedule(name, K, T)
            durations = {(k, p): 1.0 for k in range(K) for p in ("F", "B")}
            boxes = ideal_timeline.predict_boxes(sched, durations)
            starts = {(b.cell, b.phase, b.micro_batch): b.start_ns for b in boxes}
            for tick, row in enumerate(sched.timeline()):
                for a in row:
                    if a is not None:
                        self.assertEqual(tick, starts[(a.cell, a.phase.value, a.micro_batch)],
                                         msg=f"{name} {a}")

    def test_slow_device_and_recomputation(self):
        # K=2, T=2 GPipe. Device 0: F 1, B 2, R 1; device 1 twice as slow: F 2, B 4.
        # Device 0: F0 0-1, F1 1-2. Device 1: F0 1-3, F1 3-5, B1 5-9, B0 9-13.
        # Device 0, recomputing micro-batch 0 only: B1 9-11, then R0 13-14, B0 14-16.
        durations = {(0, "F"): 1, (0, "B"): 2, (0, "R"): 1, (1, "F"): 2, (1, "B"): 4}
        boxes = ideal_timeline.predict_boxes(schedule.make_schedule("gpipe", 2, 2), durations,
                                             recomputed={(0, 0)})
        got = [(b.cell, b.phase, b.micro_batch, b.start_ns, b.end_ns) for b in boxes]
        self.assertEqual([(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 1, 9, 11),
                          (0, "R", 0, 13, 14), (0, "B", 0, 14, 16),
                          (1, "F", 0, 1, 3), (1, "F", 1, 3, 5), (1, "B", 1, 5, 9),
                          (1, "B", 0, 9, 13)], got)

    def test_weight_gradient_boxes_of_a_split_backward(self):
        # K=2, T=1 zero-bubble (each cell F0 B0 W0). F 1, B 2, W 1 on both cells, cell 0
        # re-computes (R 1). Cell 1: F 1-2, B 2-4, W 4-5. Cell 0: F 0-1, R 4-5, B 5-7, W 7-8.
        durations = {(k, p): d for k in range(2) for p, d in (("F", 1), ("B", 2), ("W", 1))}
        durations[(0, "R")] = 1
        boxes = ideal_timeline.predict_boxes(schedule.make_schedule("zero_bubble", 2, 1),
                                             durations, recomputed={(0, 0)})
        got = [(b.cell, b.phase, b.micro_batch, b.start_ns, b.end_ns) for b in boxes]
        self.assertEqual([(0, "F", 0, 0, 1), (0, "R", 0, 4, 5), (0, "B", 0, 5, 7),
                          (0, "W", 0, 7, 8), (1, "F", 0, 1, 2), (1, "B", 0, 2, 4),
                          (1, "W", 0, 4, 5)], got)

    def test_mean_busy_per_device_and_phase(self):
        box = trace_analysis.Box
        boxes = [box(0, "F", 0, 0, 10, 6, 1), box(0, "F", 1, 10, 20, 10, 1),
                 box(1, "B", 0, 0, 30, 30, 1)]
        self.assertEqual({(0, "F"): 8.0, (1, "B"): 30.0}, ideal_timeline.mean_busy_ns(boxes))


if __name__ == "__main__":
    unittest.main()
