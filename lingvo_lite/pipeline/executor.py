"""Runs a schedule: each action of a `Schedule` becomes calls of its cell's functions.

`PipeliningLayer` decides what to run (partition, devices, micro-batches, schedule, remat plan);
the `Executor` walks the schedule's actions in a dependency-respecting order and emits, for each:

- F(k, t): cell k's forward function on the boundary value of micro-batch t, on device k. If
  `keep` holds (k, t) its ops run inline under a tape, so its activations stay for the
  backward and are freed layer by layer as the backward passes them (a function call's
  gradient would hold them all until it returns: `CellFunctions.forward`); on serial devices,
  where only a call runs one op at a time, it stays a call under the tape;
- B(k, t): for a kept micro-batch, the gradient of that tape, then one call that adds the weight
  gradients to the cell's running sums; otherwise one call of cell k's backward function, which
  re-runs the forward (it waits for the upstream gradient: a call starts once all its inputs
  exist), differentiates it and adds the weight gradients to the sums.

Every action of cell k waits (control dependencies) for the previous action of cell k in the
schedule's per-cell order, so the schedule object is what actually runs, and different cells
overlap. All state of a step is explicit in `StepState`. Names follow `op_names`.

Example (two cells on the default device, two micro-batches):
    >>> import tensorflow as tf
    >>> from lingvo_lite.nested_map import NestedMap
    >>> from lingvo_lite.pipeline import cell_functions, schedule
    >>> fns = [cell_functions.CellFunctions(k, lambda th, x: x * th.w) for k in range(2)]
    >>> run = Executor(fns, lambda k: tf.name_scope(""))
    >>> thetas = [NestedMap(w=tf.constant(2.0)), NestedMap(w=tf.constant(5.0))]
    >>> outs = run.forward(schedule.make_schedule("gpipe", 2, 2), thetas,
    ...                    [tf.constant([1.0]), tf.constant([3.0])], micro_batch_size=1)
    >>> [float(y[0]) for y in outs]
    [10.0, 30.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import tensorflow as tf

from lingvo_lite import fprop_context
from lingvo_lite.nested_map import NestedMap
from lingvo_lite.pipeline import op_names, tf_private
from lingvo_lite.pipeline.cell_functions import (
    CallInput,
    CellFunctions,
    flatten,
    float_outputs_and_gradients,
    is_float,
    is_trainable,
    pack,
)
from lingvo_lite.pipeline.schedule import Action, Phase, Schedule

Key = tuple[int, int]  # (cell, micro_batch)


@dataclasses.dataclass
class StepState:
    """Everything a training step carries between actions."""

    boundary: dict[Key, Any]  # Input of F(k, t); prepared (CallInput) for B(k, t) once F ran.
    offsets: dict[Key, tf.Tensor]  # Example offset of micro-batch t at cell k (int64).
    outputs: dict[int, Any] = dataclasses.field(default_factory=dict)  # Last cell's, by t.
    tapes: dict[Key, tuple[tf.GradientTape, Any]] = dataclasses.field(default_factory=dict)
    upstream: dict[Key, Any] = dataclasses.field(default_factory=dict)  # Gradient for B(k, t).
    grad_sums: list[list[Any]] = dataclasses.field(default_factory=list)  # Per cell ([]: none yet).
    input_grads: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    last_ops: list[list[Any]] = dataclasses.field(default_factory=list)  # Per device.
    zeros: dict[tuple[Any, ...], tf.Tensor] = dataclasses.field(default_factory=dict)
    # What W(k, t) of a split backward needs: boundary input, upstream gradient, offset.
    weight_inputs: dict[Key, tuple[Any, Any, tf.Tensor]] = dataclasses.field(
        default_factory=dict)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """outputs[t]: the last cell's output; grad_sums[k]: cell k's summed weight gradients (one
    per trainable leaf of its theta); input_grads[t]: per leaf of the input (if asked)."""

    outputs: list[Any]
    grad_sums: list[list[Any]]
    input_grads: list[list[Any]] | None


class Executor:
    """Emits a schedule's actions over K cells.

    Args:
      cells: cell k's functions, for k = 0..K-1.
      cell_scope: `cell_scope(k)` places cell k's ops (a device scope).
      serial: build tape gradients of kept actions on the single-threaded executor too.
    """

    def __init__(self, cells: Sequence[CellFunctions],
                 cell_scope: Callable[[int], ContextManager[Any]], serial: bool = False) -> None:
        self._cells = list(cells)
        self._cell_scope = cell_scope
        self._serial = serial

    @property
    def num_cells(self) -> int:
        return len(self._cells)

    def _action_scope(self, phase: str, k: int, t: int) -> Any:
        return tf.name_scope(op_names.action_scope(phase, k, t))

    def _first_offsets(self, num_micro_batches: int,
                       micro_batch_size: int) -> dict[Key, tf.Tensor]:
        """Where each micro-batch starts in the mini-batch (dropout masks are keyed by it).

        Only cell 0 gets these; each forward call hands its offset on to the next cell.
        """
        base = fprop_context.current().example_offset
        out = {}
        with self._cell_scope(0), tf.name_scope("cell_0/example_offsets"):
            for t in range(num_micro_batches):
                offset = base + t * micro_batch_size
                out[(0, t)] = (tf.constant(offset, tf.int64) if isinstance(offset, int)
                               else tf.cast(offset, tf.int64))
        return out

    def _step_seeds(self) -> list[CallInput]:
        """The step seed that dropout draws from, as an argument on each cell's device."""
        seed = tf.convert_to_tensor(fprop_context.current().step_seed)
        out = []
        for k, cell in enumerate(self._cells):
            with self._cell_scope(k), tf.name_scope(f"cell_{k}/step_seed"):
                out.append(cell.prepare(seed))
        return out

    def forward(self, sched: Schedule, thetas: Sequence[NestedMap], xs: Sequence[Any],
                micro_batch_size: int) -> list[Any]:
        """The last cell's output for each micro-batch (forward only: eval and inference)."""
        seeds = self._step_seeds()
        offsets = self._first_offsets(len(xs), micro_batch_size)
        boundary = {(0, t): x for t, x in enumerate(xs)}
        outputs: dict[int, Any] = {}
        for action in sched.actions():
            if action.phase is not Phase.FORWARD:
                continue
            k, t = action.cell, action.micro_batch
            with self._cell_scope(k), self._action_scope(op_names.FORWARD, k, t):
                x = self._cells[k].prepare(boundary.pop((k, t)))
                y, offsets[(k + 1, t)], reports = self._cells[k].forward(
                    thetas[k], x, offsets.pop((k, t)), seeds[k])
            report_statistics(reports)
            if k == self.num_cells - 1:
                outputs[t] = y
            else:
                boundary[(k + 1, t)] = y
        return [outputs[t] for t in range(len(xs))]

    def train(self, sched: Schedule, thetas: Sequence[NestedMap], xs: Sequence[Any],
              micro_batch_size: int, keep: frozenset[Key], loss_gradient: Callable[[Any], Any],
              need_input_grads: bool = False, batch_dim: int = 0,
              batched_weight_grads: bool = False) -> TrainResult:
        """Forward and backward of every micro-batch, weight gradients summed per cell.

        Args:
          sched: the schedule (its per-cell orders are the order things run in).
          thetas: each cell's theta (a NestedMap), on its device.
          xs: the micro-batches.
          micro_batch_size: examples per micro-batch (dropout masks are keyed by position).
          keep: the (cell, micro-batch) whose forward keeps its activations
            (`remat.remat_plan`); the others are re-computed in their backward.
          loss_gradient: `loss_gradient(y)` -> the gradient to start the last cell's
            backward from, shaped like its output y (None leaves for no gradient).
          need_input_grads: also compute d(loss)/d(micro-batch) for every float input leaf.
          batch_dim: the examples' axis (micro-batches are concatenated along it).
          batched_weight_grads: each backward computes only the input gradient; once a
            cell's last backward ran, one call re-runs its forward on all its micro-batches
            (concatenated) and takes the weight gradient of the whole mini-batch: one
            weight-sized gradient per cell instead of T (see `_batched_weight_gradient`).
        """
        seed = self._step_seeds()
        state = StepState(boundary={(0, t): x for t, x in enumerate(xs)},
                          offsets=self._first_offsets(len(xs), micro_batch_size),
                          last_ops=[[] for _ in range(sched.num_devices)])
        sources = [[v for v in theta.Flatten() if is_trainable(v)] for theta in thetas]
        # [] until a cell's first weight gradient, which becomes its sums as it is: starting
        # from zeros would hold one more weight-sized buffer per weight all step.
        state.grad_sums = [[] for _ in range(self.num_cells)]
        # One micro-batch has nothing to batch: the extra re-run would be pure cost.
        batched_weight_grads = batched_weight_grads and len(xs) > 1
        if batched_weight_grads and sched.splits_backward:
            raise ValueError(
                f"weight_gradients='batched' with schedule={sched.name!r}: that schedule already "
                "splits each backward into B and W; use weight_gradients='per_micro_batch'.")
        last_backward = {k: max(i for i, a in enumerate(sched.cell_order(k))
                                if a.phase is not Phase.FORWARD)
                         for k in range(self.num_cells)}
        done_actions = dict.fromkeys(range(self.num_cells), 0)
        for action in sched.actions():
            k = action.cell
            device = sched.device_of_cell(k)
            if action.phase is Phase.FORWARD:
                self._train_forward(action, device, state, thetas, sources, keep, seed,
                                    batched_weight_grads)
            elif action.phase is Phase.BACKWARD:
                self._train_backward(action, device, state, thetas, sources, seed,
                                     loss_gradient, need_input_grads,
                                     sched.splits_backward or batched_weight_grads)
            else:
                self._train_weight_gradient(action, device, state, thetas, seed)
            if batched_weight_grads and done_actions[k] == last_backward[k]:
                self._batched_weight_gradient(k, device, len(xs), state, thetas, seed,
                                              batch_dim)
            done_actions[k] += 1
        num_micro = len(xs)
        return TrainResult(
            outputs=[state.outputs[t] for t in range(num_micro)],
            grad_sums=state.grad_sums,
            input_grads=([state.input_grads[t] for t in range(num_micro)]
                         if need_input_grads else None))

    def _train_forward(self, action: Action, device: int, state: StepState,
                       thetas: Sequence[NestedMap], sources: list[list[Any]],
                       keep: frozenset[Key], seed: list[CallInput],
                       batched_weight_grads: bool) -> None:
        k, t = action.cell, action.micro_batch
        offset = state.offsets[(k, t)]  # Kept for the backward.
        with self._cell_scope(k), self._action_scope(op_names.FORWARD, k, t), \
                tf.control_dependencies(state.last_ops[device]):
            # The local copy serves the backward too (re-computation or tape).
            x = state.boundary[(k, t)] = self._cells[k].prepare(state.boundary[(k, t)])
            if (k, t) in keep:
                tape = tf.GradientTape(watch_accessed_variables=False)
                with tape:
                    tape.watch([v for v in x.leaves if is_float(v)] + sources[k])
                    # Inline, so the backward frees the activations layer by layer; on
                    # serial devices only a call runs one op at a time.
                    y, next_offset, reports = self._cells[k].forward(
                        thetas[k], x, offset, seed[k], inline=not self._serial)
                state.tapes[(k, t)] = (tape, y)
            else:
                y, next_offset, reports = self._cells[k].forward(thetas[k], x, offset, seed[k])
        if batched_weight_grads and reports:
            layer = reports[0][0]
            raise ValueError(
                f"weight_gradients='batched' re-runs cell {k} on all micro-batches at once, but "
                f"its layer '{getattr(layer, 'path', layer)}' computes statistics per "
                "micro-batch (e.g. batch norm), which would change; use "
                "weight_gradients='per_micro_batch'.")
        report_statistics(reports)
        state.last_ops[device] = [v for v in flatten(y) if v is not None]
        if k == self.num_cells - 1:
            state.outputs[t] = y
        else:
            state.boundary[(k + 1, t)] = y
            state.offsets[(k + 1, t)] = next_offset

    def _train_backward(self, action: Action, device: int, state: StepState,
                        thetas: Sequence[NestedMap], sources: list[list[Any]],
                        seed: list[CallInput], loss_gradient: Callable[[Any], Any],
                        need_input_grads: bool, split: bool) -> None:
        """B(k, t): the whole backward, or with `split` only the input gradient (W follows)."""
        k, t = action.cell, action.micro_batch
        offset = state.offsets.pop((k, t))
        if k == self.num_cells - 1:
            upstream = loss_gradient(state.outputs[t])
        else:
            upstream = state.upstream.pop((k, t))
        x = state.boundary.pop((k, t))
        need_dx = k > 0 or need_input_grads
        if split:
            # W(k, t) re-runs the forward and takes the weight gradient later.
            state.weight_inputs[(k, t)] = (x, upstream, offset)
        sums: list[Any] = []
        with self._cell_scope(k), self._action_scope(op_names.BACKWARD, k, t), \
                tf.control_dependencies(state.last_ops[device]):
            if (k, t) in state.tapes:
                tape, y = state.tapes.pop((k, t))
                ys, dys = float_outputs_and_gradients(
                    y, flatten(upstream), lambda i, leaf: self._zeros(state, k, i, leaf))
                x_sources = [v for v in x.leaves if is_float(v)] if need_dx else []
                weights = [] if split else sources[k]
                if x_sources or weights:
                    with tf_private.serial_function_calls(self._serial):
                        grads = tape.gradient(
                            ys, x_sources + weights, output_gradients=dys,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
                else:
                    grads = []
                dx_iter = iter(grads[:len(x_sources)])
                dx = [next(dx_iter) if is_float(v) else None for v in x.leaves] \
                    if need_dx else []
                if not split:
                    weight_grads = [tf.convert_to_tensor(g) for g in grads[len(x_sources):]]
                    sums = (self._cells[k].accumulate(state.grad_sums[k], weight_grads)
                            if state.grad_sums[k] else weight_grads)
                    dx = _after(dx, sums)
            elif split and not need_dx:
                dx = []  # Cell 0's input gradient is not needed: W does all the work.
            else:
                # The upstream gradient is an input of the call, so the re-computation starts
                # only once it exists: it stays in the backward pass.
                dx, sums = self._cells[k].backward(
                    thetas[k], x, upstream, [] if split else state.grad_sums[k], offset,
                    seed[k], need_dx, need_weight_grads=not split)
                if not self._cells[k].traced and sums:
                    dx = _after(dx, sums)
            if not split:
                state.grad_sums[k] = sums
        done = [g for g in dx if g is not None] + list(sums)
        if done:
            state.last_ops[device] = done
        if k > 0:
            state.upstream[(k - 1, t)] = pack(x.like, dx)
        elif need_input_grads:
            state.input_grads[t] = dx

    def _train_weight_gradient(self, action: Action, device: int, state: StepState,
                               thetas: Sequence[NestedMap], seed: list[CallInput]) -> None:
        """W(k, t) of a split backward: re-run the forward, add the weight gradient to the sums."""
        k, t = action.cell, action.micro_batch
        x, upstream, offset = state.weight_inputs.pop((k, t))
        with self._cell_scope(k), self._action_scope(op_names.WEIGHT, k, t), \
                tf.control_dependencies(state.last_ops[device]):
            _, sums = self._cells[k].backward(
                thetas[k], x, upstream, state.grad_sums[k], offset, seed[k], need_dx=False,
                need_weight_grads=True, family=op_names.WGRAD)
        state.grad_sums[k] = sums
        state.last_ops[device] = list(sums)

    def _batched_weight_gradient(self, k: int, device: int, num_micro_batches: int,
                                 state: StepState, thetas: Sequence[NestedMap],
                                 seed: list[CallInput], batch_dim: int) -> None:
        """Cell k's weight gradient for all its micro-batches in one call.

        The sum over micro-batches of d(loss_t)/d(weights), each weighted by its upstream
        gradient, is the gradient of one forward of the concatenated micro-batches with the
        concatenated upstream gradients: the examples keep their positions (dropout masks are
        keyed by them) and the last cell's scalar loss, a mean over its examples, takes the
        sum of the micro-batches' seeds (the mean over all of them, weighted alike).
        """
        inputs = [state.weight_inputs.pop((k, t)) for t in range(num_micro_batches)]
        xs = [x for x, _, _ in inputs]
        with self._cell_scope(k), tf.name_scope(op_names.batched_weight_gradient_scope(k)), \
                tf.control_dependencies(state.last_ops[device]):
            x_all = _concatenate([x.value(x.leaves) for x in xs], batch_dim, k, "input",
                                 shared_scalars=k == 0)
            dy_all = _concatenate([dy for _, dy, _ in inputs], batch_dim, k, "output gradient",
                                  shared_scalars=False, sum_scalars=k == self.num_cells - 1)
            _, sums = self._cells[k].backward(
                thetas[k], self._cells[k].prepare(x_all), dy_all, state.grad_sums[k],
                inputs[0][2], seed[k], need_dx=False, need_weight_grads=True,
                family=op_names.WGRAD)
        state.grad_sums[k] = sums
        state.last_ops[device] = list(sums)

    def _zeros(self, state: StepState, k: int, i: int, like: tf.Tensor) -> tf.Tensor:
        """Zeros like output leaf i of cell k, made once per step and shared by micro-batches
        (TensorFlow's gradient of a function call needs a gradient for every output)."""
        key = (k, i, like.dtype, tuple(like.shape.as_list()) if like.shape.is_fully_defined()
               else None)
        if key[-1] is None:
            return tf.zeros_like(like)
        if key not in state.zeros:
            with tf.control_dependencies(None), self._cell_scope(k):
                state.zeros[key] = tf.zeros(like.shape, like.dtype, name=f"cell_{k}_zeros")
        return state.zeros[key]


def _after(dx: list[Any], sums: list[Any]) -> list[Any]:
    """dx, available only once the weight-gradient sums are.

    B(k-1, t) must start once B(k, t) has finished, weight gradients included: otherwise the
    input-gradient chain could run ahead and keep cell k's activations alive while cell k-1
    re-computes its own. (One backward call returns both together, so it needs no such wait.)
    """
    with tf.control_dependencies(sums):
        return [None if g is None else tf.identity(g) for g in dx]


def _concatenate(values: list[Any], batch_dim: int, cell: int, what: str,
                 shared_scalars: bool, sum_scalars: bool = False) -> Any:
    """Micro-batch values of one cell joined along `batch_dim` (None leaves stay None).

    Scalars are the pipeline input's shared scalars (`shared_scalars`: take the first), the
    last cell's loss seeds (`sum_scalars`: add them up), or else an error: a scalar computed per
    micro-batch cannot be re-assembled into the mini-batch's.
    """
    leaves = [flatten(v) for v in values]
    out = []
    for i, first in enumerate(leaves[0]):
        parts = [lv[i] for lv in leaves]
        if first is None or all(p is None for p in parts):
            out.append(None)
        elif first.shape.rank == 0:
            if sum_scalars:
                out.append(tf.add_n(parts))
            elif shared_scalars:
                out.append(first)
            else:
                raise ValueError(
                    f"weight_gradients='batched' joins cell {cell}'s micro-batches, but its "
                    f"{what} has a scalar leaf computed per micro-batch; keep scalars out of "
                    "cell boundaries or use weight_gradients='per_micro_batch'.")
        else:
            out.append(tf.concat(parts, axis=batch_dim))
    return pack(values[0], out)


def report_statistics(reports: list[tuple[Any, Any]]) -> None:
    """Hands statistics that layers reported inside a cell function to the caller's collector."""
    collector = fprop_context.current().updates
    if collector is None:
        return
    for layer, stats in reports:
        collector.add(layer, stats)


__all__ = ["Executor", "StepState", "TrainResult", "report_statistics"]
