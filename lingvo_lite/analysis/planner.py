"""The dry-run planner behind `trainer.py --mode=plan`: which pipeline fits and runs fastest.

For a PipeliningLayer's params, a number of devices N and a memory budget per device, it
searches the devices per pipeline D (up to N and the number of layers), the data replicas R
(R x D <= N, R dividing the mini-batch), the micro-batches T (divisors of the per-replica
batch), the schedule and the re-materialisation policy. K cells run on the devices the
schedule places them on (`Schedule.cell_devices`): one per device (gpipe, 1f1b, zero_bubble:
D = K), v = 2, 3 or 4 per device (interleaved: D = K / v), two per device (zbv: D = K / 2).
Each candidate gets

* its peak memory per device from `memory_model.device_memory` (the layers' FPropMeta at the
  per-replica batch, the schedule's per-device orders and its simulated timeline below, the
  task's optimizer slots); candidates whose worst device exceeds the budget are dropped;
* its step time from `simulator.simulate`: each cell's forward = its layers' FLOPs / the device
  throughput (`--plan_device_flops`, default `DEFAULT_DEVICE_FLOPS`) + a fixed per-action
  overhead, backward = `simulator.BACKWARD_RATIO` (2) x forward (+ the forward again when
  recomputed), a boundary crossing
  = its bytes / `DEFAULT_LINK_BYTES_PER_S`, and with R > 1 a ring all-reduce of the gradients
  of the device that holds the most.

Plans are ranked by predicted examples/s (mini-batch / step time).

>>> from lingvo_lite.analysis import planner
>>> import tensorflow as tf
>>> from lingvo_lite.layers import dense
>>> from lingvo_lite.pipeline import pipelining_layer
>>> p = pipelining_layer.PipeliningLayer.Params().Set(
...     name="pipe", input_shapes=tf.TensorShape([64, 256]), layers=[
...         dense.ProjectionLayer.Params().Set(name=f"l{i}", input_dim=256, output_dim=256)
...         for i in range(8)])
>>> result = planner.search(p, num_devices=4, budget=planner.parse_size("4MiB"))
>>> best = result.fitting[0]
>>> best.num_devices <= 4, best.peak_bytes <= 4 * 2**20
(True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.analysis import memory_model, simulator
from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.core.sizes import format_bytes, parse_size  # noqa: F401 (re-exported)
from lingvo_lite.pipeline import pipelining_layer, step_layout
from lingvo_lite.pipeline import remat as remat_lib
from lingvo_lite.pipeline.partition import partition
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

# Cells per device tried for a schedule that takes virtual stages (the interleaved one:
# Megatron-LM's papers use 2 to 4; more cells per device add boundary crossings and
# per-action overhead for a bubble already small).
PLANNED_VIRTUAL_STAGES = (2, 3, 4)
# Achieved (not peak) dense throughput of one accelerator when --plan_device_flops is not
# given: 50 TFLOP/s, about a V100's or TPU v3 core's mixed-precision matmul rate in practice.
# Only the ranking's transfer and overhead terms depend on it.
DEFAULT_DEVICE_FLOPS = 50e12
# Bytes/s between neighbouring devices (boundary activations, gradient all-reduce).
DEFAULT_LINK_BYTES_PER_S = 25e9
# Fixed cost of every forward or backward action (kernel launches, a micro-batch's
# bookkeeping); it is what makes very many tiny micro-batches lose.
ACTION_OVERHEAD_S = 50e-6
BACKWARD_RATIO = simulator.BACKWARD_RATIO
MAX_MICRO_BATCHES = 512
# When two remat policies recompute the same backwards, the plan is labelled with the first.
_REMAT_PREFERENCE = ("never", "except_last", "always")

@dataclasses.dataclass(frozen=True)
class Plan:
    """One candidate configuration with its predicted step and memory. Its schedule
    (`step.schedule`) gives K, T and the devices of a replica."""

    num_replicas: int
    remat: str
    global_batch: int
    step: simulator.SimulatedStep
    all_reduce_time: float
    memory: tuple[memory_model.DeviceMemory, ...]  # Per device of a replica.
    virtual_stages: int = 1  # The `virtual_stages` param the schedule was built with.

    @property
    def num_cells(self) -> int:
        """K: cells of one replica."""
        return self.step.schedule.num_cells

    @property
    def num_micro_batches(self) -> int:
        return self.step.schedule.num_micro_batches

    @property
    def schedule(self) -> str:
        return self.step.schedule.name

    @property
    def step_time(self) -> float:
        return self.step.step_time + self.all_reduce_time

    @property
    def examples_per_s(self) -> float:
        return self.global_batch / max(self.step_time, 1e-30)

    @property
    def peak_bytes(self) -> int:
        return max(m.total for m in self.memory)

    @property
    def num_devices(self) -> int:
        """Devices of all replicas: R x the devices the schedule places the cells on."""
        return self.step.schedule.num_devices * self.num_replicas

    @property
    def schedule_label(self) -> str:
        """The schedule's name, with its virtual_stages when it takes more than 1."""
        if self.virtual_stages > 1:
            return f"{self.schedule} v={self.virtual_stages}"
        return self.schedule

    def label(self) -> str:
        return (f"K={self.num_cells} R={self.num_replicas} T={self.num_micro_batches} "
                f"{self.schedule_label} remat={self.remat}")

    def parts(self) -> dict[str, float]:
        """Seconds of the step spent on each of GPipe's Figure 4 parts (+ all-reduce)."""
        b = self.step.breakdown()
        t = self.step.step_time
        return {"compute": b.compute * t, "recompute": b.recompute * t,
                "load imbalance": b.load_imbalance * t, "bubble": b.bubble * t,
                "all-reduce": self.all_reduce_time}


@dataclasses.dataclass(frozen=True)
class PlanSearch:
    """Every candidate, split into those that fit the budget and those that do not."""

    fitting: tuple[Plan, ...]  # Fastest first.
    too_big: tuple[Plan, ...]  # Fastest first.
    budget: int
    num_devices: int
    device_flops: float


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def with_batch(shapes: Any, batch_dim: int, batch: int) -> Any:
    """`shapes` (a shape or nested dict of them) with dimension `batch_dim` set to `batch`."""
    if isinstance(shapes, dict):
        return NestedMap({k: with_batch(v, batch_dim, batch) for k, v in shapes.items()})
    dims = base_layer.to_shape(shapes).as_list()
    if len(dims) > batch_dim:
        dims[batch_dim] = batch
    return tf.TensorShape(dims)


def _first_batch(shapes: Any, batch_dim: int) -> int:
    """The batch size of a mini-batch shape (its first leaf's `batch_dim`)."""
    shapes = base_layer.to_shape(shapes)
    return (shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes])[0][batch_dim]


def phase_costs(cell_flops: Sequence[float], boundary_bytes: Sequence[int],
                 num_micro_batches: int, device_flops: float,
                 link_bytes_per_s: float) -> simulator.PhaseCosts:
    """Each cell's per-micro-batch action times from its FLOPs (see the module docstring)."""
    forward = tuple(f / num_micro_batches / device_flops + ACTION_OVERHEAD_S for f in cell_flops)
    backward = tuple(BACKWARD_RATIO * (f - ACTION_OVERHEAD_S) + ACTION_OVERHEAD_S
                     for f in forward)
    transfer = max(boundary_bytes, default=0) / num_micro_batches / link_bytes_per_s
    return simulator.PhaseCosts(forward, backward, transfer)


def device_memory(part: partition.Partition, layers: list[memory_model.LayerMemory],
                   input_bytes: int, sched: schedule_lib.Schedule, remat: str, num_slots: int,
                   num_replicas: int, step: simulator.SimulatedStep,
                   batched_weight_grads: bool, shard_slots: bool = False
                   ) -> list[memory_model.DeviceMemory]:
    mem = memory_model.device_memory(part, layers, input_bytes, sched, remat, num_slots,
                                     timeline=step, batched_weight_grads=batched_weight_grads,
                                     slot_shards=num_replicas if shard_slots else 1)
    if num_replicas > 1:  # The all-reduced gradient beside the local one.
        ranges = part.cell_layer_ranges
        mem = [dataclasses.replace(m, gradients=m.gradients + sum(
                   x.trainable_bytes for k in m.cells for x in layers[slice(*ranges[k])]))
               for m in mem]
    return mem


def predict_memory(p: hyperparams.Params, num_cells: int, num_replicas: int,
                   num_micro_batches: int, schedule: str, remat: str,
                   num_slots: int = 1,
                   virtual_stages: int | None = None,
                   shard_optimizer_state: bool = False) -> list[memory_model.DeviceMemory]:
    """The memory model of one configuration of PipeliningLayer params `p` (per device of a
    replica; every replica's devices hold the same). `num_cells` counts cells; the schedule
    places them (a schedule that takes virtual stages, the interleaved one, puts
    `virtual_stages`, default `p.virtual_stages`, on each device). `shard_optimizer_state`:
    the slots are sharded over the replicas (ZeRO-1), 1/num_replicas of them per device."""
    batch = global_batch_size(p)
    q = p.Copy()
    q.input_shapes = with_batch(p.input_shapes, p.batch_dim, batch // num_replicas)
    q.num_cells = num_cells
    metas = pipelining_layer.PipeliningLayer.LayerMetas(q)
    part = pipelining_layer.PipeliningLayer.ComputePartition(q)
    if virtual_stages is None:
        virtual_stages = p.virtual_stages if _takes_virtual_stages(schedule) else 1
    sched = schedule_lib.make_schedule(schedule, part.num_cells, num_micro_batches,
                                       virtual_stages)
    layers = memory_model.layer_memory(metas, tf.as_dtype(p.dtype).size)
    costs = phase_costs([sum(m.flops for m in metas[a:b]) for a, b in part.cell_layer_ranges],
                         [layers[b - 1].out_bytes for _, b in part.cell_layer_ranges[:-1]],
                         num_micro_batches, DEFAULT_DEVICE_FLOPS, DEFAULT_LINK_BYTES_PER_S)
    return device_memory(part, layers, base_layer.activation_bytes(q.input_shapes), sched,
                          remat, num_slots, num_replicas,
                          simulator.simulate(sched, costs, remat=remat),
                          p.weight_gradients == "batched", shard_optimizer_state)


def global_batch_size(p: hyperparams.Params) -> int:
    """The mini-batch size a PipeliningLayer's `input_shapes` describe (`step_layout`)."""
    batch = step_layout.global_batch_size(p)
    if batch is None:
        raise ValueError("planning needs the PipeliningLayer's input_shapes (the shape of "
                         "one mini-batch) to estimate costs; set <pipeline>.input_shapes.")
    return batch


def _takes_virtual_stages(name: str) -> bool:
    """Whether the schedule class `name` puts a chosen number of cells on each device."""
    return hasattr(schedule_lib.schedule_classes().get(name), "virtual_stages")


def _schedules_to_try(names: Sequence[str], k: int, t: int, num_replicas: int,
                      max_devices: int) -> list[tuple[schedule_lib.Schedule, int]]:
    """(schedule, its virtual_stages param) for K cells and T micro-batches: every name, a
    schedule that takes virtual stages with v in PLANNED_VIRTUAL_STAGES; those a
    schedule refuses (an odd K for zbv, a T that is not a multiple of the devices for the
    interleaved one), that need more than `max_devices` over the replicas, or that run
    several cells, or a split backward, on one device (no bubble to fill), are left out."""
    out = []
    for name in names:
        # A schedule that takes virtual stages runs v > 1 of them per device (with one it
        # runs one cell per device, as the others do).
        for v in PLANNED_VIRTUAL_STAGES if _takes_virtual_stages(name) else (1,):
            try:
                sched = schedule_lib.make_schedule(name, k, t, v)
            except ValueError:
                continue
            if sched.num_devices * num_replicas > max_devices:
                continue
            if sched.num_devices == 1 and (k > 1 or sched.splits_backward):
                continue
            out.append((sched, v))
    return out


def _candidates(scheds: Sequence[tuple[schedule_lib.Schedule, int]],
                part: partition.Partition, layers: list[memory_model.LayerMemory],
                input_bytes: int, r: int, batch: int, costs: simulator.PhaseCosts,
                link_bytes_per_s: float, remats: Sequence[str], num_slots: int,
                batched_weight_grads: bool, shard_slots: bool = False) -> list[Plan]:
    """The plans of every schedule in `scheds` and remat policy for one (K, R, T)."""
    plans = []
    seen_orders = set()
    ranges = part.cell_layer_ranges
    for sched, v in scheds:
        # Schedules (and below, remat policies) that do the same are tried once.
        orders = (sched.cell_devices, sched.device_orders())
        if orders in seen_orders:
            continue
        seen_orders.add(orders)
        # With R > 1, a ring all-reduce of the gradients of the device that holds the most;
        # sharded slots (ZeRO-1) add the all-gather of the updated weights, (R - 1) / R more.
        grads = max(sum(m.trainable_bytes for c in sched.cells_of_device(d)
                        for m in layers[slice(*ranges[c])])
                    for d in range(sched.num_devices))
        all_reduce = (2.0 * (r - 1) / r * grads / link_bytes_per_s) if r > 1 else 0.0
        if shard_slots:
            all_reduce *= 1.5
        seen_remat = set()
        for remat in sorted(remats, key=_REMAT_PREFERENCE.index):
            recomputed = remat_lib.recomputed_actions(sched, remat)
            if recomputed in seen_remat:
                continue
            seen_remat.add(recomputed)
            step = simulator.simulate(sched, costs, remat=remat)
            mem = device_memory(part, layers, input_bytes, sched, remat, num_slots, r, step,
                                 batched_weight_grads, shard_slots)
            plans.append(Plan(r, remat, batch, step, all_reduce, tuple(mem), v))
    return plans


def search(p: hyperparams.Params, num_devices: int, budget: int,
           device_flops: float = DEFAULT_DEVICE_FLOPS, num_slots: int = 1,
           schedules: Sequence[str] | None = None,
           remats: Sequence[str] = remat_lib.REMAT_MODES,
           link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
           shard_optimizer_state: bool = False) -> PlanSearch:
    """Every (K, R, T, schedule, remat) for `p` on `num_devices`, predicted and ranked.

    K counts cells; each schedule places them on its devices (`_schedules_to_try`): the
    interleaved one v (`PLANNED_VIRTUAL_STAGES`) on each of K / v devices, zbv two on each.

    Args:
      p: the PipeliningLayer params (its layers, input_shapes, partition method and dtype).
      num_devices: N; plans use R x (the schedule's devices) <= N devices.
      budget: bytes of memory per device.
      device_flops: achieved FLOP/s of one device.
      num_slots: weight-sized optimizer slots per weight (`memory_model.optimizer_slots`).
      schedules: schedule names to try (default: the registry's `planned_schedules()`).
      remats: re-materialisation policies to try.
      link_bytes_per_s: bandwidth of a boundary crossing and of the all-reduce.
      shard_optimizer_state: the slots are sharded over the R replicas (ZeRO-1).
    """
    schedules = list(schedules or schedule_lib.planned_schedules())
    batch = global_batch_size(p)
    # With input_buckets, R and T must split every bucket's batch (one T for all of them).
    split = math.gcd(batch, *(int(_first_batch(b, p.batch_dim)) for b in p.input_buckets or []))
    param_size = tf.as_dtype(p.dtype).size
    fitting, too_big = [], []
    for r in _divisors(split):
        if r > num_devices:
            break
        q = p.Copy()
        q.input_shapes = with_batch(p.input_shapes, p.batch_dim, batch // r)
        metas = pipelining_layer.PipeliningLayer.LayerMetas(q)
        layers = memory_model.layer_memory(metas, param_size)
        input_bytes = base_layer.activation_bytes(q.input_shapes)
        flops = [m.flops for m in metas]
        # K cells; the schedule places them on its devices (at most num_devices / R).
        for k in range(1, len(metas) + 1):
            q.num_cells = k
            try:
                part = pipelining_layer.PipeliningLayer.ComputePartition(q, metas)
            except ValueError:
                continue
            if part.num_cells != k:
                continue
            cell_flops = [sum(flops[a:b]) for a, b in part.cell_layer_ranges]
            boundary = [layers[b - 1].out_bytes for _, b in part.cell_layer_ranges[:-1]]
            for t in _divisors(split // r):
                if t > MAX_MICRO_BATCHES:
                    break
                scheds = _schedules_to_try(schedules, k, t, r, num_devices)
                if not scheds:
                    continue
                costs = phase_costs(cell_flops, boundary, t, device_flops, link_bytes_per_s)
                for plan in _candidates(scheds, part, layers, input_bytes, r, batch, costs,
                                        link_bytes_per_s, remats, num_slots,
                                        p.weight_gradients == "batched",
                                        shard_optimizer_state):
                    (fitting if plan.peak_bytes <= budget else too_big).append(plan)

    def rank(plans: list[Plan]) -> tuple[Plan, ...]:
        return tuple(sorted(plans, key=lambda x: (-x.examples_per_s, x.peak_bytes,
                                                  x.num_devices)))

    return PlanSearch(rank(fitting), rank(too_big), budget, num_devices, device_flops)


def why_better(best: Plan, other: Plan) -> str:
    """One sentence: where `best`'s step time is saved (or what `other` lacks)."""
    faster = other.step_time / max(best.step_time, 1e-30) - 1.0
    diffs = [f"{name} {best_s * 1e3:.2f} vs {other_s * 1e3:.2f} ms"
             for (name, best_s), other_s in zip(best.parts().items(), other.parts().values())
             if abs(best_s - other_s) > 0.01 * max(best.step_time, 1e-30)]
    knobs = [f"{n} {a} vs {b}" for n, a, b in (
        ("K", best.num_cells, other.num_cells), ("R", best.num_replicas, other.num_replicas),
        ("T", best.num_micro_batches, other.num_micro_batches),
        ("schedule", best.schedule_label, other.schedule_label),
        ("remat", best.remat, other.remat))
        if a != b]
    text = (f"The best plan is {faster:.1%} faster than the runner-up ({', '.join(knobs)}): "
            + ("; ".join(diffs) if diffs else "the same time parts, within 1%") + ".")
    if faster < 1e-9:
        text += (f" Equal speed; it needs less memory ({format_bytes(best.peak_bytes)} vs "
                 f"{format_bytes(other.peak_bytes)} on the fullest device) or fewer devices.")
    return text


def _row(i: int, plan: Plan, budget: int) -> str:
    b = plan.step.breakdown()
    return (f"{i:>3}  {plan.num_cells:>3} {plan.num_replicas:>3} {plan.num_micro_batches:>4}  "
            f"{plan.schedule_label:<15} {plan.remat:<11} {plan.examples_per_s:>12,.1f} "
            f"{plan.step_time * 1e3:>9.3f}  {b.bubble:>6.1%} {b.load_imbalance:>6.1%} "
            f"{b.recompute:>6.1%} {plan.all_reduce_time / plan.step_time:>6.1%}  "
            f"{format_bytes(plan.peak_bytes):>10} {plan.peak_bytes / budget:>5.0%}")


_HEADER = ("  #    K   R    T  schedule        remat        examples/s   step ms  bubble  imbal  "
           "recomp  allred    peak/dev  of budget")


def _memory_lines(plan: Plan) -> list[str]:
    lines = []
    for m in plan.memory:
        lines.append(
            f"    device {m.device}{_cells_text(m)}: {format_bytes(m.total):>10} = weights "
            f"{format_bytes(m.weights)} + grads {format_bytes(m.gradients)} + optimizer "
            f"{format_bytes(m.optimizer_slots)} + input {format_bytes(m.inputs)} + kept "
            f"activations {format_bytes(m.kept_activations)} ({m.peak_in_flight} in flight"
            + (f"; {format_bytes(m.waiting_records)} of it weight-gradient records waiting "
               "for W" if m.waiting_records else "")
            + f") + working {format_bytes(m.working_activations)}"
            + (f" + received early {format_bytes(m.received_early)}" if m.received_early
               else ""))
    return lines


def _cells_text(m: memory_model.DeviceMemory) -> str:
    """' (cells 1, 3)' for a device of several cells; '' for one."""
    return f" (cells {', '.join(map(str, m.cells))})" if len(m.cells) > 1 else ""


def format_report(result: PlanSearch, model: str, path: str, top: int = 5,
                  run_command: Callable[[Plan], str] | None = None) -> str:
    """The --mode=plan text; `run_command(plan)`, when given, is the command printed to run the
    chosen plan."""
    lines = [f"Plans for {model} ({path}) on {result.num_devices} device(s) with "
             f"{format_bytes(result.budget)} each, {result.device_flops / 1e12:g} TFLOP/s "
             f"per device: {len(result.fitting)} fit, {len(result.too_big)} do not.",
             "Time: schedule simulator (forward = FLOPs / device FLOP/s + "
             f"{ACTION_OVERHEAD_S * 1e6:g} us, backward = {BACKWARD_RATIO:g} x forward, "
             "recompute = 1 forward, "
             f"links {DEFAULT_LINK_BYTES_PER_S / 1e9:g} GB/s); memory: "
             "lingvo_lite/analysis/memory_model.py.", ""]
    if not result.fitting:
        smallest = min(result.too_big, key=lambda x: x.peak_bytes, default=None)
        lines.append("No plan fits." + (
            f" The smallest needs {format_bytes(smallest.peak_bytes)} per device "
            f"({smallest.label()}); raise --plan_memory_per_device or --plan_devices."
            if smallest else ""))
        return "\n".join(lines) + "\n"
    lines += ["Top plans that fit, fastest first (K cells per replica, one per device; "
              "interleaved v: v per device, K / v devices; zbv: two per device):", _HEADER]
    shown = result.fitting[:top]
    lines += [_row(i + 1, x, result.budget) for i, x in enumerate(shown)]
    best = result.fitting[0]
    lines += ["", f"Per-device memory of plan 1 ({best.label()}):", *_memory_lines(best)]
    if len(result.fitting) > 1:
        lines += ["", why_better(best, result.fitting[1])]
    faster = [x for x in result.too_big if x.examples_per_s > best.examples_per_s]
    if faster:
        lines += ["", "Faster plans rejected for memory:", _HEADER]
        lines += [_row(i + 1, x, result.budget) for i, x in enumerate(faster[:3])]
        lines += [f"  The fastest of them needs {format_bytes(faster[0].peak_bytes)} on its "
                  f"fullest device (budget {format_bytes(result.budget)}):",
                  *_memory_lines(faster[0])]
    if run_command is not None:
        lines += ["", "Run the chosen plan with:", "  " + run_command(best)]
    return "\n".join(lines) + "\n"


__all__ = ["Plan", "PlanSearch", "search", "predict_memory", "format_report", "why_better"]
