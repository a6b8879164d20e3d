"""The pipeline's boxes as a Chrome trace-event file, for Perfetto and chrome://tracing.

The file follows the Trace Event Format's JSON object form: `{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}`. Each box is a complete event (`"ph": "X"`) named
like `timeline.box_name` ('F cell 1 mb 3'), with `ts` and `dur` in microseconds, on thread
(track) `tid = cell` of process `pid`: the measured step is process 1 and, when given, the
schedule's prediction process 2, so both show one track per device, one above the other.
Metadata events name the processes and tracks. `args` hold the phase, cell, micro-batch, op
count and the busy runs (where the box's ops really ran).

Times are written relative to the first measured box (`otherData.origin_ns`, on the profiler's
clock): absolute nanosecond times exceed what a double holds to the nanosecond.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from lingvo_lite.pipeline import timeline

MEASURED_PID = 1
PREDICTED_PID = 2
_PHASE_NAMES = {timeline.FORWARD: "forward", timeline.RECOMPUTE: "recompute",
                timeline.BACKWARD: "backward"}


def _metadata(pid: int, process_name: str, num_cells: int) -> list[dict]:
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
               "args": {"name": process_name}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
               "args": {"sort_index": pid}}]
    for k in range(num_cells):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": k,
                       "args": {"name": f"device {k}"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": k,
                       "args": {"sort_index": k}})
    return events


def _box_events(boxes: Sequence[timeline.Box], pid: int, origin_ns: int) -> list[dict]:
    def us(t_ns: int) -> float:
        return (t_ns - origin_ns) / 1000.0

    return [{
        "ph": "X", "name": timeline.box_name(b), "cat": _PHASE_NAMES.get(b.phase, b.phase),
        "pid": pid, "tid": b.cell, "ts": us(b.start_ns), "dur": (b.end_ns - b.start_ns) / 1000.0,
        "args": {"phase": b.phase, "cell": b.cell, "micro_batch": b.micro_batch,
                 "ops": b.num_ops, "busy_us": b.busy_ns / 1000.0,
                 "busy_runs_us": [[us(s), us(e)] for s, e in b.segments]},
    } for b in boxes]


def trace_events(measured: Sequence[timeline.Box], step: int,
                 predicted: Sequence[timeline.Box] | None = None,
                 title: str = "") -> dict:
    """The trace-event JSON object of one step's boxes (and the schedule's prediction)."""
    if not measured:
        raise ValueError("trace_events needs at least one measured box.")
    origin_ns = min(b.start_ns for b in measured)
    num_cells = 1 + max(b.cell for b in list(measured) + list(predicted or ()))
    events = _metadata(MEASURED_PID, f"measured: global step {step}", num_cells)
    events += _box_events(measured, MEASURED_PID, origin_ns)
    if predicted:
        events += _metadata(PREDICTED_PID, "predicted by the schedule simulator", num_cells)
        events += _box_events(predicted, PREDICTED_PID, 0)  # Predictions start at 0.
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_ns": origin_ns, "step": step, "title": title}}


def write_trace(path: str, measured: Sequence[timeline.Box], step: int,
                predicted: Sequence[timeline.Box] | None = None, title: str = "") -> str:
    """Writes `trace_events(...)` to `path` (open it in https://ui.perfetto.dev); returns it."""
    with open(path, "w") as f:
        json.dump(trace_events(measured, step, predicted, title), f)
    return path


def boxes_from_trace(trace: dict, pid: int = MEASURED_PID) -> list[timeline.Box]:
    """The boxes of process `pid` of a trace written by `trace_events`, in profiler ns."""
    origin_ns = int(trace["otherData"]["origin_ns"]) if pid == MEASURED_PID else 0

    def ns(t_us: float) -> int:
        return origin_ns + round(t_us * 1000.0)

    boxes = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") != pid:
            continue
        args = e["args"]
        start = ns(e["ts"])
        boxes.append(timeline.Box(
            cell=int(args["cell"]), phase=args["phase"], micro_batch=int(args["micro_batch"]),
            start_ns=start, end_ns=start + round(e["dur"] * 1000.0),
            busy_ns=round(args["busy_us"] * 1000.0), num_ops=int(args["ops"]),
            segments=tuple((ns(s), ns(t)) for s, t in args["busy_runs_us"])))
    return sorted(boxes, key=lambda b: (b.cell, b.start_ns, timeline.PHASES.index(b.phase)))
