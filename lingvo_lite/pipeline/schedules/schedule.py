"""Explicit, inspectable pipeline schedules.

A schedule says, for every device of a pipeline of K cells (model chunks) on D devices running
T micro-batches, in which order that device runs its actions. From these per-device orders the
base class derives one global order that respects every data dependency (the executor walks
it to emit ops), a tick by tick timeline assuming unit time per action (the Gantt chart draws
it), and bubble and memory statistics (the planner compares schedules with them).

Cells and devices: cell k runs on device `device_of_cell(k)`. GPipe, 1F1B and zero-bubble put
one cell on each device (D = K, device k holds cell k); the interleaved schedule puts v cells on
each of its D devices (K = D x v, device d holds cells d, d + D, d + 2D, ...).

Dependencies, for cell k and micro-batch t:
  F(k, t) after F(k-1, t);
  B(k, t) after F(k, t) and after B(k+1, t) (the last cell's backward starts
  from its own forward output);
  W(k, t) after B(k, t) (only in schedules that split the backward).
In most schedules B is the whole backward: the input gradient and the weight gradient. A
schedule with `splits_backward` (zero-bubble) runs B as the input gradient only and W as the
weight gradient, so the input gradient can travel upstream without waiting for W. Backward
includes the re-computation of the forward when re-materialization is enabled, so it needs no
separate action.

Text form of the per-device orders (`Schedule.format_orders`; `custom_schedule` reads it back
and builds a schedule from it): one line per device, ``device <d>: <action> <action> ...``. An
action is ``<cell><phase><micro-batch>``, e.g. ``2F1`` is the forward of cell 2 on micro-batch 1
and ``0W3`` the weight gradient of cell 0 on micro-batch 3 (the cell first, as
torch.distributed.pipelining writes stage indices). On a device that holds one cell the cell
may be left out: ``F1`` is the forward of that device's cell.

Example:
    >>> sched = make_schedule('zero_bubble', 2, 2)
    >>> print(sched.format_orders())
    device 0: F0 F1 B0 W0 B1 W1
    device 1: F0 B0 F1 B1 W0 W1
    >>> sched.num_ticks()  # Cell 0 waits for B0 of cell 1 once: 6 actions + 1 idle tick.
    7
"""

from __future__ import annotations

import abc
import enum
import importlib
import operator
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "Action",
    "action_token",
    "dependencies",
    "GPipeSchedule",
    "InterleavedSchedule",
    "make_schedule",
    "OneFOneBSchedule",
    "Phase",
    "register",
    "Schedule",
    "schedule_classes",
    "schedule_for",
    "SCHEDULES",
    "ZeroBubbleSchedule",
]


class Phase(enum.Enum):
    """Forward, backward (the whole backward, or its input-gradient part) or weight gradient."""

    FORWARD = 'F'
    BACKWARD = 'B'
    WEIGHT = 'W'  # The weight-gradient part of a split backward.

    def _rank(self) -> int:
        return _PHASE_RANK[self.value]

    def __lt__(self, other):
        if not isinstance(other, Phase):
            return NotImplemented
        return self._rank() < other._rank()

    def __le__(self, other):
        if not isinstance(other, Phase):
            return NotImplemented
        return self._rank() <= other._rank()

    def __gt__(self, other):
        if not isinstance(other, Phase):
            return NotImplemented
        return self._rank() > other._rank()

    def __ge__(self, other):
        if not isinstance(other, Phase):
            return NotImplemented
        return self._rank() >= other._rank()

    # Members are singletons compared by identity; Enum's own hash (of the name, in Python)
    # dominated the planner's dictionary lookups of actions.
    __hash__ = object.__hash__


_PHASE_RANK = {'F': 0, 'B': 1, 'W': 2}


class Action(NamedTuple):
    """One unit of pipeline work: `phase` of cell `cell` on micro-batch `micro_batch`.

    Sorting orders forwards before backwards before weight gradients, then by cell, then by
    micro-batch. (A named tuple: the simulator and the planner hash millions of actions.)
    """

    phase: Phase
    cell: int
    micro_batch: int

    def __str__(self) -> str:
        return f'{self.phase.value}(k={self.cell},t={self.micro_batch})'


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f'{name} must be an int >= 1, got {value!r}')
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f'{name} must be an int >= 1, got {value!r}') from None
    if value < 1:
        raise ValueError(f'{name}={value} must be >= 1')
    return value


def dependencies(action: Action, num_cells: int) -> list[Action]:
    """The actions that must finish before `action` can start."""
    k, t = action.cell, action.micro_batch
    if action.phase is Phase.FORWARD:
        return [Action(Phase.FORWARD, k - 1, t)] if k > 0 else []
    if action.phase is Phase.WEIGHT:
        return [Action(Phase.BACKWARD, k, t)]
    deps = [Action(Phase.FORWARD, k, t)]
    if k < num_cells - 1:
        deps.append(Action(Phase.BACKWARD, k + 1, t))
    return deps


def action_token(action: Action, with_cell: bool = True) -> str:
    """The text form of `action`: '2F1' (cell 2, forward, micro-batch 1), or 'F1' without cell.

    >>> action_token(Action(Phase.WEIGHT, 3, 0)), action_token(Action(Phase.WEIGHT, 3, 0), False)
    ('3W0', 'W0')
    """
    cell = str(action.cell) if with_cell else ''
    return f'{cell}{action.phase.value}{action.micro_batch}'


class Schedule(abc.ABC):
    """A pipeline schedule defined by the order of actions on each device.

    Subclasses implement `cell_order` (one cell per device) or `device_order` (and
    `device_of_cell`, for several cells per device); everything else is derived by simulating
    clock ticks with unit time per action, where each device starts its next action as soon
    as the action's dependencies finished in earlier ticks.
    """

    name = ''
    # True when the backward is two actions: B (input gradient) and W (weight gradient).
    splits_backward = False
    # Whether --mode=plan's search tries the schedule (its time and memory are modelled).
    planned = True
    # Whether `micro_batch_loop=True` (two tf.while_loops instead of one op per action)
    # runs it.
    runs_in_micro_batch_loop = False

    def __init__(self, num_cells: int, num_micro_batches: int,
                 num_devices: int | None = None):
        self._num_cells = _check_count(num_cells, 'num_cells')
        self._num_micro_batches = _check_count(num_micro_batches, 'num_micro_batches')
        self._num_devices = (self._num_cells if num_devices is None
                             else _check_count(num_devices, 'num_devices'))
        self._timeline: list[list[Action | None]] | None = None
        self._device_orders: tuple[tuple[Action, ...], ...] | None = None

    @property
    def num_cells(self) -> int:
        return self._num_cells

    @property
    def num_micro_batches(self) -> int:
        return self._num_micro_batches

    @property
    def num_devices(self) -> int:
        return self._num_devices

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases every (cell, micro-batch) runs: F and B, plus W if the backward is split."""
        if self.splits_backward:
            return (Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT)
        return (Phase.FORWARD, Phase.BACKWARD)

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(num_cells={self.num_cells}, '
                f'num_micro_batches={self.num_micro_batches})')

    @classmethod
    def for_cells(cls, num_cells: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Schedule:
        """This schedule for a partition of `num_cells` cells: what `make_schedule` builds.

        The default puts one cell on each device and takes no virtual stages; a schedule with
        several cells per device overrides it.
        """
        v = _check_count(virtual_stages, 'virtual_stages')
        if v != 1:
            raise ValueError(f'virtual_stages={v} applies only to the interleaved schedule; set '
                             f'virtual_stages=1 for schedule {cls.name!r}, or use '
                             "schedule='interleaved'")
        return cls(num_cells, num_micro_batches)

    def device_of_cell(self, cell: int) -> int:
        """The device that runs cell `cell` (default: device k runs cell k)."""
        self._check_cell(cell)
        return cell

    @property
    def cell_devices(self) -> tuple[int, ...]:
        """`cell_devices[k]`: the device of cell k. The one placement rule: the pipeline puts
        cell k's variables and ops there, and every chart and analysis draws it there.

        >>> make_schedule('interleaved', 4, 2, virtual_stages=2).cell_devices
        (0, 1, 0, 1)
        """
        return tuple(self.device_of_cell(k) for k in range(self.num_cells))

    def cells_of_device(self, device: int) -> list[int]:
        """The cells device `device` holds, in increasing order."""
        self._check_device(device)
        return [k for k in range(self.num_cells) if self.device_of_cell(k) == device]

    def device_order(self, device: int) -> list[Action]:
        """The order in which device `device` runs the actions of all its cells.

        The default, for one cell per device, is `cell_order(device)`.
        """
        if type(self).cell_order is Schedule.cell_order:
            raise NotImplementedError(f'{type(self).__name__} must define cell_order or '
                                      'device_order')
        self._check_device(device)
        cells = self.cells_of_device(device)
        if len(cells) != 1:
            raise NotImplementedError(f'{type(self).__name__} puts {len(cells)} cells on '
                                      f'device {device}: it must define device_order')
        return self.cell_order(cells[0])

    def cell_order(self, cell: int) -> list[Action]:
        """The order in which cell `cell`'s actions run: its device's order, filtered to it."""
        if type(self).device_order is Schedule.device_order:
            raise NotImplementedError(f'{type(self).__name__} must define cell_order or '
                                      'device_order')
        self._check_cell(cell)
        return [a for a in self.device_orders()[self.device_of_cell(cell)] if a.cell == cell]

    def device_orders(self) -> tuple[tuple[Action, ...], ...]:
        """Every device's `device_order`, built once (a schedule never changes): what the
        simulator, the memory model and the planner walk, many times per schedule.

        >>> [len(order) for order in make_schedule('gpipe', 2, 3).device_orders()]
        [6, 6]
        """
        if self._device_orders is None:
            self._device_orders = tuple(tuple(self.device_order(d))
                                        for d in range(self.num_devices))
        return self._device_orders

    def _check_cell(self, cell: int) -> None:
        if isinstance(cell, bool) or not isinstance(cell, int) or not 0 <= cell < self.num_cells:
            raise ValueError(f'cell={cell!r} is out of range; valid cells are '
                             f'0..{self.num_cells - 1}')

    def _check_device(self, device: int) -> None:
        if (isinstance(device, bool) or not isinstance(device, int)
                or not 0 <= device < self.num_devices):
            raise ValueError(f'device={device!r} is out of range; valid devices are '
                             f'0..{self.num_devices - 1}')

    def _one_cell_per_device(self) -> bool:
        return (self.num_devices == self.num_cells
                and all(self.device_of_cell(k) == k for k in range(self.num_cells)))

    def _describe_cells(self, device: int) -> str:
        cells = self.cells_of_device(device)
        if len(cells) == 1:
            return f'cell {cells[0]}'
        return 'cells ' + ', '.join(str(k) for k in cells)

    def _order_problems(self) -> tuple[list[list[Action]], list[str]]:
        """Each device's order, and one line per action missing, repeated or misplaced."""
        orders, problems = [], []
        for d, order in enumerate(self.device_orders()):
            cells = self.cells_of_device(d)
            expected = {Action(p, k, t) for p in self.phases for k in cells
                        for t in range(self.num_micro_batches)}
            counts: dict[Action, int] = {}
            for a in order:
                if not isinstance(a, Action):
                    problems.append(f'device {d} runs {a!r}, which is not an Action')
                    continue
                counts[a] = counts.get(a, 0) + 1
                if counts[a] == 2:
                    problems.append(f'device {d} runs {a} more than once '
                                    f'({order.count(a)} times)')
                if a not in expected and counts[a] == 1:
                    problems.append(f'device {d} runs {a}, which does not belong to '
                                    f'{self._describe_cells(d)}: {self._where(a)}')
            missing = sorted(expected - set(counts))
            if missing:
                problems.append(f'device {d} misses {len(missing)} action(s): '
                                + ', '.join(str(a) for a in missing[:6])
                                + (', ...' if len(missing) > 6 else ''))
            orders.append(list(order))
        return orders, problems

    def _where(self, action: Action) -> str:
        if not 0 <= action.cell < self.num_cells:
            return f'the pipeline has cells 0..{self.num_cells - 1}'
        if not 0 <= action.micro_batch < self.num_micro_batches:
            return f'the step has micro-batches 0..{self.num_micro_batches - 1}'
        if action.phase not in self.phases:
            return f'{self.name or type(self).__name__} does not split the backward into B and W'
        return f'cell {action.cell} runs on device {self.device_of_cell(action.cell)}'

    def _label(self) -> str:
        return type(self).__name__

    def _simulate(self) -> list[list[Action | None]]:
        orders, problems = self._order_problems()
        if problems:
            raise ValueError('\n'.join(
                [f'{self._label()}: {len(problems)} problem(s) in the device orders:']
                + problems))
        finished: dict[Action, int] = {}
        position = [0] * self.num_devices
        remaining = sum(len(order) for order in orders)
        timeline = []
        tick = 0
        while remaining:
            row: list[Action | None] = []
            for d in range(self.num_devices):
                action = None
                if position[d] < len(orders[d]):
                    candidate = orders[d][position[d]]
                    if all(finished.get(dep, tick) < tick
                           for dep in dependencies(candidate, self.num_cells)):
                        action = candidate
                row.append(action)
            if all(a is None for a in row):
                raise ValueError(self._deadlock_message(orders, position, finished, tick))
            for d, action in enumerate(row):
                if action is not None:
                    finished[action] = tick
                    position[d] += 1
                    remaining -= 1
            timeline.append(row)
            tick += 1
        return timeline

    def _deadlock_message(self, orders: list[list[Action]], position: list[int],
                          finished: dict[Action, int], tick: int) -> str:
        stuck = []
        for d in range(self.num_devices):
            if position[d] < len(orders[d]):
                a = orders[d][position[d]]
                waits = [str(dep) for dep in dependencies(a, self.num_cells)
                         if dep not in finished]
                stuck.append(f'device {d} waits to run {a} (it needs {", ".join(waits)})')
        lines = [f'{self._label()} deadlocks at tick {tick}: ' + '; '.join(stuck)
                 + '; reorder the device orders so that dependencies can be met']
        lines.append('The device orders, stuck actions marked:')
        for d in range(self.num_devices):
            marks = {position[d]} if position[d] < len(orders[d]) else set()
            lines.append(self._format_device(d, orders[d], marks))
        return '\n'.join(lines)

    def _format_device(self, device: int, order: Sequence[Action],
                       marks: set[int] = frozenset()) -> str:
        with_cell = len(self.cells_of_device(device)) != 1
        tokens = []
        for i, a in enumerate(order):
            tokens.append(action_token(a, with_cell))
            if i in marks:
                tokens.append('<-- error here')
        return f'device {device}: ' + ' '.join(tokens)

    def validate(self) -> None:
        """Raises ValueError if device orders miss/duplicate/misplace actions or deadlock."""
        self._timeline = self._simulate()

    def timeline(self) -> list[list[Action | None]]:
        """timeline[tick][device]: the action that device runs at that tick (None = idle)."""
        if self._timeline is None:
            self._timeline = self._simulate()
        return [list(row) for row in self._timeline]

    def actions(self) -> list[Action]:
        """Every action once, in an order consistent with dependencies and device orders.

        It is the timeline flattened tick by tick (devices in increasing order within a tick).
        """
        return [a for row in self.timeline() for a in row if a is not None]

    def num_ticks(self) -> int:
        return len(self.timeline())

    def bubble_fraction(self) -> float:
        """Idle (device, tick) slots over all slots, with unit time per action."""
        rows = self.timeline()
        idle = sum(a is None for row in rows for a in row)
        return idle / (len(rows) * self.num_devices)

    def peak_in_flight(self, cell: int, until: Phase = Phase.BACKWARD) -> int:
        """Max number of micro-batches whose forward ran on `cell` but whose `until` has not.

        With `until`=BACKWARD (B) this bounds how many micro-batches' activations the cell
        keeps for its backward; with `until`=WEIGHT, how many micro-batches still hold
        something (in a split backward, the inputs and output gradients W needs). For a
        schedule that does not split the backward both are the same.
        """
        self._check_cell(cell)
        if until not in (Phase.BACKWARD, Phase.WEIGHT):
            raise ValueError(f'until={until!r}: use Phase.BACKWARD or Phase.WEIGHT')
        if not self.splits_backward:
            until = Phase.BACKWARD
        in_flight = peak = 0
        for a in self.cell_order(cell):
            if a.phase is Phase.FORWARD:
                in_flight += 1
            elif a.phase is until:
                in_flight -= 1
            peak = max(peak, in_flight)
        return peak

    def format_orders(self) -> str:
        """The per-device orders as text, one line per device (see the module docstring).

        `custom_schedule.parse_orders` reads it back; `custom_schedule.CustomSchedule`
        builds a schedule from it.
        """
        self._check_device(0)
        return '\n'.join(self._format_device(d, self.device_order(d))
                         for d in range(self.num_devices))

    def to_text(self) -> str:
        """An ASCII chart: a summary line, then one row per device and one column per tick.

        Entries are the phase and micro-batch (F3 = forward of micro-batch 3), preceded by
        the cell on devices that hold several cells (2F3), '..' marks an idle tick, e.g.
        ``cell 0 | F0 F1 .. B1 B0``. Rows are labelled 'cell k' when every device holds one
        cell (device k holds cell k), 'device d' otherwise.
        """
        rows = self.timeline()
        one_cell = self._one_cell_per_device()
        width = 1 + len(str(self.num_micro_batches - 1))
        if not one_cell:
            width += len(str(self.num_cells - 1))
        word = 'cell' if one_cell else 'device'
        label_width = len(f'{word} {self.num_devices - 1}')
        placement = '' if one_cell else f' on {self.num_devices} devices'
        lines = [f'{self.name or type(self).__name__}: {self.num_cells} cells{placement}, '
                 f'{self.num_micro_batches} micro-batches, {len(rows)} ticks, '
                 f'bubble {100.0 * self.bubble_fraction():.1f}%']
        for d in range(self.num_devices):
            entries = []
            for row in rows:
                a = row[d]
                if a is None:
                    entries.append('.' * width)
                else:
                    entries.append(action_token(a, not one_cell).ljust(width))
            lines.append(f'{f"{word} {d}":<{label_width}} | ' + ' '.join(entries))
        return '\n'.join(lines)


class GPipeSchedule(Schedule):
    """GPipe fill-drain: all forwards (t = 0..T-1), then all backwards (t = T-1..0)."""

    name = 'gpipe'
    runs_in_micro_batch_loop = True

    def cell_order(self, cell: int) -> list[Action]:
        self._check_cell(cell)
        T = self.num_micro_batches
        return ([Action(Phase.FORWARD, cell, t) for t in range(T)]
                + [Action(Phase.BACKWARD, cell, t) for t in reversed(range(T))])


def _one_f_one_b(cell: int, num_cells: int, num_micro_batches: int) -> list[Action]:
    """Cell `cell`'s 1F1B order of forwards and (input-gradient) backwards."""
    T = num_micro_batches
    warmup = min(num_cells - cell, T)
    order = [Action(Phase.FORWARD, cell, t) for t in range(warmup)]
    for i in range(T - warmup):
        order.append(Action(Phase.BACKWARD, cell, i))
        order.append(Action(Phase.FORWARD, cell, warmup + i))
    order.extend(Action(Phase.BACKWARD, cell, t) for t in range(T - warmup, T))
    return order


class OneFOneBSchedule(Schedule):
    """PipeDream-flush 1F1B: same gradients as GPipe, fewer activations in flight.

    Cell k runs w = min(K-k, T) warm-up forwards, then alternates one backward
    and one forward until the forwards are exhausted, then drains the remaining
    backwards. At most w micro-batches are in flight on cell k (GPipe: T).
    """

    name = '1f1b'

    def cell_order(self, cell: int) -> list[Action]:
        self._check_cell(cell)
        return _one_f_one_b(cell, self.num_cells, self.num_micro_batches)


class ZeroBubbleSchedule(Schedule):
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Figure 3 top).

    The backward is split into B (input gradient) and W (weight gradient). Cell k runs 1F1B's
    order of forwards and B's; the weight gradient of micro-batch t runs right after B of
    micro-batch t + k, and the last k weight gradients after the last B. The later cells,
    which wait least for their B's, hold their W's longest, so every cell has K micro-batches
    between their forward and their W, while the F/B order, and with it the activations kept
    for B (`peak_in_flight`), is 1F1B's. The first cell's idle time at the start of the
    drain is now filled by W's: with F, B and W each taking one unit the step takes
    3T + K - 1 units (bubble (K-1)(T_F + T_B - T_W)) instead of 1F1B's 3(T + K - 1).

    Example:
        >>> ZeroBubbleSchedule(3, 4).format_orders().splitlines()[2]
        'device 2: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3'
    """

    name = 'zero_bubble'
    splits_backward = True

    def cell_order(self, cell: int) -> list[Action]:
        self._check_cell(cell)
        T = self.num_micro_batches
        order = []
        for a in _one_f_one_b(cell, self.num_cells, T):
            order.append(a)
            if a.phase is Phase.BACKWARD and a.micro_batch >= cell:
                order.append(Action(Phase.WEIGHT, cell, a.micro_batch - cell))
        order.extend(Action(Phase.WEIGHT, cell, t) for t in range(max(T - cell, 0), T))
        return order


class InterleavedSchedule(Schedule):
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021): v cells per device.

    The model is cut into K = D x v cells (model chunks); device d holds cells d, d + D, ...
    (chunk j of device d is cell j D + d). Each device walks its v T forwards as "virtual
    micro-batches" in groups of D: the i-th forward is of chunk (i mod D v) div D on
    micro-batch (i div D v) D + i mod D, and the i-th backward likewise with the chunks in
    reverse. Device d runs min(2 (D-d-1) + (v-1) D, v T) warm-up forwards (all of them when
    T = D, as Megatron does), then alternates one forward and one backward, then drains the
    remaining backwards. With unit time per action the idle time of a device is 2 (D - 1)
    units over 2 v T units of work: the bubble is (D-1)/(v T) of the compute time, 1/v of
    1F1B's (D-1)/T. Megatron requires T to be a multiple of D.

    Example:
        >>> InterleavedSchedule(2, 2, virtual_stages=2).format_orders()
        'device 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\\ndevice 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1'
    """

    name = 'interleaved'

    def __init__(self, num_devices: int, num_micro_batches: int, virtual_stages: int = 2):
        num_devices = _check_count(num_devices, 'num_devices')
        v = _check_count(virtual_stages, 'virtual_stages')
        T = _check_count(num_micro_batches, 'num_micro_batches')
        if T % num_devices:
            lower = T - T % num_devices
            choices = (f'{lower} or {lower + num_devices}' if lower
                       else f'{num_devices}')
            raise ValueError(
                f'num_micro_batches={T} must be a multiple of the number of devices '
                f'({num_devices}) for the interleaved schedule (Megatron runs micro-batches '
                f'in groups of one per device); set num_micro_batches to {choices}')
        super().__init__(num_devices * v, T, num_devices)
        self._virtual_stages = v

    @classmethod
    def for_cells(cls, num_cells: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Schedule:
        v = _check_count(virtual_stages, 'virtual_stages')
        num_cells = _check_count(num_cells, 'num_cells')
        if num_cells % v:
            raise ValueError(f'virtual_stages={v} must divide the number of cells '
                             f'({num_cells}): the interleaved schedule puts virtual_stages '
                             'cells on each device')
        return cls(num_cells // v, num_micro_batches, virtual_stages=v)

    @property
    def virtual_stages(self) -> int:
        return self._virtual_stages

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(num_devices={self.num_devices}, '
                f'num_micro_batches={self.num_micro_batches}, '
                f'virtual_stages={self.virtual_stages})')

    def device_of_cell(self, cell: int) -> int:
        self._check_cell(cell)
        return cell % self.num_devices

    def device_order(self, device: int) -> list[Action]:
        self._check_device(device)
        D, v, T = self.num_devices, self.virtual_stages, self.num_micro_batches
        total = v * T
        if T == D:
            warmup = total
        else:
            warmup = min(2 * (D - device - 1) + (v - 1) * D, total)

        def action(i: int, phase: Phase) -> Action:
            group, r = divmod(i, D * v)
            chunk = r // D
            if phase is Phase.BACKWARD:
                chunk = v - 1 - chunk
            return Action(phase, chunk * D + device, group * D + r % D)

        order = [action(i, Phase.FORWARD) for i in range(warmup)]
        for i in range(total - warmup):
            order.append(action(warmup + i, Phase.FORWARD))
            order.append(action(i, Phase.BACKWARD))
        order.extend(action(i, Phase.BACKWARD) for i in range(total - warmup, total))
        return order


SCHEDULES: dict[str, type[Schedule]] = {
    GPipeSchedule.name: GPipeSchedule,
    OneFOneBSchedule.name: OneFOneBSchedule,
    InterleavedSchedule.name: InterleavedSchedule,
    ZeroBubbleSchedule.name: ZeroBubbleSchedule,
}

# Schedules defined in modules of their own, registered on first use (`register`).
_SCHEDULE_MODULES = (
    'lingvo_lite.pipeline.schedules.zbv_schedule',
)


def register(cls: type[Schedule]) -> type[Schedule]:
    """Class decorator: makes `cls` buildable by name (`make_schedule(cls.name, ...)`).

    A new schedule is one module: a `Schedule` subclass with a `name`, decorated with
    `@register`, and its module listed in `_SCHEDULE_MODULES`.
    """
    if not cls.name:
        raise ValueError(f'{cls.__name__} has no name; set the class attribute `name`')
    SCHEDULES[cls.name] = cls
    return cls


def schedule_classes() -> dict[str, type[Schedule]]:
    """Every registered schedule, by name (built-in ones and those of `_SCHEDULE_MODULES`).

    >>> list(schedule_classes())
    ['gpipe', '1f1b', 'interleaved', 'zero_bubble', 'zbv']
    """
    for module in _SCHEDULE_MODULES:
        importlib.import_module(module)
    return SCHEDULES


def planned_schedules() -> list[str]:
    """The registered schedules `--mode=plan` tries.

    >>> planned_schedules()
    ['gpipe', '1f1b', 'interleaved', 'zero_bubble', 'zbv']
    """
    return [name for name, cls in schedule_classes().items() if cls.planned]


def micro_batch_loop_schedules() -> list[str]:
    """The registered schedules `micro_batch_loop=True` runs.

    >>> micro_batch_loop_schedules()
    ['gpipe']
    """
    return [name for name, cls in schedule_classes().items() if cls.runs_in_micro_batch_loop]


def make_schedule(name: str, num_cells: int, num_micro_batches: int,
                  virtual_stages: int = 1) -> Schedule:
    """Builds the schedule called `name` (see `schedule_classes()` for the names).

    `num_cells` is always the number of cells (model chunks) the partition made, for every
    schedule: it is what PhaseCosts, the partition and profiler traces count. For
    'interleaved' those cells run on num_cells / virtual_stages devices, virtual_stages cells
    per device (device d holds cells d, d + D, ...); 'zbv' puts two cells on each device
    (device d holds cells d and 2D - 1 - d); the other schedules put one cell on each device
    and take virtual_stages=1.

    >>> make_schedule('interleaved', 8, 4, virtual_stages=2)
    InterleavedSchedule(num_devices=4, num_micro_batches=4, virtual_stages=2)
    """
    classes = schedule_classes()
    if name not in classes:
        raise ValueError(f'schedule name={name!r} is unknown; valid names: '
                         f'{", ".join(classes)}')
    return classes[name].for_cells(num_cells, num_micro_batches, virtual_stages)


def schedule_for(spec: str | Schedule, num_cells: int, num_micro_batches: int,
                 virtual_stages: int = 1) -> Schedule:
    """The schedule `spec` names (`make_schedule`), or `spec` itself when it is a Schedule
    built for `num_cells` cells and `num_micro_batches` micro-batches (one line otherwise).

    >>> schedule_for('gpipe', 2, 3).num_micro_batches
    3
    >>> schedule_for(make_schedule('1f1b', 2, 4), 2, 3)
    Traceback (most recent call last):
    ...
    ValueError: the schedule object was built for 4 micro-batches, but the step runs 3; \
build it for num_micro_batches=3 (or pass the schedule's name)
    """
    if isinstance(spec, Schedule):
        if virtual_stages != 1:
            raise ValueError(f'virtual_stages={virtual_stages} with a schedule object: the '
                             'object places its own cells; leave virtual_stages at 1')
        if spec.num_cells != num_cells:
            raise ValueError(f'the schedule object has {spec.num_cells} cells, but the '
                             f'partition made {num_cells}; set num_cells={spec.num_cells} '
                             '(or build the schedule for the partition)')
        if spec.num_micro_batches != num_micro_batches:
            raise ValueError(f'the schedule object was built for {spec.num_micro_batches} '
                             f'micro-batches, but the step runs {num_micro_batches}; build it '
                             f'for num_micro_batches={num_micro_batches} (or pass the '
                             "schedule's name)")
        return spec
    if not isinstance(spec, str):
        raise ValueError(f'schedule={spec!r}: give a schedule name '
                         f'({", ".join(schedule_classes())}) or a Schedule object')
    return make_schedule(spec, num_cells, num_micro_batches, virtual_stages)
