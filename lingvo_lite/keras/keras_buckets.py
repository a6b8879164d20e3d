"""Length buckets for `PipelinedModel.fit`: batches of a few declared shapes.

Text batched by length (`tf.data.Dataset.bucket_by_sequence_length`) comes in a few shapes,
e.g. 16 sequences of 8 tokens, 8 of 16 and 4 of 32. `PipelinedModel(..., input_buckets=...)`
declares them as the input batch shapes (batch dimension included; for a functional model
with several inputs, a dict by input name or a list in input order). The pipeline's cells are
then traced once per bucket (PipeliningLayer.input_buckets), and `fit` runs each step through
a train function traced once per bucket shape: Keras' own train function takes the dataset
iterator inside one `tf.function` with `reduce_retracing=True`, so its batches have the
dataset's unknown dimensions, which the pipeline cannot split into micro-batches. A batch of
another shape is refused in one line naming the buckets.

Example:
    >>> buckets = normalize([(16, 8), (8, 16), (4, 32)], ["x"])
    >>> describe(largest(buckets))
    '[4, 32]'
    >>> example_shapes(largest(buckets))
    {'x': (32,)}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from keras.src import tree

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import graph_layer
from lingvo_lite.pipeline import buckets as pipeline_buckets

__all__ = ["BucketedTrainFunction", "check_batch", "describe", "example_shapes", "largest",
           "functional_input_names", "functional_pipeline_buckets", "normalize",
           "pipeline_buckets_of", "plain_shape", "shapes_by_name"]


def normalize(input_buckets: Any, input_names: Sequence[str]) -> list[dict[str, tuple]]:
    """Each declared bucket as {input name: full batch shape}, every dimension known and all
    inputs of a bucket with the same batch size.

    A bucket is a shape (one input), a dict by input name, or a list in input order.
    """
    if isinstance(input_buckets, (str, bytes, dict)) or not isinstance(
            input_buckets, Sequence) or not input_buckets:
        raise ValueError(f"PipelinedModel: input_buckets={input_buckets!r}: give a non-empty "
                         "list of input batch shapes, e.g. [(16, 8), (8, 16), (4, 32)].")
    out = []
    for i, bucket in enumerate(input_buckets):
        if isinstance(bucket, dict):
            shapes = [bucket.get(n) for n in input_names]
        elif len(input_names) == 1 and all(isinstance(d, int) for d in bucket):
            shapes = [bucket]
        else:
            shapes = list(bucket)
        if len(shapes) != len(input_names) or any(
                s is None or not all(isinstance(d, int) and d > 0 for d in s) for s in shapes):
            raise ValueError(
                f"PipelinedModel: input_buckets[{i}]={bucket!r} is not one batch shape (known "
                f"positive sizes, batch first) for each of the inputs {list(input_names)}.")
        if len({s[0] for s in shapes}) != 1:
            raise ValueError(f"PipelinedModel: input_buckets[{i}]={bucket!r}: the inputs' "
                             "batch sizes differ.")
        out.append({n: tuple(int(d) for d in s) for n, s in zip(input_names, shapes)})
    return out


def largest(buckets: Sequence[dict[str, tuple]]) -> dict[str, tuple]:
    """The bucket with the most input elements: what the layers are built and planned for."""
    def size(bucket: dict[str, tuple]) -> tuple[int, int]:  # Ties: the longest examples.
        return (sum(int(tf.TensorShape(s).num_elements()) for s in bucket.values()),
                sum(int(tf.TensorShape(s[1:]).num_elements()) for s in bucket.values()))
    return max(buckets, key=size)


def example_shapes(bucket: dict[str, tuple]) -> dict[str, tuple]:
    """One example's shape of each input (the bucket's shapes without the batch)."""
    return {n: tuple(s[1:]) for n, s in bucket.items()}


def describe(bucket: dict[str, tuple]) -> str:
    """'[4, 32]' for one input, '{ids: [4, 32], segments: [4, 32]}' for several."""
    if len(bucket) == 1:
        return str(list(next(iter(bucket.values()))))
    return "{" + ", ".join(f"{n}: {list(s)}" for n, s in bucket.items()) + "}"


def check_batch(buckets: Sequence[dict[str, tuple]], shapes: dict[str, tuple]) -> None:
    """Refuses, in one line naming the buckets, a batch whose input shapes are none of them."""
    if any(shapes == b for b in buckets):
        return
    raise ValueError(
        f"PipelinedModel.fit: a training batch of shape {describe(shapes)} is not one of the "
        f"declared input_buckets ({', '.join(describe(b) for b in buckets)}); batch the data "
        "into these shapes (tf.data's bucket_by_sequence_length with "
        "pad_to_bucket_boundary=True and drop_remainder=True) or declare the shape.")


class BucketedTrainFunction:
    """The train function `fit` calls with the dataset iterator: each batch is taken eagerly
    and run by `step` under a `tf.function` traced once per input shape (at most one per
    declared bucket, since other shapes are refused before tracing).

    `input_shapes(data)` gives a batch's {input name: shape}; `traces` counts the traces.
    """

    def __init__(self, step: Callable[[Any], Any], steps_per_execution: int,
                 buckets: Sequence[dict[str, tuple]],
                 input_shapes: Callable[[Any], dict[str, tuple]]) -> None:
        self._buckets = list(buckets)
        self._input_shapes = input_shapes
        self._steps = steps_per_execution
        self._step = tf.function(step, autograph=False)

    @property
    def traces(self) -> int:
        """How many times the step has been traced (one per bucket seen)."""
        return self._step.experimental_get_tracing_count()

    def __call__(self, iterator: Any) -> Any:
        outputs = None
        for _ in range(self._steps):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                break
            check_batch(self._buckets, self._input_shapes(data))
            outputs = self._step(data)
        if outputs is None:
            raise StopIteration
        return outputs


def shapes_by_name(x: Any, input_names: Sequence[str]) -> dict[str, tuple]:
    """{input name: static shape} of a batch's inputs (a tensor, a list or a dict)."""
    if isinstance(x, dict):
        return {n: tuple(x[n].shape) for n in input_names if n in x}
    return {n: tuple(t.shape) for n, t in zip(input_names, tree.flatten(x))}


def pipeline_buckets_of(buckets: Sequence[dict[str, tuple]], keys: dict[str, str],
                        transform: Callable[[str, tuple], tuple] | None = None) -> list[Any]:
    """The PipeliningLayer.input_buckets of Keras buckets: {map key: shape}, the shape passed
    through `transform(name, shape)` (e.g. a leading Embedding's output shape)."""
    out = []
    for bucket in buckets:
        out.append(NestedMap({keys[n]: list(transform(n, s) if transform else s)
                              for n, s in bucket.items()}))
    return pipeline_buckets.normalize(out)


def plain_shape(buckets: Sequence[dict[str, tuple]] | None, name: str,
                example_shape: Sequence[int]) -> tuple:
    """`example_shape` with None where the buckets' example shapes of input `name` differ
    (the plain model's keras.Input)."""
    if not buckets:
        return tuple(example_shape)
    shapes = {b[name][1:] for b in buckets}
    return tuple(d if len({s[i] for s in shapes}) == 1 else None
                 for i, d in enumerate(example_shape))


def functional_input_names(model: Any) -> list[str]:
    """A functional model's input names in the order its pipeline map keys follow
    (graph_trace's order: sorted for a dict of inputs, else the model's inputs)."""
    struct = model._inputs_struct
    return sorted(struct) if isinstance(struct, dict) else [t.name for t in model.inputs]


def functional_pipeline_buckets(buckets: Sequence[dict[str, tuple]], key_of: dict[str, str],
                                front_nodes: Sequence[Any], pipe_keys: Sequence[str]
                                ) -> list[Any]:
    """The PipeliningLayer.input_buckets of a functional model's buckets: the shapes of the
    pipeline's input keys, a front embedding's output (front_embeddings.py) shaped from the
    bucket's shape of the input it looks up."""
    out = []
    for bucket in buckets:
        shapes = {key_of[n]: tuple(s) for n, s in bucket.items()}
        for node in front_nodes:
            read = graph_layer.tensor_keys(node.call)[0]
            shapes[node.outputs[0]] = tuple(node.layer.compute_output_shape(shapes[read]))
        out.append(NestedMap({k: list(shapes[k]) for k in pipe_keys}))
    return pipeline_buckets.normalize(out)
