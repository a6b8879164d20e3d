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
  exist), differentiates it and adds the weight gradients to the sums;
- W(k, t), in a schedule that splits the backward (zero-bubble): B defers the weight gradients
  of the ops that apply weights through `layers.weight_ops` and keeps their records (each op's
  input and output gradient); W is one call that computes those weight gradients from the
  records and adds them to the sums. With `batched_weight_grads` every B defers the same way
  and one W per cell, after its last backward, takes all micro-batches' records at once.

Every action of cell k waits (control dependencies) for the previous action of cell k in the
schedule's per-cell order, so the schedule object is what actually runs, and different cells
overlap. All state of a step is explicit in `StepState`. Names follow `op_names`.

Example (two cells on the default device, two micro-batches):
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> from lingvo_lite.pipeline import cell_functions
    >>> from lingvo_lite.pipeline.schedules import schedule
    >>> fns = [cell_functions.CellFunctions(k, lambda th, x: x * th.w) for k in range(2)]
    >>> run = Executor(fns, lambda k: tf.name_scope(""))
    >>> thetas = [NestedMap(w=tf.constant(2.0)), NestedMap(w=tf.constant(5.0))]
    >>> outs = run.forward(schedule.make_schedule("gpipe", 2, 2), thetas,
    ...                    [tf.constant([1.0]), tf.constant([3.0])], micro_batch_size=1)
    >>> [float(y[0]) for y in outs]
    [10.0, 30.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import weight_ops
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
from lingvo_lite.pipeline.schedules.schedule import Action, Phase, Schedule

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
    # Deferred weight gradients: a kept forward's stash (filled by its backward's tape), and
    # what W(k, t) (or a cell's batched W) computes them from.
    stashes: dict[Key, weight_ops.Stash] = dataclasses.field(default_factory=dict)
    # Whether the first cell's backward computes d(loss)/d(input) (else its tape does not
    # watch the input: a watched input costs a gradient op per layer that reads it).
    need_input_grads: bool = False
    deferred: dict[Key, list[weight_ops.Record]] = dataclasses.field(default_factory=dict)


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
              need_input_grads: bool = False,
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
          batched_weight_grads: each backward defers the weight gradients of ops applied
            through `weight_ops` (as a split backward's B does); once a cell's last backward
            ran, one call computes them for all its micro-batches from their concatenated
            records (one matmul over all the rows instead of T): one weight-sized gradient
            per weight instead of T, for holding every micro-batch's records until then.
        """
        seed = self._step_seeds()
        state = StepState(boundary={(0, t): x for t, x in enumerate(xs)},
                          offsets=self._first_offsets(len(xs), micro_batch_size),
                          last_ops=[[] for _ in range(sched.num_devices)],
                          need_input_grads=need_input_grads)
        sources = [[v for v in theta.Flatten() if is_trainable(v)] for theta in thetas]
        # One micro-batch has nothing to batch.
        batched_weight_grads = batched_weight_grads and len(xs) > 1
        defer = sched.splits_backward or batched_weight_grads
        # [] (or None per leaf when weight gradients are deferred) until a cell's first weight
        # gradient, which becomes its sums as it is: starting from zeros would hold one more
        # weight-sized buffer per weight all step.
        state.grad_sums = [[None] * len(sources[k]) if defer else []
                           for k in range(self.num_cells)]
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
                self._train_forward(action, device, state, thetas, sources, keep, seed, defer)
            elif action.phase is Phase.BACKWARD:
                self._train_backward(action, device, state, thetas, sources, seed,
                                     loss_gradient, need_input_grads, defer)
            else:
                self._train_weight_gradient(
                    k, device, [state.deferred.pop((k, action.micro_batch))], state, thetas,
                    self._action_scope(op_names.WEIGHT, k, action.micro_batch))
            if batched_weight_grads and done_actions[k] == last_backward[k]:
                self._train_weight_gradient(
                    k, device, [state.deferred.pop((k, t)) for t in range(len(xs))], state,
                    thetas, tf.name_scope(op_names.batched_weight_gradient_scope(k)))
            done_actions[k] += 1
        num_micro = len(xs)
        return TrainResult(
            outputs=[state.outputs[t] for t in range(num_micro)],
            grad_sums=[self._zeros_where_none(k, sums, sources[k])
                       for k, sums in enumerate(state.grad_sums)],
            input_grads=([state.input_grads[t] for t in range(num_micro)]
                         if need_input_grads else None))

    def _train_forward(self, action: Action, device: int, state: StepState,
                       thetas: Sequence[NestedMap], sources: list[list[Any]],
                       keep: frozenset[Key], seed: list[CallInput], defer: bool) -> None:
        k, t = action.cell, action.micro_batch
        offset = state.offsets[(k, t)]  # Kept for the backward.
        with self._cell_scope(k), self._action_scope(op_names.FORWARD, k, t), \
                tf.control_dependencies(state.last_ops[device]):
            # The local copy serves the backward too (re-computation or tape).
            x = state.boundary[(k, t)] = self._cells[k].prepare(state.boundary[(k, t)])
            if (k, t) in keep:
                tape = tf.GradientTape(watch_accessed_variables=False)
                with tape:
                    watched = x.leaves if k > 0 or state.need_input_grads else []
                    tape.watch([v for v in watched if is_float(v)] + sources[k])
                    # Inline, so the backward frees the activations layer by layer; on
                    # serial devices only a call runs one op at a time (and then its weight
                    # gradients cannot be deferred: the call's gradient is a function of its
                    # own, whose records could not leave it).
                    with _deferring(defer and not self._serial, sources[k]) as stash:
                        y, next_offset, reports = self._cells[k].forward(
                            thetas[k], x, offset, seed[k], inline=not self._serial)
                state.tapes[(k, t)] = (tape, y)
                if stash is not None:
                    state.stashes[(k, t)] = stash
            else:
                y, next_offset, reports = self._cells[k].forward(thetas[k], x, offset, seed[k])
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
                        need_input_grads: bool, defer: bool) -> None:
        """B(k, t): the whole backward, or with `defer` all but the weight gradients of ops
        applied through `weight_ops`, whose records W computes them from later."""
        k, t = action.cell, action.micro_batch
        offset = state.offsets.pop((k, t))
        if k == self.num_cells - 1:
            upstream = loss_gradient(state.outputs[t])
        else:
            upstream = state.upstream.pop((k, t))
        x = state.boundary.pop((k, t))
        need_dx = k > 0 or need_input_grads
        sums: list[Any] = []
        records: list[weight_ops.Record] = []
        with self._cell_scope(k), self._action_scope(op_names.BACKWARD, k, t), \
                tf.control_dependencies(state.last_ops[device]):
            if (k, t) in state.tapes:
                tape, y = state.tapes.pop((k, t))
                ys, dys = float_outputs_and_gradients(
                    y, flatten(upstream), lambda i, leaf: self._zeros(state, k, i, leaf))
                x_sources = [v for v in x.leaves if is_float(v)] if need_dx else []
                # Deferred weights get no gradient here (None); their stash gets records.
                with tf_private.serial_function_calls(self._serial):
                    grads = tape.gradient(
                        ys, x_sources + sources[k], output_gradients=dys,
                        unconnected_gradients=tf.UnconnectedGradients.NONE if defer
                        else tf.UnconnectedGradients.ZERO)
                dx_iter = iter(grads[:len(x_sources)])
                dx = [next(dx_iter) if is_float(v) else None for v in x.leaves] \
                    if need_dx else []
                weight_grads = [None if g is None else tf.convert_to_tensor(g)
                                for g in grads[len(x_sources):]]
                sums = self._add(k, state.grad_sums[k], weight_grads)
                if any(g is not None for g in weight_grads):
                    dx, sums = _after(dx, sums), _after(sums, dx)
                stash = state.stashes.pop((k, t), None)
                records = stash.records if stash is not None else []
            else:
                # The upstream gradient is an input of the call, so the re-computation starts
                # only once it exists: it stays in the backward pass.
                dx, sums, records = self._cells[k].backward_with_records(
                    thetas[k], x, upstream, state.grad_sums[k], offset, seed[k], need_dx,
                    defer_weight_grads=defer)
                if not self._cells[k].traced and sums:
                    dx, sums = _after(dx, sums), _after(sums, dx)
            state.grad_sums[k] = sums
        if defer:
            state.deferred[(k, t)] = records
        done = [g for g in dx if g is not None] + [g for g in sums if g is not None]
        if done:
            state.last_ops[device] = done
        if k > 0:
            state.upstream[(k - 1, t)] = pack(x.like, dx)
        elif need_input_grads:
            state.input_grads[t] = dx

    def _train_weight_gradient(self, k: int, device: int,
                               records: list[list[weight_ops.Record]], state: StepState,
                               thetas: Sequence[NestedMap], scope: Any) -> None:
        """W: the deferred weight gradients of one or (batched) several micro-batches of cell
        k, from their records, added to the cell's sums as one call.

        Several micro-batches' records are concatenated, so each op's weight gradient is one
        op over all their rows (`weight_ops.concatenate`): the sum over micro-batches of x^T dy
        is [x_1; ...; x_T]^T [dy_1; ...; dy_T]. A kept micro-batch on serial devices computed
        its weight gradients in B and has no records. The call is made even with no records,
        so that every W runs one function (`op_names.function_runs`).
        """
        records = [r for r in records if r]
        with self._cell_scope(k), scope, tf.control_dependencies(state.last_ops[device]):
            sums = self._cells[k].weight_gradient(
                thetas[k], weight_ops.concatenate(records) if records else [],
                state.grad_sums[k])
        state.grad_sums[k] = sums
        state.last_ops[device] = [g for g in sums if g is not None]

    def _add(self, k: int, sums: list[Any], grads: list[Any]) -> list[Any]:
        """sums + grads leaf by leaf (None: nothing yet) at the call site; [] sums (the cell's first
        weight gradients, not deferred): the grads are the sums."""
        return self._cells[k].accumulate(sums, grads) if sums else grads

    def _zeros_where_none(self, k: int, sums: list[Any], sources: list[Any]) -> list[Any]:
        """The sums with a zero gradient for weights nothing reached (as an unconnected
        gradient is)."""
        if all(s is not None for s in sums):
            return sums
        with self._cell_scope(k):
            return [tf.zeros_like(v) if s is None else s for s, v in zip(sums, sources)]

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


def _after(values: list[Any], others: list[Any]) -> list[Any]:
    """`values` (None leaves kept), available only once `others` are.

    An inline backward's input gradient dx and its weight-gradient sums each wait for the
    other. B(k-1, t) must start once B(k, t) has finished, weight gradients included: otherwise
    the input-gradient chain could run ahead and keep cell k's activations alive while cell k-1
    re-computes its own. And the optimizer's update of a weight (which waits for its sum) must
    not run before dx, which still reads the weight: a fused update then copies the weight
    before writing it (weight-heavy K=4, T=1: 16 MiB more on every device but the first). (One
    backward call returns both together, so it needs no such wait.)
    """
    with tf.control_dependencies([g for g in others if g is not None]):
        return [None if g is None else tf.identity(g) for g in values]


def _deferring(defer: bool, weights: Sequence[Any]) -> ContextManager[Any]:
    return weight_ops.deferring(weights) if defer else contextlib.nullcontext(None)


def report_statistics(reports: list[tuple[Any, Any]]) -> None:
    """Hands statistics that layers reported inside a cell function to the caller's collector."""
    collector = fprop_context.current().updates
    if collector is None:
        return
    for layer, stats in reports:
        collector.add(layer, stats)


__all__ = ["Executor", "StepState", "TrainResult", "report_statistics"]
