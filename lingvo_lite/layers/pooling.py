"""Spatial pooling on NHWC inputs: windowed (AVG/MAX) and global."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import conv

__all__ = ["GlobalPoolingLayer", "PoolingLayer"]

_POOLING_TYPES = ("AVG", "MAX")


def _check_type(pooling_type: str, where: str) -> None:
    if pooling_type not in _POOLING_TYPES:
        raise ValueError(f"{where}: p.pooling_type must be one of {list(_POOLING_TYPES)}, "
                         f"got {pooling_type!r}.")


def _check_rank4(where: str, shape: tf.TensorShape) -> None:
    if shape.rank is not None and shape.rank != 4:
        raise ValueError(f"{where}: inputs must be NHWC (rank 4), got shape {shape}.")


def _known(shape: tf.TensorShape, where: str) -> list[int]:
    if not shape.is_fully_defined():
        raise ValueError(f"{where}: FPropMeta needs a fully-defined input shape, got {shape}.")
    return shape.as_list()


class PoolingLayer(base_layer.BaseLayer):
    """Windowed pooling: [B, H, W, C] -> [B, H', W', C], sizes as tf.nn.pool computes them.

    AVG with SAME padding averages only the in-bounds elements of each window
    (TF semantics); MAX ignores the padding.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("pooling_type", "MAX", f"One of {list(_POOLING_TYPES)}.")
        p.Define("window_shape", (2, 2), "Window (h, w), or an int for a square window.")
        p.Define("window_stride", (2, 2), "Stride (sh, sw), or an int.")
        p.Define("padding", "SAME", "'SAME' or 'VALID'.")
        return p

    @classmethod
    def _validate(cls, p: hyperparams.Params, where: str) -> tuple[tuple[int, int], ...]:
        _check_type(p.pooling_type, where)
        if p.padding not in ("SAME", "VALID"):
            raise ValueError(f"{where}: p.padding must be 'SAME' or 'VALID', got {p.padding!r}.")
        return (conv.to_pair(p.window_shape, "window_shape", where),
                conv.to_pair(p.window_stride, "window_stride", where))

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self._validate(self.params, self.path)

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        del theta  # No weights.
        p = self.params
        window, stride = self._validate(p, self.path)
        inputs = tf.convert_to_tensor(inputs)
        _check_rank4(self.path, inputs.shape)
        inputs = tf.cast(inputs, self.fprop_dtype)
        return tf.nn.pool(inputs, window_shape=list(window), pooling_type=p.pooling_type,
                          strides=list(stride), padding=p.padding)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        window, stride = cls._validate(p, where)
        shape = base_layer.to_shape(inputs)
        _check_rank4(where, shape)
        b, h, w, c = _known(shape, where)
        out_h = conv.conv_output_size(h, window[0], stride[0], 1, p.padding)
        out_w = conv.conv_output_size(w, window[1], stride[1], 1, p.padding)
        outputs = b * out_h * out_w * c
        # One add/compare per window element; AVG divides once per output.
        flops = outputs * (window[0] * window[1] + int(p.pooling_type == "AVG"))
        return base_layer.fprop_meta(flops, tf.TensorShape([b, out_h, out_w, c]), 0,
                                     p.fprop_dtype or p.dtype)


class GlobalPoolingLayer(base_layer.BaseLayer):
    """Pools over all of H and W: [B, H, W, C] -> [B, C] (AVG by default)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("pooling_type", "AVG", f"One of {list(_POOLING_TYPES)}.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        _check_type(self.params.pooling_type, self.path)

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        del theta  # No weights.
        inputs = tf.convert_to_tensor(inputs)
        _check_rank4(self.path, inputs.shape)
        inputs = tf.cast(inputs, self.fprop_dtype)
        if self.params.pooling_type == "AVG":
            return tf.reduce_mean(inputs, axis=[1, 2])
        return tf.reduce_max(inputs, axis=[1, 2])

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        _check_type(p.pooling_type, where)
        shape = base_layer.to_shape(inputs)
        _check_rank4(where, shape)
        b, h, w, c = _known(shape, where)
        flops = b * h * w * c + (b * c if p.pooling_type == "AVG" else 0)
        return base_layer.fprop_meta(flops, tf.TensorShape([b, c]), 0, p.fprop_dtype or p.dtype)
