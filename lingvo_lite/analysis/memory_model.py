"""Memory model: each device's peak bytes in one pipelined training step, without running it.

From the layers' `FPropMeta` (parameters, output bytes, saved-activation estimate), the
partition, the schedule's per-device orders and the re-materialisation policy, device d's peak
is the sum of the following, over the cells it holds (one; v with the interleaved schedule,
whose device walks the actions of all of them in its own order):

* weights: every parameter of the cells' layers (trainable or not);
* gradients, followed through the device's order: a cell's weight gradients exist from its
  first backward, and their sum stays until the step's update; with T > 1, while the cell's
  backwards (or split backward's W) run, the next micro-batch's gradients stand beside the
  running sums (the sums alone at T = 1). The update adds nothing: the optimizers write in
  place (fused kernels), after the cell's last input gradient, so no read of the weight is
  alive to force a copy. A device that finishes one cell's backwards before it starts the
  next's never holds both cells' new gradients;
* optimizer slots: `optimizer_slots(optimizer params)` weight-sized slots per trainable weight
  (SGD with momentum 1, Adam 2 (and a step count), RMSProp 2, plain SGD 0); with the slots
  sharded over R replicas (ZeRO-1, `slot_shards=R`) 1/R of them (the padding of each weight
  to a multiple of R elements, at most R - 1 elements, is not counted);
* inputs: cell 0's device holds the whole received mini-batch for the step (and its
  micro-batch slices);
* activations at the worst moment of the device's own order: for every (cell, micro-batch)
  whose forward ran and whose backward has not (walked from `Schedule.device_order`, so GPipe
  keeps T, 1F1B at most K - k, interleaved and any new schedule their own), the received
  boundary copy of its input, or all its saved activations when its backward does not
  recompute (the same decision as `remat.recomputed_actions`), with the input copy too unless
  the cell's first layer's saved bytes cover what its backward reads of it
  (`layer_memory.saved_covers_input`); plus the working set of the
  running action (of the cell it belongs to): one
  micro-batch's saved activations (being produced by a forward, or re-produced by a
  recomputing backward), its activation gradients (the received output gradient, and while
  back-propagating through layer j the activations of layers up to j plus j's gradient
  temporaries, less what j's own backward has freed: `LayerMemory.inline_temporaries`). Both
  the inline backward of a kept micro-batch and a re-computing backward call free the
  activations as they pass them; a re-computing call that defers weight gradients returns
  its records (the weight ops' inputs), so it holds all it re-computed plus the largest
  layer's temporaries (`LayerMemory.temporaries`) until it returns. Received
  boundary copies are the kept inputs of cells k > 0 and the received output gradient of the
  running backward;
* received early (given the schedule's simulated `timeline`): inputs and output gradients that
  have landed and wait for the device's order to reach them. A receive lands when its sender
  finishes: under 1F1B a device gets the next micro-batch's input while still running the
  backward before;
* deferred weight gradients (zero-bubble's split backward, `weight_gradients='batched'`): from
  a micro-batch's B until its W (batched: the cell's one W after its last backward), the
  records of the ops that apply weights through `layers.weight_ops`, each op's input and
  output gradient (`LayerMemory.deferred_bytes`: the layer's declared `weight_op_bytes`, else
  its saved activations and output for a layer with trainable weights, an upper estimate).
  While a kept micro-batch's inline backward runs, the records of the layers it has passed pile
  up beside the activations not yet freed, inside a composite layer too (its sub-layers'
  output gradients: `LayerMemory.deferring_temporaries`); a re-computing call holds them
  among what it re-computed. The batched W concatenates all T micro-batches' records, one more copy
  while it runs.

Per layer, the saved activations and gradient temporaries are what the layer's
`layer_memory.MemoryRecord` declares, else that module's defaults (`layer_memory` says how
composite layers combine their children's). How well the model predicts measured peaks:
BENCHMARKS.md figure 9 (`bench/memory_model_check.py`).

>>> from lingvo_lite.analysis import memory_model
>>> from lingvo_lite.pipeline.partition import partition
>>> from lingvo_lite.pipeline.schedules import schedule
>>> layers = [memory_model.LayerMemory(param_bytes=400, trainable_bytes=400, out_bytes=800,
...                                    saved_bytes=1600)] * 4
>>> part = partition.make_partition([f"l{i}" for i in range(4)], [1.0] * 4, 2)
>>> gpipe = schedule.make_schedule("gpipe", 2, 4)
>>> mem = memory_model.device_memory(part, layers, 800, gpipe, "never", num_slots=1)
>>> mem[1].weights, mem[1].gradients, mem[1].optimizer_slots
(800, 1600, 800)
>>> mem[1].peak_in_flight  # GPipe: all T micro-batches in flight.
4
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Any

from lingvo_lite.analysis import simulator
from lingvo_lite.core import layer_memory as memory_records
from lingvo_lite.pipeline import remat as remat_lib
from lingvo_lite.pipeline.partition import partition as partition_lib
from lingvo_lite.pipeline.schedules import schedule as schedule_lib
from lingvo_lite.pipeline.schedules.schedule import Phase


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """What one layer contributes to memory, for the whole mini-batch."""

    param_bytes: int  # Every weight (trainable or not).
    trainable_bytes: int  # Those that get a gradient and optimizer slots.
    out_bytes: int  # Its output (the boundary when a cell ends here).
    saved_bytes: int  # Activations it keeps from its forward for its backward.
    # Gradient temporaries while back-propagating through it; None: the default estimate
    # (`layer_memory.backward_temporary_bytes`).
    backward_temporary_bytes: int | None = None
    # What a deferred weight gradient holds from B to W (its weight ops' inputs and output
    # gradients).
    deferred_bytes: int = 0
    # Its backward's most beyond its saved activations when it frees each as soon as its last
    # reader is back-propagated (an inline backward); None: `temporaries`.
    inline_temporary_bytes: int | None = None
    # The same for an inline backward that defers weight gradients (the records of the
    # sub-layers it passed stay); None: `inline_temporaries`.
    deferring_temporary_bytes: int | None = None
    # saved_bytes already counts what its backward reads of its input
    # (`layer_memory.saved_covers_input`); False: its input is the previous layer's output.
    saved_covers_input: bool = False

    @property
    def temporaries(self) -> int:
        if self.backward_temporary_bytes is not None:
            return self.backward_temporary_bytes
        return memory_records.default_backward_temporary_bytes(self.out_bytes, self.saved_bytes)

    @property
    def inline_temporaries(self) -> int:
        if self.inline_temporary_bytes is not None:
            return self.inline_temporary_bytes
        return self.temporaries

    @property
    def deferring_temporaries(self) -> int:
        if self.deferring_temporary_bytes is not None:
            return self.deferring_temporary_bytes
        return self.inline_temporaries


def layer_memory(metas: Sequence[Any], param_bytes_per_element: int = 4) -> list[LayerMemory]:
    """`LayerMemory` of each layer from its FPropMeta (e.g. `PipeliningLayer.LayerMetas`)."""
    out = []
    for m in metas:
        trainable = int(m.num_params) - int(m.get("non_trainable_params", 0))
        saved = memory_records.saved_activation_bytes(m)
        declared = memory_records.record_of(m)
        deferred = declared.weight_op_bytes
        if deferred is None:  # Not declared: an upper estimate.
            deferred = saved + int(m.out_bytes) if trainable > 0 else 0
        out.append(LayerMemory(param_bytes=int(m.num_params) * param_bytes_per_element,
                               trainable_bytes=trainable * param_bytes_per_element,
                               out_bytes=int(m.out_bytes),
                               saved_bytes=saved,
                               backward_temporary_bytes=declared.backward_temporary_bytes,
                               deferred_bytes=int(deferred),
                               inline_temporary_bytes=declared.inline_backward_temporary_bytes,
                               deferring_temporary_bytes=(
                                   declared.deferring_backward_temporary_bytes),
                               saved_covers_input=memory_records.saved_covers_input(m)))
    return out


def optimizer_slots(optimizer_params: Any) -> int:
    """Weight-sized slots the optimizer keeps per trainable weight (lingvo_lite.tasks.optimizers).

    >>> from lingvo_lite.tasks import optimizers
    >>> optimizer_slots(optimizers.Adam.Params()), optimizer_slots(optimizers.RMSProp.Params())
    (2, 2)
    """
    if optimizer_params is None:
        return 0
    return optimizer_params.Instantiate().weight_sized_slots()  # Creates no variable.


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Device `device`'s predicted bytes at its peak, by part."""

    device: int
    cells: tuple[int, ...]  # The cells it holds (one, or v with the interleaved schedule).
    weights: int
    gradients: int  # At the peak: the started cells' sums, the running cells' temporaries.
    optimizer_slots: int
    inputs: int  # The received mini-batch (the device of cell 0).
    kept_activations: int  # Of the micro-batches in flight at the peak.
    working_activations: int  # Of the action running at the peak.
    peak_in_flight: int  # Most (cell, micro-batch) forwards in flight on this device.
    peak_action: schedule_lib.Action | None
    # Inputs and output gradients received at the peak but not yet used (with a timeline).
    received_early: int = 0
    # Of kept_activations: deferred weight gradients' records waiting for their W.
    waiting_records: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_slots + self.inputs
                + self.activations)

    @property
    def activations(self) -> int:
        return self.kept_activations + self.working_activations + self.received_early


@dataclasses.dataclass(frozen=True)
class _CellActivations:
    """One cell's activation sizes for one micro-batch (see `device_memory`)."""

    boundary_in: float  # Its input.
    boundary_out: float  # Its output, and the output gradient its backward receives.
    saved: float  # All its layers' saved activations.
    kept_input: float  # The input copy a re-computing backward starts from.
    inline_kept_input: float  # Of it, what a backward that does not re-compute holds.
    forward_work: float  # A forward that keeps nothing: about one layer's activations.
    backward_work: float  # A kept micro-batch's inline backward, at its worst layer.
    call_work: float  # A re-computing backward call (see `_cell_activations`).
    records: float  # Deferred weight-gradient records (0 when nothing is deferred).


def _cell_activations(k: int, cell: Sequence[LayerMemory], boundary_in_bytes: int,
                      num_micro: int, defer: bool) -> _CellActivations:
    boundary_in = boundary_in_bytes / num_micro
    boundary_out = cell[-1].out_bytes / num_micro if cell else 0.0
    saved = sum(m.saved_bytes for m in cell) / num_micro
    # Back-propagating through layer j: the saved activations of layers up to j, plus j's
    # gradient temporaries as it frees its own, plus (deferring) the records of the layers
    # after j, which stay; the worst j is the cell's backward working set.
    backward_work = 0.0
    below, after = saved, 0.0
    for m in reversed(cell):
        temporaries = m.deferring_temporaries if defer else m.inline_temporaries
        backward_work = max(backward_work, below + temporaries / num_micro + after)
        below -= m.saved_bytes / num_micro
        after += m.deferred_bytes / num_micro if defer else 0.0
    largest_temporaries = max((m.temporaries for m in cell), default=0) / num_micro
    return _CellActivations(
        boundary_in=boundary_in,
        boundary_out=boundary_out,
        saved=saved,
        # Cell 0's micro-batch inputs are slices of the mini-batch its device already holds.
        kept_input=0.0 if k == 0 else boundary_in,
        inline_kept_input=0.0 if k == 0 or (cell and cell[0].saved_covers_input)
        else boundary_in,
        forward_work=max((m.saved_bytes for m in cell), default=0) / num_micro,
        backward_work=backward_work + boundary_out,
        # A re-computing call frees what it re-computed as its backward passes (profiled:
        # AmoebaNet K=4, T=4, device 1 held one of its cell's re-computed ReLU outputs at
        # its peak, at the call's end); deferring, it returns its records (the weight ops'
        # inputs, most of what it saved), so it holds all with every temporary.
        call_work=(saved + largest_temporaries if defer else backward_work) + boundary_out,
        records=sum(m.deferred_bytes for m in cell) / num_micro if defer else 0.0)


def device_memory(part: partition_lib.Partition, layers: Sequence[LayerMemory],
                  input_bytes: int, sched: schedule_lib.Schedule, remat: str,
                  num_slots: int = 1,
                  timeline: simulator.SimulatedStep | None = None,
                  batched_weight_grads: bool = False,
                  slot_shards: int = 1) -> list[DeviceMemory]:
    """Each device's predicted peak (one `DeviceMemory` per device of the schedule, not
    summed).

    Args:
      part: which layers each cell holds.
      layers: `layer_memory` of every layer, for the whole (per-replica) mini-batch.
      input_bytes: bytes of one (per-replica) mini-batch fed to cell 0.
      sched: the schedule; its per-device orders decide what is in flight (a device of the
        interleaved schedule walks the actions of all its cells).
      remat: re-materialisation policy ('always', 'except_last', 'never').
      num_slots: weight-sized optimizer slots per trainable weight (`optimizer_slots`).
      timeline: the schedule's simulated step (`simulator.simulate`). With it, a device also
        holds what it has received and not yet used: a receive lands when its sender's action
        ends, not when the device's own order reaches it (in 1F1B a device gets the next
        micro-batch's input while still running the backward before). Counted at the end of
        each of its actions; without a timeline, nothing arrives early.
      batched_weight_grads: `weight_gradients='batched'`: each backward's deferred weight
        gradients wait for the cell's one W after its last backward.
      slot_shards: the replicas the optimizer slots are sharded over (ZeRO-1,
        `train.shard_optimizer_state`): each device keeps 1/slot_shards of them.
    """
    if len(layers) != part.num_layers:
        raise ValueError(f"device_memory got {len(layers)} layers for a partition of "
                         f"{part.num_layers}.")
    if sched.num_cells != part.num_cells:
        raise ValueError(f"The schedule has {sched.num_cells} cells, the partition "
                         f"{part.num_cells}.")
    num_micro = sched.num_micro_batches
    recomputed = remat_lib.recomputed_actions(sched, remat)
    batched = batched_weight_grads and num_micro > 1 and not sched.splits_backward
    defer = sched.splits_backward or batched
    ranges = part.cell_layer_ranges
    sizes = [_cell_activations(k, layers[a:b],
                               input_bytes if k == 0 else layers[a - 1].out_bytes,
                               num_micro, defer)
             for k, (a, b) in enumerate(ranges)]
    out = []
    for d in range(sched.num_devices):
        cells = sched.cells_of_device(d)
        held = [m for k in cells for m in layers[ranges[k][0]:ranges[k][1]]]
        trainable = sum(m.trainable_bytes for m in held)
        order = sched.device_orders()[d]
        gradients_at = _gradient_bytes(order, cells, [layers[a:b] for a, b in ranges],
                                       num_micro, sched.splits_backward)
        last_backward = {action.cell: i for i, action in enumerate(order)
                         if action.phase is Phase.BACKWARD}
        landed = {k: (_landing_times(timeline, Phase.FORWARD, k - 1, num_micro),
                      _landing_times(timeline, Phase.BACKWARD, k + 1, num_micro))
                  for k in cells}
        forwards = dict.fromkeys(cells, 0)
        backwards = dict.fromkeys(cells, 0)
        kept = waiting = 0.0
        in_flight = peak_in_flight = 0
        # (kept, working, action, early, waiting records, gradients)
        peak: tuple[float, float, Any, float, float, int] = (0.0, 0.0, None, 0.0, 0.0, 0)
        stash: dict[tuple[int, int], float] = {}

        def consider(now: tuple[float, float, Any, float, float, int]) -> None:
            nonlocal peak
            if sum(now[i] for i in (0, 1, 3, 5)) > sum(peak[i] for i in (0, 1, 3, 5)):
                peak = now

        for i, action in enumerate(order):
            k, t = action.cell, action.micro_batch
            size = sizes[k]
            forwards[k] += action.phase is Phase.FORWARD
            backwards[k] += action.phase is Phase.BACKWARD
            early = 0.0
            if timeline is not None:  # Landed by the action's end, not yet used.
                end = timeline.end[action]
                for c in cells:
                    inputs_landed, gradients_landed = landed[c]
                    early += (sizes[c].boundary_in
                              * max(0, bisect.bisect_right(inputs_landed, end) - forwards[c])
                              + sizes[c].boundary_out
                              * max(0, bisect.bisect_right(gradients_landed, end)
                                    - backwards[c]))
            if action.phase is Phase.FORWARD:
                backward = schedule_lib.Action(Phase.BACKWARD, k, t)
                stash[(k, t)] = (size.kept_input if backward in recomputed
                                 else size.inline_kept_input + size.saved)
                kept += stash[(k, t)]
                in_flight += 1
                working = size.forward_work if backward in recomputed else 0.0
                consider((kept, working, action, early, waiting, gradients_at[i]))
            elif action.phase is Phase.BACKWARD:
                # A kept micro-batch's activations are already in `kept`; its records stay
                # until its W.
                working = (size.call_work if action in recomputed
                           else size.backward_work - size.saved)
                consider((kept, working, action, early, waiting, gradients_at[i]))
                kept += size.records - stash.pop((k, t))
                waiting += size.records
                in_flight -= 1
                if batched and i == last_backward[k]:
                    # The cell's W: all T micro-batches' records, and their concatenation.
                    consider((kept, size.records * num_micro, None, 0.0, waiting,
                              gradients_at[i]))
                    kept -= size.records * num_micro
                    waiting -= size.records * num_micro
            else:
                consider((kept, 0.0, action, early, waiting, gradients_at[i]))
                kept -= size.records
                waiting -= size.records
            peak_in_flight = max(peak_in_flight, in_flight)
        out.append(DeviceMemory(
            device=d, cells=tuple(cells), weights=sum(m.param_bytes for m in held),
            gradients=peak[5], optimizer_slots=-(-num_slots * trainable // slot_shards),
            inputs=int(input_bytes) if 0 in cells else 0,
            kept_activations=int(round(peak[0])), working_activations=int(round(peak[1])),
            peak_in_flight=peak_in_flight, peak_action=peak[2],
            received_early=int(round(peak[3])), waiting_records=int(round(peak[4]))))
    return out


def _gradient_bytes(order: Sequence[schedule_lib.Action], cells: Sequence[int],
                    cell_layers: Sequence[Sequence[LayerMemory]], num_micro: int,
                    splits_backward: bool) -> list[int]:
    """The weight-gradient bytes a device holds during each action of its `order`."""
    gradient_phase = Phase.WEIGHT if splits_backward else Phase.BACKWARD
    first_backward: dict[int, int] = {}
    last_gradient: dict[int, int] = {}
    for i, action in enumerate(order):
        if action.phase is Phase.BACKWARD:
            first_backward.setdefault(action.cell, i)
        if action.phase is gradient_phase:
            last_gradient[action.cell] = i
    trainable = {k: sum(m.trainable_bytes for m in cell_layers[k]) for k in cells}
    out = []
    for i in range(len(order)):
        started = [k for k in cells if first_backward.get(k, len(order)) <= i]
        running = [k for k in started if i <= last_gradient.get(k, -1)]
        sums = sum(trainable[k] for k in started)
        # With T > 1, a backward's new weight gradients stand beside the running sums until
        # they are added in; with T = 1 the gradients are the sums.
        out.append(sums + (sum(trainable[k] for k in running) if num_micro > 1 else 0))
    return out


def _landing_times(timeline: simulator.SimulatedStep | None, phase: Phase, cell: int,
                   num_micro_batches: int) -> list[float]:
    """When cell `cell`'s `phase` results reach its neighbour, sorted ([] without a timeline
    or such a cell)."""
    if timeline is None or not 0 <= cell < timeline.num_cells:
        return []
    return sorted(timeline.end[schedule_lib.Action(phase, cell, t)]
                  for t in range(num_micro_batches))


__all__ = ["LayerMemory", "DeviceMemory", "layer_memory", "optimizer_slots", "device_memory"]
