"""Helpers shared by the AmoebaNet modules: child params, shape checks, and the wiring that lets
one description of a layer's structure run on tensors (FProp) and on shapes (FPropMeta)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite import base_layer, hyperparams
from lingvo_lite.layers import conv, normalization
from lingvo_lite.nested_map import NestedMap

__all__: list[str] = []

Params = hyperparams.Params
InstantiableParams = hyperparams.InstantiableParams


def dtype_of(p: Params) -> tf.DType:
    """Activation dtype of a layer's params."""
    return p.fprop_dtype or p.dtype


def inherit(parent: Params, child: InstantiableParams) -> InstantiableParams:
    """`child` with the parent's variable and activation dtypes (children don't inherit them)."""
    return child.Set(dtype=parent.dtype, fprop_dtype=parent.fprop_dtype)


def conv_step(p: Params, name: str, kernel: tuple[int, int], cin: int, cout: int,
              stride: tuple[int, int] = (1, 1), dilation: int = 1,
              padding: str = "SAME") -> tuple[str, InstantiableParams]:
    """(name, params) of a bias-free Conv2DLayer child with `p`'s dtypes."""
    return name, inherit(p, conv.Conv2DLayer.Params().Set(
        filter_shape=(kernel[0], kernel[1], cin, cout), filter_stride=stride,
        dilation_rate=(dilation, dilation), padding=padding, has_bias=False))


def bn_step(p: Params, name: str, dim: int) -> tuple[str, InstantiableParams]:
    """(name, params) of a BatchNormLayer child with `p`'s dtypes and batch-norm settings."""
    return name, inherit(p, normalization.BatchNormLayer.Params().Set(
        dim=dim, decay=p.batch_norm_decay, epsilon=p.batch_norm_epsilon))


def define_bn_params(p: Params) -> None:
    p.Define("batch_norm_decay", 0.9997, "Moving-average decay of every batch norm.")
    p.Define("batch_norm_epsilon", 1e-3, "Epsilon of every batch norm.")


def bn_settings(p: Params) -> dict[str, float]:
    """`p`'s batch-norm settings, to pass on to a child's params."""
    return dict(batch_norm_decay=p.batch_norm_decay, batch_norm_epsilon=p.batch_norm_epsilon)


def num_elements(shape: tf.TensorShape) -> int:
    return int(shape.num_elements() or 0)


def check_nhwc(where: str, shape: tf.TensorShape, channels: int, param: str) -> None:
    shape = tf.TensorShape(shape)
    if shape.rank != 4:
        raise ValueError(f"{where}: expected an NHWC tensor, got shape {shape}.")
    if shape[-1] is not None and shape[-1] != channels:
        raise ValueError(f"{where}: input has {shape[-1]} channels but p.{param}={channels}; "
                         f"set p.{param}={shape[-1]}.")


def boundary(where: str, inputs: Any, *keys: str) -> NestedMap:
    """`inputs`, checked to be a NestedMap boundary holding `keys`."""
    if not isinstance(inputs, NestedMap):
        raise ValueError(f"{where}: expects a NestedMap boundary (fields {list(keys)} plus "
                         f"passthrough fields), got {type(inputs).__name__}.")
    for key in keys:
        if key not in inputs:
            raise ValueError(f"{where}: the input NestedMap has no '{key}' field (it has "
                             f"{sorted(inputs.keys())}); check the layer order.")
    return inputs


# -- one structure, two interpretations ---------------------------------------------------------
#
# A layer whose FProp and FPropMeta walk the same structure writes it once, as a classmethod
# `_Wire(p, wiring, *inputs)` that reaches its children and elementwise ops only through
# `wiring`. FProp passes a TensorWiring (values are tensors), FPropMeta a ShapeWiring (values
# are shapes; it accumulates the cost).


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
    return dict(step for step in steps if step is not RELU)


def wire_chain(wiring: TensorWiring | ShapeWiring, steps: list[Any], x: Any) -> Any:
    """Applies a chain of steps: each (name, params) child in turn, or a ReLU."""
    for step in steps:
        x = wiring.relu(x) if step is RELU else wiring.child(step[0], x)
    return x
