"""Schedules written by hand: the text form of per-device orders, read back and checked.

A user (or a test) writes each device's order as one line, ``device <d>: <action> ...``, in the
notation `Schedule.format_orders` prints (see `schedule`): ``<cell><F|B|W><micro-batch>``, such
as ``2F1``, or ``F1`` on a device that holds one cell. `parse_orders` reads the lines back;
`CustomSchedule` builds a schedule from them and checks it at once, reporting every problem on a
line of its own (an action missing, repeated, on a device its cell is not on; a line it cannot
read) and, on a deadlock, the orders with the stuck actions marked ``<-- error here``, as
torch.distributed.pipelining does. For example, 1F1B on two cells with two micro-batches::

    device 0: F0 F1 B0 B1
    device 1: F0 B0 F1 B1

Example:
    >>> sched = CustomSchedule('device 0: F0 B0 W0\\ndevice 1: F0 B0 W0')
    >>> sched.splits_backward, sched.num_ticks()
    (True, 5)
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

from lingvo_lite.pipeline.schedules.schedule import Action, Phase, Schedule

__all__ = ["CustomSchedule", "parse_orders"]

_LINE = re.compile(r'^device\s+(?P<device>\d+)\s*:(?P<actions>.*)$')
_TOKEN = re.compile(r'^(?P<cell>\d+)?(?P<phase>[FBW])(?P<t>\d+)$')


def _parse(text: str, device_of_cell: Sequence[int] | None
           ) -> tuple[list[list[Action]], tuple[int, ...], list[str]]:
    """(orders, each cell's device, one line per syntax problem) of the text form."""
    problems: list[str] = []
    raw: dict[int, list[tuple[int | None, Phase, int, str]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            problems.append(f'line {number}: expected "device <d>: <actions>", got {line!r}')
            continue
        d = int(m.group('device'))
        if d in raw:
            problems.append(f'line {number}: device {d} is listed twice')
            continue
        raw[d] = []
        for token in m.group('actions').split():
            t = _TOKEN.match(token)
            if t is None:
                problems.append(
                    f'line {number}: cannot read {token!r}; write <cell><F|B|W><micro-batch> '
                    'such as 0F3, or <F|B|W><micro-batch> such as F3 on a device holding '
                    'one cell')
                continue
            cell = None if t.group('cell') is None else int(t.group('cell'))
            raw[d].append((cell, Phase(t.group('phase')), int(t.group('t')), token))
    num_devices = len(raw)
    if raw and sorted(raw) != list(range(num_devices)):
        absent = sorted(set(range(max(raw) + 1)) - set(raw))
        problems.append(f'devices must be numbered 0..{num_devices - 1} with one line each; '
                        f'device(s) {", ".join(map(str, absent))} have no line')
    if not raw and not problems:
        problems.append('no device lines: write one "device <d>: <actions>" line per device')
    if device_of_cell is None:
        listed = max(raw, default=0) + 1
        cells = [c for entries in raw.values() for c, *_ in entries if c is not None]
        num_cells = max([listed] + [c + 1 for c in cells])
        placement = tuple(k % listed for k in range(num_cells))
    else:
        placement = tuple(operator.index(d) for d in device_of_cell)
    orders: list[list[Action]] = []
    for d in range(max(raw, default=-1) + 1):
        order = []
        on_device = [k for k, dev in enumerate(placement) if dev == d]
        for cell, phase, t, token in raw.get(d, []):
            if cell is None:
                if len(on_device) != 1:
                    held = ', '.join(map(str, on_device)) or 'none'
                    problems.append(f'device {d}: {token!r} does not say its cell and device '
                                    f'{d} holds cells {held}; write it as <cell>{token}')
                    continue
                cell = on_device[0]
            order.append(Action(phase, cell, t))
        orders.append(order)
    return orders, placement, problems


def parse_orders(text: str, device_of_cell: Sequence[int] | None = None) -> list[list[Action]]:
    """The per-device action lists of the text form (see the module docstring).

    Args:
      text: one ``device <d>: <actions>`` line per device; blank lines and ``#`` comments
        are skipped.
      device_of_cell: device_of_cell[k] is cell k's device. Default: cell k on device
        k mod D (D devices listed), which is one cell per device when no action names a
        cell beyond D-1, and the interleaved placement otherwise.

    Returns:
      orders[d]: device d's actions in order.

    Raises ValueError with one line per problem.

    >>> parse_orders('device 0: F0 B0\\ndevice 1: F0 B0')[1]
    [Action(phase=<Phase.FORWARD: 'F'>, cell=1, micro_batch=0), \
Action(phase=<Phase.BACKWARD: 'B'>, cell=1, micro_batch=0)]
    """
    orders, _, problems = _parse(text, device_of_cell)
    if problems:
        raise ValueError('\n'.join([f'parse_orders: {len(problems)} problem(s):'] + problems))
    return orders


class CustomSchedule(Schedule):
    """A schedule written by hand as per-device orders, checked when it is built.

    Args:
      orders: the text form (`parse_orders`), or orders[d] = device d's list of Actions.
      device_of_cell: device_of_cell[k] is cell k's device; default k mod D.
      num_micro_batches: T; default one more than the largest micro-batch named.
      name: what charts and summaries call it.

    The schedule splits the backward (`splits_backward`) if any action is a W. Problems
    (an action missing, repeated, or on a device its cell is not on; a deadlock) raise one
    ValueError with one line per problem; a deadlock adds the orders with the stuck actions
    marked '<-- error here'.

    Example:
        >>> CustomSchedule('device 0: F0 F1 B0 B1\\ndevice 1: F0 B0 F1 B1').bubble_fraction()
        0.3333333333333333
    """

    def __init__(self, orders: str | Sequence[Sequence[Action]],
                 device_of_cell: Sequence[int] | None = None,
                 num_micro_batches: int | None = None, name: str = 'custom'):
        if isinstance(orders, str):
            parsed, placement, problems = _parse(orders, device_of_cell)
            if problems:
                raise ValueError('\n'.join(
                    [f'CustomSchedule: {len(problems)} problem(s) in the orders:'] + problems))
        else:
            parsed = [list(order) for order in orders]
            if device_of_cell is None:
                cells = [a.cell for order in parsed for a in order if isinstance(a, Action)]
                num_cells = max([len(parsed)] + [c + 1 for c in cells])
                placement = tuple(k % max(len(parsed), 1) for k in range(num_cells))
            else:
                placement = tuple(operator.index(d) for d in device_of_cell)
        actions = [a for order in parsed for a in order if isinstance(a, Action)]
        if num_micro_batches is None:
            num_micro_batches = 1 + max((a.micro_batch for a in actions), default=0)
        self.name = name
        self.splits_backward = any(a.phase is Phase.WEIGHT for a in actions)
        self._orders = parsed
        self._placement = placement
        super().__init__(max(len(placement), 1), num_micro_batches, max(len(parsed), 1))
        bad = [d for d in placement if not 0 <= d < self.num_devices]
        if bad:
            raise ValueError(f'device_of_cell names device {bad[0]}, but the orders list '
                             f'devices 0..{self.num_devices - 1}')
        self.validate()

    def _label(self) -> str:
        return f'CustomSchedule {self.name!r}'

    def device_of_cell(self, cell: int) -> int:
        self._check_cell(cell)
        return self._placement[cell]

    def device_order(self, device: int) -> list[Action]:
        self._check_device(device)
        return list(self._orders[device]) if device < len(self._orders) else []
