"""One description of a layer's structure, run on tensors by FProp and on shapes by FPropMeta.

An AmoebaNet layer whose FProp and FPropMeta walk the same structure writes it once, as a
`_wire(..., wiring, *inputs)` method that reaches its children and elementwise ops only
through `wiring`: FProp passes a `TensorWiring` (values are tensors, children are the layer's),
FPropMeta a `ShapeWiring` (values are shapes; children are costed from `declare_children(p)`
and the cost is accumulated). So the two cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import conv, normalization, pooling
from tasks.image.amoebanet._common import InstantiableParams, Params, dtype_of, num_elements

__all__: list[str] = []


class TensorWiring:
    """Runs a structure on tensors: children are `layer`'s, with weights from `theta`."""

    def __init__(self, layer: base_layer.BaseLayer, theta: NestedMap) -> None:
        self._layer = layer
        self._theta = theta

    def has(self, name: str) -> bool:
        """Whether the layer has a child `name`."""
        return name in self._layer.children

    def child(self, name: str, x: tf.Tensor, index: int | None = None) -> tf.Tensor:
        """Child `name` (item `index` of a list child) applied to `x`."""
        child, theta = self._layer.children[name], self._theta[name]
        if index is not None:
            child, theta = child[index], theta[index]
        return child.FProp(theta, x)

    def relu(self, x: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(x)

    def add(self, a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return a + b

    def concat(self, xs: list[tf.Tensor]) -> tf.Tensor:
        """Concatenation along channels (the only input itself when there is one)."""
        return tf.concat(xs, axis=-1) if len(xs) > 1 else xs[0]

    def shift(self, x: tf.Tensor) -> tf.Tensor:
        """x moved up and left by one pixel, zero-padded at the bottom and right."""
        return tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]


@dataclasses.dataclass(frozen=True)
class _Op:
    """One step of a structure, as its backward sees it (values by id)."""

    reads: tuple[int, ...]  # The values it reads.
    output: int  # The value it makes.
    kept: tuple[int, ...]  # The values its gradient reads (saved by the forward).
    inside: int  # Bytes a child keeps of its own intermediate values.
    temporaries: int  # Its gradient's temporaries, with the gradients of what it reads.


class ShapeWiring:
    """Runs a structure on shapes, costing the children declared by `declare_children(p)`.

    Elementwise ops (ReLU, add) cost one flop per element. Every value is a shape object of
    its own, so the wiring can tell which tensors the backward reads (`saved_bytes`): what
    TensorFlow's gradients of the ops need, each tensor once (`backward_needs`); and it walks
    the backward op by op to size the gradient temporaries (`backward_temporaries`).
    """

    def __init__(self, layer_cls: type[base_layer.BaseLayer], p: Params) -> None:
        self._children = layer_cls.declare_children(p)
        self._dtype = dtype_of(p)
        self._where = p.name or layer_cls.__name__
        self.metas: list[NestedMap] = []
        self.elementwise_flops = 0
        self._values: list[tf.TensorShape] = []  # Holds every value, so ids stay unique.
        self._kept: dict[int, int] = {}  # id of a value the backward reads -> its bytes.
        self._kept_inside = 0  # Bytes the children keep of their own intermediate values.
        self._ops: list[_Op] = []
        self._bytes: dict[int, int] = {}  # id of every value read or made -> its bytes.

    def _value(self, shape: tf.TensorShape) -> tf.TensorShape:
        value = tf.TensorShape(shape)
        self._values.append(value)
        return value

    def _keep(self, value: tf.TensorShape) -> None:
        self._kept[id(value)] = self._size(value)

    def _size(self, value: tf.TensorShape) -> int:
        self._bytes[id(value)] = base_layer.activation_bytes(value, self._dtype)
        return self._bytes[id(value)]

    def _op(self, reads: list[tf.TensorShape], output: tf.TensorShape,
            kept: Sequence[tf.TensorShape] = (), inside: int = 0,
            temporaries: int | None = None) -> None:
        """Records a step; `temporaries` None: the gradients of what it reads."""
        read_bytes = sum(self._size(v) for v in reads)
        self._size(output)
        self._ops.append(_Op(tuple(id(v) for v in reads), id(output), tuple(id(v) for v in kept),
                             inside, read_bytes if temporaries is None
                             else max(temporaries, read_bytes)))

    def has(self, name: str) -> bool:
        return name in self._children

    def child(self, name: str, x: tf.TensorShape, index: int | None = None) -> tf.TensorShape:
        child = self._children[name] if index is None else self._children[name][index]
        meta = child.cls.FPropMeta(child, x)
        self.metas.append(meta)
        y = self._value(meta.out_shapes[0])
        needs_input, needs_output, inside = backward_needs(child, x, meta)
        kept = [x] * needs_input + [y] * needs_output
        for value in kept:
            self._keep(value)
        self._kept_inside += inside
        self._op([x], y, kept, inside, layer_memory.backward_temporary_bytes(meta))
        return y

    def relu(self, x: tf.TensorShape) -> tf.TensorShape:
        self.elementwise_flops += num_elements(x)
        y = self._value(x)
        self._keep(y)  # ReluGrad reads the output.
        self._op([x], y, [y])
        return y

    def add(self, a: tf.TensorShape, b: tf.TensorShape) -> tf.TensorShape:
        if a != b:
            raise ValueError(f"{self._where}: adds shapes {a} and {b}.")
        self.elementwise_flops += num_elements(a)
        y = self._value(a)
        self._op([a, b], y)
        return y

    def concat(self, xs: list[tf.TensorShape]) -> tf.TensorShape:
        if len(xs) == 1:
            return xs[0]
        y = self._value(xs[0][:-1].concatenate([sum(x[-1] for x in xs)]))
        self._op(xs, y)
        return y

    def shift(self, x: tf.TensorShape) -> tf.TensorShape:
        y = self._value(x)  # A pad and a slice: free, and their gradients read nothing.
        self._op([x], y)
        return y

    @property
    def flops(self) -> float:
        return sum(m.flops for m in self.metas) + self.elementwise_flops

    @property
    def num_params(self) -> int:
        return sum(m.num_params for m in self.metas)

    @property
    def weight_op_bytes(self) -> int | None:
        """What the children's deferred weight gradients hold (`layer_memory.weight_op_bytes`)."""
        return layer_memory.weight_op_bytes(self.metas)

    @property
    def saved_bytes(self) -> int:
        """Bytes the backward reads: every value an op's gradient needs, once, and what the
        children keep inside themselves."""
        return sum(self._kept.values()) + self._kept_inside

    def backward_temporaries(self, output: tf.TensorShape) -> tuple[int, int]:
        """The structure's gradient temporaries, beyond its output's gradient:
        (all saved activations held meanwhile, saved activations freed as the backward
        passes their last reader), the most at any step of an op-by-op backward.

        The backward visits the ops in reverse. A value read by c > 1 ops gets a gradient
        from each reader's backward, summed once the last has come (c + 1 of its size at
        that moment, then one); an op's own backward holds its temporaries (a child's
        declared `backward_temporary_bytes`, else the gradients of what it reads), beside
        every gradient not yet consumed. The first figure sizes a backward that keeps its
        activations to the end (a re-computing call that defers weight gradients returns the
        weight ops' inputs); the second, in excess of the saved activations, a backward that
        frees them as it goes (`memory_model`, layer by layer). The registered AmoebaNet's
        normal cell after a reduction holds three gradients the size of its 2x-larger prev_x
        at once, in its factorized reduction (two strided slices read the ReLU's output).
        """
        readers: dict[int, int] = {}
        first_keeper: dict[int, int] = {}
        for i, op in enumerate(self._ops):
            for value in op.reads:
                readers[value] = readers.get(value, 0) + 1
            for value in op.kept:
                first_keeper.setdefault(value, i)
        freed_at: dict[int, int] = {}  # Op index -> saved bytes its backward frees.
        for value, i in first_keeper.items():
            freed_at[i] = freed_at.get(i, 0) + self._bytes[value]
        received: dict[int, int] = {}  # Value id -> gradients received.
        live = held = freed = released = 0  # live: gradients held, bytes.
        for i in reversed(range(len(self._ops))):
            op = self._ops[i]
            if op.output != id(output) and op.output not in received:
                continue  # No gradient reaches it.
            now = live + op.temporaries
            held, freed = max(held, now), max(freed, now - released)
            if op.output != id(output):
                live -= self._bytes[op.output]
            for value in op.reads:
                received[value] = received.get(value, 0) + 1
                live += self._bytes[value]
                if readers[value] > 1 and received[value] == readers[value]:
                    now = live + self._bytes[value]  # Summed: the gradients and their sum.
                    held, freed = max(held, now), max(freed, now - released)
                    live -= (readers[value] - 1) * self._bytes[value]
            released += freed_at.get(i, 0) + op.inside
        return held, freed

    def fprop_meta(self, inputs: tf.TensorShape, output: tf.TensorShape) -> NestedMap:
        """The layer's FPropMeta, with what its backward keeps split into its input, its
        output and the values inside it (read by a parent's `backward_needs`)."""
        ends = {id(v): self._kept.get(id(v), 0) for v in (inputs, output)}
        held, freeing = self.backward_temporaries(output)
        meta = base_layer.fprop_meta(self.flops, output, self.num_params, self._dtype,
                                     **self.extra_param_counts(),
                                     memory=layer_memory.MemoryRecord(saved_activation_bytes=self.saved_bytes,
                                                                      weight_op_bytes=self.weight_op_bytes,
                                                                      backward_temporary_bytes=held,
                                                                      inline_backward_temporary_bytes=freeing,
                                                                      saved_covers_input=True))
        meta.update(kept_input=id(inputs) in self._kept, kept_output=id(output) in self._kept,
                    kept_inside_bytes=self.saved_bytes - sum(ends.values()))
        return meta

    def extra_param_counts(self) -> dict[str, int]:
        return base_layer.extra_param_counts(self.metas)


def backward_needs(child: InstantiableParams, x: tf.TensorShape,
                   meta: NestedMap) -> tuple[bool, bool, int]:
    """What the gradient of `child` reads: (its input, its output, bytes of values inside it).

    From TensorFlow's gradients: a convolution (plain or depthwise) reads its input, the batch
    norm (moments and an elementwise affine) its input, a max pool its input and output, an
    average pool and a strided slice nothing; a separable convolution reads its input and the
    depthwise output. AmoebaNet's own layers say so in their FPropMeta
    (`ShapeWiring.fprop_meta`); any other layer keeps its `saved_activation_bytes` estimate,
    counted as inside it.
    """
    if "kept_input" in meta:
        return bool(meta.kept_input), bool(meta.kept_output), int(meta.kept_inside_bytes)
    cls = child.cls
    reads_output = getattr(child, "activation", "NONE") not in ("NONE", None)
    if issubclass(cls, conv.SeparableConv2DLayer):
        depthwise = cls.declare_children(child)["depthwise"]
        inside = depthwise.cls.FPropMeta(depthwise, x).out_bytes
        return True, reads_output, inside
    if issubclass(cls, (conv.Conv2DLayer, conv.DepthwiseConv2DLayer,
                        normalization.BatchNormLayer)):
        return True, reads_output, 0
    if issubclass(cls, pooling.PoolingLayer):
        reads = child.pooling_type == "MAX"
        return reads, reads, 0
    # Any other layer (drop path: its per-example boolean mask, when it drops) keeps what its
    # FPropMeta says.
    return False, False, layer_memory.saved_activation_bytes(meta)


# A step of a chain that is an elementwise ReLU rather than a child layer.
RELU = "relu"


def chain_children(steps: list[Any]) -> dict[str, InstantiableParams]:
    """The children of a chain of steps: (name, params) pairs and RELU markers."""
    return dict(step for step in steps if step != RELU)


def wire_chain(wiring: TensorWiring | ShapeWiring, steps: list[Any], x: Any) -> Any:
    """Applies a chain of steps: each (name, params) child in turn, or a ReLU."""
    for step in steps:
        x = wiring.relu(x) if step == RELU else wiring.child(step[0], x)
    return x
