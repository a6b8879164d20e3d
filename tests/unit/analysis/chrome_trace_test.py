"""The Chrome trace file: valid trace-event JSON that round-trips the boxes."""

from __future__ import annotations

import json
import os
import tempfile
import unittest

from trace_readers import boxes_from_trace

from lingvo_lite.analysis import chrome_trace, ideal_timeline, trace_analysis
from lingvo_lite.pipeline.schedules import schedule

ORIGIN = 1_732_000_000_123_456_789  # A profiler clock reading: ns since the epoch.
BOXES = [
    trace_analysis.Box(0, "F", 0, ORIGIN, ORIGIN + 1_500, 1_200, 4,
                 ((ORIGIN, ORIGIN + 700), (ORIGIN + 1_000, ORIGIN + 1_500))),
    trace_analysis.Box(1, "F", 0, ORIGIN + 1_600, ORIGIN + 2_601, 1_001, 2,
                 ((ORIGIN + 1_600, ORIGIN + 2_601),)),
    trace_analysis.Box(1, "B", 0, ORIGIN + 2_700, ORIGIN + 4_000, 1_300, 7,
                 ((ORIGIN + 2_700, ORIGIN + 4_000),)),
    trace_analysis.Box(0, "R", 0, ORIGIN + 4_100, ORIGIN + 4_600, 500, 3,
                 ((ORIGIN + 4_100, ORIGIN + 4_600),)),
    trace_analysis.Box(0, "B", 0, ORIGIN + 4_600, ORIGIN + 6_000, 1_400, 9,
                 ((ORIGIN + 4_600, ORIGIN + 6_000),)),
]


def check_trace_event_format(test: unittest.TestCase, trace: dict) -> None:
    """The Trace Event Format's JSON object form, as Perfetto and chrome://tracing read it."""
    test.assertIsInstance(trace["traceEvents"], list)
    test.assertIn(trace.get("displayTimeUnit", "ms"), ("ms", "ns"))
    for e in trace["traceEvents"]:
        test.assertIsInstance(e["name"], str)
        test.assertIsInstance(e["pid"], int)
        test.assertIsInstance(e["tid"], int)
        test.assertIn(e["ph"], ("X", "M"))
        if e["ph"] == "X":  # Complete event: start and duration in microseconds.
            test.assertIsInstance(e["ts"], (int, float))
            test.assertIsInstance(e["dur"], (int, float))
            test.assertGreaterEqual(e["dur"], 0)
        else:
            test.assertIn(e["name"], ("process_name", "process_sort_index", "thread_name",
                                      "thread_sort_index"))
            test.assertIsInstance(e["args"], dict)


class ChromeTraceTest(unittest.TestCase):

    def test_file_is_trace_event_json_and_round_trips(self):
        path = os.path.join(tempfile.mkdtemp(), "pipeline_trace_7.json")
        chrome_trace.write_trace(path, BOXES, step=7)
        with open(path) as f:
            trace = json.load(f)
        check_trace_event_format(self, trace)
        self.assertEqual(sorted(BOXES, key=lambda b: (b.cell, b.start_ns)),
                         boxes_from_trace(trace))

    def test_interleaved_tracks_name_device_and_cell_and_sort_by_device(self):
        boxes = [trace_analysis.Box(cell, "F", 0, 1000 * cell, 1000 * cell + 500, 500, 1,
                                    ((1000 * cell, 1000 * cell + 500),)) for cell in range(4)]
        trace = chrome_trace.trace_events(boxes, step=1, cell_devices=(0, 1, 0, 1))
        meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
        names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        self.assertEqual({0: "device 0, cell 0", 1: "device 1, cell 1", 2: "device 0, cell 2",
                          3: "device 1, cell 3"}, names)
        order = {e["tid"]: e["args"]["sort_index"] for e in meta
                 if e["name"] == "thread_sort_index"}
        self.assertEqual([0, 2, 1, 3], sorted(order, key=order.get))

    def test_zbv_tracks_are_the_schedules_devices(self):
        # ZB-V, 4 cells on 2 devices: device 0 holds cells 0 and 3, device 1 cells 1 and 2.
        boxes = [trace_analysis.Box(cell, "F", 0, 1000 * cell, 1000 * cell + 500, 500, 1,
                                    ((1000 * cell, 1000 * cell + 500),)) for cell in range(4)]
        sched = schedule.make_schedule("zbv", 4, 1)
        trace = chrome_trace.trace_events(boxes, step=1, cell_devices=sched.cell_devices)
        check_trace_event_format(self, trace)
        meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
        names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        self.assertEqual({0: "device 0, cell 0", 1: "device 1, cell 1", 2: "device 1, cell 2",
                          3: "device 0, cell 3"}, names)
        order = {e["tid"]: e["args"]["sort_index"] for e in meta
                 if e["name"] == "thread_sort_index"}
        self.assertEqual([0, 3, 1, 2], sorted(order, key=order.get))

    def test_one_named_track_per_device_and_box_names(self):
        trace = chrome_trace.trace_events(BOXES, step=7)
        tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                  if e["ph"] == "M" and e["name"] == "thread_name"}
        self.assertEqual({0: "device 0", 1: "device 1"}, tracks)
        complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        self.assertEqual(
            {"F cell 0 mb 0", "F cell 1 mb 0", "B cell 1 mb 0", "R cell 0 mb 0", "B cell 0 mb 0"},
            {e["name"] for e in complete})
        b1 = next(e for e in complete if e["name"] == "B cell 1 mb 0")
        self.assertEqual(1, b1["tid"])
        self.assertAlmostEqual(2.7, b1["ts"])  # us after the first box.
        self.assertAlmostEqual(1.3, b1["dur"])
        self.assertEqual(7, b1["args"]["ops"])

    def test_overlapping_boxes_of_a_device_get_their_own_track(self):
        # Device 0 runs F1 (0-10 us) while B0 (5-20 us) starts, then R1 (20-25 us): trace
        # viewers need each track's slices nested, so B0 goes on a second track of device 0.
        us = 1000

        def box(phase, mb, start, end):
            return trace_analysis.Box(0, phase, mb, start * us, end * us, (end - start) * us, 1,
                                ((start * us, end * us),))

        boxes = [box("F", 1, 0, 10), box("B", 0, 5, 20), box("R", 1, 20, 25)]
        trace = chrome_trace.trace_events(boxes, step=1)
        check_trace_event_format(self, trace)
        complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        by_track: dict[int, list[dict]] = {}
        for e in complete:
            by_track.setdefault(e["tid"], []).append(e)
        self.assertEqual(2, len(by_track))
        for events in by_track.values():
            events.sort(key=lambda e: e["ts"])
            for a, b in zip(events, events[1:]):
                self.assertLessEqual(a["ts"] + a["dur"], b["ts"])
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        self.assertEqual(["device 0", "device 0 (overlapping 1)"], sorted(names.values()))
        self.assertEqual(sorted(boxes, key=lambda b: b.start_ns),
                         boxes_from_trace(trace))

    def test_prediction_is_a_second_process_that_round_trips(self):
        predicted = ideal_timeline.predict_from_measured(
            schedule.make_schedule("gpipe", 2, 1), BOXES)
        trace = chrome_trace.trace_events(BOXES, step=3, predicted=predicted)
        check_trace_event_format(self, trace)
        pids = {e["pid"] for e in trace["traceEvents"]}
        self.assertEqual({chrome_trace.MEASURED_PID, chrome_trace.PREDICTED_PID}, pids)
        self.assertEqual(predicted, boxes_from_trace(
            json.loads(json.dumps(trace)), pid=chrome_trace.PREDICTED_PID))


if __name__ == "__main__":
    unittest.main()
