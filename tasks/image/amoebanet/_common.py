"""Helpers shared by the AmoebaNet modules: child params and boundary/shape checks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import conv, normalization

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
