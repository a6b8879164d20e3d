"""Cost-based partitioning of a layer sequence into contiguous pipeline cells.

GPipe runs a sequence of L layers as K cells, one per device; a cell is a
contiguous run of layers. The pipeline is as fast as its slowest cell, so the
split should balance the estimated per-layer cost (usually FLOPs).

Objectives offered here:

* ``min_max``: minimise the largest cell cost (the pipeline's bottleneck),
  exactly. Ties are broken by the smaller sum of squared cell costs, then by the
  more even layer counts, then by putting larger cells first.
* ``min_variance``: minimise the variance of the cell costs (equivalently their
  sum of squares), exactly, with the same secondary tie-breaks.
* ``uniform``: equal layer counts, costs ignored.
* ``explicit``: user-given split points.

``lingvo_cumulative_split`` reproduces Lingvo's original heuristic for
comparison only.

Exactness: costs are converted to integers over a common denominator (every
finite float is a dyadic rational), so all sums and comparisons are exact and
the result never depends on floating-point summation order.
"""

import bisect
import dataclasses
import fractions
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "format_si",
    "lingvo_cumulative_split",
    "make_partition",
    "METHODS",
    "Partition",
    "partition_min_max",
    "partition_min_variance",
    "split_points_to_sizes",
    "uniform_sizes",
]

METHODS = ('min_max', 'min_variance', 'uniform', 'explicit')

_OBJECTIVES = {
    'min_max': 'min_max (minimise the largest cell cost; ties: smaller sum of squares)',
    'min_variance': 'min_variance (minimise the variance of cell costs)',
    'uniform': 'uniform (equal layer counts, costs ignored)',
    'explicit': 'explicit (user-given split points)',
    'lingvo_cumulative': 'lingvo_cumulative (Lingvo cumulative-cost heuristic)',
}


# ----------------------------------------------------------------------------
# Validation and exact arithmetic.


def _exact_costs(costs: Sequence[float], name: str) -> list[int]:
    """Validates `costs` and returns them as integers over a common denominator.

    Scaling by a common positive factor preserves every comparison between sums
    of costs, so the partitioners can work on Python ints without rounding.
    """
    if isinstance(costs, (str, bytes)):
        raise ValueError(f'{name} must be a sequence of numbers (one cost per layer), '
                         f'got a string {costs!r}')
    if isinstance(costs, np.ndarray) and costs.ndim != 1:
        raise ValueError(f'{name} must be 1-D (one cost per layer), got shape {costs.shape}')
    try:
        values = list(costs)
    except TypeError:
        raise ValueError(f'{name} must be a sequence of numbers (one cost per layer), '
                         f'got {type(costs).__name__}') from None
    if not values:
        raise ValueError(f'{name} is empty; pass one cost per layer (at least one layer)')
    fracs = []
    for i, value in enumerate(values):
        if isinstance(value, fractions.Fraction):
            frac = value
        elif isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            frac = fractions.Fraction(int(value))
        else:
            try:
                as_float = float(value)
            except (TypeError, ValueError):
                raise ValueError(f'{name}[{i}]={value!r} is not a number; '
                                 f'pass a finite cost >= 0 for every layer') from None
            if isinstance(value, (bool, np.bool_)):
                raise ValueError(f'{name}[{i}]={value!r} is a bool; pass a numeric cost')
            if not math.isfinite(as_float):
                raise ValueError(f'{name}[{i}]={value!r} is not finite; '
                                 f'pass a finite cost >= 0 for every layer')
            frac = fractions.Fraction(as_float)
        if frac < 0:
            raise ValueError(f'{name}[{i}]={value!r} is negative; layer costs must be >= 0')
        fracs.append(frac)
    denominator = math.lcm(*(f.denominator for f in fracs))
    return [f.numerator * (denominator // f.denominator) for f in fracs]


def _check_num_cells(num_cells: int, num_layers: int) -> int:
    if isinstance(num_cells, (bool, np.bool_)) or not isinstance(num_cells, (int, np.integer)):
        raise ValueError(f'num_cells must be an int >= 1, got {num_cells!r}; '
                         f'pass the number of pipeline cells (devices)')
    num_cells = int(num_cells)
    if num_cells < 1:
        raise ValueError(f'num_cells={num_cells} must be >= 1; '
                         f'pass the number of pipeline cells (devices)')
    if num_cells > num_layers:
        raise ValueError(f'num_cells={num_cells} exceeds the number of layers {num_layers}; '
                         f'use at most {num_layers} cells or split layers further')
    return num_cells


def _prefix_sums(values: Sequence[int]) -> list[int]:
    prefix = [0]
    for v in values:
        prefix.append(prefix[-1] + v)
    return prefix


# ----------------------------------------------------------------------------
# Exact dynamic programmes.


def _cells_needed(weights: Sequence[int], limit: int) -> int:
    """Fewest contiguous cells with cost <= limit each (greedy is optimal here)."""
    count, current = 1, 0
    for w in weights:
        if w > limit:
            return len(weights) + 1
        if current + w > limit:
            count += 1
            current = w
        else:
            current += w
    return count


def _optimal_max_cost(weights: list[int], num_cells: int) -> int:
    """The exact minimum over partitions of the largest cell cost.

    The optimum is the cost of some cell, i.e. one of the O(L^2) segment sums;
    a binary search over their sorted set with a greedy feasibility test finds
    the smallest feasible one. With costs >= 0, a split into fewer than K cells
    can always be refined into exactly K non-empty cells (K <= L) without
    raising the maximum, so "feasible with <= K cells" is the right test.
    """
    prefix = _prefix_sums(weights)
    n = len(weights)
    total = prefix[-1]
    lower = max(max(weights), -(-total // num_cells))
    candidates = sorted({prefix[j] - prefix[i]
                         for i in range(n) for j in range(i + 1, n + 1)
                         if prefix[j] - prefix[i] >= lower})
    lo, hi = 0, len(candidates) - 1  # candidates[-1] == total is always feasible.
    while lo < hi:
        mid = (lo + hi) // 2
        if _cells_needed(weights, candidates[mid]) <= num_cells:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _min_squares_sizes(weights: list[int], num_cells: int, limit: int | None) -> list[int]:
    """Exact DP over suffixes minimising, lexicographically,

    1. the sum of squared cell costs,
    2. the sum of squared cell sizes (even layer counts, e.g. for zero costs),
    3. then preferring larger cells first (lexicographically largest sizes),

    subject to every cell cost <= `limit` (no limit when None). best[c][i] is the
    optimal key for splitting layers i..L-1 into c cells; taking the largest
    optimal end of the first cell at every step yields the lexicographically
    largest sizes among optimal solutions.
    """
    n = len(weights)
    prefix = _prefix_sums(weights)
    total = prefix[-1]
    size_scale = n * n + 1  # > any sum of squared sizes, so criterion 1 dominates.
    infeasible = total * total * size_scale + size_scale  # > any feasible key.
    if limit is None:
        limit = total
    # ends[i]: the largest j such that layers i..j-1 fit under the limit.
    ends = [bisect.bisect_right(prefix, prefix[i] + limit) - 1 for i in range(n)]

    # c == 1: the last cell covers layers i..n-1.
    previous = [infeasible] * (n + 1)
    for i in range(num_cells - 1, n):
        if prefix[n] - prefix[i] <= limit:
            previous[i] = (prefix[n] - prefix[i]) ** 2 * size_scale + (n - i) ** 2
    choices: list[list[int]] = [[]] * (num_cells + 1)
    for c in range(2, num_cells + 1):
        current = [infeasible] * (n + 1)
        choice = [0] * (n + 1)
        # With c cells left, the first of them starts at i in [K-c, n-c].
        for i in range(num_cells - c, n - c + 1):
            pi = prefix[i]
            j_stop = min(n - c + 1, ends[i]) + 1
            if j_stop <= i + 1:
                continue
            values = [(prefix[j] - pi) ** 2 * size_scale + (j - i) ** 2 + previous[j]
                      for j in range(i + 1, j_stop)]
            best = min(values)
            if best >= infeasible:
                continue
            current[i] = best
            choice[i] = j_stop - 1 - values[::-1].index(best)
        choices[c] = choice
        previous = current
    if previous[0] >= infeasible:  # Unreachable when limit is the true optimum.
        raise AssertionError('no feasible partition under the cost limit')
    sizes, start = [], 0
    for c in range(num_cells, 1, -1):
        stop = choices[c][start]
        sizes.append(stop - start)
        start = stop
    sizes.append(n - start)
    return sizes


# ----------------------------------------------------------------------------
# Public partitioners.


def partition_min_max(costs: Sequence[float], num_cells: int) -> list[int]:
    """Splits layers into `num_cells` contiguous cells minimising the largest cell cost.

    Exact for ints and floats. Among optimal splits the one with the smallest
    sum of squared cell costs is chosen (so 8 equal layers on 2 cells split
    4/4), then the most even layer counts, then larger cells first.

    Args:
      costs: estimated cost of each layer, finite and >= 0.
      num_cells: number of cells K, 1 <= K <= len(costs).

    Returns:
      The number of layers in each cell; they sum to len(costs).
    """
    weights = _exact_costs(costs, 'costs')
    num_cells = _check_num_cells(num_cells, len(weights))
    limit = _optimal_max_cost(weights, num_cells)
    return _min_squares_sizes(weights, num_cells, limit)


def partition_min_variance(costs: Sequence[float], num_cells: int) -> list[int]:
    """Splits layers into `num_cells` contiguous cells minimising the variance of cell costs.

    The mean cell cost is fixed (total / K), so this minimises the sum of squared
    cell costs, exactly. Ties: the most even layer counts, then larger cells first.

    Returns:
      The number of layers in each cell; they sum to len(costs).
    """
    weights = _exact_costs(costs, 'costs')
    num_cells = _check_num_cells(num_cells, len(weights))
    return _min_squares_sizes(weights, num_cells, None)


def uniform_sizes(num_layers: int, num_cells: int) -> list[int]:
    """Equal layer counts (differing by at most one, larger cells first)."""
    q, r = divmod(num_layers, num_cells)
    return [q + 1] * r + [q] * (num_cells - r)


def split_points_to_sizes(split_points: Sequence[int], num_layers: int) -> list[int]:
    """Converts explicit split points into cell sizes.

    Args:
      split_points: the layer indices where cells 1..K-1 start, strictly
        increasing, each in 1..num_layers-1. An empty sequence means one cell.
      num_layers: the number of layers L.

    Returns:
      The K = len(split_points) + 1 cell sizes.
    """
    if (isinstance(num_layers, (bool, np.bool_)) or not isinstance(num_layers, (int, np.integer))
            or num_layers < 1):
        raise ValueError(f'num_layers must be an int >= 1, got {num_layers!r}')
    num_layers = int(num_layers)
    if isinstance(split_points, (str, bytes)):
        raise ValueError(f'split_points must be a sequence of layer indices, got {split_points!r}')
    try:
        points = list(split_points)
    except TypeError:
        raise ValueError(f'split_points must be a sequence of layer indices, '
                         f'got {type(split_points).__name__}') from None
    for i, p in enumerate(points):
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise ValueError(f'split_points[{i}]={p!r} is not an int; split points are the '
                             f'layer indices where cells 1..K-1 start')
        if not 1 <= p <= num_layers - 1:
            raise ValueError(
                f'split_points[{i}]={p} is out of range: each split point must be in '
                f'1..{num_layers - 1} (the index where a cell starts; 0 or {num_layers} would '
                f'leave a cell empty)')
        if i > 0 and p <= points[i - 1]:
            raise ValueError(
                f'split_points must be strictly increasing: split_points[{i}]={p} <= '
                f'split_points[{i - 1}]={points[i - 1]}, which would leave cell {i} empty; '
                f'sort the points and remove duplicates')
    bounds = [0] + [int(p) for p in points] + [num_layers]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def lingvo_cumulative_split(costs: Sequence[float], num_cells: int) -> list[int]:
    """Lingvo's original GPipe heuristic, for comparison with the exact methods.

    Lingvo (`gpipe.PartitionSequentialLayers`) puts layer i into cell
    ``min(int(c_i * K), K - 1)`` where ``c_i`` is the cumulative cost of layers
    0..i (inclusive) divided by the total, i.e. it cuts where the cumulative cost
    histogram crosses k/K. A layer ending exactly on k/K already belongs to cell
    k, so 8 equal layers on 2 cells split 3/5 (layer 3 ends at 4/8 = 1/2 and
    goes to cell 1), whereas `partition_min_max` gives 4/4. The heuristic can
    also leave cells empty (size 0), e.g. when one layer dominates the cost;
    this function reproduces that faithfully instead of repairing it.

    Floating-point arithmetic is used as in Lingvo. Raises ValueError when the
    total cost is 0 (the normalisation is undefined).
    """
    _exact_costs(costs, 'costs')
    values = [float(c) for c in costs]
    num_cells = _check_num_cells(num_cells, len(values))
    cumulative, running = [], 0.0
    for v in values:
        running += v
        cumulative.append(running)
    total = running
    if total == 0:
        raise ValueError('costs sum to 0: the cumulative-cost heuristic is undefined; '
                         'use method="uniform" or give non-zero costs')
    sizes = [0] * num_cells
    for c in cumulative:
        sizes[min(int(float(c / total) * num_cells), num_cells - 1)] += 1
    return sizes


# ----------------------------------------------------------------------------
# The Partition record.


def format_si(value: float) -> str:
    """Formats a non-negative number with 3 significant digits and an SI suffix (12k, 1.2G)."""
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    suffixes = ['', 'k', 'M', 'G', 'T', 'P', 'E', 'Z', 'Y']
    index = 0
    scaled = value
    while index < len(suffixes) - 1 and abs(float(f'{scaled:.3g}')) >= 1000:
        scaled /= 1000.0
        index += 1
    return f'{scaled:.3g}{suffixes[index]}'


@dataclasses.dataclass(frozen=True)
class Partition:
    """A split of named, costed layers into contiguous cells, plus a readable report.

    Attributes:
      cell_sizes: number of layers in each cell (all >= 1).
      layer_names: one name per layer.
      layer_costs: estimated cost of each layer.
      cost_name: what the costs measure, e.g. 'flops' (used in report()).
      method: the objective that produced the split (one of METHODS, or '').
    """

    cell_sizes: tuple[int, ...]
    layer_names: tuple[str, ...]
    layer_costs: tuple[float, ...]
    cost_name: str = 'flops'
    method: str = ''

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.cell_sizes)
        names = tuple(str(n) for n in self.layer_names)
        costs = tuple(float(c) for c in self.layer_costs)
        object.__setattr__(self, 'cell_sizes', sizes)
        object.__setattr__(self, 'layer_names', names)
        object.__setattr__(self, 'layer_costs', costs)
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f'cell_sizes={sizes} must be non-empty with every cell >= 1 layer')
        if len(names) != len(costs):
            raise ValueError(f'layer_names has {len(names)} entries but layer_costs has '
                             f'{len(costs)}; give one name and one cost per layer')
        if sum(sizes) != len(names):
            raise ValueError(f'cell_sizes={sizes} sum to {sum(sizes)} but there are '
                             f'{len(names)} layers; sizes must cover every layer once')

    @property
    def num_cells(self) -> int:
        return len(self.cell_sizes)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def cell_layer_ranges(self) -> list[tuple[int, int]]:
        """(start, stop) layer indices of each cell, stop exclusive."""
        ranges, start = [], 0
        for size in self.cell_sizes:
            ranges.append((start, start + size))
            start += size
        return ranges

    @property
    def cell_costs(self) -> list[float]:
        return [math.fsum(self.layer_costs[a:b]) for a, b in self.cell_layer_ranges]

    @property
    def total_cost(self) -> float:
        return math.fsum(self.layer_costs)

    @property
    def cell_shares(self) -> list[float]:
        """Each cell's fraction of the total cost (all 0.0 when the total is 0)."""
        total = self.total_cost
        if total == 0:
            return [0.0] * self.num_cells
        return [c / total for c in self.cell_costs]

    @property
    def imbalance(self) -> float:
        """Largest cell cost over the mean cell cost (1.0 is perfect; 1.0 when the total is 0)."""
        total = self.total_cost
        if total == 0:
            return 1.0
        return max(self.cell_costs) * self.num_cells / total

    def cell_of_layer(self, layer_index: int) -> int:
        """The cell that holds layer `layer_index`."""
        if not 0 <= layer_index < self.num_layers:
            raise IndexError(f'layer_index={layer_index} is out of range; '
                             f'there are {self.num_layers} layers (0..{self.num_layers - 1})')
        starts = [a for a, _ in self.cell_layer_ranges]
        return bisect.bisect_right(starts, layer_index) - 1

    def report(self, max_name_chars: int = 20) -> str:
        """A fixed-width table: one row per cell, then totals, imbalance and objective."""

        def short(name: str) -> str:
            if len(name) <= max_name_chars:
                return name
            return name[:max_name_chars - 1] + '~'

        costs = self.cell_costs
        shares = self.cell_shares
        rows = []
        for k, (a, b) in enumerate(self.cell_layer_ranges):
            if b - a == 1:
                span = f'layer {a} ({short(self.layer_names[a])})'
            else:
                span = (f'layers {a}-{b - 1} ({short(self.layer_names[a])} .. '
                        f'{short(self.layer_names[b - 1])})')
            rows.append((str(k), span, str(b - a), format_si(costs[k]),
                         f'{100.0 * shares[k]:.1f}%'))
        total_share = '100.0%' if self.total_cost > 0 else '0.0%'
        footer = ('total', '', str(self.num_layers), format_si(self.total_cost), total_share)
        header = ('cell', 'layers', '#layers', self.cost_name, 'share')
        table = [header] + rows + [footer]
        widths = [max(len(r[i]) for r in table) for i in range(5)]

        def fmt(r):
            return (f'{r[0]:>{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  '
                    f'{r[3]:>{widths[3]}}  {r[4]:>{widths[4]}}').rstrip()

        lines = [f'Partition of {self.num_layers} layers into {self.num_cells} cells '
                 f'by {self.cost_name}']
        lines.append(fmt(header))
        lines.append('-' * len(fmt(header)))
        lines.extend(fmt(r) for r in rows)
        lines.append('-' * len(fmt(header)))
        lines.append(fmt(footer))
        lines.append(f'imbalance (max/mean): {self.imbalance:.2f}')
        lines.append(f'objective: {_OBJECTIVES.get(self.method, self.method or "unspecified")}')
        return '\n'.join(lines)

    def __str__(self) -> str:
        return self.report()


def make_partition(layer_names: Sequence[str],
                   layer_costs: Sequence[float],
                   num_cells: int,
                   method: str = 'min_max',
                   split_points: Sequence[int] | None = None,
                   cost_name: str = 'flops') -> Partition:
    """Partitions named layers into `num_cells` cells with the chosen method.

    Args:
      layer_names: one name per layer.
      layer_costs: one estimated cost per layer (finite, >= 0).
      num_cells: number of cells K, 1 <= K <= number of layers.
      method: 'min_max' | 'min_variance' | 'uniform' | 'explicit'.
      split_points: required for (and only allowed with) method='explicit': the
        layer indices where cells 1..K-1 start.
      cost_name: what the costs measure, shown in the report.
    """
    if method not in METHODS:
        raise ValueError(f'method={method!r} is unknown; valid methods: {", ".join(METHODS)}')
    if isinstance(layer_names, (str, bytes)):
        raise ValueError(f'layer_names must be a sequence of names, got a string {layer_names!r}')
    names = list(layer_names)
    weights = _exact_costs(layer_costs, 'layer_costs')
    if len(names) != len(weights):
        raise ValueError(f'layer_names has {len(names)} entries but layer_costs has '
                         f'{len(weights)}; give one name and one cost per layer')
    if not all(isinstance(n, str) for n in names):
        raise ValueError('layer_names must all be strings')
    num_layers = len(names)
    num_cells = _check_num_cells(num_cells, num_layers)
    if method == 'explicit':
        if split_points is None:
            raise ValueError('method="explicit" requires split_points: the layer indices where '
                             'cells 1..K-1 start')
        sizes = split_points_to_sizes(split_points, num_layers)
        if len(sizes) != num_cells:
            raise ValueError(f'split_points gives {len(sizes)} cells but num_cells={num_cells}; '
                             f'pass exactly num_cells - 1 = {num_cells - 1} split points')
    else:
        if split_points is not None:
            raise ValueError(f'split_points is only used with method="explicit", got '
                             f'method={method!r}; drop split_points or set method="explicit"')
        if method == 'min_max':
            limit = _optimal_max_cost(weights, num_cells)
            sizes = _min_squares_sizes(weights, num_cells, limit)
        elif method == 'min_variance':
            sizes = _min_squares_sizes(weights, num_cells, None)
        else:
            sizes = uniform_sizes(num_layers, num_cells)
    return Partition(cell_sizes=tuple(sizes), layer_names=tuple(names),
                     layer_costs=tuple(float(c) for c in layer_costs), cost_name=cost_name,
                     method=method)
