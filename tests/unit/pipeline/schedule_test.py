"""Tests for lingvo_lite.pipeline.schedules.schedule, checked by independent replay of the
schedules."""

import pytest

from lingvo_lite.pipeline.schedules import custom_schedule, schedule
from lingvo_lite.pipeline.schedules.schedule import Action, Phase

F, B = Phase.FORWARD, Phase.BACKWARD
SHAPES = [(1, 1), (1, 4), (2, 1), (2, 2), (3, 5), (4, 8), (5, 3), (8, 16), (4, 2)]
NAMES = ['gpipe', '1f1b']


def _deps(phase, k, t, num_cells):
    """Data dependencies, written out independently of the module."""
    if phase == 'F':
        return [('F', k - 1, t)] if k > 0 else []
    deps = [('F', k, t)]
    if k + 1 < num_cells:
        deps.append(('B', k + 1, t))
    return deps


def _key(action):
    return (action.phase.value, action.cell, action.micro_batch)


def _expected_cell_order(name, k, num_cells, T):
    """Per-cell orders from the textbook definitions (1F1B in the Megatron formulation:
    K-k-1 warm-up forwards, then (forward, backward) pairs, then the remaining backwards)."""
    if name == 'gpipe':
        return [('F', k, t) for t in range(T)] + [('B', k, t) for t in reversed(range(T))]
    warmup = min(num_cells - k - 1, T)
    order = [('F', k, t) for t in range(warmup)]
    for i in range(T - warmup):
        order += [('F', k, warmup + i), ('B', k, i)]
    order += [('B', k, t) for t in range(T - warmup, T)]
    return order


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('num_cells,T', SHAPES)
def test_actions_cover_everything_once_and_respect_dependencies(name, num_cells, T):
    sched = schedule.make_schedule(name, num_cells, T)
    acts = [_key(a) for a in sched.actions()]
    expected = {(p, k, t) for p in 'FB' for k in range(num_cells) for t in range(T)}
    assert len(acts) == 2 * num_cells * T
    assert set(acts) == expected
    done = set()
    for a in acts:
        for d in _deps(*a, num_cells):
            assert d in done, f'{a} runs before its dependency {d}'
        done.add(a)
    for k in range(num_cells):
        want = _expected_cell_order(name, k, num_cells, T)
        assert [a for a in acts if a[1] == k] == want
        assert [_key(a) for a in sched.cell_order(k)] == want


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('num_cells,T', SHAPES)
def test_timeline_is_the_greedy_unit_time_simulation(name, num_cells, T):
    sched = schedule.make_schedule(name, num_cells, T)
    rows = sched.timeline()
    assert all(len(row) == num_cells for row in rows)
    finish = {}
    for tick, row in enumerate(rows):
        for k, a in enumerate(row):
            if a is not None:
                assert a.cell == k
                finish[_key(a)] = tick
    orders = {k: _expected_cell_order(name, k, num_cells, T) for k in range(num_cells)}
    for k in range(num_cells):
        ticks = [finish[a] for a in orders[k]]
        assert ticks == sorted(ticks)  # The cell follows its order.
        previous_end = -1
        for a, tick in zip(orders[k], ticks):
            ready = max([finish[d] + 1 for d in _deps(*a, num_cells)] + [previous_end + 1])
            assert tick == ready, f'{a} ran at {tick}, could run at {ready}'
            previous_end = tick
    assert sched.num_ticks() == len(rows)
    flat = [_key(a) for row in rows for a in row if a is not None]
    assert flat == [_key(a) for a in sched.actions()]


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('num_cells,T', SHAPES)
def test_ticks_and_bubble_with_unit_times(name, num_cells, T):
    # With unit-time forwards and backwards, fill-drain takes 2(T+K-1) ticks and idles
    # 2K(K-1) of the 2K(T+K-1) slots; 1F1B has the same makespan and bubble.
    sched = schedule.make_schedule(name, num_cells, T)
    assert sched.num_ticks() == 2 * (T + num_cells - 1)
    assert sched.bubble_fraction() == pytest.approx((num_cells - 1) / (T + num_cells - 1))


@pytest.mark.parametrize('num_cells,T', SHAPES)
def test_peak_in_flight(num_cells, T):
    gpipe = schedule.GPipeSchedule(num_cells, T)
    one_f_one_b = schedule.OneFOneBSchedule(num_cells, T)
    for k in range(num_cells):
        assert gpipe.peak_in_flight(k) == T
        assert one_f_one_b.peak_in_flight(k) == min(num_cells - k, T)
    # Independently from the global order.
    for sched in (gpipe, one_f_one_b):
        in_flight = [0] * num_cells
        peak = [0] * num_cells
        for a in sched.actions():
            in_flight[a.cell] += 1 if a.phase is F else -1
            peak[a.cell] = max(peak[a.cell], in_flight[a.cell])
        assert peak == [sched.peak_in_flight(k) for k in range(num_cells)]


def test_to_text_small_gpipe():
    text = schedule.GPipeSchedule(2, 2).to_text()
    lines = text.splitlines()
    assert lines[1:] == ['cell 0 | F0 F1 .. .. B1 B0',
                         'cell 1 | .. F0 F1 B1 B0 ..']
    assert 'gpipe' in lines[0] and '6 ticks' in lines[0]


@pytest.mark.parametrize('name', NAMES)
@pytest.mark.parametrize('num_cells,T', [(3, 5), (4, 12), (11, 3)])
def test_to_text_shape(name, num_cells, T):
    sched = schedule.make_schedule(name, num_cells, T)
    lines = sched.to_text().splitlines()
    assert len(lines) == num_cells + 1
    width = len(str(T - 1)) + 1
    rows = sched.timeline()
    for k, line in enumerate(lines[1:]):
        label, chart = line.split(' | ')
        assert label.strip() == f'cell {k}'
        num_ticks = 2 * (T + num_cells - 1)
        assert len(chart) == num_ticks * (width + 1) - 1
        tokens = [chart[i * (width + 1):i * (width + 1) + width] for i in range(num_ticks)]
        assert all(chart[i * (width + 1) - 1] == ' ' for i in range(1, num_ticks))
        for tick, tok in enumerate(tokens):
            a = rows[tick][k]
            assert tok.strip() == ('.' * width if a is None
                                   else f'{a.phase.value}{a.micro_batch}')
    assert len({len(line) for line in lines[1:]}) == 1


def test_action_str_and_order():
    assert str(Action(F, 2, 3)) == 'F(k=2,t=3)'
    assert str(Action(B, 0, 11)) == 'B(k=0,t=11)'
    acts = [Action(B, 0, 0), Action(F, 1, 0), Action(F, 0, 1), Action(F, 0, 0)]
    assert sorted(acts) == [Action(F, 0, 0), Action(F, 0, 1), Action(F, 1, 0), Action(B, 0, 0)]


def test_device_orders_are_built_once_and_match_device_order():
    for sched in (schedule.make_schedule('zero_bubble', 3, 4),
                  schedule.make_schedule('interleaved', 4, 4, virtual_stages=2)):
        orders = sched.device_orders()
        assert orders is sched.device_orders()
        assert [list(o) for o in orders] == [sched.device_order(d)
                                             for d in range(sched.num_devices)]
        assert all(isinstance(o, tuple) for o in orders)  # Nobody can change the cached ones.


@pytest.mark.parametrize('args,fragment', [
    ((0, 4), 'num_cells=0'),
    ((2, 0), 'num_micro_batches=0'),
    ((2.5, 4), 'num_cells must be an int'),
    ((2, '4'), 'num_micro_batches must be an int'),
])
def test_constructor_errors(args, fragment):
    for cls in (schedule.GPipeSchedule, schedule.OneFOneBSchedule):
        with pytest.raises(ValueError, match=fragment):
            cls(*args)


def test_make_schedule_errors():
    with pytest.raises(ValueError) as err:
        schedule.make_schedule('pipedream', 2, 2)
    assert 'pipedream' in str(err.value)
    for name in ('gpipe', '1f1b', 'interleaved', 'zero_bubble'):
        assert name in str(err.value)
    assert isinstance(schedule.make_schedule('gpipe', 2, 2), schedule.GPipeSchedule)
    assert isinstance(schedule.make_schedule('1f1b', 2, 2), schedule.OneFOneBSchedule)
    assert isinstance(schedule.make_schedule('zero_bubble', 2, 2), schedule.ZeroBubbleSchedule)


def test_cell_out_of_range():
    with pytest.raises(ValueError, match='cell=2'):
        schedule.GPipeSchedule(2, 2).cell_order(2)
    with pytest.raises(ValueError, match='cell=-1'):
        schedule.OneFOneBSchedule(2, 2).peak_in_flight(-1)


class _Custom(schedule.Schedule):
    """A schedule whose per-cell orders are given directly."""

    def __init__(self, num_cells, T, orders):
        super().__init__(num_cells, T)
        self._orders = orders

    def cell_order(self, cell):
        return self._orders[cell]


def test_validate_accepts_custom_valid_order():
    # Cell 1 interleaves; still valid.
    orders = [[Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1)],
              [Action(F, 1, 0), Action(B, 1, 0), Action(F, 1, 1), Action(B, 1, 1)]]
    sched = _Custom(2, 2, orders)
    sched.validate()
    assert len(sched.actions()) == 8


@pytest.mark.parametrize('orders,fragment', [
    # The last cell tries to run a backward before its forward: deadlock.
    ([[Action(F, 0, 0), Action(B, 0, 0)], [Action(B, 1, 0), Action(F, 1, 0)]], 'deadlock'),
    # Cell 0 waits for B(1, 1) while cell 1 waits for F(0, 1): deadlock.
    ([[Action(F, 0, 0), Action(B, 0, 1), Action(F, 0, 1), Action(B, 0, 0)],
      [Action(F, 1, 0), Action(F, 1, 1), Action(B, 1, 1), Action(B, 1, 0)]], 'deadlock'),
    ([[Action(F, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]], 'misses 1 action'),
    ([[Action(F, 0, 0), Action(B, 0, 0), Action(B, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]],
     'more than once'),
    ([[Action(F, 0, 0), Action(B, 1, 0)], [Action(F, 1, 0), Action(B, 1, 0)]],
     'does not belong to cell 0'),
])
def test_validate_rejects_bad_orders(orders, fragment):
    T = max(a.micro_batch for order in orders for a in order) + 1
    sched = _Custom(2, T, orders)
    with pytest.raises(ValueError, match=fragment):
        sched.validate()
    with pytest.raises(ValueError, match=fragment):
        sched.actions()


# ---------------------------------------------------------------------------------------------
# Devices, interleaved 1F1B, zero-bubble (ZB-H1), the text form and the validator.

W = Phase.WEIGHT


def _read(tokens, cell=None):
    """'2F1 2B0' -> [('F', 2, 1), ('B', 2, 0)]; 'F1' takes `cell`. Written for the tests, so
    the expected orders do not go through the module's parser."""
    out = []
    for tok in tokens.split():
        i = next(i for i, ch in enumerate(tok) if ch in 'FBW')
        out.append((tok[i], int(tok[:i]) if i else cell, int(tok[i + 1:])))
    return out


def _deps_split(phase, k, t, num_cells):
    if phase == 'W':
        return [('B', k, t)]
    return _deps(phase, k, t, num_cells)


# Megatron-LM's interleaved 1F1B, K=2 devices, v=2, T=4, worked out by hand from
# forward_backward_pipelining_with_interleaving: device d runs 2(K-d-1) + (v-1)K warm-up
# forwards (4 on device 0, 2 on device 1); the i-th forward is of chunk (i mod Kv) div K on
# micro-batch (i div Kv) K + i mod K, backwards likewise with the chunks reversed; chunk j of
# device d is cell jK + d. Steady state: one forward, then one backward.
INTERLEAVED_2_2_4 = {
    0: '0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3',
    1: '1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3',
}
# T = K: Megatron runs every forward as warm-up, then every backward.
INTERLEAVED_2_2_2 = {
    0: '0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1',
    1: '1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1',
}
# ZB-H1, K=3, T=4, from the rule of Figure 3 (top) of Qi et al.: 1F1B's F/B order (K-1-k
# warm-up forwards, then (F, B) pairs), W of micro-batch t right after B of t + k, the last k
# W's at the end.
ZERO_BUBBLE_3_4 = {
    0: 'F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3',
    1: 'F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3',
    2: 'F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3',
}
# Figure 3 (top) of the paper itself, K=4, T=8, read tick by tick (micro-batches renumbered
# from 0; '.' is an idle tick). With F, B and W one unit each this is the unit-time timeline.
ZERO_BUBBLE_FIGURE_4_8 = {
    0: 'F0 F1 F2 F3 . . . B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7',
    1: '. F0 F1 F2 . . B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7',
    2: '. . F0 F1 . B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7',
    3: '. . . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7',
}


@pytest.mark.parametrize('K,v,T,expected', [(2, 2, 4, INTERLEAVED_2_2_4),
                                            (2, 2, 2, INTERLEAVED_2_2_2)])
def test_interleaved_orders_by_hand(K, v, T, expected):
    sched = schedule.InterleavedSchedule(K, T, virtual_stages=v)
    assert (sched.num_cells, sched.num_devices, sched.virtual_stages) == (K * v, K, v)
    for d in range(K):
        assert [_key(a) for a in sched.device_order(d)] == _read(expected[d])
        assert sched.cells_of_device(d) == [d + j * K for j in range(v)]
    for k in range(K * v):
        assert sched.device_of_cell(k) == k % K
        want = [a for a in _read(expected[k % K]) if a[1] == k]
        assert [_key(a) for a in sched.cell_order(k)] == want


def test_zero_bubble_orders_by_hand():
    sched = schedule.ZeroBubbleSchedule(3, 4)
    assert sched.splits_backward and sched.phases == (F, B, W)
    for k in range(3):
        assert [_key(a) for a in sched.device_order(k)] == _read(ZERO_BUBBLE_3_4[k], cell=k)
        assert sched.cell_order(k) == sched.device_order(k)


def test_zero_bubble_reproduces_figure_3_of_the_paper():
    sched = schedule.ZeroBubbleSchedule(4, 8)
    rows = sched.timeline()
    for d in range(4):
        figure = ZERO_BUBBLE_FIGURE_4_8[d].split()
        got = ['.' if row[d] is None else f'{row[d].phase.value}{row[d].micro_batch}'
               for row in rows]
        assert got == figure, d
    assert sched.num_ticks() == 3 * 8 + 4 - 1


NEW_SHAPES = [  # (name, devices K, virtual stages v, T)
    ('interleaved', 1, 3, 2), ('interleaved', 2, 2, 4), ('interleaved', 2, 3, 6),
    ('interleaved', 3, 2, 6), ('interleaved', 4, 2, 8), ('interleaved', 4, 2, 4),
    ('interleaved', 4, 3, 12), ('interleaved', 3, 1, 9),
    ('zero_bubble', 1, 1, 3), ('zero_bubble', 2, 1, 1), ('zero_bubble', 3, 1, 4),
    ('zero_bubble', 4, 1, 2), ('zero_bubble', 4, 1, 8), ('zero_bubble', 5, 1, 7),
]


def _new(name, K, v, T):
    return schedule.make_schedule(name, K * v, T, virtual_stages=v)


@pytest.mark.parametrize('name,K,v,T', NEW_SHAPES)
def test_new_schedules_run_everything_once_in_dependency_order(name, K, v, T):
    sched = _new(name, K, v, T)
    cells = K * v
    phases = 'FBW' if name == 'zero_bubble' else 'FB'
    acts = [_key(a) for a in sched.actions()]
    assert sorted(acts) == sorted((p, k, t) for p in phases for k in range(cells)
                                  for t in range(T))
    assert len(set(acts)) == len(acts)
    done = set()
    for a in acts:
        for dep in _deps_split(*a, cells):
            assert dep in done, f'{a} runs before its dependency {dep}'
        done.add(a)
    for d in range(K):
        device_cells = {k for k in range(cells) if k % K == d}
        order = [_key(a) for a in sched.device_order(d)]
        assert {a[1] for a in order} == device_cells
        assert [a for a in acts if a[1] in device_cells] == order


@pytest.mark.parametrize('name,K,v,T', NEW_SHAPES)
def test_new_schedules_timeline_is_the_greedy_unit_time_simulation(name, K, v, T):
    sched = _new(name, K, v, T)
    rows = sched.timeline()
    assert all(len(row) == K for row in rows)
    finish = {}
    for tick, row in enumerate(rows):
        for d, a in enumerate(row):
            if a is not None:
                assert a.cell % K == d
                finish[_key(a)] = tick
    for d in range(K):
        previous_end = -1
        for a in (_key(x) for x in sched.device_order(d)):
            ready = max([finish[dep] + 1 for dep in _deps_split(*a, K * v)]
                        + [previous_end + 1])
            assert finish[a] == ready, f'{a} ran at {finish[a]}, could run at {ready}'
            previous_end = finish[a]


@pytest.mark.parametrize('K,v,T', [(2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 8), (4, 2, 4),
                                   (4, 3, 12), (4, 2, 16), (8, 2, 16)])
def test_interleaved_bubble_is_one_vth_of_1f1b(K, v, T):
    # Unit time per action: a device's v cells each take 1/v of a whole stage. Narayanan et
    # al.: the bubble is (K-1)/(vT) of the compute time (1F1B: (K-1)/T), i.e. 2(K-1) idle
    # ticks per device over 2vT busy ones.
    sched = schedule.InterleavedSchedule(K, T, virtual_stages=v)
    rows = sched.timeline()
    assert len(rows) == 2 * v * T + 2 * (K - 1)
    for d in range(K):
        idle = sum(row[d] is None for row in rows)
        busy = len(rows) - idle
        assert busy == 2 * v * T
        assert idle / busy == pytest.approx((K - 1) / (v * T))
    one_f_one_b = schedule.OneFOneBSchedule(K, T)
    ofob_idle = one_f_one_b.bubble_fraction() * one_f_one_b.num_ticks()  # Per device.
    assert ofob_idle / (2 * T) == pytest.approx((K - 1) / T)
    assert sched.bubble_fraction() == pytest.approx((K - 1) / (v * T + K - 1))


@pytest.mark.parametrize('K,T', [(2, 2), (3, 4), (4, 4), (4, 8), (5, 12), (8, 16)])
def test_zero_bubble_beats_1f1b_with_the_same_activations(K, T):
    from lingvo_lite.analysis import simulator
    zb = schedule.ZeroBubbleSchedule(K, T)
    ofob = schedule.OneFOneBSchedule(K, T)
    # F = B = W = 1: 1F1B's whole backward takes 2. ZB-H1 (Table 2 of the paper): bubble
    # (K-1)(T_F + T_B - T_W) = K-1 per device, 1F1B's (K-1)(T_F + T_B + T_W) = 3(K-1).
    costs = simulator.PhaseCosts.uniform(K, forward=1.0, backward=2.0, weight=1.0)
    zb_step = simulator.simulate(zb, costs, remat='never')
    ofob_step = simulator.simulate(ofob, costs, remat='never')
    assert zb_step.step_time == pytest.approx(3 * T + K - 1)
    assert ofob_step.step_time == pytest.approx(3 * (T + K - 1))
    assert zb_step.breakdown().bubble < ofob_step.breakdown().bubble
    assert zb_step.breakdown().bubble == pytest.approx((K - 1) / (3 * T + K - 1))
    assert zb.num_ticks() == 3 * T + K - 1  # The unit-time timeline agrees.
    for k in range(K):
        # The F/B order is 1F1B's: as many activations kept for B ...
        assert zb.peak_in_flight(k) == ofob.peak_in_flight(k) == min(K - k, T)
        # ... and every cell holds K micro-batches until their W (the paper's "same number
        # of in-flight micro-batches"), as many as 1F1B's first cell.
        assert zb.peak_in_flight(k, until=W) == min(K, T)
        assert ofob.peak_in_flight(k, until=W) == ofob.peak_in_flight(k)
    assert (max(zb.peak_in_flight(k, W) for k in range(K))
            == max(ofob.peak_in_flight(k) for k in range(K)))


def test_peak_in_flight_until_must_be_a_backward_phase():
    with pytest.raises(ValueError, match='until='):
        schedule.ZeroBubbleSchedule(2, 2).peak_in_flight(0, until=F)


def test_interleaved_peak_in_flight_by_hand():
    # From INTERLEAVED_2_2_4: device 0 runs 0F0 0F1 0F2 0F3 before 0B0: 4 in flight on cell
    # 0; cell 2 has 2F0 2F1 then 2B0 2B1, 2F2 2F3, 2B2 2B3: 2.
    sched = schedule.InterleavedSchedule(2, 4, virtual_stages=2)
    assert [sched.peak_in_flight(k) for k in range(4)] == [4, 3, 2, 1]


def test_make_schedule_counts_cells_for_every_schedule():
    sched = schedule.make_schedule('interleaved', 8, 4, virtual_stages=2)
    assert isinstance(sched, schedule.InterleavedSchedule)
    assert (sched.num_cells, sched.num_devices, sched.virtual_stages) == (8, 4, 2)
    zb = schedule.make_schedule('zero_bubble', 3, 4)
    assert (zb.num_cells, zb.num_devices) == (3, 3)


@pytest.mark.parametrize('call,fragment', [
    (lambda: schedule.InterleavedSchedule(4, 6, virtual_stages=2),
     r'^num_micro_batches=6 must be a multiple of the number of devices \(4\).*'
     r'set num_micro_batches to 4 or 8$'),
    (lambda: schedule.InterleavedSchedule(4, 3, virtual_stages=2),
     r'num_micro_batches=3 .*set num_micro_batches to 4$'),
    (lambda: schedule.make_schedule('interleaved', 6, 4, virtual_stages=4),
     r'^virtual_stages=4 must divide the number of cells \(6\)'),
    (lambda: schedule.make_schedule('1f1b', 4, 4, virtual_stages=2),
     r"^virtual_stages=2 applies only to the interleaved schedule; set virtual_stages=1"),
    (lambda: schedule.InterleavedSchedule(2, 4, virtual_stages=0), r'virtual_stages=0'),
])
def test_interleaved_argument_errors_are_one_line(call, fragment):
    with pytest.raises(ValueError, match=fragment) as err:
        call()
    assert '\n' not in str(err.value)


def test_to_text_with_several_cells_per_device():
    lines = schedule.InterleavedSchedule(2, 2, virtual_stages=2).to_text().splitlines()
    assert 'interleaved: 4 cells on 2 devices, 2 micro-batches, 10 ticks' in lines[0]
    # INTERLEAVED_2_2_2 replayed: device 1 waits one tick for 0F0 and idles at the end.
    assert lines[1:] == [
        'device 0 | 0F0 0F1 2F0 2F1 ... ... 2B0 2B1 0B0 0B1',
        'device 1 | ... 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1 ...']


def test_to_text_zero_bubble_draws_w():
    lines = schedule.ZeroBubbleSchedule(2, 2).to_text().splitlines()
    assert lines[1:] == ['cell 0 | F0 F1 .. B0 W0 B1 W1',
                         'cell 1 | .. F0 B0 F1 B1 W0 W1']


@pytest.mark.parametrize('name,K,v,T', NEW_SHAPES + [('gpipe', 3, 1, 4), ('1f1b', 4, 1, 6)])
def test_text_form_round_trip(name, K, v, T):
    sched = _new(name, K, v, T)
    text = sched.format_orders()
    lines = text.splitlines()
    assert [line.split(':')[0] for line in lines] == [f'device {d}' for d in range(K)]
    want = [sched.device_order(d) for d in range(K)]
    assert custom_schedule.parse_orders(text) == want
    assert custom_schedule.parse_orders(text, [k % K for k in range(K * v)]) == want
    custom = custom_schedule.CustomSchedule(text)
    assert custom.splits_backward == (name == 'zero_bubble')
    assert custom.timeline() == sched.timeline()
    assert custom.format_orders() == text


def test_text_form_notation():
    # One cell per device: the cell is left out; several: written first.
    assert schedule.GPipeSchedule(2, 2).format_orders() == ('device 0: F0 F1 B1 B0\n'
                                                            'device 1: F0 F1 B1 B0')
    assert schedule.InterleavedSchedule(2, 2, 2).format_orders().splitlines()[1] == (
        'device 1: ' + INTERLEAVED_2_2_2[1])
    # The parser takes both forms, comments and blank lines; the cell of a short form is
    # the device's only cell, here with an explicit placement (cell 0 on device 1).
    orders = custom_schedule.parse_orders('# two devices\n\ndevice 0: 1F0 B0\ndevice 1:  F0 0B0\n',
                                   device_of_cell=[1, 0])
    assert [[_key(a) for a in order] for order in orders] == [[('F', 1, 0), ('B', 1, 0)],
                                                               [('F', 0, 0), ('B', 0, 0)]]


def test_custom_schedule_written_by_hand():
    # A user's own split-backward schedule: K=2, T=2, W's of cell 1 moved to the end.
    sched = custom_schedule.CustomSchedule('device 0: F0 F1 B0 W0 B1 W1\n'
                                    'device 1: F0 B0 F1 B1 W0 W1', name='mine')
    assert sched.name == 'mine' and sched.splits_backward
    assert (sched.num_cells, sched.num_devices, sched.num_micro_batches) == (2, 2, 2)
    # Ticks by hand: d0 F0 F1 . B0 W0 B1 W1; d1 . F0 B0 F1 B1 W0 W1.
    assert sched.num_ticks() == 7
    assert sched.bubble_fraction() == pytest.approx(2 / 14)
    assert 'mine: 2 cells, 2 micro-batches, 7 ticks' in sched.to_text()
    # Actions may be given as lists too.
    same = custom_schedule.CustomSchedule([sched.device_order(0), sched.device_order(1)])
    assert same.timeline() == sched.timeline()


def _problems(text, **kwargs):
    with pytest.raises(ValueError) as err:
        custom_schedule.CustomSchedule(text, **kwargs)
    return str(err.value).splitlines()


def test_validator_reports_one_line_per_problem():
    lines = _problems('device 0: F0 F0 B0 1F1\n'
                      'device 1: F0 B0 W0')
    assert lines[0] == "CustomSchedule 'custom': 4 problem(s) in the device orders:"
    assert lines[1:] == [
        'device 0 runs F(k=0,t=0) more than once (2 times)',
        'device 0 runs F(k=1,t=1), which does not belong to cell 0: cell 1 runs on device 1',
        'device 0 misses 4 action(s): F(k=0,t=1), B(k=0,t=1), W(k=0,t=0), W(k=0,t=1)',
        'device 1 misses 3 action(s): F(k=1,t=1), B(k=1,t=1), W(k=1,t=1)',
    ]


def test_validator_reports_wrong_device_for_interleaved_placement():
    text = schedule.InterleavedSchedule(2, 2, 2).format_orders().replace('2B1', '3B1')
    lines = _problems(text)
    assert ('device 0 runs B(k=3,t=1), which does not belong to cells 0, 2: '
            'cell 3 runs on device 1') in lines
    assert 'device 0 misses 1 action(s): B(k=2,t=1)' in lines
    assert len(lines) == 3  # The summary and the two problems; device 1's order is right.


def test_validator_prints_the_orders_on_a_deadlock():
    # Device 0 waits for B(1, 0) before running F1; device 1 waits for F(0, 1) before B0.
    lines = _problems('device 0: F0 B0 F1 B1\n'
                      'device 1: F0 F1 B0 B1')
    assert lines[0].startswith("CustomSchedule 'custom' deadlocks at tick 2: "
                               'device 0 waits to run B(k=0,t=0) (it needs B(k=1,t=0)); '
                               'device 1 waits to run F(k=1,t=1) (it needs F(k=0,t=1))')
    assert lines[1:] == ['The device orders, stuck actions marked:',
                         'device 0: F0 B0 <-- error here F1 B1',
                         'device 1: F0 F1 <-- error here B0 B1']


@pytest.mark.parametrize('text,kwargs,line', [
    ('device 0: F0 Q1', {}, "line 1: cannot read 'Q1'; write <cell><F|B|W><micro-batch>"),
    ('dev 0: F0 B0', {}, 'line 1: expected "device <d>: <actions>", got \'dev 0: F0 B0\''),
    ('device 0: F0 B0\ndevice 0: F0 B0', {}, 'line 2: device 0 is listed twice'),
    ('device 0: F0 B0\ndevice 2: F0 B0', {},
     'devices must be numbered 0..1 with one line each; device(s) 1 have no line'),
    ('device 0: 0F0 2F0 F1', {},
     "device 0: 'F1' does not say its cell and device 0 holds cells 0, 1, 2; write it as "
     '<cell>F1'),
    ('', {}, 'no device lines'),
])
def test_parser_errors(text, kwargs, line):
    lines = _problems(text, **kwargs)
    assert len(lines) == 2 and lines[1].startswith(line), lines
    with pytest.raises(ValueError, match='parse_orders: 1 problem'):
        custom_schedule.parse_orders(text, **kwargs)


def test_existing_subclass_with_several_cells_per_device_must_define_device_order():
    class TwoPerDevice(schedule.Schedule):
        def device_of_cell(self, cell):
            return cell // 2

        def cell_order(self, cell):
            return [Action(F, cell, 0), Action(B, cell, 0)]

    with pytest.raises(NotImplementedError, match='must define device_order'):
        TwoPerDevice(4, 1, num_devices=2).timeline()


def test_custom_schedule_placement_must_name_listed_devices():
    with pytest.raises(ValueError, match='device_of_cell names device 2, but the orders list '
                                         r'devices 0\.\.1'):
        custom_schedule.CustomSchedule('device 0: 0F0 0B0\ndevice 1: 1F0 1B0',
                                       device_of_cell=[0, 2])


def test_docstring_examples():
    import doctest
    assert doctest.testmod(schedule).failed == 0


def test_custom_schedule_docstring_examples():
    import doctest
    assert doctest.testmod(custom_schedule).failed == 0
