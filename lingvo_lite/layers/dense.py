"""Fully connected layers: y = act(x @ w + b) over the last dimension."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import activations, weight_ops

__all__ = ["check_projection_shape", "FCLayer", "ProjectionLayer"]


def check_projection_shape(layer_name: str, input_dim: int, shape: tf.TensorShape) -> None:
    """ValueError unless `shape` has rank >= 2 and last dim `input_dim` (when known)."""
    if shape.rank is not None and shape.rank < 2:
        raise ValueError(
            f"{layer_name}: inputs must have rank >= 2 ([batch, ..., input_dim]); got shape "
            f"{shape}."
        )
    if shape.rank is not None and shape[-1] is not None and shape[-1] != input_dim:
        raise ValueError(
            f"{layer_name}: the last input dim must equal p.input_dim={input_dim}; got input "
            f"shape {shape}. Set p.input_dim to {shape[-1]} or fix the input."
        )


class ProjectionLayer(base_layer.BaseLayer):
    """Projects the last dim: [..., input_dim] -> [..., output_dim], then `activation`.

    Works on inputs of any rank >= 2 (axis 0 is the batch). Weights: `w`
    [input_dim, output_dim] and, if `has_bias`, `b` [output_dim].
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Size of the input's last dimension.")
        p.Define("output_dim", 0, "Size of the output's last dimension.")
        p.Define("has_bias", True, "Whether to add a bias `b` after the matmul.")
        p.Define("activation", "NONE", f"One of {list(activations.VALID_ACTIVATIONS)}.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        _validate(p, self.path)
        self.CreateVariable(
            "w", weight_params.WeightParams(shape=(p.input_dim, p.output_dim))
        )
        if p.has_bias:
            self.CreateVariable(
                "b", weight_params.WeightParams(
                    shape=(p.output_dim,), init=weight_params.WeightInit.Constant(0.0)
                )
            )

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        p = self.params
        theta = self.CastTheta(theta)
        inputs = tf.convert_to_tensor(inputs)
        check_projection_shape(self.path, p.input_dim, inputs.shape)
        inputs = tf.cast(inputs, self.fprop_dtype)
        if inputs.shape.rank == 2:
            out = weight_ops.matmul(inputs, theta.w)
        else:
            flat = tf.reshape(inputs, [-1, p.input_dim])
            out = weight_ops.matmul(flat, theta.w)
            out = tf.reshape(out, tf.concat([tf.shape(inputs)[:-1], [p.output_dim]], axis=0))
            out.set_shape(inputs.shape[:-1].concatenate([p.output_dim]))
        if p.has_bias:
            out = tf.nn.bias_add(out, theta.b)  # Its gradient keeps no activation alive.
        return activations.get_activation(p.activation)(out)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        _validate(p, p.name or cls.__name__)
        shape = base_layer.to_shape(inputs)
        check_projection_shape(p.name or cls.__name__, p.input_dim, shape)
        rows = _known_prod(shape, p.name or cls.__name__) // p.input_dim
        outputs = rows * p.output_dim
        flops = 2 * rows * p.input_dim * p.output_dim
        flops += outputs * (int(p.has_bias) + activations.activation_flops_per_element(
            p.activation))
        num_params = p.input_dim * p.output_dim + (p.output_dim if p.has_bias else 0)
        out_shape = shape[:-1].concatenate([p.output_dim])
        dtype = p.fprop_dtype or p.dtype
        # For the backward it keeps its output (the activation's gradient needs it; matmul,
        # bias and activation run fused); its input is the previous layer's output.
        size = tf.as_dtype(dtype).size
        saved = outputs * size
        # A deferred weight gradient holds the matmul's input and its output's gradient.
        return base_layer.fprop_meta(flops, out_shape, num_params, dtype,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=saved,
                                         weight_op_bytes=(rows * p.input_dim + outputs) * size))


class FCLayer(ProjectionLayer):
    """A fully connected layer: ProjectionLayer with a RELU activation by default."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.activation = "RELU"
        return p


def _validate(p: hyperparams.Params, where: str) -> None:
    for name in ("input_dim", "output_dim"):
        value = getattr(p, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: p.{name} must be a positive int, got {value!r}.")
    activations.get_activation(p.activation)


def _known_prod(shape: tf.TensorShape, where: str) -> int:
    if not shape.is_fully_defined():
        raise ValueError(
            f"{where}: FPropMeta needs fully-defined input shapes (batch included); got {shape}."
        )
    return math.prod(shape.as_list())
