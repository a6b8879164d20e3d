"""Training batches of varying shape: a bounded set of declared mini-batch shapes (buckets).

Text batched by length comes in a few shapes, e.g. sequence length 32, 64, 128 or 256 with the
batch size scaled to keep tokens per batch about constant. `PipeliningLayer.input_buckets`
declares them (each a mini-batch shape like `input_shapes`: a TensorShape or a NestedMap of
them). A training step's batch must have one of these shapes; every cell's functions are then
traced once per bucket and reused (`tf.function` keys its traces by shape), and the partition is
chosen once, for `input_shapes` or, when that is unset, for the largest bucket.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> buckets = normalize([NestedMap(x=[8, 32]), NestedMap(x=[4, 64])])
    >>> largest(buckets).x
    TensorShape([4, 64])
    >>> matching(buckets, NestedMap(x=tf.zeros([4, 64])))
    1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap

__all__ = ["describe", "largest", "matching", "normalize", "planning_shapes", "shapes_of"]


def _to_shapes(shapes: Any) -> Any:
    if isinstance(shapes, dict):
        return NestedMap({k: _to_shapes(v) for k, v in shapes.items()})
    return tf.TensorShape(shapes)


def normalize(buckets: Sequence[Any]) -> list[Any]:
    """The declared buckets as TensorShapes (or NestedMaps of them), each fully defined.

    Raises a ValueError naming the bucket that is not a list of shapes or has an unknown
    dimension.
    """
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets:
        raise ValueError(f"input_buckets={buckets!r}: give a non-empty list of mini-batch "
                         "shapes, e.g. [NestedMap(ids=[64, 32]), NestedMap(ids=[32, 64])].")
    out = []
    for i, bucket in enumerate(buckets):
        try:
            shapes = _to_shapes(bucket)
        except (TypeError, ValueError) as e:
            raise ValueError(f"input_buckets[{i}]={bucket!r} is not a shape: {e}") from None
        leaves = shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes]
        if not all(s.is_fully_defined() for s in leaves):
            raise ValueError(f"input_buckets[{i}] has an unknown dimension ({describe(shapes)}); "
                             "each bucket is one exact mini-batch shape.")
        out.append(shapes)
    return out


def _leaves(shapes: Any) -> list[tf.TensorShape]:
    return shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes]


def largest(buckets: Sequence[Any]) -> Any:
    """The bucket with the most elements (summed over its tensors): what memory is planned for.
    Of buckets with as many elements (a tokens-per-batch budget), the one with the longest
    examples: what grows faster than linearly in length (attention) is largest there."""
    def size(b: Any) -> tuple[int, int]:
        leaves = _leaves(b)
        return (sum(s.num_elements() for s in leaves),
                sum(s.num_elements() // max(s[0], 1) for s in leaves if s.rank))
    return max(buckets, key=size)


def shapes_of(inputs: Any) -> Any:
    """The static shapes of a batch (a tensor or a NestedMap of tensors)."""
    if isinstance(inputs, dict):
        return NestedMap({k: shapes_of(v) for k, v in inputs.items()})
    return tf.TensorShape(getattr(inputs, "shape", None))


def _fits(bucket: Any, shapes: Any) -> bool:
    if isinstance(bucket, NestedMap):
        return (isinstance(shapes, dict)
                and all(k in shapes and _fits(v, shapes[k]) for k, v in bucket.items()))
    return not isinstance(shapes, dict) and shapes.is_fully_defined() and \
        shapes.as_list() == bucket.as_list()


def matching(buckets: Sequence[Any], inputs: Any) -> int | None:
    """The index of the bucket whose shapes `inputs` has (tensors the buckets do not name are
    not compared), or None."""
    shapes = shapes_of(inputs)
    for i, bucket in enumerate(buckets):
        if _fits(bucket, shapes):
            return i
    return None


def describe(shapes: Any) -> str:
    """'[8, 32]' or '{x: [8, 32], labels: [8]}'."""
    if isinstance(shapes, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in shapes.items()) + "}"
    return str(tf.TensorShape(shapes).as_list())


def planning_shapes(p: Any) -> Any:
    """The mini-batch shape a PipeliningLayer's costs and memory are planned for:
    `p.input_shapes`, else the largest of `p.input_buckets`, else None."""
    if p.input_shapes is not None or not p.input_buckets:
        return p.input_shapes
    return largest(normalize(p.input_buckets))
