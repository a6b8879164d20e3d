"""One cell's work as functions traced once and called once per micro-batch.

A cell runs four bodies: the forward, the backward of a re-materialised action (re-run the
forward under a tape, differentiate it, add the weight gradients to the running sums; or, as the
B of a split backward, leave the weight gradients of `layers.weight_ops` to W and return their
records), W (those weight gradients from the records) and the gradient sum of an action that kept
its activations. `CellFunctions` builds each as a
`tf.function` that is traced once per input signature and called T times, so a step's graph holds
O(layers + cells x micro-batches) ops instead of O(layers x micro-batches), and its start-up time
stops growing with T. The calls are never inlined (`tf_private.NO_INLINE`): each call is one
executor run on its cell's device, which waits for all its inputs. That is what keeps a
re-computation in the backward pass (it needs the upstream gradient) without the process-wide
grappler changes the inlined form needed.

Everything a body reads that differs between micro-batches is an argument: the cell's weights,
the boundary value, the upstream gradient, the example offset and step seed that dropout masks are
drawn from. What is the same for all of them (training or not, `batch_dim`, whether batch-norm
statistics are collected) is fixed when the body is traced.

With `traced=False` (a TPUStrategy step, which XLA compiles whole) the same bodies run inline.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> fns = CellFunctions(0, lambda theta, x: x * theta.w)
    >>> theta = NestedMap(w=tf.constant(3.0))
    >>> x, seed = fns.prepare(tf.constant([1.0, 2.0])), fns.prepare(tf.constant(0))
    >>> y, _, _ = fns.forward(theta, x, example_offset=tf.constant(0, tf.int64),
    ...                       step_seed=seed)
    >>> y.numpy().tolist()
    [3.0, 6.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import weight_ops
from lingvo_lite.pipeline import op_names, tf_private

CellBody = Callable[[NestedMap, Any], Any]


def flatten(x: Any) -> list[Any]:
    """The leaves of a boundary value (a tensor or a NestedMap; None leaves kept)."""
    return x.Flatten() if isinstance(x, NestedMap) else [x]


def pack(like: Any, leaves: Sequence[Any]) -> Any:
    return like.Pack(list(leaves)) if isinstance(like, NestedMap) else leaves[0]


def is_float(x: Any) -> bool:
    return x is not None and x.dtype.is_floating


def is_trainable(leaf: Any) -> bool:
    if isinstance(leaf, tf.Variable):
        return leaf.trainable and leaf.dtype.is_floating
    return is_float(leaf)


def _is_host_int(v: Any) -> bool:
    return v is not None and v.dtype == tf.int32


def _to_call_argument(v: Any) -> Any:
    """`v` as a local argument of a function call on the current device.

    A call's arguments must already live on its device: an argument from another device, or an
    int32 one (TensorFlow pins int32 function arguments to the host CPU), turns the call into a
    multi-device function whose single-threaded part blocks an inter-op thread until the copy
    arrives; run eagerly, K cells with fewer inter-op threads than such pending copies
    deadlocked (issue 12). In a traced step the same call ran 1.5-1.8x slower on serial devices
    (bench/first_step.py, 32 layers, K=4, T=8). int32 travels as int64 and is cast back inside.
    """
    if v is None or isinstance(v, tf.Variable):
        return v
    return tf.cast(v, tf.int64) if _is_host_int(v) else tf.identity(v)


def _from_call_argument(v: Any, was_int32: bool) -> Any:
    return tf.cast(v, tf.int32) if was_int32 else v


@dataclasses.dataclass(frozen=True)
class CallInput:
    """A value made ready to be a call's argument on a cell's device (`CellFunctions.prepare`).

    `leaves` are local copies (int32 as int64, see `_to_call_argument`); `like` and `was_int32`
    say how to rebuild the value inside the function. Prepared once when a micro-batch arrives,
    it serves both the forward and the backward of that micro-batch.
    """

    like: Any
    leaves: tuple[Any, ...]
    was_int32: tuple[bool, ...]

    def structure(self) -> tuple[Any, ...]:
        """Static data that tells differently nested inputs apart when tracing."""
        paths = (tuple(path for path, _ in self.like.FlattenItems())
                 if isinstance(self.like, NestedMap) else None)
        return paths, self.was_int32

    def value(self, leaves: Sequence[Any]) -> Any:
        """The value rebuilt from (traced) leaves, int32 leaves cast back."""
        return pack(self.like, [None if v is None else _from_call_argument(v, m)
                                for v, m in zip(leaves, self.was_int32)])


@dataclasses.dataclass(frozen=True)
class _Context:
    """What a body reads from fprop_context that is fixed for all calls of one trace."""

    training: bool
    batch_dim: int
    collect_updates: bool

    @classmethod
    def current(cls, collect_updates: bool) -> _Context:
        ctx = fprop_context.current()
        return cls(bool(ctx.training), ctx.batch_dim, collect_updates)


def _spec_of(v: Any) -> Any:
    return None if v is None else tf.TensorSpec(v.shape, v.dtype)


def _specs(value: Any) -> Any:
    """`value` (a tensor or NestedMap, None leaves kept) with every tensor replaced by its spec."""
    return pack(value, [_spec_of(v) for v in flatten(value)])


def input_specs(value: Any) -> CallInput:
    """A CallInput of specs shaped like `prepare(value)` would make it (int32 as int64)."""
    leaves = flatten(value)
    was_int32 = tuple(v is not None and v.dtype == tf.int32 for v in leaves)
    return CallInput(value, tuple(
        None if v is None else tf.TensorSpec(v.shape, tf.int64 if m else v.dtype)
        for v, m in zip(leaves, was_int32)), was_int32)


def _signature(value: Any) -> Any:
    """A hashable key of a call's arguments: tensors by dtype and shape, variables by identity,
    Python values as they are (what makes tf.function trace anew)."""
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, tf.Variable):
        return ("variable", id(value))
    if tf.is_tensor(value) or isinstance(value, tf.TensorSpec):  # A spec traces as its tensor.
        return ("tensor", value.dtype, tuple(value.shape.as_list()) if value.shape.rank
                is not None else None)
    return value


class _TracedOnce:
    """`body(*args)` as a non-inlined tf.function; remembers each trace's output structure.

    `body` returns (flat list of tensors, structure): the structure is Python data (how to
    re-assemble the outputs) that only exists while tracing, so it is kept per concrete
    function.
    """

    def __init__(self, body: Callable[..., tuple[list[Any], Any]], name: str,
                 traced: bool, jit_compile: bool = False) -> None:
        self._body = body
        self._structures: dict[int, tuple[Any, Any]] = {}
        self._by_signature: dict[Any, tuple[Any, Any]] = {}
        self._last_structure: Any = None
        self._function = None
        if traced:
            def record(*args: Any) -> list[Any]:
                flat, self._last_structure = self._body(*args)
                return flat

            record.__name__ = name  # Names the function in the graph's library.
            tf_private.allow_function_attributes()
            self._function = tf.function(record, autograph=False, jit_compile=jit_compile,
                                         experimental_attributes=tf_private.NO_INLINE)

    @property
    def num_traces(self) -> int:
        """How many times the body was traced (one per input signature)."""
        return len(self._structures)

    def trace(self, *args: Any) -> tuple[Any, Any]:
        """(the concrete function, the output structure) for `args`, traced if new; tensor
        arguments may be tf.TensorSpecs. Nothing is called."""
        # tf.function's own dispatch costs ~10 ms per call with a cell's worth of weights as
        # arguments; T calls with the same signature look their trace up here instead.
        signature = _signature(args)
        found = self._by_signature.get(signature)
        if found is None:
            concrete = self._function.get_concrete_function(*args)
            if id(concrete) not in self._structures:
                self._structures[id(concrete)] = (concrete, self._last_structure)
            found = self._by_signature[signature] = self._structures[id(concrete)]
        return found

    def __call__(self, *args: Any) -> tuple[list[Any], Any]:
        if self._function is None:
            return self._body(*args)
        concrete, structure = self.trace(*args)
        return list(concrete(*args)), structure


class CellFunctions:
    """The forward, backward and gradient-sum functions of one cell of one replica.

    Args:
      cell: the cell index k (names the ops: see `op_names`).
      body: `body(theta, x) -> y`, the cell's forward on its theta (a NestedMap).
      replica: the replica index when there are several (names the ops), else None.
      traced: trace each function once (False: run the bodies inline).
      serial: run every call on TensorFlow's single-threaded executor (an emulated
        accelerator's one op at a time).
      jit_compile: compile each traced function with XLA for its device.
    """

    def __init__(self, cell: int, body: CellBody, replica: int | None = None,
                 traced: bool = True, serial: bool = False, jit_compile: bool = False) -> None:
        self.cell = cell
        self._jit_compile = jit_compile
        self._body = body
        self._replica = replica
        self._traced = traced
        self._serial = serial
        self._forward: dict[tuple[_Context, bool], _TracedOnce] = {}
        self._backward: dict[_Context, _TracedOnce] = {}
        self._weight_gradient: dict[tuple[Any, ...], _TracedOnce] = {}
        self._pending: tuple[NestedMap, CallInput, CallInput] | None = None

    def _name(self, family: str) -> str:
        return op_names.function_scope(family, self.cell, self._replica).replace("/", "_")

    def _scope(self, family: str, inline: bool = False) -> Any:
        if inline or not self._traced:  # The call site's scope already names the action.
            return tf.name_scope(family)
        return tf.name_scope(op_names.function_scope(family, self.cell, self._replica) + "/")

    @property
    def traced(self) -> bool:
        """Whether the bodies are traced functions (False: they run inline)."""
        return self._traced

    @property
    def num_traces(self) -> int:
        """Traces of all this cell's functions so far (each is traced once per signature)."""
        return (sum(f.num_traces for f in self._forward.values())
                + sum(f.num_traces for f in self._backward.values())
                + sum(f.num_traces for f in self._weight_gradient.values()))

    def _call(self, function: _TracedOnce, *args: Any) -> tuple[list[Any], Any]:
        with tf_private.serial_function_calls(self._serial and self._traced):
            return function(*args)

    # -- forward -----------------------------------------------------------------------------

    def prepare(self, x: Any) -> CallInput:
        """`x` (a boundary value or a step seed) as local call arguments; build it in the
        cell's device scope."""
        leaves = flatten(x)
        was_int32 = tuple(_is_host_int(v) for v in leaves)
        if self._traced:
            leaves = [_to_call_argument(v) for v in leaves]
        return CallInput(x, tuple(leaves), was_int32)

    def forward(self, theta: NestedMap, x: CallInput, example_offset: tf.Tensor,
                step_seed: CallInput,
                inline: bool = False) -> tuple[Any, tf.Tensor, list[tuple[Any, Any]]]:
        """y = body(theta, x), the example offset, and the statistics layers reported.

        `example_offset` (int64: the position of x's first example in the mini-batch) comes
        back as an output of the call, so the next cell receives it together with y instead of
        needing a constant per call. Statistics are reported if the context collects them.

        `inline=True` runs the body's ops at the call site instead of calling the traced
        function: for a forward whose activations are kept for the backward (run under the
        caller's tape). TensorFlow's gradient of a function call is one call that holds every
        activation it was handed until it returns, where inline ops free each layer's as the
        backward passes it: measured, a step that keeps every activation peaked 16% (Transformer
        blocks) and 29% (AmoebaNet cells) higher with the forward as a call (BENCHMARKS.md,
        section 9).
        """
        args = self._arguments(theta, x, example_offset, step_seed)
        flat, (y_like, reports) = self._call(self._forward_function(inline), *args)
        num_y = len(flatten(y_like))
        y = pack(y_like, flat[:num_y])
        offset = flat[num_y]
        rest = iter(flat[num_y + 1:])
        return y, offset, [
            (layer, tf.nest.pack_sequence_as(s, [next(rest) for _ in tf.nest.flatten(s)]))
            for layer, s in reports]

    def forward_output_specs(self, theta: NestedMap, x: CallInput,
                             step_seed: CallInput) -> tuple[Any, list[tuple[Any, Any]]]:
        """What `forward` on `x` returns, as tf.TensorSpecs, from its trace (no call is made).

        `x` may hold tf.TensorSpecs for leaves (the prepared dtypes: int64 for int32). Returns
        (y like the forward's output, [(layer, statistics)] like its reports), every tensor
        replaced by its spec: what a loop needs to set up its TensorArrays before it runs.
        """
        if not self._traced:
            raise ValueError("forward_output_specs needs traced cell functions.")
        args = self._arguments(theta, x, tf.TensorSpec([], tf.int64), step_seed)
        _, (y_like, reports) = self._forward_function(inline=False).trace(*args)
        return (_specs(y_like),
                [(layer, tf.nest.map_structure(_spec_of, s)) for layer, s in reports])

    def _forward_function(self, inline: bool) -> _TracedOnce:
        """The forward for the current context (traced, unless inline or untraced)."""
        ctx = _Context.current(fprop_context.current().updates is not None)
        key = (ctx, inline or not self._traced)
        if key not in self._forward:
            self._forward[key] = _TracedOnce(
                lambda *a: self._forward_body(ctx, key[1], *a), self._name(op_names.FPROP),
                not key[1], self._jit_compile)
        return self._forward[key]

    def _arguments(self, theta: NestedMap, x: CallInput, example_offset: tf.Tensor,
                   step_seed: CallInput) -> list[Any]:
        """The call's arguments: flat leaves, plus static data describing how they nest.

        The nesting itself (`theta`, `x` with their tensors replaced) is handed to the body
        through `self._pending`, read while tracing; the static `structure` argument makes a
        differently nested input trace anew instead of reusing a wrong trace.
        """
        self._pending = (theta, x, step_seed)
        structure = (tuple(path for path, _ in theta.FlattenItems()), x.structure(),
                     step_seed.structure())
        return [structure, theta.Flatten(), list(x.leaves), example_offset,
                list(step_seed.leaves)]

    def _unpack_arguments(self, theta_leaves: list[Any], x_leaves: list[Any], offset: Any,
                          seed_leaves: list[Any]) -> tuple[NestedMap, Any, Any, Any]:
        theta_like, x, seed = self._pending
        return theta_like.Pack(theta_leaves), x.value(x_leaves), offset, seed.value(seed_leaves)

    def _forward_body(self, ctx: _Context, inline: bool, structure: Any,
                      theta_leaves: list[Any], x_leaves: list[Any], offset: Any,
                      seed_leaves: list[Any]) -> tuple[list[Any], Any]:
        del structure  # Only tells traces apart.
        theta, x, offset, seed = self._unpack_arguments(theta_leaves, x_leaves, offset,
                                                        seed_leaves)
        collector = fprop_context.UpdateCollector() if ctx.collect_updates else None
        with self._scope(op_names.FPROP, inline), fprop_context.fprop_context(
                training=ctx.training, batch_dim=ctx.batch_dim, example_offset=offset,
                step_seed=seed, updates=collector, jit_compile=self._jit_compile):
            y = self._body(theta, x)
        reports = [(layer, s) for layer, per_call in (collector.items() if collector else [])
                   for s in per_call]
        flat = (flatten(y) + [tf.identity(offset)]
                + [leaf for _, s in reports for leaf in tf.nest.flatten(s)])
        return flat, (y, reports)

    # -- backward ----------------------------------------------------------------------------

    def backward(self, theta: NestedMap, x: CallInput, dy: Any, grad_sums: list[Any],
                 example_offset: tf.Tensor, step_seed: CallInput, need_dx: bool,
                 packed: tuple[int, ...] = (),
                 defer_weight_grads: bool = False) -> tuple[list[Any], list[Any]]:
        """Re-runs the forward on `x` under a tape and differentiates it with `dy`.

        Args:
          theta, x: the cell's weights and its prepared boundary input for this micro-batch.
          dy: like the forward's output: the gradient arriving from the next cell (None
            leaves: no gradient, i.e. zeros).
          grad_sums: the running weight-gradient sums, one per trainable leaf of theta in
            `theta.Flatten()` order, on this device; [] before the cell's first weight
            gradient (a trace of its own), which then becomes the sums.
          example_offset, step_seed: as for `forward` (the re-computation draws the same
            dropout masks).
          need_dx: also return the gradient of every float leaf of x (cell 0 needs it only
            when the caller asked for input gradients).
          packed: positions (among the trainable leaves) of weights whose gradients are summed
            in one flat vector (`pack_gradients`); the sums are then that vector followed by
            the other leaves' sums. A loop carries one tensor instead of many small ones.
          defer_weight_grads: the B of a split backward: weights applied through
            `weight_ops` get no gradient here; their ops' inputs and output gradients come
            back as records for `weight_gradient` (W). The other weights' gradients are
            added to `grad_sums`, which then has one entry per trainable leaf, None where
            nothing was added yet (use `backward_with_records`).

        Returns:
          (dx, new_grad_sums): dx per leaf of x (None for non-float leaves, [] if not
          needed) and the sums plus this micro-batch's weight gradients.
        """
        dx, sums, _ = self.backward_with_records(
            theta, x, dy, grad_sums, example_offset, step_seed, need_dx, packed,
            defer_weight_grads)
        return dx, sums

    def backward_with_records(
            self, theta: NestedMap, x: CallInput, dy: Any, grad_sums: list[Any],
            example_offset: tf.Tensor, step_seed: CallInput, need_dx: bool,
            packed: tuple[int, ...] = (), defer_weight_grads: bool = False,
    ) -> tuple[list[Any], list[Any], list[weight_ops.Record]]:
        """`backward`, plus the records of deferred weight gradients (with
        `defer_weight_grads`; else [])."""
        ctx = _Context(bool(fprop_context.current().training), fprop_context.current().batch_dim,
                       False)
        key = (ctx, need_dx, packed, defer_weight_grads)
        if key not in self._backward:
            self._backward[key] = _TracedOnce(
                lambda *a: self._backward_body(ctx, need_dx, packed, defer_weight_grads, *a),
                self._name(op_names.BPROP), self._traced, self._jit_compile)
        args = self._arguments(theta, x, example_offset, step_seed)
        dy_leaves = flatten(dy)
        if self._traced:
            dy_leaves = [_to_call_argument(v) for v in dy_leaves]
        flat, (num_dx, num_sums, records) = self._call(self._backward[key], *args, dy_leaves,
                                                       list(grad_sums))
        pairs = iter(flat[num_dx + num_sums:])
        return (flat[:num_dx], flat[num_dx:num_dx + num_sums],
                [r.with_tensors(next(pairs), next(pairs)) for r in records])

    def _backward_body(self, ctx: _Context, need_dx: bool, packed: tuple[int, ...],
                       defer_weight_grads: bool, structure: Any, theta_leaves: list[Any],
                       x_leaves: list[Any], offset: Any, seed_leaves: list[Any],
                       dy_leaves: list[Any], grad_sums: list[Any]) -> tuple[list[Any], Any]:
        del structure  # Only tells traces apart.
        theta, x, offset, seed = self._unpack_arguments(theta_leaves, x_leaves, offset,
                                                        seed_leaves)
        sources = [v for v in theta.Flatten() if is_trainable(v)]
        deferral = (weight_ops.deferring(sources) if defer_weight_grads
                    else contextlib.nullcontext(None))
        with self._scope(op_names.BPROP), deferral as stash:
            x_sources = [v for v in flatten(x) if is_float(v)] if need_dx else []
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                tape.watch(x_sources + sources)
                with tf.name_scope(op_names.RECOMPUTE_SCOPE), fprop_context.fprop_context(
                        training=ctx.training, batch_dim=ctx.batch_dim, example_offset=offset,
                        step_seed=seed, updates=None, jit_compile=self._jit_compile):
                    y = self._body(theta, x)
            ys, dys = float_outputs_and_gradients(y, dy_leaves)
            # Deferred weights get no gradient here (None), nor do weights that only they use.
            grads = tape.gradient(ys, x_sources + sources, output_gradients=dys,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE
                                  if defer_weight_grads else tf.UnconnectedGradients.ZERO)
            dx_iter = iter(grads[:len(x_sources)])
            dx = ([next(dx_iter) if is_float(v) else None for v in flatten(x)]
                  if need_dx else [])
            weight_grads = pack_gradients(grads[len(x_sources):], packed)
            if defer_weight_grads or grad_sums:
                sums = add_gradients(grad_sums, weight_grads)
            else:  # The cell's first weight gradient: it is the sum so far.
                sums = [tf.convert_to_tensor(g) for g in weight_grads]
            records = stash.records if stash is not None else []
        return (dx + sums + [t for r in records for t in (r.x, r.dy)],
                (len(dx), len(sums), records))

    def weight_gradient(self, theta: NestedMap, records: Sequence[weight_ops.Record],
                        grad_sums: list[Any]) -> list[Any]:
        """W: the weight gradients that `records` stand for, added to `grad_sums` (one entry
        per trainable leaf of theta, None where nothing was added yet), as one call."""
        static = tuple(r.static() for r in records)  # Also tells traces apart.
        if static not in self._weight_gradient:
            self._weight_gradient[static] = _TracedOnce(
                self._weight_gradient_body, self._name(op_names.WGRAD), self._traced,
                self._jit_compile)
        pairs = [_to_call_argument(t) if self._traced else t
                 for r in records for t in (r.x, r.dy)]
        flat, _ = self._call(self._weight_gradient[static], static, theta.Flatten(), pairs,
                             list(grad_sums))
        return flat

    def _weight_gradient_body(self, static: tuple[Any, ...], theta_leaves: list[Any],
                              pairs: list[Any], grad_sums: list[Any]) -> tuple[list[Any], Any]:
        sources = [v for v in theta_leaves if is_trainable(v)]
        records = [weight_ops.Record(*s, x=pairs[2 * i], dy=pairs[2 * i + 1])
                   for i, s in enumerate(static)]
        with self._scope(op_names.WGRAD):
            return add_gradients(grad_sums, weight_ops.weight_gradients(records, sources)), None

    # -- gradient sums -----------------------------------------------------------------------

    def accumulate(self, grad_sums: list[Any], grads: list[Any]) -> list[Any]:
        """`grad_sums + grads`, leaf by leaf (a kept action's weight gradients), at the call
        site.

        Not a call: a call's arguments stay referenced by its caller until it returns, so no
        add inside could write into the sum's or the new gradient's buffer, and every weight
        would hold a third weight-sized buffer while the sums are made (measured: 1F1B's last
        device at T=4, 16 MiB more with a 16 MiB dense layer, BENCHMARKS.md section 9). At the
        call site the add takes over the gradient's buffer, which nothing else reads.
        """
        with self._scope(op_names.ACCUMULATE, inline=True):
            return add_gradients(list(grad_sums), grads)


def float_outputs_and_gradients(
        y: Any, dy_leaves: Sequence[Any],
        zeros: Callable[[int, Any], Any] | None = None) -> tuple[list[Any], list[Any]]:
    """The float leaves of `y` and their upstream gradients.

    Where no gradient arrived (e.g. for a metric of the last cell) the gradient is zero:
    `zeros(i, leaf)` if given (a caller can share one zero tensor between micro-batches),
    else a new `tf.zeros_like(leaf)`.
    """
    ys, dys = [], []
    for i, (y_leaf, g) in enumerate(zip(flatten(y), dy_leaves)):
        if is_float(y_leaf):
            ys.append(y_leaf)
            if g is None:
                g = zeros(i, y_leaf) if zeros is not None else tf.zeros_like(y_leaf)
            dys.append(g)
    return ys, dys


def pack_gradients(grads: Sequence[Any], packed: Sequence[int]) -> list[Any]:
    """The gradients at positions `packed` as one flat vector, followed by the others."""
    if not packed:
        return list(grads)
    chosen = set(packed)
    flat = tf.concat([tf.reshape(tf.convert_to_tensor(grads[i]), [-1]) for i in packed], 0)
    return [flat] + [g for i, g in enumerate(grads) if i not in chosen]


def unpack_gradients(sums: Sequence[Any], packed: Sequence[int],
                     like: Sequence[Any]) -> list[Any]:
    """Inverse of `pack_gradients`: one tensor per leaf of `like`, shaped like it (sums whose
    static shape was lost, e.g. in a loop, get it back)."""
    sizes = [like[i].shape.num_elements() for i in packed]
    pieces = dict(zip(packed, tf.split(sums[0], sizes))) if packed else {}
    rest = iter(sums[1:] if packed else sums)
    return [tf.reshape(pieces[i] if i in pieces else next(rest), like[i].shape)
            for i in range(len(like))]


def add_gradients(sums: Sequence[Any], grads: Sequence[Any]) -> list[Any]:
    """Leaf-wise sums + grads; embedding-lookup gradients (IndexedSlices) added densely.

    A None on either side is nothing yet (the other side is the sum); [] sums: none at all.
    """
    if not sums:
        sums = [None] * len(grads)
    out = []
    for s, g in zip(sums, grads):
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        out.append(g if s is None else s if g is None else s + g)
    return out


__all__ = ["CallInput", "CellFunctions", "float_outputs_and_gradients", "add_gradients",
           "input_specs", "pack_gradients", "unpack_gradients"]
