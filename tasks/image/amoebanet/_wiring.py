"""One description of a layer's structure, run on tensors by FProp and on shapes by FPropMeta.

An AmoebaNet layer whose FProp and FPropMeta walk the same structure writes it once, as a
`_wire(..., wiring, *inputs)` method that reaches its children and elementwise ops only
through `wiring`: FProp passes a `TensorWiring` (values are tensors, children are the layer's),
FPropMeta a `ShapeWiring` (values are shapes; children are costed from `declare_children(p)`
and the cost is accumulated). So the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite import base_layer
from lingvo_lite.layers import conv, normalization, pooling
from lingvo_lite.nested_map import NestedMap
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


class ShapeWiring:
    """Runs a structure on shapes, costing the children declared by `declare_children(p)`.

    Elementwise ops (ReLU, add) cost one flop per element. Every value is a shape object of
    its own, so the wiring can tell which tensors the backward reads (`saved_bytes`): what
    TensorFlow's gradients of the ops need, each tensor once (`backward_needs`).
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

    def _value(self, shape: tf.TensorShape) -> tf.TensorShape:
        value = tf.TensorShape(shape)
        self._values.append(value)
        return value

    def _keep(self, value: tf.TensorShape) -> None:
        self._kept[id(value)] = base_layer.activation_bytes(value, self._dtype)

    def has(self, name: str) -> bool:
        return name in self._children

    def child(self, name: str, x: tf.TensorShape, index: int | None = None) -> tf.TensorShape:
        child = self._children[name] if index is None else self._children[name][index]
        meta = child.cls.FPropMeta(child, x)
        self.metas.append(meta)
        y = self._value(meta.out_shapes[0])
        needs_input, needs_output, inside = backward_needs(child, x, meta)
        if needs_input:
            self._keep(x)
        if needs_output:
            self._keep(y)
        self._kept_inside += inside
        return y

    def relu(self, x: tf.TensorShape) -> tf.TensorShape:
        self.elementwise_flops += num_elements(x)
        y = self._value(x)
        self._keep(y)  # ReluGrad reads the output.
        return y

    def add(self, a: tf.TensorShape, b: tf.TensorShape) -> tf.TensorShape:
        if a != b:
            raise ValueError(f"{self._where}: adds shapes {a} and {b}.")
        self.elementwise_flops += num_elements(a)
        return self._value(a)

    def concat(self, xs: list[tf.TensorShape]) -> tf.TensorShape:
        if len(xs) == 1:
            return xs[0]
        return self._value(xs[0][:-1].concatenate([sum(x[-1] for x in xs)]))

    def shift(self, x: tf.TensorShape) -> tf.TensorShape:
        return self._value(x)  # A pad and a slice: free, and their gradients read nothing.

    @property
    def flops(self) -> float:
        return sum(m.flops for m in self.metas) + self.elementwise_flops

    @property
    def num_params(self) -> int:
        return sum(m.num_params for m in self.metas)

    @property
    def weight_op_bytes(self) -> int | None:
        """What the children's deferred weight gradients hold (`base_layer.weight_op_bytes`)."""
        return base_layer.weight_op_bytes(self.metas)

    @property
    def saved_bytes(self) -> int:
        """Bytes the backward reads: every value an op's gradient needs, once, and what the
        children keep inside themselves."""
        return sum(self._kept.values()) + self._kept_inside

    def largest_value_bytes(self, *ends: tf.TensorShape) -> int:
        """Bytes of the largest value made inside the layer (not one of `ends`)."""
        skip = {id(v) for v in ends}
        return max((base_layer.activation_bytes(v, self._dtype) for v in self._values
                    if id(v) not in skip), default=0)

    def fprop_meta(self, inputs: tf.TensorShape, output: tf.TensorShape) -> NestedMap:
        """The layer's FPropMeta, with what its backward keeps split into its input, its
        output and the values inside it (read by a parent's `backward_needs`)."""
        ends = {id(v): self._kept.get(id(v), 0) for v in (inputs, output)}
        meta = base_layer.fprop_meta(self.flops, output, self.num_params, self._dtype,
                                     **self.extra_param_counts(),
                                     saved_activation_bytes=self.saved_bytes,
                                     weight_op_bytes=self.weight_op_bytes)
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
    return False, False, base_layer.saved_activation_bytes(meta)


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
