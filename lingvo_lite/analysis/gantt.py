"""The pipeline's Gantt chart as a matplotlib figure: measured, predicted and the breakdown.

One figure, top to bottom:
  - the measured step: one row per device, time in milliseconds since the first pipeline op,
    each action phase a box coloured by phase (forward, recompute, backward, weight gradient)
    spanning its first op start to its last op end, drawn light where no op of it ran ("between
    its ops") and solid where its ops ran, a device's later cells hatched (interleaved, zbv);
    grey where the device is idle; the legend names each. The micro-batch number stands inside
    the box when it fits (turned upright in narrow boxes; where boxes are too narrow, every
    n-th number), and never where it would overlap another number;
  - optionally the simulator's predicted timeline (`ideal_timeline`) on the same time axis, W
    boxes (weight gradients of a split backward) in their own colour: idle
    time the prediction also has comes from the schedule (its bubble) and the devices' unequal
    work; the rest is the runtime's;
  - optionally GPipe's Figure 4 breakdown as one stacked bar (shares of the step time).

The figure is a plain `matplotlib.figure.Figure` on the Agg canvas: no pyplot state and no
display. Artists carry gids (`trace_analysis.box_name(box)`, '<name> label', 'idle device k',
'breakdown <part>') so tests and tools can find them; axes carry labels 'measured',
'predicted' and 'breakdown'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lingvo_lite.analysis import trace_analysis
from lingvo_lite.pipeline import op_names
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

__all__ = [
    "device_idle_fraction",
    "DPI",
    "FIGURE_WIDTH_IN",
    "gantt_figure",
    "phases_present",
    "render_rgb",
    "StepInfo",
]

WEIGHT_GRADIENT = trace_analysis.WEIGHT  # W: the weight gradient of a split backward (zero-bubble).
PHASE_NAMES = {trace_analysis.FORWARD: "forward", trace_analysis.RECOMPUTE: "recompute",
               trace_analysis.BACKWARD: "backward", WEIGHT_GRADIENT: "weight gradient"}
PHASE_COLORS = {trace_analysis.FORWARD: "#3b78e7", trace_analysis.RECOMPUTE: "#2e9e4f",
                trace_analysis.BACKWARD: "#f08a00", WEIGHT_GRADIENT: "#9c4fd6"}
IDLE_COLOR = "#e4e4e4"
BREAKDOWN_PARTS = {"setup": "setup", "compute": "compute", "recompute": "recompute",
                   "load_imbalance": "load imbalance", "bubble": "bubble",
                   "weight_update": "weight update"}
BREAKDOWN_COLORS = {"setup": "#9e9e9e", "compute": "#3b78e7", "recompute": "#2e9e4f",
                    "load_imbalance": "#d93025", "bubble": "#fbbc04",
                    "weight_update": "#6d4c41"}

# TensorBoard shows an image card 350 pixels wide (full size on request): a narrow figure
# with large type, drawn at 150 dpi (750 pixels), keeps its text about 9 pixels tall at that
# size and its details sharp at full size.
FIGURE_WIDTH_IN = 5.0
DPI = 150
ROW_HEIGHT_IN = 0.3  # Per device: the figure's height grows with K.
BAR_HEIGHT = 0.8  # Of a row.
FONT_PT = 9.5
TITLE_FONT_PT = 11.0
LABEL_FONT_PT = 8.5
NARROW_LABEL_FONT_PT = 6.5
LEGEND_COLUMNS = 4


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the chart's title says about the run, and where its cells ran."""

    model: str
    num_cells: int
    num_micro_batches: int
    schedule: str
    remat: str
    step_ms: float
    # cell_devices[k]: the device of cell k, as the schedule placed it (chart rows are
    # devices); () for one cell per device, cell k on device k.
    cell_devices: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: str, sched: schedule_lib.Schedule, remat: str,
           step_ms: float) -> StepInfo:
        """The facts of a step run by `sched` (its cells, T, name and placement)."""
        return cls(model, sched.num_cells, sched.num_micro_batches,
                   sched.name or type(sched).__name__, remat, step_ms, sched.cell_devices)

    @property
    def devices(self) -> tuple[int, ...]:
        """Each cell's device (`cell_devices`, or cell k on device k)."""
        return tuple(self.cell_devices) or tuple(range(self.num_cells))

    @property
    def num_devices(self) -> int:
        return 1 + max(self.devices, default=0)

    def title(self) -> str:
        cells = f"K={self.num_cells}"
        if self.num_devices != self.num_cells:
            cells += f" on {self.num_devices} devices"
        return (f"{self.model}: step {self.step_ms:.1f} ms\n{cells}, "
                f"T={self.num_micro_batches}, schedule {self.schedule}, remat {self.remat}")


def phases_present(boxes: Sequence[trace_analysis.Box]) -> list[str]:
    """The phases of `boxes`, in PHASE_NAMES order."""
    present = {b.phase for b in boxes}
    return [p for p in PHASE_NAMES if p in present]


def device_idle_fraction(boxes: Sequence[trace_analysis.Box], device: int, start_ns: int,
                         end_ns: int, cell_devices: Sequence[int] | None = None) -> float:
    """Share of [start_ns, end_ns) during which no op of `device`'s cells ran
    (`cell_devices[k]`: cell k's device, the schedule's; default: one cell per device)."""
    runs = [seg for b in boxes if _row(b, cell_devices) == device
            for seg in (b.segments or ((b.start_ns, b.end_ns),))]
    return 1.0 - trace_analysis.union_ns(runs) / max(end_ns - start_ns, 1)


def _row(box: trace_analysis.Box, cell_devices: Sequence[int] | None) -> int:
    """The device (chart row) of a box's cell."""
    return cell_devices[box.cell] if cell_devices and box.cell < len(cell_devices) else box.cell


def _stage(cell: int, cell_devices: Sequence[int]) -> int:
    """Which of its device's cells `cell` is, in increasing order (0 for the first)."""
    return sum(1 for k in range(min(cell, len(cell_devices)))
               if cell < len(cell_devices) and cell_devices[k] == cell_devices[cell])


# A device's later cells (interleaved, zbv) are hatched, one pattern per cell of the device.
STAGE_HATCHES = ("", "////", "xxxx", "....")


def _close_gaps(runs: Sequence[tuple[int, int]], min_gap_ns: float) -> list[tuple[int, int]]:
    """`runs` (sorted, disjoint) with gaps shorter than `min_gap_ns` filled."""
    out: list[list[int]] = []
    for start, end in runs:
        if out and start - out[-1][1] < min_gap_ns:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _draw_timeline(ax, boxes: Sequence[trace_analysis.Box], cell_devices: Sequence[int],
                   t0_ns: int, span_ms: float) -> None:
    """Rows, idle bands and boxes; labels come later, once the layout fixes the axes' size.

    The axis spans `span_ms` (shared by the panels); idle shares are of these boxes' own span.
    """
    end_ns = max(b.end_ns for b in boxes)
    # Gaps narrower than a pixel between a box's ops would draw as a hatch of hairlines.
    min_gap_ns = span_ms * 1e6 / (FIGURE_WIDTH_IN * DPI)
    num_devices = 1 + max(cell_devices)
    # The limits are set below, and boxes stay inside them: neither autoscaling nor the
    # layout engine needs to look at each of the (K x T x phases) boxes.
    ax.set_autoscale_on(False)
    for k in range(num_devices):
        ax.barh(k, span_ms, left=0.0, height=BAR_HEIGHT, color=IDLE_COLOR, gid=f"idle device {k}")
    for b in boxes:
        color = PHASE_COLORS.get(b.phase, "#777777")
        row, stage = _row(b, cell_devices), _stage(b.cell, cell_devices)
        hatch = STAGE_HATCHES[stage % len(STAGE_HATCHES)] or None
        start_ms, width_ms = (b.start_ns - t0_ns) / 1e6, (b.end_ns - b.start_ns) / 1e6
        bar, = ax.barh(row, width_ms, left=start_ms, height=BAR_HEIGHT, color=color,
                       alpha=0.35, edgecolor="white", linewidth=0.6,
                       gid=trace_analysis.box_name(b))
        bar.set_in_layout(False)
        segments = [((s - t0_ns) / 1e6, (e - s) / 1e6)
                    for s, e in _close_gaps(b.segments, min_gap_ns)]
        if segments:
            ax.broken_barh(segments, (row - BAR_HEIGHT / 2, BAR_HEIGHT), facecolors=color,
                           linewidth=0, hatch=hatch, edgecolor="white" if hatch else None,
                           gid=f"{trace_analysis.box_name(b)} busy").set_in_layout(False)
    ax.set_ylim(num_devices - 0.5, -0.5)  # Device 0 on top.
    ax.set_yticks(range(num_devices))
    ax.set_yticklabels([
        f"device {k}\nidle "
        f"{100 * device_idle_fraction(boxes, k, t0_ns, end_ns, cell_devices):.0f}%"
        for k in range(num_devices)], fontsize=FONT_PT)
    ax.set_xlim(0.0, span_ms)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="white", linewidth=0.8)
    ax.set_axisbelow(False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _label_placement(label: str, width_px: float, row_px: float) -> tuple[float, int] | None:
    """(font size, rotation) that fits `label` inside a box of that size, None if none does."""
    pt_to_px = DPI / 72.0
    for size, rotation in ((LABEL_FONT_PT, 0), (NARROW_LABEL_FONT_PT, 90)):
        # A digit advances ~0.6 em and stands ~0.75 em tall.
        along = 0.62 * size * pt_to_px * len(label) + 3
        across = 0.75 * size * pt_to_px + 1.5
        room_along, room_across = (width_px, row_px) if rotation == 0 else (row_px, width_px)
        if along <= room_along and across <= room_across:
            return size, rotation
    return None


def _label_extent_px(label: str, size: float, rotation: int) -> float:
    """Horizontal pixels a label takes (a digit advances ~0.6 em and stands ~0.75 em tall)."""
    pt_to_px = DPI / 72.0
    if rotation:
        return 0.75 * size * pt_to_px + 1.5
    return 0.62 * size * pt_to_px * len(label) + 3


def _label_boxes(ax, boxes: Sequence[trace_analysis.Box], t0_ns: int,
                 cell_devices: Sequence[int]) -> None:
    """Micro-batch numbers inside the boxes wide (or, upright, tall) enough to hold them, and
    where boxes are too narrow (large T) every n-th number on a white patch, n the smallest
    power of two that leaves room for it; no label is drawn where it would overlap another
    one of its row, so every number drawn can be read.
    """
    px_per_ms = ax.transData.transform((1.0, 0.0))[0] - ax.transData.transform((0.0, 0.0))[0]
    row_px = abs(ax.transData.transform((0.0, BAR_HEIGHT))[1]
                 - ax.transData.transform((0.0, 0.0))[1])
    widths = {b: (b.end_ns - b.start_ns) / 1e6 * px_per_ms for b in boxes}
    needed_px = _label_extent_px("00", NARROW_LABEL_FONT_PT, 0) + 3
    typical_px = float(np.median(list(widths.values())))
    stride = 2
    while stride * typical_px < needed_px and stride < 64:
        stride *= 2
    inside, patched = [], []
    for b in boxes:
        label = trace_analysis.micro_batch_label(b.micro_batch)
        placement = _label_placement(label, widths[b], row_px)
        if placement is not None:
            inside.append((b, label, placement))
        elif (b.micro_batch % stride == 0 or b.micro_batch == op_names.ALL_MICRO_BATCHES) \
                and b.phase != trace_analysis.RECOMPUTE:
            patched.append((b, label, (NARROW_LABEL_FONT_PT, 0)))
    taken: dict[int, list[tuple[float, float]]] = {}
    for group in (inside, patched):  # Labels inside their boxes first.
        for b, label, (size, rotation) in sorted(group, key=lambda g: g[0].start_ns):
            center_ms = ((b.start_ns + b.end_ns) / 2 - t0_ns) / 1e6
            half = _label_extent_px(label, size, rotation) / 2 + 1
            left, right = center_ms * px_per_ms - half, center_ms * px_per_ms + half
            row = _row(b, cell_devices)
            if any(left < end and start < right for start, end in taken.get(row, [])):
                continue
            taken.setdefault(row, []).append((left, right))
            style = {} if group is inside else {"bbox": {
                "boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none",
                "alpha": 0.85}}
            ax.text(center_ms, row, label, ha="center", va="center", fontsize=size,
                    rotation=rotation, color="black", clip_on=True, in_layout=False,
                    gid=f"{trace_analysis.box_name(b)} label", **style)


def _draw_breakdown(ax, breakdown: trace_analysis.Breakdown) -> None:
    left = 0.0
    for part, name in BREAKDOWN_PARTS.items():
        share = 100.0 * float(getattr(breakdown, part))
        ax.barh(0, share, left=left, height=0.8, color=BREAKDOWN_COLORS[part],
                label=f"{name} {share:.0f}%", gid=f"breakdown {part}")
        if share >= 6.0:
            ax.text(left + share / 2, 0, f"{share:.0f}%", ha="center", va="center",
                    fontsize=FONT_PT, color="white" if part != "bubble" else "black")
        left += share
    ax.set_xlim(0, 100)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_xlabel("share of the step time (%)", fontsize=FONT_PT)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.set_title(f"Where the {breakdown.step_ns / 1e6:.1f} ms step went (GPipe Figure 4)",
                 fontsize=FONT_PT + 0.5, loc="left")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -1.2), ncol=3, fontsize=FONT_PT,
              frameon=False, handlelength=1.2, columnspacing=1.0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def gantt_figure(measured: Sequence[trace_analysis.Box], info: StepInfo,
                 predicted: Sequence[trace_analysis.Box] | None = None,
                 breakdown: trace_analysis.Breakdown | None = None) -> Figure:
    """The chart of one step's `measured` boxes (see the module docstring).

    Args:
      measured: the boxes of one step (`trace_analysis.boxes_from_events`).
      info: the title's facts; one row per device, each cell on its device
        `info.cell_devices[k]` (the schedule's placement; a device's later cells hatched).
      predicted: the schedule's prediction (`ideal_timeline.predict_from_measured`), drawn
        under the measured step on the same axis.
      breakdown: the step's Figure 4 breakdown, drawn at the bottom.
    """
    if not measured:
        raise ValueError("gantt_figure needs at least one box; was a pipeline step profiled?")
    num_cells = max(info.num_cells, 1 + max(b.cell for b in measured))
    # Cells the info does not name (more in the trace than it says) get rows of their own.
    cell_devices = info.devices + tuple(range(info.num_devices,
                                              info.num_devices + num_cells - len(info.devices)))
    num_devices = 1 + max(cell_devices)
    t0_ns = min(b.start_ns for b in measured)
    measured_ms = (max(b.end_ns for b in measured) - t0_ns) / 1e6
    span_ms = measured_ms
    if predicted:
        predicted_ms = max(b.end_ns for b in predicted) / 1e6
        span_ms = max(span_ms, predicted_ms)
    panels = [("measured", num_devices * ROW_HEIGHT_IN + 0.2)]
    if predicted:
        panels.append(("predicted", num_devices * ROW_HEIGHT_IN + 0.2))
    if breakdown is not None:
        panels.append(("breakdown", 0.3))
    height_in = (sum(h for _, h in panels) + 0.6 * len(panels) + 1.2
                 + (0.25 if len(cell_devices) > len(set(cell_devices)) else 0.0)
                 + (0.5 if breakdown is not None else 0.0))
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False,
                        gridspec_kw={"height_ratios": [h for _, h in panels]})[:, 0]
    fig.suptitle(info.title(), fontsize=TITLE_FONT_PT, fontweight="bold")
    by_label = {}
    for ax, (label, _) in zip(axes, panels):
        ax.set_label(label)
        by_label[label] = ax
    ax = by_label["measured"]
    _draw_timeline(ax, measured, cell_devices, t0_ns, span_ms)
    ax.set_title(f"Measured: {measured_ms:.1f} ms", fontsize=FONT_PT + 0.5, loc="left")
    # The legend names the phases of both panels: a prediction of a split-backward schedule
    # has W boxes even where the measured step has none.
    handles = [Patch(color=PHASE_COLORS[p], label=PHASE_NAMES[p])
               for p in phases_present(list(measured) + list(predicted or []))]
    # Light: the span of an action between its ops (its phase's colour, faded); hatched: a
    # device's later cells (interleaved, zbv); grey: nothing of the pipeline runs.
    handles.append(Patch(facecolor=PHASE_COLORS[trace_analysis.FORWARD], alpha=0.35,
                         label="between its ops"))
    if len(set(cell_devices)) < len(cell_devices):
        handles.append(Patch(facecolor="#9e9e9e", hatch=STAGE_HATCHES[1], edgecolor="white",
                             label="later cell"))
    handles.append(Patch(color=IDLE_COLOR, label="idle"))
    if predicted:
        ax = by_label["predicted"]
        _draw_timeline(ax, predicted, cell_devices, 0, span_ms)
        ax.set_title(f"Simulated {info.schedule} schedule, mean durations: "
                     f"{predicted_ms:.1f} ms", fontsize=FONT_PT + 0.5, loc="left")
    timelines = [ax for label, ax in by_label.items() if label != "breakdown"]
    timelines[-1].set_xlabel("time since the first pipeline op (ms)", fontsize=FONT_PT)
    timelines[-1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.45),
                         ncol=min(len(handles), LEGEND_COLUMNS), fontsize=FONT_PT,
                         frameon=False, handlelength=1.2, columnspacing=1.0)
    if breakdown is not None:
        _draw_breakdown(by_label["breakdown"], breakdown)
    fig.draw_without_rendering()  # Fixes the layout, so box widths in pixels are known.
    _label_boxes(by_label["measured"], measured, t0_ns, cell_devices)
    if predicted:
        _label_boxes(by_label["predicted"], predicted, 0, cell_devices)
    return fig


def render_rgb(fig: Figure) -> np.ndarray:
    """The figure as an RGB uint8 array [height, width, 3] (for `tf.summary.image`)."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
