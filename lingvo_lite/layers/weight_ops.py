"""Ops that apply a weight to an input, with a weight gradient that can be taken later.

A zero-bubble schedule splits each backward into B, the input gradient (on the critical path),
and W, the weight gradient (which fills the pipeline's bubbles). For an op y = f(x, w) like a
matmul or a convolution, the weight gradient needs only x and the output gradient dy (a
matmul's is x^T dy). Layers apply their weights through `apply` (or `matmul`, `einsum`,
`conv2d`, `depthwise_conv2d`); outside `deferring` that is the plain op. Inside
`deferring(weights)`, for each of `weights` the op's gradient gives no weight gradient: it
records (x, dy) in the context's `Stash` instead, and `weight_gradients` later computes the
gradient from those, with TensorFlow's own gradient of the op (the op's forward, whose output
that gradient does not read, is pruned from the traced function). The weight gradient of T
micro-batches can be one op over their concatenated records (`concatenate`): one [rows, in]
x [rows, out] matmul instead of T.

An op must treat axis 0 of x as independent rows, f(concat([x1, x2]), w) = concat([f(x1, w),
f(x2, w)]), for its records to be concatenated; all the ops here do. A weight used other than
through these ops (or cast first, as in mixed precision) gets its gradient in B as usual.

Example:
    >>> import tensorflow as tf
    >>> x, w = tf.constant([[1.0, 2.0]]), tf.constant([[3.0], [4.0]])
    >>> with tf.GradientTape(persistent=True) as tape:
    ...     tape.watch(w)
    ...     with deferring([w]) as stash:
    ...         y = matmul(x, w)
    >>> print(tape.gradient(y, w))  # B: no weight gradient ...
    None
    >>> grads = weight_gradients(stash.records, [w])  # ... W: from the record of x and dy.
    >>> grads[0].numpy().ravel().tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

WeightOp = Callable[..., tf.Tensor]  # f(x, w, **attrs) -> y


@dataclasses.dataclass(frozen=True)
class Record:
    """One application of a weight whose gradient was deferred: W computes it from `x`, `dy`."""

    weight: int  # Index into the `deferring` context's weights.
    op: WeightOp
    attrs: tuple[tuple[str, Any], ...]  # The op's static keyword arguments.
    order: int  # Position among the context's ops in the forward (records come in backward).
    x: tf.Tensor
    dy: tf.Tensor

    def static(self) -> tuple[Any, ...]:
        """What tells records apart when tracing (everything but the tensors)."""
        return self.weight, self.op, self.attrs, self.order

    def with_tensors(self, x: tf.Tensor, dy: tf.Tensor) -> Record:
        return dataclasses.replace(self, x=x, dy=dy)


class Stash:
    """The records of one `deferring` context, filled as its gradients are taken."""

    def __init__(self, weights: Sequence[Any]) -> None:
        self._index = {id(w): i for i, w in enumerate(weights)}
        self._num_ops = 0
        self._records: list[Record] = []

    @property
    def records(self) -> list[Record]:
        """The records so far, in forward order (the backward makes them in reverse)."""
        return sorted(self._records, key=lambda r: r.order)

    def _weight_index(self, w: Any) -> int | None:
        return self._index.get(id(w))

    def _next_order(self) -> int:
        self._num_ops += 1
        return self._num_ops - 1

    def _add(self, record: Record) -> None:
        self._records.append(record)


_local = threading.local()


def _active() -> Stash | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def deferring(weights: Sequence[Any]) -> Iterator[Stash]:
    """Inside, ops applying any of `weights` record (x, dy) instead of a weight gradient.

    `weights` are the very objects layers read (theta's leaves); the gradient of ops created
    inside, whenever it is taken, adds to the yielded `Stash`.
    """
    stash = Stash(weights)
    _local.stack = getattr(_local, "stack", []) + [stash]
    try:
        yield stash
    finally:
        _local.stack = _local.stack[:-1]


def apply(op: WeightOp, x: Any, w: Any, **attrs: Any) -> tf.Tensor:
    """`op(x, w, **attrs)`, whose weight gradient is deferred inside `deferring`.

    `op` and `attrs` must be hashable (a module-level function and static values): a W traced
    for one micro-batch's records serves the others.
    """
    stash = _active()
    index = stash._weight_index(w) if stash is not None else None
    if index is None:
        return op(x, w, **attrs)
    x = tf.convert_to_tensor(x)
    y = op(x, tf.stop_gradient(w), **attrs)
    static = (index, op, tuple(sorted(attrs.items())), stash._next_order())

    # w is an input (with no gradient) so that a tape watching it records this op even when
    # nothing else on y's path is watched (the first op of the first cell).
    @tf.custom_gradient
    def record_output_gradient(y: tf.Tensor, w: tf.Tensor) -> tuple[tf.Tensor, Callable]:
        def gradient(dy: tf.Tensor) -> tuple[tf.Tensor, None]:
            stash._add(Record(*static, x=x, dy=dy))
            return dy, None
        return tf.identity(y), gradient

    return record_output_gradient(y, w)


def weight_gradients(records: Sequence[Record],
                     weights: Sequence[Any]) -> list[tf.Tensor | None]:
    """The weight gradient the records stand for, per weight of the `deferring` context (None
    where no record names it): TensorFlow's gradient of each record's op, summed per weight."""
    out: list[tf.Tensor | None] = [None] * len(weights)
    for r in records:  # r.op is the plain op (never `apply`): nothing here is deferred.
        w = weights[r.weight]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(w)
            y = r.op(r.x, w, **dict(r.attrs))
        g = tf.convert_to_tensor(tape.gradient(y, w, output_gradients=r.dy))
        out[r.weight] = g if out[r.weight] is None else out[r.weight] + g
    return out


def concatenate(per_micro_batch: Sequence[Sequence[Record]]) -> list[Record]:
    """Records of several micro-batches as one per op: x and dy concatenated along axis 0.

    Each micro-batch's records must come from the same ops in the same order (the same cell
    run on each), which is checked.
    """
    first = per_micro_batch[0]
    for records in per_micro_batch[1:]:
        if [r.static() for r in records] != [r.static() for r in first]:
            raise ValueError("weight_ops.concatenate: the micro-batches' records differ (the "
                             "cell applied its weights differently for different micro-batches).")
    if len(per_micro_batch) == 1:
        return list(first)
    return [r.with_tensors(tf.concat([rs[j].x for rs in per_micro_batch], 0),
                           tf.concat([rs[j].dy for rs in per_micro_batch], 0))
            for j, r in enumerate(first)]


def matmul(x: Any, w: Any, transpose_b: bool = False) -> tf.Tensor:
    """x [rows, in] times w ([in, out], or [out, in] with `transpose_b`)."""
    return apply(_matmul, x, w, transpose_b=transpose_b)


def einsum(equation: str, x: Any, w: Any) -> tf.Tensor:
    """`tf.einsum(equation, x, w)`; axis 0 of x must be a batch axis kept in the output."""
    return apply(_einsum, x, w, equation=equation)


def conv2d(x: Any, w: Any, strides: Sequence[int], padding: str,
           dilations: Sequence[int]) -> tf.Tensor:
    """`tf.nn.conv2d` on NHWC x."""
    return apply(_conv2d, x, w, strides=tuple(strides), padding=padding,
                 dilations=tuple(dilations))


def depthwise_conv2d(x: Any, w: Any, strides: Sequence[int], padding: str,
                     dilations: Sequence[int]) -> tf.Tensor:
    """`tf.nn.depthwise_conv2d` on NHWC x."""
    return apply(_depthwise_conv2d, x, w, strides=tuple(strides), padding=padding,
                 dilations=tuple(dilations))


def dot_last_axis(x: Any, w: Any) -> tf.Tensor:
    """x [..., in] times w [in, out] -> [..., out] (`tf.tensordot` over x's last axis)."""
    return apply(_dot_last_axis, x, w)


def _matmul(x: tf.Tensor, w: Any, transpose_b: bool) -> tf.Tensor:
    return tf.matmul(x, w, transpose_b=transpose_b)


def _einsum(x: tf.Tensor, w: Any, equation: str) -> tf.Tensor:
    return tf.einsum(equation, x, w)


def _conv2d(x: tf.Tensor, w: Any, strides: tuple[int, ...], padding: str,
            dilations: tuple[int, ...]) -> tf.Tensor:
    return tf.nn.conv2d(x, w, strides=list(strides), padding=padding,
                        dilations=list(dilations))


def _depthwise_conv2d(x: tf.Tensor, w: Any, strides: tuple[int, ...], padding: str,
                      dilations: tuple[int, ...]) -> tf.Tensor:
    return tf.nn.depthwise_conv2d(x, w, strides=list(strides), padding=padding,
                                  dilations=list(dilations))


def _dot_last_axis(x: tf.Tensor, w: Any) -> tf.Tensor:
    return tf.tensordot(x, w, axes=[[-1], [0]])


__all__ = ["Record", "Stash", "deferring", "apply", "weight_gradients",
           "concatenate", "matmul", "einsum", "conv2d", "depthwise_conv2d", "dot_last_axis"]
