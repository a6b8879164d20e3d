"""The timeline the schedule simulator predicts when every action takes its measured mean time.

A profiled step shows where each device was idle, but not why: the schedule's own bubble (fill
and drain, dependency waits) or load imbalance (one cell's actions take longer than another's).
Replaying the schedule with `simulator.simulate`, each (device, phase) taking its measured mean
busy time and nothing else (no transfer, no executor overhead, no interference), separates
them: idle time the prediction also has comes from the schedule and the devices' unequal work;
the rest is the runtime's.

A backward action whose micro-batch was re-computed on that device in the measured step takes
the mean re-computation time too, and is drawn as a re-computation box followed by the
backward box, as the executor runs them. In a schedule that splits the backward (zero-bubble),
B is the input gradient and W the weight gradient: each takes its own phase's duration
((cell, 'B') and (cell, 'W')) and gets its own box; re-computation stays with B.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lingvo_lite.analysis import simulator, trace_analysis
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

__all__ = ["mean_busy_ns", "predict_boxes", "predict_from_measured"]


def mean_busy_ns(boxes: Sequence[trace_analysis.Box]) -> dict[tuple[int, str], float]:
    """(cell, phase) -> mean busy time of that cell's boxes of that phase."""
    sums: dict[tuple[int, str], list[float]] = {}
    for b in boxes:
        total = sums.setdefault((b.cell, b.phase), [0.0, 0.0])
        total[0] += b.busy_ns
        total[1] += 1
    return {key: total / count for key, (total, count) in sums.items()}


def predict_boxes(sched: schedule_lib.Schedule, durations_ns: Mapping[tuple[int, str], float],
                  recomputed: set[tuple[int, int]] = frozenset()) -> list[trace_analysis.Box]:
    """The boxes the simulator predicts for `sched` when phase p on cell k takes
    durations_ns[(k, p)].

    Args:
      sched: the schedule (its cell orders and dependencies are replayed).
      durations_ns: (cell, phase letter F, B, W or R) -> duration; a missing entry counts
        as 0.
      recomputed: (cell, micro_batch) pairs whose backward starts with a re-computation.

    Returns:
      Boxes starting at time 0, each busy for its whole span, sorted like
      `trace_analysis.boxes_from_events`.
    """
    def recompute_ns(a: schedule_lib.Action) -> float:
        if a.phase is schedule_lib.Phase.BACKWARD and (a.cell, a.micro_batch) in recomputed:
            return durations_ns.get((a.cell, trace_analysis.RECOMPUTE), 0.0)
        return 0.0

    def duration(a: schedule_lib.Action) -> float:
        return durations_ns.get((a.cell, a.phase.value), 0.0) + recompute_ns(a)

    step = simulator.simulate(sched, duration)
    boxes = []

    def add(cell: int, phase: str, micro_batch: int, start: float, end: float) -> None:
        s, e = round(start), round(end)
        boxes.append(trace_analysis.Box(cell, phase, micro_batch, s, e, e - s, 0, ((s, e),)))

    for a in sched.actions():
        start, end = step.start[a], step.end[a]
        split = start + recompute_ns(a)
        if split > start:
            add(a.cell, trace_analysis.RECOMPUTE, a.micro_batch, start, split)
        add(a.cell, a.phase.value, a.micro_batch, split, end)
    return sorted(boxes, key=lambda b: (b.cell, b.start_ns, trace_analysis.PHASES.index(b.phase)))


def predict_from_measured(sched: schedule_lib.Schedule,
                          measured: Sequence[trace_analysis.Box]) -> list[trace_analysis.Box]:
    """`predict_boxes` with the measured step's mean durations and re-computed micro-batches."""
    recomputed = {(b.cell, b.micro_batch) for b in measured if b.phase == trace_analysis.RECOMPUTE}
    return predict_boxes(sched, mean_busy_ns(measured), recomputed)
