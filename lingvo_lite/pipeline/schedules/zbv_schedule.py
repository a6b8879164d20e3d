"""ZB-V: the V-shaped zero-bubble schedule (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

The model is cut into 2D cells on D devices, and device d holds cells d and 2D-1-d: a
micro-batch's forward runs down the devices (cells 0..D-1) and back up (cells D..2D-1), so the
last cell sits on device 0 beside the first and the backward starts where the forward began.
Each backward is split into B (input gradient) and W (weight gradient), as in ZB-H1.

Each device's order is built by a unit-time list schedule, as the paper's schedules are: at
every tick a device runs a ready B if it has one (it unblocks the devices upstream), else a
ready F if fewer than 2D forwards await their B on it (1F1B's activation memory: D
micro-batches of a whole stage, here 2D half-stage cells), else a pending W (which fills what
would be a bubble), else waits. Among ready B's and F's the earliest micro-batch goes first,
then the later cell (which is closer to its backward).

Example:
    >>> sched = ZeroBubbleVSchedule(4, 4)  # 4 cells on 2 devices.
    >>> sched.cell_devices
    (0, 1, 1, 0)
    >>> for line in sched.format_orders().splitlines():
    ...     print(line[:45])
    device 0: 0F0 0F1 0F2 3F0 3B0 3F1 3B1 0B0 0F3
    device 1: 1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1 1F2
"""

from __future__ import annotations

from lingvo_lite.pipeline.schedules import schedule
from lingvo_lite.pipeline.schedules.schedule import Action, Phase

__all__ = ["ZeroBubbleVSchedule"]


@schedule.register
class ZeroBubbleVSchedule(schedule.Schedule):
    """ZB-V on `num_cells` = 2D cells: device d holds cells d and 2D-1-d (see the module doc)."""

    name = "zbv"
    splits_backward = True

    def __init__(self, num_cells: int, num_micro_batches: int):
        if isinstance(num_cells, int) and num_cells % 2:
            raise ValueError(f"num_cells={num_cells}: the zbv schedule puts two cells on each "
                             "device (a V); set num_cells to an even number (2 x devices)")
        super().__init__(num_cells, num_micro_batches, num_cells // 2)
        self._orders = _list_schedule(self.num_devices, self.num_micro_batches)

    @classmethod
    def for_cells(cls, num_cells: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> schedule.Schedule:
        if virtual_stages not in (1, 2):
            raise ValueError(f"virtual_stages={virtual_stages}: the zbv schedule always puts "
                             "two cells on each device; leave virtual_stages at 1")
        return cls(num_cells, num_micro_batches)

    def device_of_cell(self, cell: int) -> int:
        self._check_cell(cell)
        return cell if cell < self.num_devices else self.num_cells - 1 - cell

    def device_order(self, device: int) -> list[Action]:
        self._check_device(device)
        return list(self._orders[device])


def _list_schedule(num_devices: int, num_micro_batches: int) -> list[list[Action]]:
    """Each device's order from the unit-time list schedule of the module doc."""
    D, T = num_devices, num_micro_batches
    last_cell = 2 * D - 1
    finished: dict[Action, int] = {}  # Action -> the tick it ran in.
    next_forward = [0] * (2 * D)  # Per cell: the next micro-batch to run forward / backward.
    next_backward = [0] * (2 * D)
    waiting_weights: list[list[Action]] = [[] for _ in range(D)]
    in_flight = [0] * D
    orders: list[list[Action]] = [[] for _ in range(D)]

    def done_before(action: Action, tick: int) -> bool:
        return finished.get(action, tick) < tick

    tick = 0
    while sum(len(o) for o in orders) < 3 * 2 * D * T:
        for d in range(D):
            cells = (last_cell - d, d)  # The later cell first.
            ready_b = [Action(Phase.BACKWARD, k, next_backward[k]) for k in cells
                       if next_backward[k] < T
                       and done_before(Action(Phase.FORWARD, k, next_backward[k]), tick)
                       and (k == last_cell or done_before(
                           Action(Phase.BACKWARD, k + 1, next_backward[k]), tick))]
            ready_f = [Action(Phase.FORWARD, k, next_forward[k]) for k in cells
                       if next_forward[k] < T
                       and (k == 0 or done_before(Action(Phase.FORWARD, k - 1, next_forward[k]),
                                                  tick))]
            if ready_b:
                action = min(ready_b, key=lambda a: a.micro_batch)
                next_backward[action.cell] += 1
                in_flight[d] -= 1
                waiting_weights[d].append(Action(Phase.WEIGHT, action.cell, action.micro_batch))
            elif ready_f and in_flight[d] < 2 * D:
                action = min(ready_f, key=lambda a: a.micro_batch)
                next_forward[action.cell] += 1
                in_flight[d] += 1
            elif waiting_weights[d]:
                action = waiting_weights[d].pop(0)
            else:
                continue
            finished[action] = tick
            orders[d].append(action)
        tick += 1
    return orders
