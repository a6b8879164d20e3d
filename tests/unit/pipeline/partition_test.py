"""Tests for lingvo_lite.pipeline.partition.partition against brute force and hand-computed
cases."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from lingvo_lite.pipeline.partition import partition


def _compositions(num_layers, num_cells):
    """All ways to write num_layers as an ordered sum of num_cells positive sizes."""
    for cuts in itertools.combinations(range(1, num_layers), num_cells - 1):
        bounds = (0,) + cuts + (num_layers,)
        yield [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _cell_costs_exact(costs, sizes):
    """Exact cell sums with Fractions (floats convert to Fractions exactly)."""
    out, start = [], 0
    for s in sizes:
        out.append(sum((Fraction(float(c)) for c in costs[start:start + s]), Fraction(0)))
        start += s
    return out


def _brute_force(costs, num_cells, objective):
    """The documented optimum by enumeration: primary objective, then the tie-breaks
    (smaller sum of squared costs, more even sizes, larger cells first)."""

    def key(sizes):
        cc = _cell_costs_exact(costs, sizes)
        sq = sum(c * c for c in cc)
        even = sum(s * s for s in sizes)
        neg_sizes = tuple(-s for s in sizes)
        if objective == 'min_max':
            return (max(cc), sq, even, neg_sizes)
        return (sq, even, neg_sizes)

    return min(_compositions(len(costs), num_cells), key=key)


def _random_cases(seed, count):
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        num_layers = int(rng.integers(1, 11))
        num_cells = int(rng.integers(1, num_layers + 1))
        kind = i % 4
        if kind == 0:  # Small ints: many exact ties.
            costs = [int(x) for x in rng.integers(0, 4, num_layers)]
        elif kind == 1:  # Wider ints.
            costs = [int(x) for x in rng.integers(0, 1000, num_layers)]
        elif kind == 2:  # Arbitrary floats.
            costs = [float(x) for x in rng.random(num_layers) * 10.0]
        else:  # Decimal-looking floats such as 0.1 + 0.2 vs 0.3: not exact in binary.
            costs = [float(x) for x in np.round(rng.random(num_layers), 1)]
        cases.append((costs, num_cells))
    return cases


@pytest.mark.parametrize('objective', ['min_max', 'min_variance'])
def test_matches_brute_force(objective):
    fn = (partition.partition_min_max if objective == 'min_max'
          else partition.partition_min_variance)
    cases = _random_cases(seed=1234 if objective == 'min_max' else 5678, count=240)
    for costs, num_cells in cases:
        got = fn(costs, num_cells)
        want = _brute_force(costs, num_cells, objective)
        assert got == want, (costs, num_cells, got, want)


def test_min_max_objective_value_matches_brute_force_on_numpy_input():
    rng = np.random.default_rng(7)
    for _ in range(50):
        costs = rng.random(int(rng.integers(2, 10))).astype(np.float32)
        num_cells = int(rng.integers(1, len(costs) + 1))
        sizes = partition.partition_min_max(costs, num_cells)
        best = min(max(_cell_costs_exact(costs, s))
                   for s in _compositions(len(costs), num_cells))
        assert max(_cell_costs_exact(costs, sizes)) == best


def test_equal_layers_split_evenly():
    assert partition.partition_min_max([1.0] * 8, 2) == [4, 4]
    assert partition.partition_min_variance([1.0] * 8, 2) == [4, 4]
    assert partition.partition_min_max([5] * 12, 4) == [3, 3, 3, 3]


def test_min_max_prefers_balanced_among_equal_maxima():
    # Max is 10 (the first layer) for any split; the sum of squares decides.
    assert partition.partition_min_max([10, 1, 1, 1, 1, 1, 1], 3) == [1, 3, 3]


def test_zero_costs_fall_back_to_even_layer_counts():
    assert partition.partition_min_max([0] * 7, 3) == [3, 2, 2]
    assert partition.partition_min_variance([0.0] * 7, 3) == [3, 2, 2]


def test_num_cells_equals_num_layers_and_one():
    costs = [3.0, 1.0, 4.0, 1.0, 5.0]
    assert partition.partition_min_max(costs, 5) == [1] * 5
    assert partition.partition_min_variance(costs, 5) == [1] * 5
    assert partition.partition_min_max(costs, 1) == [5]
    assert partition.partition_min_variance(costs, 1) == [5]


def test_large_problem_runs():
    rng = np.random.default_rng(0)
    costs = rng.random(256) * 1e9
    for fn in (partition.partition_min_max, partition.partition_min_variance):
        sizes = fn(costs, 128)
        assert len(sizes) == 128 and sum(sizes) == 256 and min(sizes) >= 1


@pytest.mark.parametrize('fn', [partition.partition_min_max, partition.partition_min_variance,
                                partition.lingvo_cumulative_split])
@pytest.mark.parametrize('costs,num_cells,fragments', [
    ([1, 2, 3], 0, ['num_cells=0', '>= 1']),
    ([1, 2, 3], -2, ['num_cells=-2']),
    ([1, 2, 3], 2.0, ['num_cells', 'int']),
    ([1, 2, 3], 4, ['num_cells=4 exceeds the number of layers 3',
                    'use at most 3 cells or split layers further']),
    ([1, -2, 3], 2, ['costs[1]', 'negative']),
    ([1, float('nan'), 3], 2, ['costs[1]', 'not finite']),
    ([1, float('inf'), 3], 2, ['costs[1]', 'not finite']),
    ([1, 'x', 3], 2, ['costs[1]', 'not a number']),
    ([], 1, ['costs is empty']),
])
def test_validation_errors(fn, costs, num_cells, fragments):
    with pytest.raises(ValueError) as err:
        fn(costs, num_cells)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_split_points_to_sizes():
    assert partition.split_points_to_sizes([3, 5], 8) == [3, 2, 3]
    assert partition.split_points_to_sizes([], 4) == [4]
    assert partition.split_points_to_sizes([1, 2, 3], 4) == [1, 1, 1, 1]


@pytest.mark.parametrize('points,num_layers,fragments', [
    ([0, 3], 8, ['split_points[0]=0', 'out of range', '1..7', 'leave a cell empty']),
    ([3, 8], 8, ['split_points[1]=8', 'out of range']),
    ([5, 3], 8, ['split_points', 'strictly increasing', 'sort']),
    ([3, 3], 8, ['split_points[1]=3', 'strictly increasing', 'cell 1 empty']),
    ([1.5], 8, ['split_points[0]', 'not an int']),
])
def test_split_points_errors(points, num_layers, fragments):
    with pytest.raises(ValueError) as err:
        partition.split_points_to_sizes(points, num_layers)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_lingvo_cumulative_split():
    # Inclusive cumulative shares 1/8 .. 8/8; layer i goes to min(int(2 * share), 1):
    # layers 0-2 (shares < 1/2) to cell 0, layer 3 (share exactly 1/2) onwards to cell 1.
    assert partition.lingvo_cumulative_split([1.0] * 8, 2) == [3, 5]
    # Shares 0.25, 0.5, 0.75, 1.0 on 4 cells -> cells 1, 2, 3, 3: cell 0 stays empty.
    assert partition.lingvo_cumulative_split([1, 1, 1, 1], 4) == [0, 1, 1, 2]
    # A dominant first layer (share 10/13 -> int(1.54) = 1) empties cell 0.
    assert partition.lingvo_cumulative_split([10, 1, 1, 1], 2) == [0, 4]
    with pytest.raises(ValueError, match='sum to 0'):
        partition.lingvo_cumulative_split([0, 0, 0], 2)


def test_make_partition_methods():
    names = [f'l{i}' for i in range(7)]
    costs = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0, 2.0]
    p = partition.make_partition(names, costs, 3)
    assert p.cell_sizes == tuple(partition.partition_min_max(costs, 3))
    assert p.method == 'min_max' and p.cost_name == 'flops'
    p = partition.make_partition(names, costs, 3, method='min_variance')
    assert p.cell_sizes == tuple(partition.partition_min_variance(costs, 3))
    p = partition.make_partition(names, costs, 3, method='uniform')
    assert p.cell_sizes == (3, 2, 2)
    p = partition.make_partition(names, costs, 3, method='explicit', split_points=[2, 6])
    assert p.cell_sizes == (2, 4, 1)
    assert p.cell_layer_ranges == [(0, 2), (2, 6), (6, 7)]
    assert p.cell_costs == [5.0, 7.0, 2.0]
    assert [p.cell_of_layer(i) for i in range(7)] == [0, 0, 1, 1, 1, 1, 2]
    np.testing.assert_allclose(p.cell_shares, [5 / 14, 7 / 14, 2 / 14])
    assert p.imbalance == pytest.approx(7.0 / (14.0 / 3))
    assert p.num_cells == 3
    with pytest.raises(IndexError, match='layer_index=7'):
        p.cell_of_layer(7)


def test_uniform_sizes_differ_by_at_most_one():
    for num_layers in range(1, 20):
        for num_cells in range(1, num_layers + 1):
            p = partition.make_partition([str(i) for i in range(num_layers)],
                                         [1.0] * num_layers, num_cells, method='uniform')
            sizes = list(p.cell_sizes)
            assert sum(sizes) == num_layers and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize('kwargs,fragments', [
    (dict(method='greedy'), ['method=', 'greedy', 'min_max', 'min_variance', 'uniform',
                             'explicit']),
    (dict(method='explicit'), ['requires split_points']),
    (dict(method='min_max', split_points=[2]), ['split_points', 'explicit']),
    (dict(method='explicit', split_points=[2]), ['split_points gives 2 cells', 'num_cells=3']),
    (dict(layer_costs=[1.0, -1.0, 1.0, 1.0]), ['layer_costs[1]', 'negative']),
    (dict(layer_names=['a', 'b']), ['layer_names has 2', 'layer_costs has 4']),
    (dict(num_cells=5), ['num_cells=5 exceeds the number of layers 4']),
])
def test_make_partition_errors(kwargs, fragments):
    args = dict(layer_names=['a', 'b', 'c', 'd'], layer_costs=[1.0] * 4, num_cells=3)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        partition.make_partition(**args)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_partition_rejects_inconsistent_sizes():
    with pytest.raises(ValueError, match='sum to 3'):
        partition.Partition((1, 2), ('a', 'b', 'c', 'd'), (1.0,) * 4)
    with pytest.raises(ValueError, match='>= 1 layer'):
        partition.Partition((0, 4), ('a', 'b', 'c', 'd'), (1.0,) * 4)


def test_format_si():
    assert partition.format_si(1.2e9) == '1.2G'
    assert partition.format_si(340e6) == '340M'
    assert partition.format_si(12e3) == '12k'
    assert partition.format_si(999.96) == '1k'
    assert partition.format_si(512) == '512'
    assert partition.format_si(0) == '0'


def test_report():
    names = ['stem', 'normal_0', 'normal_1', 'normal_2', 'reduce_0', 'normal_3', 'head']
    costs = [0.3e9, 0.3e9, 0.3e9, 0.3e9, 0.9e9, 0.34e9, 0.01e9]
    p = partition.make_partition(names, costs, 3, method='explicit', split_points=[4, 5])
    text = p.report()
    lines = text.splitlines()
    assert 'layers 0-3 (stem .. normal_2)' in text
    assert 'layer 4 (reduce_0)' in text
    assert 'layers 5-6 (normal_3 .. head)' in text
    # Independent cell sums and imbalance.
    sums = [sum(costs[0:4]), sum(costs[4:5]), sum(costs[5:7])]
    imbalance = max(sums) / (sum(sums) / 3)
    assert f'imbalance (max/mean): {imbalance:.2f}' in lines
    assert any(line.startswith('objective: explicit') for line in lines)
    assert 'flops' in text
    rows = {}
    for line in lines:
        fields = line.split()
        if fields and fields[0] in ('0', '1', '2'):
            rows[int(fields[0])] = fields
    assert sorted(rows) == [0, 1, 2]
    assert rows[0][-3:] == ['4', '1.2G', f'{100 * sums[0] / sum(sums):.1f}%']
    assert rows[1][-3:] == ['1', '900M', f'{100 * sums[1] / sum(sums):.1f}%']
    assert rows[2][-3:] == ['2', '350M', f'{100 * sums[2] / sum(sums):.1f}%']
    # Fixed width: the cost column is right-aligned, so every row ends at the same column.
    row_lines = [line for line in lines if line.split() and line.split()[0] in '012']
    assert len({len(line) for line in row_lines}) == 1


def test_report_zero_costs():
    p = partition.make_partition(['a', 'b'], [0, 0], 2)
    assert p.imbalance == 1.0
    assert p.cell_shares == [0.0, 0.0]
    assert 'imbalance (max/mean): 1.00' in p.report()


def test_exact_for_floats_that_do_not_add_up_in_binary():
    # 0.1 + 0.2 > 0.3 in binary floating point, so [0.3 | 0.1, 0.2] has the smaller max
    # only when sums are exact; both cells cost 0.3 in decimal arithmetic.
    costs = [0.3, 0.1, 0.2]
    sizes = partition.partition_min_max(costs, 2)
    best = min(_compositions(3, 2), key=lambda s: max(_cell_costs_exact(costs, s)))
    assert max(_cell_costs_exact(costs, sizes)) == max(_cell_costs_exact(costs, best))
    assert math.isclose(sum(costs[:sizes[0]]), 0.3)
