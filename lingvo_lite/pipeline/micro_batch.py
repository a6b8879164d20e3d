"""Splitting a mini-batch into micro-batches and putting the outputs back together."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import replica_means

__all__: list[str] = []

# Scalar outputs that count examples (or real tokens): summed across micro-batches, they weigh
# the other scalars' means (defined with the means over replicas and tasks).
WEIGHT_KEYS = replica_means.WEIGHT_KEYS


def _leaves_with_paths(inputs: Any) -> list[tuple[str, Any]]:
    if isinstance(inputs, NestedMap):
        return inputs.FlattenItems()
    return [("inputs", inputs)]


def batch_size_of(inputs: Any, batch_dim: int = 0) -> int:
    """The static mini-batch size shared by every non-scalar tensor of `inputs`."""
    sizes = {}
    for path, leaf in _leaves_with_paths(inputs):
        if leaf is None or leaf.shape.rank == 0:
            continue
        if leaf.shape.rank <= batch_dim:
            raise ValueError(f"Input '{path}' has rank {leaf.shape.rank}; batch_dim={batch_dim}.")
        size = leaf.shape[batch_dim]
        if size is None:
            raise ValueError(
                f"Input '{path}' has an unknown batch size {leaf.shape}; the pipeline needs a "
                "static mini-batch size (batch the dataset with drop_remainder=True)."
            )
        sizes[path] = size
    if not sizes:
        raise ValueError("The pipeline input has no tensor with a batch dimension.")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"Inputs disagree on the batch size along batch_dim: {sizes}.")
    return next(iter(sizes.values()))


def check_micro_batch_params(num_micro_batches: Any, micro_batch_size: Any) -> None:
    """Each of the two is None (unset) or an integer >= 1."""
    for name, value in (("num_micro_batches", num_micro_batches),
                        ("micro_batch_size", micro_batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 (or None: unset), got {value!r}.")


def resolve_num_micro_batches(
    batch_size: int, num_micro_batches: int | None, micro_batch_size: int | None
) -> int:
    """T from `num_micro_batches` and/or `micro_batch_size`; never silently changed.

    None means unset; with neither set T is 1. Both set is allowed only when they
    agree (num_micro_batches * micro_batch_size == batch_size), as in Lingvo.
    """
    check_micro_batch_params(num_micro_batches, micro_batch_size)
    if micro_batch_size is not None:
        if batch_size % micro_batch_size:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} does not divide the mini-batch size "
                f"{batch_size}; choose one of {_divisors(batch_size)}."
            )
        t = batch_size // micro_batch_size
        if num_micro_batches is not None and num_micro_batches != t:
            raise ValueError(
                f"num_micro_batches={num_micro_batches} and micro_batch_size="
                f"{micro_batch_size} disagree for a mini-batch of {batch_size} (that size "
                f"means {t} micro-batches); set only one of them (the other to None)."
            )
        return t
    t = 1 if num_micro_batches is None else num_micro_batches
    if batch_size % t:
        raise ValueError(
            f"num_micro_batches={t} does not divide the mini-batch size {batch_size}; "
            f"choose one of {_divisors(batch_size)} or change the batch size."
        )
    return t


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split(inputs: Any, num_micro_batches: int, batch_dim: int = 0) -> list[Any]:
    """Splits every non-scalar tensor of `inputs` into equal micro-batches (scalars are shared)."""
    if num_micro_batches == 1:
        return [inputs]

    def split_leaf(x: Any) -> list[Any]:
        if x is None or x.shape.rank == 0:
            return [x] * num_micro_batches
        return tf.split(x, num_micro_batches, axis=batch_dim)

    if not isinstance(inputs, NestedMap):
        return split_leaf(inputs)
    pieces = [split_leaf(x) for x in inputs.Flatten()]
    return [inputs.Pack([p[t] for p in pieces]) for t in range(num_micro_batches)]


def merge(outputs: list[Any], batch_dim: int = 0, weights: list[Any] | None = None) -> Any:
    """Re-assembles per-micro-batch outputs in order.

    Tensors with a batch dimension are concatenated. Scalars (losses and metrics,
    which the last cell computes as means over its micro-batch) are combined as
    a weighted mean with `weights` (e.g. each micro-batch's number of real
    tokens), or a plain mean when micro-batches weigh the same; that equals the
    mean over the whole mini-batch.
    """
    if len(outputs) == 1:
        return outputs[0]
    if weights is None:
        weights = [1.0 / len(outputs)] * len(outputs)

    def merge_leaf(*xs: Any) -> Any:
        if xs[0] is None:
            return None
        if xs[0].shape.rank == 0:
            return tf.add_n([tf.cast(w, x.dtype) * x for w, x in zip(weights, xs)])
        return tf.concat(xs, axis=batch_dim)

    if not isinstance(outputs[0], NestedMap):
        return merge_leaf(*outputs)
    merged = []
    for (path, first), *rest in zip(*[o.FlattenItems() for o in outputs]):
        leaves = [first] + [leaf for _, leaf in rest]
        if path in WEIGHT_KEYS and first is not None and first.shape.rank == 0:
            merged.append(tf.add_n(leaves))
        else:
            merged.append(merge_leaf(*leaves))
    return outputs[0].Pack(merged)


def check_tensor_leaves(value: Any, where: str) -> None:
    """A cell boundary carries tensors (or None): anything else is a one-line ValueError."""
    items = value.FlattenItems() if isinstance(value, NestedMap) else [("", value)]
    for path, leaf in items:
        if leaf is not None and not tf.is_tensor(leaf):
            name = f" leaf '{path}'" if path else ""
            raise ValueError(
                f"{where}{name} is a {type(leaf).__name__}, not a tensor; values crossing a "
                "pipeline cell boundary must be tensors (or None): convert it with "
                "tf.convert_to_tensor or keep it out of the boundary NestedMap.")


def weight_key(output: Any) -> str | None:
    """Which of `WEIGHT_KEYS` the last cell's output holds, or None."""
    if not isinstance(output, NestedMap):
        return None
    return next((key for key in WEIGHT_KEYS if key in output and output[key] is not None), None)


def micro_batch_weight(output: Any) -> tf.Tensor | None:
    """The last cell's `loss_weight` (else `num_examples`) output as float32, or None.

    These two names are reserved: a non-scalar one is a ValueError; that they are >= 0 is
    checked at run time by `total_weight`.
    """
    key = weight_key(output)
    if key is None:
        return None
    w = output[key]
    if w.shape.rank != 0:
        raise ValueError(
            f"The last cell's output '{key}' has shape {w.shape}, but '{key}' is "
            "reserved for a scalar micro-batch weight (PipeliningLayer weighs each "
            "micro-batch's scalars by it); return a scalar count or rename the output.")
    return tf.cast(w, tf.float32)


def total_weight(outputs: list[Any], weights: list[tf.Tensor]) -> tf.Tensor:
    """sum(weights) (at least 1e-8), once a run-time check found every weight >= 0.

    One check for all micro-batches: everything the weights feed (the merged scalars, the
    gradients' division) depends on the total, so a negative weight fails the step.
    """
    stacked = tf.stack(weights)
    check = tf.debugging.assert_non_negative(
        stacked, message=f"The last cell's micro-batch weight '{weight_key(outputs[0])}' "
                         "must be >= 0")
    with tf.control_dependencies([check] if check is not None else []):
        return tf.maximum(tf.reduce_sum(stacked), 1e-8)


def loss_weights(outputs: list[Any], weights: list[Any] | None = None,
                 total: Any = None) -> list[Any] | None:
    """Micro-batch weights from a scalar `loss_weight` or `num_examples` output.

    With padded examples or tokens, micro-batches weigh differently; the mini-batch loss is
    then the weighted mean of the micro-batch means.
    """
    if weights is None:
        weights = [micro_batch_weight(o) for o in outputs]
    if len(outputs) == 1 or weights[0] is None:
        return None
    if total is None:
        total = total_weight(outputs, weights)
    return [w / total for w in weights]
