"""The Figure 4 breakdown in words: a markdown table and suggestions drawn from its numbers.

`advice` looks at one step's `trace_analysis.Breakdown` and says what to change when a share is
large enough to matter. Each rule states its threshold below; a balanced pipeline with enough
micro-batches gets no suggestion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lingvo_lite.analysis import trace_analysis

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
    """The knobs the suggestions name."""

    num_cells: int
    num_micro_batches: int
    remat: str = "except_last"
    partition_cost: str = "flops"
    partition_costs: Sequence[str] = ("flops", "param_bytes", "activation_bytes")
    virtual_stages: int = 1  # Cells per device (the interleaved schedule).

    @property
    def num_devices(self) -> int:
        return max(self.num_cells // max(self.virtual_stages, 1), 1)

    def bubble_bound(self, num_micro_batches: int | None = None) -> float:
        """The schedule's idle fraction of a balanced pipeline: (D-1)/(vT+D-1) on D devices
        with v cells each (GPipe's (K-1)/(T+K-1) when v = 1)."""
        t = self.num_micro_batches if num_micro_batches is None else num_micro_batches
        return theoretical_bubble(self.num_devices, self.virtual_stages * t)

    @property
    def bubble_formula(self) -> str:
        return ("GPipe's bound (K-1)/(T+K-1)" if self.virtual_stages == 1
                else "the interleaved bound (D-1)/(vT+D-1)")


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
        out.append(f"bubble {_pct(b.bubble)}: at T={T} {config.bubble_formula} is "
                   f"{_pct(config.bubble_bound())} of the pipelined time; "
                   f"num_micro_batches={more} would bring it to "
                   f"{_pct(config.bubble_bound(more))}")
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
    K, T, v = config.num_devices, config.num_micro_batches, config.virtual_stages
    where = f"K={K}, T={T}" if v == 1 else f"D={K}, v={v}, T={T}"
    formula = config.bubble_formula
    lines += ["", f"{formula[0].upper()}{formula[1:]} at {where}: "
              f"{100 * config.bubble_bound():.1f}% of the pipelined time."]
    return "\n".join(lines)
