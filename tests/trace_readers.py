"""Readers the tests use to check what the profiling code wrote (the library only writes)."""

from __future__ import annotations

from collections.abc import Sequence

from lingvo_lite.analysis import chrome_trace, trace_analysis


def cell_orders(boxes: Sequence[trace_analysis.Box]) -> dict[int, list[tuple[str, int]]]:
    """Per cell, its actions as (F|B|W, micro_batch) in the order they started.

    Re-computation belongs to its backward action (the schedule has no separate R action), so
    an action starts at its earliest R or B op.
    """
    starts: dict[tuple[int, str, int], int] = {}
    for b in boxes:
        phase = trace_analysis.BACKWARD if b.phase == trace_analysis.RECOMPUTE else b.phase
        key = (b.cell, phase, b.micro_batch)
        starts[key] = min(starts.get(key, b.start_ns), b.start_ns)
    orders: dict[int, list[tuple[str, int]]] = {}
    for (cell, phase, t), _ in sorted(starts.items(), key=lambda kv: (kv[0][0], kv[1])):
        orders.setdefault(cell, []).append((phase, t))
    return orders


def boxes_from_trace(trace: dict, pid: int = chrome_trace.MEASURED_PID) -> list[trace_analysis.Box]:
    """The boxes of process `pid` of a trace written by `chrome_trace.trace_events`, in ns."""
    origin_ns = int(trace["otherData"]["origin_ns"]) if pid == chrome_trace.MEASURED_PID else 0

    def ns(t_us: float) -> int:
        return origin_ns + round(t_us * 1000.0)

    boxes = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") != pid:
            continue
        args = e["args"]
        start = ns(e["ts"])
        boxes.append(trace_analysis.Box(
            cell=int(args["cell"]), phase=args["phase"], micro_batch=int(args["micro_batch"]),
            start_ns=start, end_ns=start + round(e["dur"] * 1000.0),
            busy_ns=round(args["busy_us"] * 1000.0), num_ops=int(args["ops"]),
            segments=tuple((ns(s), ns(t)) for s, t in args["busy_runs_us"])))
    return sorted(boxes, key=lambda b: (b.cell, b.start_ns, trace_analysis.PHASES.index(b.phase)))
