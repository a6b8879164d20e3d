"""What a pipelined step is made of, observed or predicted: boxes, phases and the breakdown.

A `Box` is one action phase of one cell on one micro-batch (F, R for a re-computation, B, W),
with its time span and busy time; a `Breakdown` is GPipe's Figure 4 split of a step's time.
Trace analysis builds them from profiler ops, the simulator from a schedule replay; charts,
traces and advice read them. The phase letters are the runtime's (`op_names`).

>>> box = Box(cell=1, phase=FORWARD, micro_batch=3, start_ns=0, end_ns=10, busy_ns=8,
...           num_ops=2)
>>> box_name(box), union_ns([(0, 4), (2, 6), (8, 9)])
('F cell 1 mb 3', 7)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lingvo_lite.pipeline import op_names

__all__ = ["BACKWARD", "Box", "box_name", "Breakdown", "FORWARD", "merge_intervals",
           "micro_batch_label", "PHASES", "RECOMPUTE", "union_ns", "WEIGHT"]

FORWARD, RECOMPUTE, BACKWARD = op_names.FORWARD, op_names.RECOMPUTE, op_names.BACKWARD
WEIGHT = op_names.WEIGHT  # The weight gradient of a split backward (zero-bubble).
PHASES = (FORWARD, RECOMPUTE, BACKWARD, WEIGHT)


@dataclasses.dataclass(frozen=True)
class Box:
    """The ops of one action phase: F, R (re-computation), B or W of micro-batch t on cell k
    (t = `op_names.ALL_MICRO_BATCHES` for the batched weight gradient of all of them)."""

    cell: int
    phase: str
    micro_batch: int
    start_ns: int
    end_ns: int
    busy_ns: int  # Union of the ops' intervals: time some op of this box was running.
    num_ops: int
    segments: tuple[tuple[int, int], ...] = ()  # That union, as disjoint [start, end) runs.


def micro_batch_label(micro_batch: int) -> str:
    """'3', or 'all' for the batched weight gradient (`op_names.ALL_MICRO_BATCHES`)."""
    return "all" if micro_batch == op_names.ALL_MICRO_BATCHES else str(micro_batch)


def box_name(box: Box) -> str:
    """The name one action phase goes by in charts and traces, e.g. 'F cell 1 mb 3' (the
    batched weight gradient: 'W cell 1 mb all')."""
    return f"{box.phase} cell {box.cell} mb {micro_batch_label(box.micro_batch)}"


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """GPipe Figure 4: where the step time went, as fractions of `step_ns` (they sum to 1).

    Within the pipelined phase (first to last cell op), each device d is busy (some op of its
    cell runs) for busy_d. The slowest device bounds the pipeline: time the busiest device is
    idle too is `bubble` (fill/drain and dependency waits); the extra idle time of the others,
    max(busy) - busy_d, is `load_imbalance`. Both are averaged over devices, as are `compute`
    (forward and backward) and `recompute`. `device_busy` is each device's busy fraction of the
    whole step, and `device_idle_in_pipeline` its idle fraction of the pipelined phase (the
    quantity GPipe's bubble bound (K-1)/(T+K-1) describes).
    """

    step_ns: int
    setup: float
    compute: float
    recompute: float
    load_imbalance: float
    bubble: float
    weight_update: float
    device_busy: tuple[float, ...]
    device_idle_in_pipeline: tuple[float, ...]

    def as_scalars(self, prefix: str = "pipeline/") -> dict[str, float]:
        """Flat name -> value, for TensorBoard scalars and JSON."""
        out = {f"{prefix}{name}": float(getattr(self, name))
               for name in ("setup", "compute", "recompute", "load_imbalance", "bubble",
                            "weight_update")}
        out[f"{prefix}step_ms"] = self.step_ns / 1e6
        for d, value in enumerate(self.device_busy):
            out[f"{prefix}device_{d}_busy"] = value
        for d, value in enumerate(self.device_idle_in_pipeline):
            out[f"{prefix}device_{d}_idle_in_pipeline"] = value
        return out


def merge_intervals(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of [start, end) intervals as sorted, disjoint runs."""
    runs: list[list[int]] = []
    for start, end in sorted(intervals):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    return [(a, b) for a, b in runs]


def union_ns(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length of the union of [start, end) intervals."""
    return sum(b - a for a, b in merge_intervals(intervals))
