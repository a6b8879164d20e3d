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

    Elementwise ops (ReLU, add) cost one flop per element; their outputs, and the
    concatenation's, are kept for the backward (`elementwise_bytes`).
    """

    def __init__(self, layer_cls: type[base_layer.BaseLayer], p: Params) -> None:
        self._children = layer_cls.declare_children(p)
        self._dtype = dtype_of(p)
        self._where = p.name or layer_cls.__name__
        self.metas: list[NestedMap] = []
        self.elementwise_flops = 0
        self.elementwise_bytes = 0

    def has(self, name: str) -> bool:
        return name in self._children

    def child(self, name: str, x: tf.TensorShape, index: int | None = None) -> tf.TensorShape:
        child = self._children[name] if index is None else self._children[name][index]
        meta = child.cls.FPropMeta(child, x)
        self.metas.append(meta)
        return meta.out_shapes[0]

    def _elementwise(self, x: tf.TensorShape, flops_per_element: int) -> tf.TensorShape:
        self.elementwise_flops += flops_per_element * num_elements(x)
        self.elementwise_bytes += base_layer.activation_bytes(x, self._dtype)
        return x

    def relu(self, x: tf.TensorShape) -> tf.TensorShape:
        return self._elementwise(x, 1)

    def add(self, a: tf.TensorShape, b: tf.TensorShape) -> tf.TensorShape:
        if a != b:
            raise ValueError(f"{self._where}: adds shapes {a} and {b}.")
        return self._elementwise(a, 1)

    def concat(self, xs: list[tf.TensorShape]) -> tf.TensorShape:
        out = xs[0][:-1].concatenate([sum(x[-1] for x in xs)])
        return self._elementwise(out, 0)

    def shift(self, x: tf.TensorShape) -> tf.TensorShape:
        return x  # A copy; counted as free.

    @property
    def flops(self) -> float:
        return sum(m.flops for m in self.metas) + self.elementwise_flops

    @property
    def num_params(self) -> int:
        return sum(m.num_params for m in self.metas)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept for the backward: the children's and the elementwise ops' outputs."""
        return (sum(base_layer.saved_activation_bytes(m) for m in self.metas)
                + self.elementwise_bytes)

    def extra_param_counts(self) -> dict[str, int]:
        return base_layer.extra_param_counts(self.metas)


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
