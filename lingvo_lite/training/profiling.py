"""Profiling training steps: TensorFlow profiler capture, then the pipeline's real schedule.

`trainer.py --profile_steps=N,M` captures global steps N..M (inclusive) with
`tf.profiler.experimental` into `<logdir>/train` (TensorBoard's profile tab, from the optional
tensorboard-plugin-profile package, opens it as run `train`), then reads the trace back
(`lingvo_lite.analysis.trace_analysis`) and writes, at step M of the `train` run:
  - `pipeline/gantt`: a chart of the last profiled step (`lingvo_lite.analysis.gantt`): one
    row per device, a box per forward, re-computation and backward of each micro-batch, the
    timeline the schedule simulator predicts under it, and the step's Figure 4 breakdown;
  - `pipeline/breakdown` (Text tab): that breakdown as a markdown table, with suggestions
    (`lingvo_lite.analysis.breakdown_advice`);
  - `pipeline/<part>`: GPipe's Figure 4 breakdown of each profiled step's time, one point per
    step (setup, compute, recompute, load_imbalance, bubble, weight_update, step_ms), and
    `pipeline/device_<d>_busy`;
  - beside the trace: `pipeline_breakdown.json` (per-step values) and
    `pipeline_trace_<M>.json`, the last step's boxes as a Chrome trace-event file (Perfetto,
    chrome://tracing);
and prints the breakdown's summary line and suggestions.

The first step of a run also traces and optimises the graph; profile later steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any, TextIO

__all__: list[str] = []

PROFILE_SUBDIR = "train"


@dataclasses.dataclass(frozen=True)
class PipelineDescription:
    """The run's facts the charts and suggestions name (None: read from the profiled boxes).

    `schedule` and `virtual_stages` are the pipeline's params (a schedule name or a Schedule
    object); `schedule_for` builds the step's schedule from them, which places the cells on
    devices for every chart and breakdown.
    """

    model: str = ""
    num_cells: int | None = None
    num_micro_batches: int | None = None
    schedule: Any = "gpipe"
    remat: str = "except_last"
    partition_cost: str = "flops"
    virtual_stages: int = 1
    serial_devices: bool = False

    @classmethod
    def from_task_params(cls, model: str, task_params: Any) -> PipelineDescription:
        """From the first PipeliningLayer in `task_params` (defaults when there is none); T
        from its input_shapes' mini-batch as the pipeline resolves it (`step_layout`)."""
        from lingvo_lite.pipeline import step_layout
        from lingvo_lite.training import model_config

        for _, pp in model_config.iter_pipelining_params(task_params):
            num_micro_batches = pp.num_micro_batches
            batch = step_layout.global_batch_size(pp)
            if batch is not None:
                try:
                    num_micro_batches = step_layout.num_micro_batches(
                        pp, step_layout.replica_batch_size(batch, pp.num_replicas))
                except ValueError:
                    pass
            return cls(model=model, num_cells=pp.num_cells,
                       num_micro_batches=num_micro_batches if isinstance(
                           num_micro_batches, int) else None,
                       schedule=pp.schedule, remat=pp.remat, partition_cost=pp.partition_cost,
                       virtual_stages=pp.virtual_stages, serial_devices=pp.serial_devices)
        return cls(model=model)

    def schedule_for(self, num_cells: int, num_micro_batches: int) -> Any:
        """The profiled step's Schedule for `num_cells` cells and T (None when the
        description's schedule cannot be built so)."""
        from lingvo_lite.pipeline.schedules import schedule

        try:
            return schedule.schedule_for(self.schedule, num_cells, num_micro_batches,
                                         self.virtual_stages)
        except ValueError:
            return None


class StepProfiler:
    """Captures global steps [first, last] and summarises them (see the module docstring).

    Use `with profiler.step(global_step_about_to_run, writers):` around each train-step call;
    steps outside the range cost nothing.
    """

    def __init__(self, logdir: str, first: int, last: int,
                 description: PipelineDescription | None = None,
                 out: TextIO | None = None) -> None:
        self.trace_dir = os.path.join(logdir, PROFILE_SUBDIR)
        self.first, self.last = first, last
        self.description = description or PipelineDescription()
        self._out = out
        self._active = False
        self.result: dict | None = None
        if self.description.serial_devices and out is not None:
            print("Note: with serial_devices=True the cells run on TensorFlow's single-threaded "
                  "executor, which the profiler does not trace op by op: the chart will show "
                  "little cell work. Profile with network.serial_devices : False for the "
                  "breakdown.", file=out, flush=True)

    @contextlib.contextmanager
    def step(self, step_number: int, writers=None) -> Iterator[None]:
        import tensorflow as tf

        from lingvo_lite.analysis import trace_analysis

        if not self.first <= step_number <= self.last:
            yield
            return
        if not self._active:
            os.makedirs(self.trace_dir, exist_ok=True)
            tf.profiler.experimental.start(self.trace_dir)
            self._active = True
        with tf.profiler.experimental.Trace(trace_analysis.STEP_TRACE_NAME, step_num=step_number,
                                            _r=1):
            yield
        if step_number == self.last:
            self.stop(writers, step_number)

    def stop(self, writers=None, step_number: int | None = None) -> dict | None:
        """Stops the capture (if running), analyses it and writes the summaries."""
        import tensorflow as tf

        if not self._active:
            return self.result
        tf.profiler.experimental.stop()
        self._active = False
        self.result = analyse(self.trace_dir, self.description)
        if self.result is None:
            return None
        report = build_report(self.result, self.description)
        self.result["report"] = report
        trace_path = write_trace(self.trace_dir, self.result["step"], self.result, report)
        if writers is not None:
            write_summaries(writers, PROFILE_SUBDIR, step_number or self.last, self.result,
                            report)
        if self._out is not None:
            print(f"Pipeline profile of step {self.result['step']}: {report.summary}",
                  file=self._out)
            for tip in report.advice[1:]:
                print(f"  also: {tip}", file=self._out)
            print(f"  Gantt chart and breakdown: TensorBoard, run {PROFILE_SUBDIR}, Images and "
                  f"Text tabs; zoomable trace: {trace_path} (https://ui.perfetto.dev).",
                  file=self._out, flush=True)
        return self.result


def analyse(trace_dir: str, description: PipelineDescription | None = None) -> dict | None:
    """Per-step breakdowns and the last step's boxes of the newest session in `trace_dir`.

    `description` names the profiled pipeline's schedule and remat mode, which map the ops
    of its traced-once cell functions to micro-batches.

    Returns None when the trace holds no pipeline op (a model without PipeliningLayer).
    """
    from lingvo_lite.analysis import trace_analysis

    description = description or PipelineDescription()
    spaces = trace_analysis.load_xspaces(trace_dir)
    events = trace_analysis.op_events(spaces)
    windows = trace_analysis.step_windows(spaces) or [(0, -1, 2**62)]
    steps = []
    last_boxes: list = []
    last_breakdown = None
    for step, start, end in windows:
        step_events = trace_analysis.events_in(events, start, end)
        boxes = trace_analysis.boxes_from_events(step_events, description.schedule,
                                           description.remat, description.virtual_stages)
        if not boxes:
            continue
        num_cells = description.num_cells or 1 + max(b.cell for b in boxes)
        sched = description.schedule_for(num_cells, _num_micro_batches(description, boxes))
        last_breakdown = trace_analysis.compute_breakdown(
            step_events, num_cells, cell_devices=sched.cell_devices if sched else None)
        steps.append({"step": step, **last_breakdown.as_scalars(prefix="")})
        last_boxes = boxes
    if not steps:
        return None
    keys = [k for k in steps[0] if k != "step"]
    mean = {k: sum(s.get(k, 0.0) for s in steps) / len(steps) for k in keys}
    result = {"steps": steps, "mean": mean, "boxes": last_boxes, "step": steps[-1]["step"],
              "breakdown": last_breakdown, "num_cells": 1 + max(b.cell for b in last_boxes)}
    path = os.path.join(trace_dir, "pipeline_breakdown.json")
    with open(path, "w") as f:
        json.dump({"steps": steps, "mean": mean}, f, indent=1)
    return result


def _num_micro_batches(description: PipelineDescription, boxes: list) -> int:
    """T: the description's, else the largest micro-batch the boxes name, plus 1."""
    return description.num_micro_batches or 1 + max(b.micro_batch for b in boxes)


@dataclasses.dataclass
class Report:
    """What the charts show of the last profiled step."""

    info: Any  # gantt.StepInfo
    config: Any  # breakdown_advice.PipelineConfig
    predicted: list  # The schedule's predicted boxes; [] for an unknown schedule.
    markdown: str
    summary: str
    advice: list[str]


def one_line(text: str) -> str:
    return text.replace("\n", ", ")


def build_report(result: dict, description: PipelineDescription) -> Report:
    """The title facts, predicted timeline, table and suggestions of `analyse`'s result."""
    from lingvo_lite.analysis import breakdown_advice, gantt, ideal_timeline
    from lingvo_lite.pipeline import pipelining_layer
    from lingvo_lite.pipeline.schedules import schedule

    boxes, breakdown = result["boxes"], result["breakdown"]
    num_cells = description.num_cells or result["num_cells"]
    num_micro_batches = _num_micro_batches(description, boxes)
    model, step_ms = description.model or "pipeline", breakdown.step_ns / 1e6
    sched = description.schedule_for(num_cells, num_micro_batches)
    predicted = []
    if sched is not None:  # The schedule places the cells: rows, tracks and devices.
        info = gantt.StepInfo.of(model, sched, description.remat, step_ms)
        predicted = ideal_timeline.predict_from_measured(sched, boxes)
    else:
        info = gantt.StepInfo(model, num_cells, num_micro_batches, str(description.schedule),
                              description.remat, step_ms)
    config = breakdown_advice.PipelineConfig(
        sched or schedule.make_schedule("gpipe", num_cells, num_micro_batches),
        remat=description.remat, partition_cost=description.partition_cost,
        partition_costs=pipelining_layer.PARTITION_COSTS)
    tips = breakdown_advice.advice(breakdown, config)
    return Report(info=info, config=config, predicted=predicted,
                  markdown=breakdown_advice.markdown(
                      breakdown, config,
                      title=f"Global step {result['step']}: {one_line(info.title())}"),
                  summary=breakdown_advice.summary_line(breakdown, config), advice=tips)


def write_trace(trace_dir: str, step: int, result: dict, report: Report) -> str:
    """Writes `<trace_dir>/pipeline_trace_<step>.json`; returns its path."""
    from lingvo_lite.analysis import chrome_trace

    return chrome_trace.write_trace(
        os.path.join(trace_dir, f"pipeline_trace_{step}.json"), result["boxes"], step,
        predicted=report.predicted, title=one_line(report.info.title()),
        cell_devices=report.info.devices)


def write_summaries(writers, subdir: str, step: int, result: dict, report: Report) -> None:
    """Writes the chart image and the breakdown text at `step`, and the breakdown scalars of
    every profiled step at that step."""
    import tensorflow as tf

    from lingvo_lite.analysis import gantt

    figure = gantt.gantt_figure(result["boxes"], report.info, predicted=report.predicted,
                                breakdown=result["breakdown"])
    image = gantt.render_rgb(figure)
    with writers.writer(subdir).as_default(step=step):
        tf.summary.image("pipeline/gantt", image[None], step=step,
                         description="Last profiled step: measured boxes per device, the "
                         "schedule simulator's prediction from the measured mean durations, "
                         "and GPipe's Figure 4 breakdown.")
        tf.summary.text("pipeline/breakdown", report.markdown, step=step)
        # One point per profiled step (a line over --profile_steps, not a single dot).
        for values in result["steps"]:
            point = int(values["step"]) if int(values["step"]) >= 0 else step
            for name, value in values.items():
                if name != "step":
                    tf.summary.scalar(f"pipeline/{name}", value, step=point)
    writers.flush()
