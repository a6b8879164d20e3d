"""Schedule simulator: a pipeline step's timeline from action durations, without running it.

A `Schedule` fixes the order of each device's actions; this module replays that order with
real durations. Every device runs its actions one after the other; an action starts once its
device has finished the previous one and every action it depends on has finished (plus a
transfer time when the dependency ran on another device). In a schedule that splits the
backward (zero-bubble), B takes the input-gradient share of the backward and W the weight
gradient share; re-computation, when re-materialising, is part of B. The result is when each
action starts and ends, the step time, and GPipe's Figure 4 breakdown (compute, recompute,
load imbalance, bubble) as `boxes.Breakdown` defines it for measured steps, so prediction
and measurement read the same way.

It costs O(K x T) after the schedule's own ordering, so K = 128 cells and T = 512
micro-batches take seconds. Each device is assumed to run on hardware of its own; a different
model of how devices share hardware replaces the replay (`simulate(..., replay=...)`; the
benchmarks' `bench/shared_processors.py` replays logical CPU devices time-sharing a host's
cores).

>>> from lingvo_lite.analysis import simulator
>>> from lingvo_lite.pipeline.schedules import schedule
>>> gpipe = schedule.make_schedule("gpipe", 4, 8)
>>> costs = simulator.PhaseCosts.uniform(4, forward=1.0, backward=2.0)
>>> step = simulator.simulate(gpipe, costs, remat="never")
>>> step.step_time  # (T + K - 1) x (forward + backward)
33.0
>>> round(step.breakdown().bubble, 4)  # (K - 1) / (T + K - 1) = 3 / 11
0.2727
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from lingvo_lite.analysis import boxes
from lingvo_lite.pipeline import remat as remat_lib
from lingvo_lite.pipeline.partition import partition as partition_lib
from lingvo_lite.pipeline.schedules import schedule as schedule_lib
from lingvo_lite.pipeline.schedules.schedule import Action, Phase

# Backward time / forward time when nothing better is known: a matmul's input gradient and
# weight gradient each cost about one forward. The one definition the planner, the
# predictions of `predict` and the benchmarks' time model use.
BACKWARD_RATIO = 2.0


@dataclasses.dataclass(frozen=True)
class PhaseCosts:
    """Seconds per micro-batch of each cell's phases, and of one boundary crossing.

    `backward[k]` is the whole backward (input and weight gradient) and excludes
    re-computation; a recomputed backward also takes `forward[k]` (the re-run forward).
    `weight[k]` is the weight-gradient share of `backward[k]` (default: half of it, as for a
    matmul, whose input and weight gradients each cost one forward): a schedule that splits
    the backward runs B for backward - weight and W for weight, so B + W is the old backward.
    `transfer` is added between a dependency on another device and the action that needs it
    (activations forward, their gradient backward).
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    transfer: float = 0.0
    weight: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.forward) != len(self.backward) or not self.forward:
            raise ValueError("PhaseCosts needs one forward and one backward cost per cell; got "
                             f"{len(self.forward)} and {len(self.backward)}.")
        if min(self.forward + self.backward + (self.transfer,)) < 0:
            raise ValueError("PhaseCosts: durations must be >= 0.")
        if self.weight is not None:
            if len(self.weight) != len(self.backward):
                raise ValueError(f"PhaseCosts needs one weight cost per cell; got "
                                 f"{len(self.weight)} for {len(self.backward)} cells.")
            if any(not 0 <= w <= b for w, b in zip(self.weight, self.backward)):
                raise ValueError("PhaseCosts: weight[k] is the weight-gradient share of "
                                 "backward[k]; it must be >= 0 and <= backward[k].")

    @property
    def weight_costs(self) -> tuple[float, ...]:
        """W's duration per cell: `weight`, or half of the backward if not given."""
        if self.weight is None:
            return tuple(b / 2 for b in self.backward)
        return self.weight

    @property
    def num_cells(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(cls, num_cells: int, forward: float, backward: float,
                transfer: float = 0.0, weight: float | None = None) -> PhaseCosts:
        """Every cell alike (a perfectly balanced partition)."""
        return cls((forward,) * num_cells, (backward,) * num_cells, transfer,
                   None if weight is None else (weight,) * num_cells)

    @classmethod
    def from_cell_costs(cls, cell_forward: Sequence[float],
                        backward_ratio: float = BACKWARD_RATIO,
                        transfer: float = 0.0) -> PhaseCosts:
        """From each cell's forward time; backward = `backward_ratio` x forward
        (`BACKWARD_RATIO` by default)."""
        forward = tuple(float(c) for c in cell_forward)
        return cls(forward, tuple(backward_ratio * c for c in forward), transfer)


@dataclasses.dataclass(frozen=True)
class SimulatedStep:
    """The replayed step: when each action ran on its device, and what that adds up to."""

    schedule: schedule_lib.Schedule
    remat: str
    start: dict[Action, float]
    end: dict[Action, float]
    recomputed: frozenset[Action]
    recompute_time: tuple[float, ...]  # Per device: time spent re-running forwards.
    setup_time: float = 0.0
    update_time: float = 0.0

    @property
    def num_cells(self) -> int:
        return self.schedule.num_cells

    @property
    def num_devices(self) -> int:
        return self.schedule.num_devices

    @property
    def pipeline_time(self) -> float:
        """First action start to last action end."""
        return max(self.end.values()) - min(self.start.values())

    @property
    def step_time(self) -> float:
        return self.setup_time + self.pipeline_time + self.update_time

    def busy_time(self, cell: int) -> float:
        """Time cell `cell`'s actions ran."""
        return sum(self.end[a] - self.start[a] for a in self.schedule.cell_order(cell))

    def device_busy_time(self, device: int) -> float:
        """Time device `device` ran actions of any of its cells."""
        return sum(self.end[a] - self.start[a] for a in self._device_order(device))

    def device_timeline(self, device: int) -> list[tuple[Action, float, float]]:
        """(action, start, end) of each action of `device`, in its order."""
        return [(a, self.start[a], self.end[a]) for a in self._device_order(device)]

    def _device_order(self, device: int) -> tuple[Action, ...]:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device={device} is out of range; the schedule has devices "
                             f"0..{self.num_devices - 1}.")
        return self.schedule.device_orders()[device]

    def breakdown(self) -> boxes.Breakdown:
        """GPipe's Figure 4 split of the step, per device (as a measured step's is defined)."""
        k = self.num_devices
        step = max(self.step_time, 1e-30)
        pipe = max(self.pipeline_time, 1e-30)
        busy = [self.device_busy_time(d) for d in range(k)]
        mean_busy, mean_rec = sum(busy) / k, sum(self.recompute_time) / k
        return boxes.Breakdown(
            step_ns=int(round(self.step_time * 1e9)),
            setup=self.setup_time / step,
            compute=(mean_busy - mean_rec) / step,
            recompute=mean_rec / step,
            load_imbalance=(max(busy) - mean_busy) / step,
            bubble=(self.pipeline_time - max(busy)) / step,
            weight_update=self.update_time / step,
            device_busy=tuple(b / step for b in busy),
            device_idle_in_pipeline=tuple(1.0 - b / pipe for b in busy),
        )


# How a replay runs a schedule: (schedule, duration of each action, transfer time, setup time,
# each device's update time) -> (start and end of each action, when each device finished its
# update). `replay_devices_alone` is the default.
Replay = Callable[[schedule_lib.Schedule, Callable[[Action], float], float, float,
                   Sequence[float]], tuple[dict[Action, float], dict[Action, float], list[float]]]


def simulate(sched: schedule_lib.Schedule, costs: PhaseCosts | Callable[[Action], float],
             remat: str = "except_last", transfer: float | None = None,
             setup_time: float = 0.0,
             update_time: float | Sequence[float] = 0.0,
             replay: Replay | None = None) -> SimulatedStep:
    """Replays `sched` with the given durations.

    Args:
      sched: the schedule (its per-device orders are what each device runs).
      costs: `PhaseCosts`, or a function giving any action's duration in seconds (then
        re-materialisation is whatever that function includes, and `remat` only labels
        the recompute share).
      remat: re-materialisation policy: which backwards re-run their forward.
      transfer: seconds per boundary crossing (default: `costs.transfer`, else 0).
      setup_time: time before the first action (input feeding), added to the step.
      update_time: the optimizer's update: one time after the last action, or one per
        device, each starting when that device's last action ends (a device updates its
        own weights while others still run); the step ends with the last update. The
        step's `update_time` is what the updates add after the last action.
      replay: how the devices run the schedule (see `Replay`); default
        `replay_devices_alone`: each device on hardware of its own, every action taking its
        duration.
    """
    recomputed = remat_lib.recomputed_actions(sched, remat)
    if isinstance(costs, PhaseCosts):
        if costs.num_cells != sched.num_cells:
            raise ValueError(f"PhaseCosts has {costs.num_cells} cells, the schedule "
                             f"{sched.num_cells}.")
        transfer = costs.transfer if transfer is None else transfer

        weight = costs.weight_costs

        def duration(a: Action) -> float:
            if a.phase is Phase.FORWARD:
                return costs.forward[a.cell]
            if a.phase is Phase.WEIGHT:
                return weight[a.cell]
            backward = costs.backward[a.cell] - (weight[a.cell] if sched.splits_backward
                                                 else 0.0)
            return backward + (costs.forward[a.cell] if a in recomputed else 0.0)

        def recompute_of(a: Action) -> float:
            return costs.forward[a.cell] if a in recomputed else 0.0
    else:
        duration = costs
        transfer = transfer or 0.0

        def recompute_of(a: Action) -> float:
            return 0.0

    per_device_update = (None if isinstance(update_time, (int, float))
                         else list(update_time))
    if per_device_update is not None and len(per_device_update) != sched.num_devices:
        raise ValueError(f"update_time has {len(per_device_update)} per-device times, the "
                         f"schedule {sched.num_devices} devices.")
    start, end, device_free = (replay or replay_devices_alone)(
        sched, duration, transfer, setup_time, per_device_update or [0.0] * sched.num_devices)
    recompute_time = [0.0] * sched.num_devices
    for a in start:
        recompute_time[sched.device_of_cell(a.cell)] += recompute_of(a)
    if per_device_update is not None:
        update_time = max(0.0, max(device_free) - max(end.values(), default=setup_time))
    return SimulatedStep(schedule=sched, remat=remat, start=start, end=end,
                         recomputed=recomputed, recompute_time=tuple(recompute_time),
                         setup_time=setup_time, update_time=update_time)


def replay_devices_alone(sched: schedule_lib.Schedule, duration: Callable[[Action], float],
                         transfer: float, setup_time: float, update: Sequence[float]
                         ) -> tuple[dict[Action, float], dict[Action, float], list[float]]:
    """The default `Replay`: each device runs its order one action after the other, an action
    starting once its device is free and its inputs are ready; a device runs its update
    (`update[device]`) after its last action."""
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    device_free = [setup_time] * sched.num_devices
    device = sched.cell_devices
    # The unit-time order respects every dependency and each device's order, so each
    # action's predecessors are final when it is reached.
    for a in sched.actions():
        dev = device[a.cell]
        start[a] = max(device_free[dev], inputs_ready(a, end, transfer, device))
        end[a] = start[a] + duration(a)
        device_free[dev] = end[a]
    return start, end, [f + u for f, u in zip(device_free, update)]


def inputs_ready(action: Action, end: dict[Action, float], transfer: float,
                 device: Sequence[int]) -> float | None:
    """When all of `action`'s dependencies have ended (plus `transfer` from another device;
    `device[k]` runs cell k); None while one has not."""
    dev = device[action.cell]
    ready = 0.0
    for d in schedule_lib.dependencies(action, len(device)):
        if d not in end:
            return None
        ready = max(ready, end[d] + (transfer if device[d.cell] != dev else 0.0))
    return ready


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A pipeline configuration's simulated step, and the one-device step it replaces."""

    step: SimulatedStep
    one_device_time: float  # Every layer's forward and backward on one device, no recompute.

    @property
    def speedup(self) -> float:
        return self.one_device_time / max(self.step.step_time, 1e-30)

    def summary(self) -> str:
        b = self.step.breakdown()
        sched = self.step.schedule
        devices = ("" if sched.num_devices == sched.num_cells
                   else f" on {sched.num_devices} devices")
        return (f"K={sched.num_cells}{devices}, T={sched.num_micro_batches}, {sched.name}, "
                f"remat={self.step.remat}: bubble {b.bubble:.1%}, load imbalance "
                f"{b.load_imbalance:.1%}, recompute {b.recompute:.1%}; "
                f"{self.speedup:.2f}x the one-device step (ideal {sched.num_devices}x)")


def predict(partition: partition_lib.Partition, layer_costs: Sequence[float],
            num_micro_batches: int, schedule: str | schedule_lib.Schedule = "gpipe",
            remat: str = "except_last", backward_ratio: float = BACKWARD_RATIO,
            transfer: float = 0.0, virtual_stages: int = 1) -> Prediction:
    """The simulated step of `partition` with T micro-batches.

    Args:
      partition: which layers each cell holds.
      layer_costs: each layer's forward time on the whole mini-batch (any unit, e.g. FLOPs
        over a device's FLOP/s); a micro-batch costs 1/T of it.
      num_micro_batches: T.
      schedule, remat: as in PipeliningLayer: a schedule's name or a Schedule object (built
        for the partition's cells and T; it places the cells on its devices).
      backward_ratio: backward time / forward time (`BACKWARD_RATIO`).
      transfer: time per boundary crossing, in the unit of `layer_costs`.
      virtual_stages: for a name: cells per device of the interleaved schedule
        (`schedule_for`).
    """
    if len(layer_costs) != partition.num_layers:
        raise ValueError(f"predict got {len(layer_costs)} layer costs for a partition of "
                         f"{partition.num_layers} layers.")
    cell_forward = [sum(layer_costs[a:b]) / num_micro_batches
                    for a, b in partition.cell_layer_ranges]
    costs = PhaseCosts.from_cell_costs(cell_forward, backward_ratio, transfer)
    sched = schedule_lib.schedule_for(schedule, partition.num_cells, num_micro_batches,
                                      virtual_stages)
    step = simulate(sched, costs, remat=remat)
    return Prediction(step=step, one_device_time=(1.0 + backward_ratio) * sum(layer_costs))


__all__ = ["BACKWARD_RATIO", "inputs_ready", "PhaseCosts", "Prediction", "predict", "Replay",
           "replay_devices_alone", "SimulatedStep", "simulate"]
