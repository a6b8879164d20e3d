"""Devices time-sharing a CPU host's cores: a replay of a schedule for the time model.

Logical CPU devices own no processor: K serial devices on a host with fewer cores time-share
them, and cores sharing one memory system slow each other down. Neither happens on
accelerators with a processor and memory each, so this model lives with the benchmarks that
measure such hosts, not in `lingvo_lite.analysis`. It plugs into the simulator as its replay:

    >>> from lingvo_lite.analysis import simulator
    >>> from lingvo_lite.pipeline.schedules import schedule
    >>> sched = schedule.make_schedule("gpipe", 2, 2)
    >>> costs = simulator.PhaseCosts.uniform(2, forward=1.0, backward=2.0)
    >>> simulator.simulate(sched, costs, remat="never", replay=replay(processors=1)).step_time
    12.0

With n > processors running actions, each progresses at processors / n of its speed (the
cores are time-shared equally); `CoRunSlowdown` says how much slower each job runs while other
processors are busy (measured by timing a call beside a copy of itself).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lingvo_lite.analysis import simulator  # noqa: E402
from lingvo_lite.pipeline.schedules import schedule as schedule_lib  # noqa: E402
from lingvo_lite.pipeline.schedules.schedule import Action  # noqa: E402

__all__ = ["CoRunSlowdown", "replay", "replay_on_shared_processors"]


@dataclasses.dataclass(frozen=True)
class CoRunSlowdown:
    """How much longer each job takes while it shares the host with others.

    Processors on one host share its memory bandwidth and caches: a memory-bound job (a
    weight-sized gradient written for a few rows) can take 1.4x its time alone while the
    other core runs one like it, where a compute-bound one takes 1.0x. `actions(a)` is action
    a's factor beside a copy of itself (its duration run so, over its duration alone),
    `updates[d]` that of device d's update. Two different jobs a and b slow each other by the
    geometric mean of their excesses, 1 + sqrt((s_a - 1)(s_b - 1)): a job beside a copy of
    itself takes its own factor, beside a compute-bound one (s = 1) its time alone. With b
    processors busy, a job meets b - 1 of the others running at a time (time-shared equally
    when more run than there are processors), each adding its share.
    """

    actions: Callable[[Action], float]
    updates: Sequence[float] = ()

    def excess(self, job: Action | None, device: int) -> float:
        """`job`'s factor beside a copy of itself, less 1 (None: `device`'s update)."""
        if job is None:
            return max(0.0, (self.updates[device] if self.updates else 1.0) - 1.0)
        return max(0.0, self.actions(job) - 1.0)

    def factors(self, running: dict[int, Action | None], processors: int) -> dict[int, float]:
        """The slowdown of each running job (`running`: device -> its action, None for its
        update)."""
        if len(running) < 2:
            return {dev: 1.0 for dev in running}
        roots = {dev: self.excess(job, dev) ** 0.5 for dev, job in running.items()}
        total = sum(roots.values())
        # Each meets `partners` of the others at a time: their mean sqrt(excess x excess).
        partners = min(len(running), processors) - 1
        return {dev: 1.0 + partners * root * (total - root) / (len(running) - 1)
                for dev, root in roots.items()}


def replay(processors: int | None, co_run_slowdown: CoRunSlowdown | None = None
           ) -> simulator.Replay | None:
    """The simulator's replay (`simulate(..., replay=...)`) for devices sharing `processors`
    cores: None (the simulator's default, each device alone) when `processors` is None, or
    when there are enough of them and no co-run slowdown."""
    if processors is not None and processors < 1:
        raise ValueError(f"processors={processors}: it must be >= 1 (or None: one per device).")
    if processors is None:
        if co_run_slowdown is not None:
            raise ValueError("co_run_slowdown needs processors= (how many jobs share the host "
                             "at full speed).")
        return None

    def run(sched: schedule_lib.Schedule, duration: Callable[[Action], float], transfer: float,
            setup_time: float, update: Sequence[float]):
        if co_run_slowdown is not None and co_run_slowdown.updates \
                and len(co_run_slowdown.updates) != sched.num_devices:
            raise ValueError(f"co_run_slowdown has {len(co_run_slowdown.updates)} update "
                             f"factors, the schedule {sched.num_devices} devices.")
        if processors >= sched.num_devices and co_run_slowdown is None:
            return simulator.replay_devices_alone(sched, duration, transfer, setup_time, update)
        return replay_on_shared_processors(sched, duration, transfer, setup_time, update,
                                           processors, co_run_slowdown)
    return run


def replay_on_shared_processors(sched: schedule_lib.Schedule,
                                duration: Callable[[Action], float], transfer: float,
                                setup_time: float, update: Sequence[float], processors: int,
                                slowdown: CoRunSlowdown | None = None
                                ) -> tuple[dict[Action, float], dict[Action, float], list[float]]:
    """A `simulator.Replay` for devices time-sharing `processors` cores (processor sharing).

    Event by event: at each instant, the running actions (at most one per device) each
    progress at min(1, processors / running) of their speed, divided by their `slowdown`
    factor for the processors busy; the next event is the first completion or the first
    moment a waiting action's inputs are ready. After its last action, a device runs its
    update (`update[device]`), which also takes its share. Returns each action's start and
    end, and when each device finished its update.
    """
    num_devices = sched.num_devices
    orders = sched.device_orders()
    device = sched.cell_devices
    position = [0] * num_devices
    running: dict[int, list] = {}  # device -> [action or None (its update), remaining work]
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    finished = [setup_time] * num_devices
    done = [False] * num_devices
    now = setup_time

    def ready_time(dev: int) -> float | None:
        """When `dev`'s next job can start (None: it waits on an action not finished)."""
        if position[dev] == len(orders[dev]):
            return finished[dev]  # Its update, right after its last action.
        inputs = simulator.inputs_ready(orders[dev][position[dev]], end, transfer, device)
        return None if inputs is None else max(finished[dev], inputs)

    while not all(done):
        waiting = {}
        for dev in range(num_devices):
            if dev in running or done[dev]:
                continue
            ready = ready_time(dev)
            if ready is None:
                continue
            if ready <= now:
                if position[dev] < len(orders[dev]):
                    a = orders[dev][position[dev]]
                    start[a] = now
                    running[dev] = [a, duration(a)]
                else:
                    running[dev] = [None, update[dev]]
            else:
                waiting[dev] = ready
        share = min(1.0, processors / len(running)) if running else 1.0
        factor = (slowdown.factors({dev: job[0] for dev, job in running.items()}, processors)
                  if slowdown else {})
        rate = {dev: share / factor.get(dev, 1.0) for dev in running}
        next_event = min(list(waiting.values())
                         + [now + job[1] / rate[dev] for dev, job in running.items()],
                         default=None)
        if next_event is None:
            raise RuntimeError(f"{sched!r}: the replay found no action that can run.")
        for dev in list(running):
            job = running[dev]
            job[1] -= (next_event - now) * rate[dev]
            if job[1] <= 1e-12 * max(1.0, next_event):
                del running[dev]
                finished[dev] = next_event
                if job[0] is None:
                    done[dev] = True
                else:
                    end[job[0]] = next_event
                    position[dev] += 1
        now = next_event
    return start, end, finished
