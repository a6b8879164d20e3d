"""GPipe with the micro-batches in a loop: a step's graph and start-up stop growing with T.

The unrolled `Executor` emits one call per action, 2 x K x T calls, and each costs start-up
time: ~7 ms of Python to trace the call into the step's graph, and graph optimisation per call
site when the step first runs (BENCHMARKS.md, section 11). `LoopExecutor` runs GPipe's
fill-drain schedule with re-materialisation 'always' (GPipe's own setting) as two
`tf.while_loop`s, one over the forwards and one over the backwards, whose bodies call every
cell once: a step holds 2K calls whatever T is, as Lingvo's GPipe (a While loop) and praxis (a
scan) do. The TensorArrays that carry values between the loops are set up from the cells'
traces (`CellFunctions.forward_output_specs`), and the gradient sums start as scalar zeros of
unknown shape, so the first micro-batch's gradients become the sums by broadcasting: no
weight-sized zeros, and one trace of each cell's backward.

Why the pipeline still overlaps: TensorFlow lowers the loops to its dataflow control flow,
whose iterations run concurrently (up to `parallel_iterations`). Iteration t's call of cell k
waits only for cell k-1's output of the same iteration and for cell k's own call of the
previous iteration, through data: in the forward, cell k's example offset is its previous
call's plus the micro-batch size; in the backward, its gradient sums. So while cell 1 runs
micro-batch t, cell 0 runs micro-batch t + 1, and no device ever runs two calls at once (serial
devices rely on that): the schedule the unrolled executor emits, and the profiler sees GPipe's
per-cell order. Two things TensorFlow does by default would undo it, and are switched off for
the loops: automatic control dependencies in the bodies (every output would wait for every
call of its iteration: no overlap at all) and placing the loop variables' plumbing on the
default device (every iteration would copy every cell's state there and back).

Each cell keeps its boundary input of every micro-batch (a TensorArray on the cell's device)
for its backward, which re-runs the forward from it, as the unrolled executor does with
remat='always'. Gradients are those of the unrolled executor.

Example (two cells on the default device, four micro-batches):
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> from lingvo_lite.pipeline import cell_functions
    >>> from lingvo_lite.pipeline.schedules import schedule
    >>> fns = [cell_functions.CellFunctions(k, lambda th, x: x * th.w) for k in range(2)]
    >>> run = LoopExecutor(fns, lambda k: tf.name_scope(""))
    >>> thetas = [NestedMap(w=tf.constant(2.0)), NestedMap(w=tf.constant(5.0))]
    >>> xs = [tf.constant([float(t)]) for t in range(4)]
    >>> outs = run.forward(schedule.make_schedule("gpipe", 2, 4), thetas, xs, micro_batch_size=1)
    >>> [float(y[0]) for y in outs]
    [0.0, 10.0, 20.0, 30.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.pipeline import op_names, tf_private
from lingvo_lite.pipeline.cell_functions import (
    CallInput,
    flatten,
    input_specs,
    is_trainable,
    pack,
    unpack_gradients,
)
from lingvo_lite.pipeline.executor import Executor, Key, TrainResult, report_statistics
from lingvo_lite.pipeline.schedules import schedule
from lingvo_lite.pipeline.schedules.schedule import Schedule

__all__ = ["LoopExecutor", "check_loop_supported"]

# Gradients of weights up to this size are summed in one flat vector per cell: the backward
# loop carries one tensor instead of one per bias or scale (each loop variable costs a few
# control-flow ops per iteration; at 128 layers, K=8, they took as long as the cells' work).
PACK_MAX_ELEMENTS = 1 << 16
LOOP_REMAT = "always"


def check_loop_supported(schedule_name: str, remat_mode: str, weight_gradients: str) -> None:
    """Raises a ValueError naming the parameter to change if the loop cannot run this setup."""
    loop_schedules = schedule.micro_batch_loop_schedules()
    if schedule_name not in loop_schedules:
        names = ", ".join(f"'{name}'" for name in loop_schedules)
        raise ValueError(f"micro_batch_loop=True runs schedule={names} only, got "
                         f"schedule={schedule_name!r}; set schedule={names} or "
                         "micro_batch_loop=False.")
    if remat_mode != LOOP_REMAT:
        raise ValueError(f"micro_batch_loop=True re-computes every forward (remat='{LOOP_REMAT}'),"
                         f" got remat={remat_mode!r}; set remat='{LOOP_REMAT}' or "
                         "micro_batch_loop=False.")
    if weight_gradients != "per_micro_batch":
        raise ValueError(f"micro_batch_loop=True sums weight gradients per micro-batch, got "
                         f"weight_gradients={weight_gradients!r}; set "
                         "weight_gradients='per_micro_batch' or micro_batch_loop=False.")



def packed_leaves(sources: Sequence[Any]) -> tuple[int, ...]:
    """Positions of the small weights (of the first small one's dtype) whose gradient sums
    travel as one vector; () when fewer than two qualify."""
    small = [i for i, v in enumerate(sources)
             if v.shape.num_elements() is not None
             and v.shape.num_elements() <= PACK_MAX_ELEMENTS]
    small = [i for i in small if sources[i].dtype == sources[small[0]].dtype] if small else []
    return tuple(small) if len(small) > 1 else ()


def _check_schedule(sched: Schedule) -> None:
    if not sched.runs_in_micro_batch_loop or sched.num_devices != sched.num_cells:
        raise ValueError(f"LoopExecutor runs {schedule.micro_batch_loop_schedules()} with one "
                         f"cell per device, got {sched.name!r}.")


def _present(flat: Sequence[Any]) -> tuple[bool, ...]:
    return tuple(v is not None for v in flat)


def _tensors(flat: Sequence[Any], present: Sequence[bool]) -> list[Any]:
    return [v for v, p in zip(flat, present) if p]


def _with_nones(tensors: Sequence[Any], present: Sequence[bool]) -> list[Any]:
    it = iter(tensors)
    return [next(it) if p else None for p in present]


def _arrays(specs: Sequence[tf.TensorSpec], size: int) -> list[tf.TensorArray]:
    """One empty TensorArray of `size` per spec, on the current device."""
    return [tf.TensorArray(s.dtype, size=size, element_shape=s.shape) for s in specs]


def _write(arrays: Sequence[tf.TensorArray], index: Any, values: Sequence[Any]) -> list[Any]:
    return [a.write(index, v) for a, v in zip(arrays, values)]


def _unstack(arrays: Sequence[tf.TensorArray], num: int) -> list[list[Any]]:
    """Per array, its `num` elements as separate tensors."""
    return [tf.unstack(a.stack(), num=num) for a in arrays]


def _device_of_input(op: tf.Operation) -> str:
    """Places an op without a device of its own on its first input's device.

    tf.while_loop passes every loop variable through an Identity it creates outside any scope
    of ours; placed on the default device, each iteration would copy every cell's gradient
    sums there and back (measured: 2x the step time of the unrolled schedule at K=4, T=8).
    """
    if op.device or not op.inputs:
        return op.device
    return op.inputs[0].device


class _MicroBatches:
    """The pipeline input's T micro-batches, readable by a loop's index (build it on the first
    cell's device: it holds a copy of the input)."""

    def __init__(self, xs: Sequence[Any]) -> None:
        self._xs = list(xs)
        flat = [flatten(x) for x in xs]
        # Scalars and None leaves are shared by all micro-batches (micro_batch.split).
        self._stacked = [None if first is None or first.shape.rank == 0
                         else tf.stack([f[i] for f in flat])
                         for i, first in enumerate(flat[0])]

    def read(self, t: tf.Tensor) -> Any:
        shared = flatten(self._xs[0])
        return pack(self._xs[0], [v if s is None else tf.gather(s, t)
                                  for v, s in zip(shared, self._stacked)])


@dataclasses.dataclass
class _ForwardRun:
    """What the backward loop reads of the forward loop."""

    outputs: list[Any]  # The last cell's output, by micro-batch.
    micro_batches: _MicroBatches  # Cell 0's inputs.
    input_like: list[CallInput]  # Every cell's input as specs (structure and dtypes).
    arrays: list[list[tf.TensorArray]]  # Cell k >= 1: its input's present leaves, by t.
    present: list[tuple[bool, ...]]  # Cell k >= 1: which leaves of its input are tensors.


class LoopExecutor(Executor):
    """`Executor` for GPipe with remat='always' whose step graph does not grow with T.

    Args: as `Executor`'s; `parallel_iterations` bounds how many micro-batches a loop has in
    flight (by default 2K, at least 10: enough for every cell to be busy).
    """

    def __init__(self, cells: Sequence[Any], cell_scope: Callable[[int], Any],
                 serial: bool = False, parallel_iterations: int | None = None) -> None:
        super().__init__(cells, cell_scope, serial)
        self._parallel_iterations = parallel_iterations or max(10, 2 * len(self._cells))

    @staticmethod
    def _offset(t: Any, micro_batch_size: int) -> tf.Tensor:
        """Where micro-batch t starts in the mini-batch (int64, on the current device)."""
        base = fprop_context.current().example_offset
        base = tf.cast(base, tf.int64) if tf.is_tensor(base) else tf.constant(base, tf.int64)
        return base + tf.cast(t, tf.int64) * micro_batch_size

    @staticmethod
    def _bookkeeping_scope(k: int) -> Any:
        """Example offsets and local copies of inputs are not part of an action: those of a
        micro-batch known before the loops run at the step's start, and would stretch its
        backward's box in a profile back to it."""
        return tf.name_scope(f"cell_{k}/inputs")

    @staticmethod
    def _loop_scope(phase: str, k: int, t: int | None) -> Any:
        """Call sites outside the loops name their micro-batch; inside (t None), 'loop'."""
        name = op_names.action_scope(phase, k, 0 if t is None else t)
        return tf.name_scope(name if t is not None else name[:-1] + "loop")

    def _loop(self, num_iterations: int, body: Callable[..., tuple[Any, ...]],
              state: tuple[Any, ...], name: str,
              shape_invariants: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """`state = body(i, *state)` for i = 0 .. num_iterations - 1, as a tf.while_loop
        (`shape_invariants`: like `state`, None where a value keeps its shape)."""

        def step(i: tf.Tensor, *state: Any) -> tuple[Any, ...]:
            return (i + 1, *body(i, *state))

        invariants = None if shape_invariants is None else (None, *shape_invariants)
        placement = (contextlib.nullcontext() if tf.executing_eagerly()
                     else tf.compat.v1.device(_device_of_input))
        with placement, tf_private.without_automatic_control_dependencies():
            out = tf.while_loop(lambda i, *_: i < num_iterations, step,
                                (tf.constant(0), *state), shape_invariants=invariants,
                                parallel_iterations=self._parallel_iterations, name=name)
        return tuple(out[1:])

    # -- forward ----------------------------------------------------------------------------

    def _forward_chain(self, thetas: Sequence[NestedMap], x: Any, micro_batch_size: int,
                       seeds: list[CallInput], tokens: list[Any]) -> tuple[list[CallInput], Any,
                                                                        list[Any], list[Any]]:
        """One micro-batch through every cell: (the cells' prepared inputs, the last cell's
        output, each cell's reported statistics, each cell's offset: its token)."""
        inputs, reports, new_tokens = [], [], []
        for k, cell in enumerate(self._cells):
            with self._cell_scope(k), self._bookkeeping_scope(k):
                # This micro-batch's offset from this cell's previous call's: the data
                # dependency that keeps the cell's calls in order.
                offset = tokens[k] + micro_batch_size
            with self._cell_scope(k), self._loop_scope(op_names.FORWARD, k, None):
                prepared = cell.prepare(x)
                x, offset, cell_reports = cell.forward(thetas[k], prepared, offset, seeds[k])
            inputs.append(prepared)
            reports.append(cell_reports)
            new_tokens.append(offset)
        return inputs, x, reports, new_tokens

    def _specs(self, thetas: Sequence[NestedMap], x: Any,
               seeds: list[CallInput]) -> tuple[list[CallInput], Any, list[Any]]:
        """From the cells' traces, no call: each cell's input as a CallInput of tf.TensorSpecs,
        the last cell's output and every cell's reported statistics, as specs."""
        inputs, reports = [], []
        x = input_specs(x)
        for k, cell in enumerate(self._cells):
            inputs.append(x)
            with self._cell_scope(k):
                y, cell_reports = cell.forward_output_specs(thetas[k], x, seeds[k])
            reports.append(cell_reports)
            x = input_specs(y)
        return inputs, y, reports

    def _run_forward(self, thetas: Sequence[NestedMap], xs: Sequence[Any],
                     micro_batch_size: int, seeds: list[CallInput],
                     keep_inputs: bool) -> _ForwardRun:
        """Every micro-batch's forward (with `keep_inputs`, every cell's input is kept for the
        backward). Statistics the layers reported go to the collector in micro-batch order,
        as the unrolled executor hands them on."""
        num_micro, last = len(xs), self.num_cells - 1
        with self._cell_scope(0):
            micro_batches = _MicroBatches(xs)
        input_like, y_like, reports_like = self._specs(thetas, xs[0], seeds)
        y_present = _present(flatten(y_like))

        def outputs_of(y: Any, reports: list[Any]) -> list[Any]:
            return _tensors(flatten(y), y_present) + [
                leaf for cell_reports in reports for _, s in cell_reports
                for leaf in tf.nest.flatten(s)]

        present = [_present(x.leaves) for x in input_like[1:]] if keep_inputs else []
        with self._cell_scope(last):
            out_arrays = _arrays(outputs_of(y_like, reports_like), num_micro)
        in_arrays, tokens = [], []
        for k in range(1, len(present) + 1):
            with self._cell_scope(k):
                in_arrays.append(_arrays(_tensors(input_like[k].leaves, present[k - 1]),
                                         num_micro))
        for k in range(self.num_cells):
            with self._cell_scope(k), self._bookkeeping_scope(k):
                tokens.append(self._offset(0, micro_batch_size) - micro_batch_size)

        def body(t: tf.Tensor, tokens: list[Any], out_arrays: list[Any],
                 in_arrays: list[list[Any]]) -> tuple[Any, ...]:
            with self._cell_scope(0):
                x = micro_batches.read(t)
            inputs, y, reports, tokens = self._forward_chain(thetas, x, micro_batch_size, seeds,
                                                             tokens)
            with self._cell_scope(last):
                out_arrays = _write(out_arrays, t, outputs_of(y, reports))
            written = []
            for k in range(1, len(present) + 1):
                with self._cell_scope(k):
                    written.append(_write(in_arrays[k - 1], t,
                                          _tensors(inputs[k].leaves, present[k - 1])))
            return tokens, out_arrays, written

        _, out_arrays, in_arrays = self._loop(num_micro, body, (tokens, out_arrays, in_arrays),
                                              "forward_loop")
        with self._cell_scope(last):
            per_leaf = _unstack(out_arrays, num_micro)
        num_y = sum(y_present)
        outputs = [pack(y_like, _with_nones([leaf[t] for leaf in per_leaf[:num_y]], y_present))
                   for t in range(num_micro)]
        for t in range(num_micro):
            reported = iter(leaf[t] for leaf in per_leaf[num_y:])
            for cell_reports in reports_like:
                report_statistics([(layer, tf.nest.pack_sequence_as(
                    s, [next(reported) for _ in tf.nest.flatten(s)]))
                    for layer, s in cell_reports])
        return _ForwardRun(outputs, micro_batches, input_like, in_arrays, present)

    def forward(self, sched: Schedule, thetas: Sequence[NestedMap], xs: Sequence[Any],
                micro_batch_size: int) -> list[Any]:
        """The last cell's output for each micro-batch (forward only: eval and inference)."""
        _check_schedule(sched)
        if len(xs) == 1:
            return super().forward(sched, thetas, xs, micro_batch_size)
        return self._run_forward(thetas, xs, micro_batch_size, self._step_seeds(),
                                 keep_inputs=False).outputs

    # -- backward ---------------------------------------------------------------------------

    def _input_at(self, run: _ForwardRun, k: int, t: Any) -> CallInput:
        """Cell k's prepared input of micro-batch t (build it in the cell's scope)."""
        if k == 0:
            return self._cells[0].prepare(run.micro_batches.read(t))
        like = run.input_like[k]
        leaves = _with_nones([a.read(t) for a in run.arrays[k - 1]], run.present[k - 1])
        return CallInput(like.like, tuple(leaves), like.was_int32)

    def _backward_chain(self, run: _ForwardRun, thetas: Sequence[NestedMap], t: tf.Tensor,
                        dy: Any, sums: list[list[Any]], packed: list[tuple[int, ...]],
                        tokens: list[list[Any]], micro_batch_size: int, seeds: list[CallInput],
                        need_input_grads: bool) -> tuple[list[Any], list[list[Any]],
                                                         list[list[Any]]]:
        """Micro-batch t's backward through every cell, last to first: (cell 0's input
        gradient per leaf, or [] if not needed; the new sums; the new tokens)."""
        sums, tokens = list(sums), list(tokens)
        dx: list[Any] = []
        for k in reversed(range(self.num_cells)):
            with self._cell_scope(k), self._bookkeeping_scope(k):
                offset = self._offset(t, micro_batch_size)
                x = self._input_at(run, k, t)
            with self._cell_scope(k), self._loop_scope(op_names.BACKWARD, k, None), \
                    tf.control_dependencies(tokens[k]):
                dx, sums[k] = self._cells[k].backward(
                    thetas[k], x, dy, sums[k], offset, seeds[k],
                    need_dx=k > 0 or need_input_grads, packed=packed[k])
            if tokens[k]:  # A cell without weights: its sums cannot chain its calls.
                with self._cell_scope(k), self._bookkeeping_scope(k):
                    tokens[k] = [tf.size(g, out_type=tf.int64) for g in dx if g is not None][:1]
            if k > 0:
                dy = pack(x.like, dx)
        return dx, sums, tokens

    def train(self, sched: Schedule, thetas: Sequence[NestedMap], xs: Sequence[Any],
              micro_batch_size: int, keep: frozenset[Key], loss_gradient: Callable[[Any], Any],
              need_input_grads: bool = False, batch_dim: int = 0,
              batched_weight_grads: bool = False) -> TrainResult:
        """As `Executor.train`, for GPipe with nothing kept (remat='always')."""
        _check_schedule(sched)
        if keep or (batched_weight_grads and len(xs) > 1):
            raise ValueError("LoopExecutor re-computes every forward and sums weight gradients "
                             "per micro-batch: keep must be empty, batched_weight_grads False.")
        num_micro = len(xs)
        if num_micro == 1:
            return super().train(sched, thetas, xs, micro_batch_size, keep, loss_gradient,
                                 need_input_grads, batch_dim)
        seeds = self._step_seeds()
        run = self._run_forward(thetas, xs, micro_batch_size, seeds, keep_inputs=True)
        dys = [loss_gradient(y) for y in run.outputs]
        dy_present = _present(flatten(dys[0]))
        with self._cell_scope(self.num_cells - 1):
            dy_stacked = [tf.stack(parts) for parts in
                          zip(*[_tensors(flatten(d), dy_present) for d in dys])]

        def dy_at(t: tf.Tensor) -> Any:
            with self._cell_scope(self.num_cells - 1):
                return pack(dys[0], _with_nones([tf.gather(s, t) for s in dy_stacked],
                                                dy_present))

        sources = [[v for v in theta.Flatten() if is_trainable(v)] for theta in thetas]
        packed = [packed_leaves(s) for s in sources]
        # The sums start as scalar zeros of unknown shape: the first micro-batch's gradients
        # then become them by broadcasting, with no weight-sized zeros and one trace of each
        # cell's backward for all micro-batches.
        sums, tokens = [], []
        for k in range(self.num_cells):
            with self._cell_scope(k), self._bookkeeping_scope(k):
                sums.append([tf.zeros([], dtype) for dtype in _sum_dtypes(sources[k], packed[k])])
                tokens.append([] if sums[k] else [tf.constant(0, tf.int64)])
        dx_like = run.input_like[0].leaves if need_input_grads else ()
        dx_present = tuple(v is not None and v.dtype.is_floating for v in dx_like)
        with self._cell_scope(0):
            dx_arrays = _arrays(_tensors(dx_like, dx_present), num_micro)

        def body(i: tf.Tensor, sums: list[list[Any]], tokens: list[list[Any]],
                 dx_arrays: list[Any]) -> tuple[Any, ...]:
            t = num_micro - 1 - i
            dx, sums, tokens = self._backward_chain(run, thetas, t, dy_at(t), sums, packed,
                                                    tokens, micro_batch_size, seeds,
                                                    need_input_grads)
            with self._cell_scope(0):
                dx_arrays = _write(dx_arrays, t, _tensors(dx, dx_present))
            return sums, tokens, dx_arrays

        invariants = (tf.nest.map_structure(lambda _: tf.TensorShape(None), sums),
                      tf.nest.map_structure(lambda _: None, tokens),
                      [None] * len(dx_arrays))
        sums, _, dx_arrays = self._loop(num_micro, body, (sums, tokens, dx_arrays),
                                        "backward_loop", invariants)
        input_grads = None
        if need_input_grads:
            with self._cell_scope(0):
                per_leaf = _unstack(dx_arrays, num_micro)
            input_grads = [_with_nones([leaf[t] for leaf in per_leaf], dx_present)
                           for t in range(num_micro)]
        grad_sums = []
        for k in range(self.num_cells):
            with self._cell_scope(k):
                grad_sums.append(unpack_gradients(sums[k], packed[k], sources[k]))
        return TrainResult(outputs=run.outputs, grad_sums=grad_sums, input_grads=input_grads)


def _sum_dtypes(sources: Sequence[Any], packed: tuple[int, ...]) -> list[tf.DType]:
    """The dtypes of a cell's gradient sums: the packed vector's, then each other leaf's."""
    rest = [v.dtype for i, v in enumerate(sources) if i not in packed]
    return ([sources[packed[0]].dtype] if packed else []) + rest
