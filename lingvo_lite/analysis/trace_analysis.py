"""What a pipelined step really did: profiler trace -> per-action boxes -> time breakdown.

The executor names every op it emits after the cell and action that emitted it (`op_names`
owns the scheme): call sites carry the micro-batch (`cell_{k}/fprop_mb_{t}/...`), while ops
inside a cell's functions, traced once and called once per micro-batch, carry only the cell and
the function (`cell_{k}/fprop/...`, `cell_{k}/bprop/recompute/...`). A cell runs its actions one
after the other in its schedule order, so the j-th run of a function-body op on cell k is the
j-th call of that function in the schedule (`op_names.function_runs`): ops of a profiler trace
(XSpace protobuf, the `*.xplane.pb` files `tf.profiler.experimental.start/stop` writes) map to
(cell, phase, micro-batch) without guessing, given the schedule and the remat mode. Cell k runs on
the schedule's device `cell_devices[k]` (`Schedule.cell_devices`, the one placement rule), so
rows of the chart and the breakdown's per-device times are the schedule's devices.

From the op intervals this module derives:
- `Box`es: one per (cell, phase, micro-batch), spanning that action's first op start to its last
  op end, with the time its ops were really busy (their union);
- the Figure 4 breakdown of GPipe's step time (`Breakdown`): setup (before the first cell op:
  splitting and reshaping inputs), weight update (after the last cell op), and, in between, the
  devices' compute, recomputation, load imbalance and bubble.

The pictures of the boxes are elsewhere: `gantt` (a matplotlib figure), `chrome_trace` (a
trace-event file for Perfetto / chrome://tracing), `ideal_timeline` (the schedule's prediction).

Times are nanoseconds on the profiler's clock.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Iterable, Sequence

from lingvo_lite.analysis import boxes
from lingvo_lite.pipeline import op_names, remat, tf_private
from lingvo_lite.pipeline.schedules import schedule

__all__ = [
    "Box",
    "box_name",
    "boxes_from_events",
    "cell_devices_of",
    "Breakdown",
    "classify_events",
    "classify_op",
    "compute_breakdown",
    "events_in",
    "find_xplane_files",
    "load_xspaces",
    "merge_intervals",
    "micro_batch_label",
    "op_events",
    "OpEvent",
    "PHASES",
    "STEP_TRACE_NAME",
    "step_windows",
    "union_ns",
    "WEIGHT",
]

# Boxes, phases and the breakdown live in `boxes` (the simulator makes them too); re-exported.
FORWARD, RECOMPUTE, BACKWARD, WEIGHT = boxes.FORWARD, boxes.RECOMPUTE, boxes.BACKWARD, boxes.WEIGHT
PHASES = boxes.PHASES
STEP_TRACE_NAME = "profiled_step"
_TRANSFER_OPS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
# Ops that do no work: a variable read under a cell's scope may run at the very start of the
# step (it waits for nothing), which would hide the setup phase and stretch boxes.
BOOKKEEPING_OPS = frozenset(("ReadVariableOp", "Const", "NoOp", "Identity", "IdentityN",
                             "VarHandleOp", "_Arg", "_Retval"))


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed op: `name` (full graph name), `op_type`, [start_ns, end_ns)."""

    name: str
    op_type: str
    start_ns: int
    end_ns: int


Box, Breakdown, box_name, micro_batch_label = (boxes.Box, boxes.Breakdown, boxes.box_name,
                                               boxes.micro_batch_label)


# ---------------------------------------------------------------------------------------------
# Reading traces.


def find_xplane_files(logdir: str) -> list[str]:
    """The `*.xplane.pb` files of the newest profiler session under `logdir`."""
    sessions = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))
    sessions = [s for s in sessions if glob.glob(os.path.join(s, "*.xplane.pb"))]
    if not sessions:
        raise FileNotFoundError(
            f"No profiler session under {logdir}/plugins/profile; capture one with "
            "tf.profiler.experimental.start(logdir) ... stop().")
    return sorted(glob.glob(os.path.join(sessions[-1], "*.xplane.pb")))


def load_xspaces(logdir: str) -> list:
    """Parsed XSpace protos of the newest profiler session under `logdir`."""
    xplane_pb2 = tf_private.xplane_pb2()
    spaces = []
    for path in find_xplane_files(logdir):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        spaces.append(space)
    return spaces


def _events(space) -> Iterable[tuple[object, object, object, int, int]]:
    """(plane, line, event, start_ns, end_ns) for every event of every plane."""
    for plane in space.planes:
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            for ev in line.events:
                start_ps = base_ps + ev.offset_ps
                yield plane, line, ev, start_ps // 1000, (start_ps + ev.duration_ps) // 1000


def op_events(spaces: Sequence) -> list[OpEvent]:
    """Every executed TensorFlow op (events named `op_name:OpType`), transfers excluded."""
    out = []
    for space in spaces:
        for plane, _, ev, start, end in _events(space):
            md = plane.event_metadata[ev.metadata_id]
            op_type = md.display_name
            if not op_type or op_type in _TRANSFER_OPS or not md.name.endswith(":" + op_type):
                continue
            out.append(OpEvent(md.name[:-len(op_type) - 1], op_type, start, end))
    out.sort(key=lambda e: (e.start_ns, e.end_ns))
    return out


def step_windows(spaces: Sequence, trace_name: str = STEP_TRACE_NAME) -> list[tuple[int, int, int]]:
    """(step_num, start_ns, end_ns) of every `tf.profiler.experimental.Trace(trace_name,
    step_num=...)` region, sorted by start."""
    out = []
    for space in spaces:
        for plane, _, ev, start, end in _events(space):
            if plane.event_metadata[ev.metadata_id].name != trace_name:
                continue
            step = None
            for stat in ev.stats:
                if plane.stat_metadata[stat.metadata_id].name == "step_num":
                    step = int(stat.int64_value or stat.uint64_value)
            if step is not None:
                out.append((step, start, end))
    return sorted(out, key=lambda w: w[1])


def events_in(events: Sequence[OpEvent], start_ns: int, end_ns: int) -> list[OpEvent]:
    """The events that start within [start_ns, end_ns]."""
    return [e for e in events if start_ns <= e.start_ns <= end_ns]


# ---------------------------------------------------------------------------------------------
# Ops -> actions.


def classify_op(name: str) -> tuple[int, str, int | None] | None:
    """(cell, phase, micro_batch) of an op emitted by the executor, None for any other op.

    Phase: F for the forward, R for the re-computed forward of a re-materialised backward, B
    for everything else of the backward (gradients, weight-gradient sums). The micro-batch is
    None for ops inside a cell's functions (see `classify_events`).
    """
    parsed = op_names.parse(name)
    if parsed is None:
        return None
    return parsed.cell, parsed.phase, parsed.micro_batch


def classify_events(events: Sequence[OpEvent],
                    schedule_spec: str | schedule.Schedule = "gpipe",
                    remat_mode: str = "except_last",
                    virtual_stages: int = 1) -> list[tuple[OpEvent, int, str, int]]:
    """(event, cell, phase, micro_batch) for the pipeline ops of one step, in time order.

    Ops inside a cell's functions get their micro-batch from the order their function ran in:
    the j-th run of an op is the j-th call of its function in the schedule `schedule_spec` (a
    name, built with `virtual_stages` for K and T read off the trace, or the profiled
    pipeline's Schedule object) with re-materialisation `remat_mode`. Bookkeeping ops are
    left out.
    """
    parsed = []
    for e in sorted(events, key=lambda e: (e.start_ns, e.end_ns)):
        if e.op_type in BOOKKEEPING_OPS:
            continue
        p = op_names.parse(e.name)
        if p is not None:
            parsed.append((e, p))
    runs = None
    if any(p.micro_batch is None for _, p in parsed):
        runs = _function_runs_of(parsed, schedule_spec, remat_mode, virtual_stages)
    seen: dict[str, int] = {}
    out = []
    for e, p in parsed:
        t = p.micro_batch
        if t is None:
            j = seen.get(e.name, 0)
            seen[e.name] = j + 1
            calls = runs.get((p.cell, p.family), [])
            if j >= len(calls):
                continue  # More runs than one step has: the window holds part of another.
            t = calls[j]
        out.append((e, p.cell, p.phase, t))
    return out


def _function_runs_of(parsed: list[tuple[OpEvent, op_names.ParsedName]],
                      schedule_spec: str | schedule.Schedule, remat_mode: str,
                      virtual_stages: int) -> dict[tuple[int, str], list[int]]:
    if isinstance(schedule_spec, schedule.Schedule):
        return _function_runs(schedule_spec, remat_mode, parsed)
    num_cells = 1 + max(p.cell for _, p in parsed)
    # T: the runs of a forward function, or, where micro-batches kept their activations (their
    # forwards run inline and name their micro-batch), the largest micro-batch named.
    forward_runs: dict[str, int] = {}
    for e, p in parsed:
        if p.family == op_names.FPROP and p.micro_batch is None:
            forward_runs[e.name] = forward_runs.get(e.name, 0) + 1
    named = [p.micro_batch + 1 for _, p in parsed if p.micro_batch is not None]
    num_micro_batches = max(max(forward_runs.values(), default=1), max(named, default=1))
    sched = schedule.make_schedule(schedule_spec, num_cells, num_micro_batches, virtual_stages)
    return _function_runs(sched, remat_mode, parsed)


def _function_runs(sched: schedule.Schedule, remat_mode: str,
                   parsed: list[tuple[OpEvent, op_names.ParsedName]]
                   ) -> dict[tuple[int, str], list[int]]:
    # Kept forwards ran inline if their body's ops name their micro-batch (not so on serial
    # devices, where they are calls).
    kept_inline = any(_INLINE_FORWARD.search(e.name) for e, _ in parsed)
    # Weight-gradient ops where the schedule has no W actions: weight_gradients='batched'.
    batched = not sched.splits_backward and any(p.family == op_names.WGRAD for _, p in parsed)
    return op_names.function_runs(sched, remat.remat_plan(sched, remat_mode), kept_inline,
                                  batched_weight_grads=batched)


_INLINE_FORWARD = re.compile(r"cell_\d+/fprop_mb_\d+/fprop/")


merge_intervals, union_ns = boxes.merge_intervals, boxes.union_ns


def boxes_from_events(events: Sequence[OpEvent],
                      schedule_spec: str | schedule.Schedule = "gpipe",
                      remat_mode: str = "except_last", virtual_stages: int = 1) -> list[Box]:
    """One Box per (cell, phase, micro-batch) that has ops, sorted by cell then start.

    Bookkeeping ops (variable reads, constants, identities) are left out: they take no time
    and may run long before the action they belong to. `schedule_spec` (a name or a Schedule)
    and `remat_mode` are the profiled pipeline's (see `classify_events`).
    """
    groups: dict[tuple[int, str, int], list[OpEvent]] = {}
    for e, cell, phase, t in classify_events(events, schedule_spec, remat_mode,
                                             virtual_stages):
        groups.setdefault((cell, phase, t), []).append(e)
    boxes = []
    for (cell, phase, t), evs in groups.items():
        runs = merge_intervals((e.start_ns, e.end_ns) for e in evs)
        boxes.append(Box(cell, phase, t, runs[0][0], max(e.end_ns for e in evs),
                         sum(b - a for a, b in runs), len(evs), tuple(runs)))
    return sorted(boxes, key=lambda b: (b.cell, b.start_ns, PHASES.index(b.phase)))


# ---------------------------------------------------------------------------------------------
# The Figure 4 breakdown.


def cell_devices_of(placement: schedule.Schedule | Sequence[int] | None,
                    num_cells: int) -> tuple[int, ...]:
    """Cell k's device for each of `num_cells` cells: a Schedule's `cell_devices`, a mapping
    given as a sequence, or (None) one cell per device, cell k on device k.

    >>> cell_devices_of(schedule.make_schedule("zbv", 4, 2), 4)
    (0, 1, 1, 0)
    """
    if placement is None:
        return tuple(range(num_cells))
    devices = tuple(placement.cell_devices if isinstance(placement, schedule.Schedule)
                    else placement)
    if len(devices) != num_cells or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices):
        raise ValueError(f"cell_devices={list(devices)} must give a device index >= 0 for "
                         f"each of the {num_cells} cells.")
    return devices


def compute_breakdown(events: Sequence[OpEvent], num_cells: int | None = None,
                      cell_devices: schedule.Schedule | Sequence[int] | None = None
                      ) -> Breakdown:
    """The breakdown (see `Breakdown`) of one step's op events, per device.

    Args:
      events: the ops of exactly one step (see `step_windows` / `events_in`); bookkeeping
        ops (BOOKKEEPING_OPS) bound the step but are not cell work.
      num_cells: the cells the partition made; default: `len(cell_devices)`, else 1 + the
        largest cell index seen.
      cell_devices: where each cell ran: the profiled pipeline's Schedule (its
        `cell_devices`) or that mapping (`cell_devices[k]`: cell k's device); default: cell k
        on device k. A device is busy while an op of any of its cells runs.
    """
    if not events:
        raise ValueError("compute_breakdown got no op events; profile at least one step.")
    step_start = min(e.start_ns for e in events)
    step_end = max(e.end_ns for e in events)
    step_ns = max(step_end - step_start, 1)
    per_cell: dict[int, list[tuple[int, int]]] = {}
    recompute: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        key = None if e.op_type in BOOKKEEPING_OPS else classify_op(e.name)
        if key is None:
            continue
        per_cell.setdefault(key[0], []).append((e.start_ns, e.end_ns))
        if key[1] == RECOMPUTE:
            recompute.setdefault(key[0], []).append((e.start_ns, e.end_ns))
    if not per_cell:
        raise ValueError("No op of the step is named after a pipeline cell (op_names): "
                         "was a PipeliningLayer's FPropAndGrads profiled?")
    if num_cells is None:
        num_cells = (len(cell_devices.cell_devices) if isinstance(cell_devices, schedule.Schedule)
                     else len(cell_devices) if cell_devices is not None else max(per_cell) + 1)
    if max(per_cell) >= num_cells:
        raise ValueError(f"The trace has ops of cell {max(per_cell)}, but the pipeline has "
                         f"{num_cells} cells.")
    device_of = cell_devices_of(cell_devices, num_cells)
    num_devices = 1 + max(device_of)
    per_device: dict[int, list[tuple[int, int]]] = {}
    recompute_per_device: dict[int, list[tuple[int, int]]] = {}
    for cell, intervals in per_cell.items():
        per_device.setdefault(device_of[cell], []).extend(intervals)
    for cell, intervals in recompute.items():
        recompute_per_device.setdefault(device_of[cell], []).extend(intervals)
    first = min(s for iv in per_cell.values() for s, _ in iv)
    last = max(e for iv in per_cell.values() for _, e in iv)
    pipe_ns = max(last - first, 1)
    busy = [union_ns(per_device.get(d, [])) for d in range(num_devices)]
    rec = [union_ns(recompute_per_device.get(d, [])) for d in range(num_devices)]
    mean_busy = sum(busy) / num_devices
    mean_rec = sum(rec) / num_devices
    max_busy = max(busy)
    return Breakdown(
        step_ns=step_ns,
        setup=(first - step_start) / step_ns,
        compute=(mean_busy - mean_rec) / step_ns,
        recompute=mean_rec / step_ns,
        load_imbalance=(max_busy - mean_busy) / step_ns,
        bubble=(pipe_ns - max_busy) / step_ns,
        weight_update=(step_end - last) / step_ns,
        device_busy=tuple(b / step_ns for b in busy),
        device_idle_in_pipeline=tuple(1.0 - b / pipe_ns for b in busy),
    )
