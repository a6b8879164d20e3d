"""The timeline a schedule predicts when every action takes its measured mean time.

A profiled step shows where each device was idle, but not why: the schedule's own bubble (fill
and drain, dependency waits) or load imbalance (one cell's actions take longer than another's).
Replaying the schedule object's per-cell orders with each (device, phase)'s measured mean busy
time, and nothing else (no transfer, no executor overhead, no interference), separates the two:
idle time the prediction also has is the schedule's; the rest is the runtime's.

The replay is event driven: each device runs its `cell_order` one action at a time, and an
action starts once its device is free and its dependencies (`schedule.dependencies`) finished.
A backward action whose micro-batch was re-computed on that device in the measured step is
predicted as a re-computation followed by the backward, as the executor runs them.

This is the prediction the charts draw until the project has a planner with its own cost
simulator; that simulator's boxes can then be passed to `gantt.gantt_figure` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lingvo_lite.pipeline import schedule as schedule_lib
from lingvo_lite.pipeline import timeline


def mean_busy_ns(boxes: Sequence[timeline.Box]) -> dict[tuple[int, str], float]:
    """(cell, phase) -> mean busy time of that cell's boxes of that phase."""
    sums: dict[tuple[int, str], list[float]] = {}
    for b in boxes:
        total = sums.setdefault((b.cell, b.phase), [0.0, 0.0])
        total[0] += b.busy_ns
        total[1] += 1
    return {key: total / count for key, (total, count) in sums.items()}


def predict_boxes(sched: schedule_lib.Schedule, durations_ns: Mapping[tuple[int, str], float],
                  recomputed: set[tuple[int, int]] = frozenset()) -> list[timeline.Box]:
    """The boxes `sched` gives when phase p on cell k always takes durations_ns[(k, p)].

    Args:
      sched: the schedule (its cell orders and dependencies are replayed).
      durations_ns: (cell, phase letter) -> duration; a missing entry counts as 0.
      recomputed: (cell, micro_batch) pairs whose backward starts with a re-computation.

    Returns:
      Boxes starting at time 0, each busy for its whole span, sorted like
      `timeline.boxes_from_events`.
    """
    orders = [sched.cell_order(k) for k in range(sched.num_cells)]
    finish: dict[schedule_lib.Action, float] = {}
    device_free = [0.0] * sched.num_cells
    position = [0] * sched.num_cells
    boxes: list[timeline.Box] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for k, order in enumerate(orders):
            while position[k] < len(order):
                action = order[position[k]]
                deps = schedule_lib.dependencies(action, sched.num_cells)
                if any(d not in finish for d in deps):
                    break
                start = max([device_free[k]] + [finish[d] for d in deps])
                t = action.micro_batch
                phases = [timeline.FORWARD]
                if action.phase is schedule_lib.Phase.BACKWARD:
                    phases = ([timeline.RECOMPUTE] if (k, t) in recomputed else [])
                    phases.append(timeline.BACKWARD)
                for phase in phases:
                    end = start + durations_ns.get((k, phase), 0.0)
                    s, e = round(start), round(end)
                    boxes.append(timeline.Box(k, phase, t, s, e, e - s, 0, ((s, e),)))
                    start = end
                finish[action] = start
                device_free[k] = start
                position[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # Schedule.validate() rules this out for the registered schedules.
            raise ValueError(f"{sched!r} deadlocks: its cell orders cannot be replayed.")
    return sorted(boxes, key=lambda b: (b.cell, b.start_ns, timeline.PHASES.index(b.phase)))


def predict_from_measured(sched: schedule_lib.Schedule,
                          measured: Sequence[timeline.Box]) -> list[timeline.Box]:
    """`predict_boxes` with the measured step's mean durations and re-computed micro-batches."""
    recomputed = {(b.cell, b.micro_batch) for b in measured if b.phase == timeline.RECOMPUTE}
    return predict_boxes(sched, mean_busy_ns(measured), recomputed)
