"""The pipeline's boxes as a Chrome trace-event file, for Perfetto and chrome://tracing.

The file follows the Trace Event Format's JSON object form: `{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}`. Each box is a complete event (`"ph": "X"`) named
like `trace_analysis.box_name` ('F cell 1 mb 3'), with `ts` and `dur` in microseconds, on thread
(track) `tid = cell` of process `pid`: the measured step is process 1 and, when given, the
schedule simulator's prediction process 2, so both show one track per cell, named and sorted
by the device the schedule placed it on (`cell_devices`), one above the other (plus a track
for boxes that overlap others of their cell, see `assign_lanes`).
Metadata events name the processes and tracks. `args` hold the phase, cell, micro-batch, op
count and the busy runs (where the box's ops really ran).

Times are written relative to the first measured box (`otherData.origin_ns`, on the profiler's
clock): absolute nanosecond times exceed what a double holds to the nanosecond.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from lingvo_lite.analysis import trace_analysis

__all__ = ["assign_lanes", "MEASURED_PID", "PREDICTED_PID", "trace_events", "write_trace"]

MEASURED_PID = 1
PREDICTED_PID = 2
_PHASE_NAMES = {trace_analysis.FORWARD: "forward", trace_analysis.RECOMPUTE: "recompute",
                trace_analysis.BACKWARD: "backward", trace_analysis.WEIGHT: "weight gradient"}


# Trace viewers need the slices of one track to nest. On CPUs a device's actions can overlap
# (the shared thread pool runs a forward while the previous backward finishes), so a box that
# overlaps an earlier one of its device goes on an extra track of that device: lane n > 0 of
# device k is thread LANE_TID_STRIDE * n + k, named 'device k (overlapping n)'.
LANE_TID_STRIDE = 1000


def assign_lanes(boxes: Sequence[trace_analysis.Box]) -> list[int]:
    """Per box, the lowest lane of its device in which it overlaps no earlier box."""
    lane_ends: dict[int, list[int]] = {}
    lanes = [0] * len(boxes)
    for i in sorted(range(len(boxes)), key=lambda i: (boxes[i].start_ns, boxes[i].end_ns)):
        b = boxes[i]
        ends = lane_ends.setdefault(b.cell, [])
        lane = next((n for n, end in enumerate(ends) if end <= b.start_ns), len(ends))
        if lane == len(ends):
            ends.append(b.end_ns)
        else:
            ends[lane] = b.end_ns
        lanes[i] = lane
    return lanes


def _device(cell: int, cell_devices: Sequence[int] | None) -> int:
    return cell_devices[cell] if cell_devices and cell < len(cell_devices) else cell


def _track_name(cell: int, cell_devices: Sequence[int] | None) -> str:
    """'device k' for cell k on device k, else (several cells per device: interleaved, zbv)
    'device d, cell k' with d = cell_devices[k]."""
    device = _device(cell, cell_devices)
    if not cell_devices or list(cell_devices) == list(range(len(cell_devices))):
        return f"device {device}"
    return f"device {device}, cell {cell}"


def _metadata(pid: int, process_name: str, tracks: set[tuple[int, int]],
              cell_devices: Sequence[int] | None) -> list[dict]:
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": process_name}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
               "args": {"sort_index": pid}}]
    for cell, lane in sorted(tracks):
        tid = LANE_TID_STRIDE * lane + cell
        name = _track_name(cell, cell_devices) + (f" (overlapping {lane})" if lane else "")
        # Tracks sort by device, then cell, then lane.
        device = _device(cell, cell_devices)
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                       "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                       "args": {"sort_index": LANE_TID_STRIDE * (LANE_TID_STRIDE * device + cell)
                                + lane}})
    return events


def _box_events(boxes: Sequence[trace_analysis.Box], pid: int, process_name: str,
                origin_ns: int, cell_devices: Sequence[int] | None) -> list[dict]:
    def us(t_ns: int) -> float:
        return (t_ns - origin_ns) / 1000.0

    lanes = assign_lanes(boxes)
    tracks = {(b.cell, 0) for b in boxes} | {(b.cell, n) for b, n in zip(boxes, lanes)}
    return _metadata(pid, process_name, tracks, cell_devices) + [{
        "ph": "X", "name": trace_analysis.box_name(b), "cat": _PHASE_NAMES.get(b.phase, b.phase),
        "pid": pid, "tid": LANE_TID_STRIDE * lane + b.cell, "ts": us(b.start_ns),
        "dur": (b.end_ns - b.start_ns) / 1000.0,
        "args": {"phase": b.phase, "cell": b.cell, "micro_batch": b.micro_batch,
                 "ops": b.num_ops, "busy_us": b.busy_ns / 1000.0,
                 "busy_runs_us": [[us(s), us(e)] for s, e in b.segments]},
    } for b, lane in zip(boxes, lanes)]


def trace_events(measured: Sequence[trace_analysis.Box], step: int,
                 predicted: Sequence[trace_analysis.Box] | None = None,
                 title: str = "", cell_devices: Sequence[int] | None = None) -> dict:
    """The trace-event JSON object of one step's boxes (and the schedule's prediction).

    `cell_devices[k]`: the device the schedule placed cell k on (`Schedule.cell_devices`);
    default: cell k on device k. Where it is not so, each cell's track is named after its
    device too ('device d, cell k').
    """
    if not measured:
        raise ValueError("trace_events needs at least one measured box.")
    origin_ns = min(b.start_ns for b in measured)
    events = _box_events(measured, MEASURED_PID, f"measured: global step {step}", origin_ns,
                         cell_devices)
    if predicted:  # Predictions start at 0.
        events += _box_events(predicted, PREDICTED_PID, "predicted by the schedule simulator", 0,
                              cell_devices)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_ns": origin_ns, "step": step, "title": title}}


def write_trace(path: str, measured: Sequence[trace_analysis.Box], step: int,
                predicted: Sequence[trace_analysis.Box] | None = None, title: str = "",
                cell_devices: Sequence[int] | None = None) -> str:
    """Writes `trace_events(...)` to `path` (open it in https://ui.perfetto.dev); returns it."""
    with open(path, "w") as f:
        json.dump(trace_events(measured, step, predicted, title, cell_devices), f)
    return path
