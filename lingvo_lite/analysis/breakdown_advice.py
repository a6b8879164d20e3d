"""The Figure 4 breakdown in words: a markdown table and suggestions drawn from its numbers.

`advice` looks at one step's `trace_analysis.Breakdown` and says what to change when a share is
large enough to matter. Each rule states its threshold below; a balanced pipeline with enough
micro-batches gets no suggestion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lingvo_lite.analysis import trace_analysis
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

__all__ = [
    "advice",
    "busiest_and_idlest",
    "markdown",
    "PipelineConfig",
    "summary_line",
    "theoretical_bubble",
]

# Load imbalance worth acting on: this share of the step, and the busiest device at least this
# many times busier than the least busy one.
IMBALANCE_SHARE = 0.05
IMBALANCE_RATIO = 1.2
# Bubble worth acting on: this share of the step while T is below MICRO_BATCHES_PER_CELL x K,
# where GPipe's bubble bound (K-1)/(T+K-1) is still large.
BUBBLE_SHARE = 0.10
MICRO_BATCHES_PER_CELL = 4
# Idle time in the pipeline the schedule does not explain (measured minus GPipe's bound).
UNEXPLAINED_IDLE = 0.15
RECOMPUTE_SHARE = 0.15
OUTSIDE_PIPELINE_SHARE = 0.30


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The knobs the suggestions name, and the profiled step's schedule: its cells, T, the
    devices it places the cells on and its bubble."""

    schedule: schedule_lib.Schedule
    remat: str = "except_last"
    partition_cost: str = "flops"
    partition_costs: Sequence[str] = ("flops", "param_bytes", "activation_bytes")

    @property
    def num_cells(self) -> int:
        return self.schedule.num_cells

    @property
    def num_micro_batches(self) -> int:
        return self.schedule.num_micro_batches

    @property
    def num_devices(self) -> int:
        return self.schedule.num_devices

    def bubble_bound(self, num_micro_batches: int | None = None) -> float | None:
        """The schedule's idle fraction of a balanced pipeline (its unit-time timeline's idle
        share: GPipe's (K-1)/(T+K-1), the interleaved (D-1)/(vT+D-1), ...), at T or at
        `num_micro_batches`; None when the schedule cannot be rebuilt for that T (a
        CustomSchedule)."""
        sched = (self.schedule if num_micro_batches in (None, self.num_micro_batches)
                 else _at_micro_batches(self.schedule, num_micro_batches))
        return None if sched is None else sched.bubble_fraction()

    @property
    def bubble_formula(self) -> str:
        return f"the {self.schedule.name or type(self.schedule).__name__} schedule's bubble"

    def where(self) -> str:
        """'K=2, T=8', or with several cells per device 'K=4 cells on D=2 devices, T=2'."""
        if self.num_devices == self.num_cells:
            return f"K={self.num_cells}, T={self.num_micro_batches}"
        return (f"K={self.num_cells} cells on D={self.num_devices} devices, "
                f"T={self.num_micro_batches}")


def _at_micro_batches(sched: schedule_lib.Schedule,
                      num_micro_batches: int) -> schedule_lib.Schedule | None:
    """The same schedule class on the same cells at another T, built as its class builds it
    (`for_cells`); None when it cannot be."""
    try:
        return type(sched).for_cells(sched.num_cells, num_micro_batches,
                                     getattr(sched, "virtual_stages", 1))
    except (TypeError, ValueError):
        return None


def _pct(share: float) -> str:
    return f"{100 * share:.0f}%"


def theoretical_bubble(num_cells: int, num_micro_batches: int) -> float:
    """GPipe's idle fraction of a balanced fill-drain pipeline: (K-1)/(T+K-1)."""
    return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def busiest_and_idlest(breakdown: trace_analysis.Breakdown) -> tuple[int, int]:
    """(most busy device, least busy device)."""
    busy = breakdown.device_busy
    return (max(range(len(busy)), key=busy.__getitem__),
            min(range(len(busy)), key=busy.__getitem__))


def _imbalance_advice(b: trace_analysis.Breakdown, config: PipelineConfig) -> str | None:
    hi, lo = busiest_and_idlest(b)
    busy_hi, busy_lo = b.device_busy[hi], b.device_busy[lo]
    ratio = busy_hi / busy_lo if busy_lo > 0 else float("inf")
    if b.load_imbalance < IMBALANCE_SHARE or ratio < IMBALANCE_RATIO:
        return None
    if "measured" in config.partition_costs and config.partition_cost != "measured":
        fix = "consider partition_cost='measured'"
    elif config.partition_cost == "measured":
        fix = ("the measured layer times misjudge the cells' times: re-measure them on a quiet "
               "machine (delete the partition_profile_path file) or move layers off device "
               f"{hi} (partition_method='explicit' with split_points)")
    else:
        fix = (f"the partition_cost='{config.partition_cost}' estimate misjudges the cells' "
               f"times: move layers off device {hi} (partition_method='explicit' with "
               "split_points) or try another partition_cost")
    return (f"load imbalance {_pct(b.load_imbalance)}: device {hi} is {ratio:.1f}x busier than "
            f"device {lo}; {fix}")


def _bubble_advice(b: trace_analysis.Breakdown, config: PipelineConfig) -> list[str]:
    out = []
    K, T = config.num_devices, config.num_micro_batches
    if K > 1 and b.bubble >= BUBBLE_SHARE and T < MICRO_BATCHES_PER_CELL * K:
        more = MICRO_BATCHES_PER_CELL * K
        later = config.bubble_bound(more)
        out.append(f"bubble {_pct(b.bubble)}: at T={T} {config.bubble_formula} is "
                   f"{_pct(config.bubble_bound())} of the pipelined time; "
                   f"num_micro_batches={more} would "
                   + (f"bring it to {_pct(later)}" if later is not None else "shrink it"))
    pipelined = 1.0 - b.setup - b.weight_update
    if K > 1 and pipelined > 0:
        busiest_idle = b.bubble / pipelined
        expected = config.bubble_bound()
        if busiest_idle - expected >= UNEXPLAINED_IDLE:
            out.append(f"the busiest device idles {_pct(busiest_idle)} of the pipelined time, "
                       f"{_pct(expected)} of which the schedule explains: the rest is waiting on "
                       "transfers or the runtime (compare the predicted timeline)")
    return out


def advice(breakdown: trace_analysis.Breakdown, config: PipelineConfig) -> list[str]:
    """Suggestions for one step's breakdown, most important first; [] when nothing stands out."""
    out = []
    imbalance = _imbalance_advice(breakdown, config)
    if imbalance:
        out.append(imbalance)
    out += _bubble_advice(breakdown, config)
    if breakdown.recompute >= RECOMPUTE_SHARE and config.remat != "never":
        out.append(f"re-computation takes {_pct(breakdown.recompute)} of the step: "
                   "remat='never' saves it if activation memory allows")
    outside = breakdown.setup + breakdown.weight_update
    if outside >= OUTSIDE_PIPELINE_SHARE:
        out.append(f"{_pct(outside)} of the step is outside the pipeline (setup "
                   f"{_pct(breakdown.setup)}, weight update {_pct(breakdown.weight_update)}): "
                   "a larger batch spreads it over more examples")
    return out


def summary_line(breakdown: trace_analysis.Breakdown, config: PipelineConfig) -> str:
    """'bubble 13%, load imbalance 18%: <first suggestion>' (the trainer prints it)."""
    head = f"bubble {_pct(breakdown.bubble)}, load imbalance {_pct(breakdown.load_imbalance)}"
    tips = advice(breakdown, config)
    if not tips:
        return head + ": balanced, nothing to suggest"
    first = tips[0]
    for prefix in (f"load imbalance {_pct(breakdown.load_imbalance)}: ",
                   f"bubble {_pct(breakdown.bubble)}: "):
        if first.startswith(prefix):
            first = first[len(prefix):]
    return f"{head}: {first}"


def markdown(breakdown: trace_analysis.Breakdown, config: PipelineConfig, title: str = "") -> str:
    """Suggestions, then the breakdown as markdown tables (TensorBoard's Text tab renders them)."""
    step_ms = breakdown.step_ns / 1e6
    lines = [f"**{title}**", ""] if title else []
    # Suggestions first: TensorBoard's text cards scroll, and they are what to act on.
    tips = advice(breakdown, config)
    lines += [f"- {tip}" for tip in tips] if tips else ["- balanced: nothing to suggest."]
    lines += ["", "| part | share of step | ms |", "| --- | ---: | ---: |"]
    for part in ("setup", "compute", "recompute", "load_imbalance", "bubble", "weight_update"):
        share = float(getattr(breakdown, part))
        lines.append(f"| {part.replace('_', ' ')} | {100 * share:.1f}% | "
                     f"{share * step_ms:.2f} |")
    lines.append(f"| **step** | 100% | {step_ms:.2f} |")
    lines += ["", "| device | busy (of step) | idle (of pipelined time) |",
              "| --- | ---: | ---: |"]
    for d, (busy, idle) in enumerate(zip(breakdown.device_busy,
                                         breakdown.device_idle_in_pipeline)):
        lines.append(f"| {d} | {100 * busy:.1f}% | {100 * idle:.1f}% |")
    formula = config.bubble_formula
    lines += ["", f"{formula[0].upper()}{formula[1:]} at {config.where()}: "
              f"{100 * config.bubble_bound():.1f}% of the pipelined time (its unit-time "
              "timeline's idle share)."]
    return "\n".join(lines)
