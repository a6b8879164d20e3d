"""2-D convolutions on NHWC inputs: regular, depthwise and separable.

Output spatial sizes follow TensorFlow exactly (`conv_output_size`), so
`FPropMeta` predicts the shapes FProp produces for any stride, dilation and
padding. Kernels default to He-normal initialisation (fan-in = kh * kw * cin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import activations, composite, weight_ops

_PADDINGS = ("SAME", "VALID")


def conv_output_size(in_size: int, kernel: int, stride: int, dilation: int, padding: str) -> int:
    """Output length of a TF convolution/pooling along one spatial axis.

    SAME: ceil(in / stride). VALID: ceil((in - (kernel - 1) * dilation) / stride),
    which must be >= 1 (ValueError otherwise).
    """
    if padding == "SAME":
        return -(-in_size // stride)
    if padding != "VALID":
        raise ValueError(f"padding must be one of {list(_PADDINGS)}, got {padding!r}.")
    effective = (kernel - 1) * dilation + 1
    if in_size < effective:
        raise ValueError(
            f"VALID padding needs an input of at least {effective} (kernel {kernel}, dilation "
            f"{dilation}) along each spatial axis, got {in_size}; use padding 'SAME' or a "
            "larger input."
        )
    return (in_size - effective) // stride + 1


def same_padding(in_size: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """(before, after) zero padding TF's SAME mode applies along one axis."""
    effective = (kernel - 1) * dilation + 1
    out = -(-in_size // stride)
    total = max((out - 1) * stride + effective - in_size, 0)
    return total // 2, total - total // 2


def to_pair(value: Any, name: str, where: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair of positive ints."""
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise ValueError(f"{where}: p.{name} must be a positive int or a pair of them, "
                         f"got {value!r}.")
    return pair  # type: ignore[return-value]


def _check_common(p: hyperparams.Params, where: str) -> None:
    if p.padding not in _PADDINGS:
        raise ValueError(f"{where}: p.padding must be one of {list(_PADDINGS)}, "
                         f"got {p.padding!r}.")
    activations.get_activation(p.activation)


def _check_filter_shape(p: hyperparams.Params, where: str, last: str) -> tuple[int, ...]:
    fs = tuple(p.filter_shape) if p.filter_shape is not None else ()
    if len(fs) != 4 or not all(isinstance(v, int) and v > 0 for v in fs):
        raise ValueError(f"{where}: p.filter_shape must be 4 positive ints (h, w, in, {last}), "
                         f"got {p.filter_shape!r}.")
    return fs


def _check_input(where: str, shape: tf.TensorShape, in_channels: int, param: str) -> None:
    if shape.rank is not None and shape.rank != 4:
        raise ValueError(f"{where}: inputs must be NHWC (rank 4), got shape {shape}.")
    if shape.rank is not None and shape[-1] is not None and shape[-1] != in_channels:
        raise ValueError(
            f"{where}: input channels {shape[-1]} (shape {shape}) do not match "
            f"p.{param}={in_channels}; set p.{param} to match the input."
        )


def _known(shape: tf.TensorShape, where: str) -> list[int]:
    if not shape.is_fully_defined():
        raise ValueError(f"{where}: FPropMeta needs a fully-defined input shape, got {shape}.")
    return shape.as_list()


def _conv_meta(
    p: hyperparams.Params, where: str, shape: tf.TensorShape, kernel: Sequence[int],
    macs_per_output: int, out_channels: int, num_params: int,
) -> NestedMap:
    """Shared FPropMeta: TF output dims, 2 flops per MAC, bias and activation per output."""
    b, h, w, _ = _known(shape, where)
    stride = to_pair(p.filter_stride, "filter_stride", where)
    dilation = to_pair(p.dilation_rate, "dilation_rate", where)
    out_h = conv_output_size(h, kernel[0], stride[0], dilation[0], p.padding)
    out_w = conv_output_size(w, kernel[1], stride[1], dilation[1], p.padding)
    outputs = b * out_h * out_w * out_channels
    flops = 2 * outputs * macs_per_output
    flops += outputs * (int(p.has_bias) + activations.activation_flops_per_element(p.activation))
    dtype = p.fprop_dtype or p.dtype
    # A deferred weight gradient holds the convolution's input and output gradient.
    out_shape = tf.TensorShape([b, out_h, out_w, out_channels])
    return base_layer.fprop_meta(
        flops, out_shape, num_params, dtype,
        memory=layer_memory.MemoryRecord(weight_op_bytes=(
            base_layer.activation_bytes(shape, dtype)
            + base_layer.activation_bytes(out_shape, dtype))))


class _FilterConvLayer(base_layer.BaseLayer):
    """What Conv2DLayer and DepthwiseConv2DLayer share: a `filter_shape` kernel `w`, an
    optional bias `b` per output channel, then `activation`. A subclass says how the
    kernel's last axis maps to output channels and how to convolve."""

    _FILTER_LAST_DIM = ""  # Name of filter_shape[3], for docs and messages.
    _FAN_IN_AXES: tuple[int, ...] = ()  # Kernel axes an output's inputs span.

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("filter_shape", (0, 0, 0, 0),
                 f"Kernel shape (h, w, in_channels, {cls._FILTER_LAST_DIM}).")
        p.Define("filter_stride", (1, 1), "Strides (sh, sw) along height and width.")
        p.Define("padding", "SAME", "'SAME' or 'VALID', as in tf.nn.conv2d.")
        p.Define("dilation_rate", (1, 1), "Dilation (dh, dw) along height and width.")
        p.Define("has_bias", False, "Add a bias per output channel (off: convs usually feed a "
                 "batch norm).")
        p.Define("activation", "NONE", f"One of {list(activations.VALID_ACTIVATIONS)}.")
        p.params_init = weight_params.WeightInit.HeNormal(1.0)
        return p

    @staticmethod
    def _out_channels(fs: tuple[int, ...]) -> int:
        raise NotImplementedError

    @staticmethod
    def _macs_per_output(fs: tuple[int, ...]) -> int:
        raise NotImplementedError

    def _convolve(self, inputs: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    @classmethod
    def _validate(cls, p: hyperparams.Params, where: str) -> tuple[int, ...]:
        """Checks the params; returns the filter shape."""
        _check_common(p, where)
        to_pair(p.filter_stride, "filter_stride", where)
        to_pair(p.dilation_rate, "dilation_rate", where)
        return _check_filter_shape(p, where, cls._FILTER_LAST_DIM)

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        fs = self._validate(self.params, self.path)
        self.CreateVariable("w", weight_params.WeightParams(
            shape=fs, fan_in_axes=self._FAN_IN_AXES, fan_out_axes=(0, 1, 3)))
        if self.params.has_bias:
            self.CreateVariable("b", weight_params.WeightParams(
                shape=(self._out_channels(fs),), init=weight_params.WeightInit.Constant(0.0)))

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        p = self.params
        theta = self.CastTheta(theta)
        inputs = tf.convert_to_tensor(inputs)
        _check_input(self.path, inputs.shape, p.filter_shape[2], "filter_shape[2]")
        out = self._convolve(tf.cast(inputs, self.fprop_dtype), theta.w)
        if p.has_bias:
            out = tf.nn.bias_add(out, theta.b)
        return activations.get_activation(p.activation)(out)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        fs = cls._validate(p, where)
        shape = base_layer.to_shape(inputs)
        _check_input(where, shape, fs[2], "filter_shape[2]")
        out_channels = cls._out_channels(fs)
        num_params = math.prod(fs) + (out_channels if p.has_bias else 0)
        return _conv_meta(p, where, shape, fs[:2], cls._macs_per_output(fs), out_channels,
                          num_params)


class Conv2DLayer(_FilterConvLayer):
    """NHWC 2-D convolution: [B, H, W, in] -> [B, H', W', out], then `activation`.

    Weights: `w` of shape `filter_shape` (h, w, in, out); `b` [out] if `has_bias`.
    """

    _FILTER_LAST_DIM = "out_channels"
    _FAN_IN_AXES = (0, 1, 2)

    @staticmethod
    def _out_channels(fs: tuple[int, ...]) -> int:
        return fs[3]

    @staticmethod
    def _macs_per_output(fs: tuple[int, ...]) -> int:
        return fs[0] * fs[1] * fs[2]

    def _convolve(self, inputs: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        p = self.params
        sh, sw = to_pair(p.filter_stride, "filter_stride", self.path)
        dh, dw = to_pair(p.dilation_rate, "dilation_rate", self.path)
        return weight_ops.conv2d(inputs, w, strides=[1, sh, sw, 1], padding=p.padding,
                                 dilations=[1, dh, dw, 1])


class DepthwiseConv2DLayer(_FilterConvLayer):
    """Depthwise NHWC convolution: each input channel gets `channel_multiplier` filters.

    [B, H, W, in] -> [B, H', W', in * channel_multiplier]; output channel
    c * channel_multiplier + m comes from input channel c and filter m.
    Weights: `w` of shape `filter_shape` (h, w, in, channel_multiplier); `b` if `has_bias`.
    """

    _FILTER_LAST_DIM = "channel_multiplier"
    _FAN_IN_AXES = (0, 1)  # Each output sees kh * kw inputs of one channel.

    @staticmethod
    def _out_channels(fs: tuple[int, ...]) -> int:
        return fs[2] * fs[3]

    @staticmethod
    def _macs_per_output(fs: tuple[int, ...]) -> int:
        return fs[0] * fs[1]

    def _convolve(self, inputs: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        p = self.params
        sh, sw = to_pair(p.filter_stride, "filter_stride", self.path)
        dh, dw = to_pair(p.dilation_rate, "dilation_rate", self.path)
        if sh == sw and (sh == 1 or (dh == 1 and dw == 1)):
            return weight_ops.depthwise_conv2d(inputs, w, strides=[1, sh, sw, 1],
                                               padding=p.padding, dilations=[dh, dw])
        # TF's kernel rejects unequal strides and silently mis-sizes stride > 1 with
        # dilation > 1; pad as TF would, convolve densely, then subsample.
        if p.padding == "SAME":
            if inputs.shape[1] is None or inputs.shape[2] is None:
                raise ValueError(
                    f"{self.path}: filter_stride {p.filter_stride} with dilation_rate "
                    f"{p.dilation_rate} needs static spatial input dims, got {inputs.shape}.")
            kh, kw = p.filter_shape[:2]
            pads = [[0, 0], list(same_padding(inputs.shape[1], kh, sh, dh)),
                    list(same_padding(inputs.shape[2], kw, sw, dw)), [0, 0]]
            inputs = tf.pad(inputs, pads)
        dense = weight_ops.depthwise_conv2d(inputs, w, strides=[1, 1, 1, 1], padding="VALID",
                                            dilations=[dh, dw])
        return dense[:, ::sh, ::sw, :]


class SeparableConv2DLayer(base_layer.BaseLayer):
    """Depthwise conv then a pointwise 1x1 conv (the "sep conv" of NASNet/AmoebaNet).

    Children: `depthwise` (DepthwiseConv2DLayer: kernel, stride, dilation; no bias, no
    activation) and `pointwise` (1x1 Conv2DLayer to `output_dim`; `has_bias`, `activation`).
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("kernel_size", 3, "Depthwise kernel size: int or (kh, kw).")
        p.Define("input_dim", 0, "Number of input channels.")
        p.Define("output_dim", 0, "Number of output channels.")
        p.Define("stride", 1, "Depthwise stride: int or (sh, sw).")
        p.Define("depth_multiplier", 1, "Depthwise channel multiplier.")
        p.Define("dilation_rate", 1, "Depthwise dilation: int or (dh, dw).")
        p.Define("padding", "SAME", "'SAME' or 'VALID' (depthwise step).")
        p.Define("has_bias", False, "Bias after the pointwise conv.")
        p.Define("activation", "NONE", "Activation after the pointwise conv; one of "
                 f"{list(activations.VALID_ACTIVATIONS)}.")
        p.params_init = weight_params.WeightInit.HeNormal(1.0)
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        where = p.name or cls.__name__
        for name in ("input_dim", "output_dim", "depth_multiplier"):
            value = getattr(p, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: p.{name} must be a positive int, got {value!r}.")
        kh, kw = to_pair(p.kernel_size, "kernel_size", where)
        stride = to_pair(p.stride, "stride", where)
        dilation = to_pair(p.dilation_rate, "dilation_rate", where)
        common = dict(dtype=p.dtype, fprop_dtype=p.fprop_dtype, params_init=p.params_init)
        return {
            "depthwise": DepthwiseConv2DLayer.Params().Set(
                filter_shape=(kh, kw, p.input_dim, p.depth_multiplier), filter_stride=stride,
                dilation_rate=dilation, padding=p.padding, has_bias=False, activation="NONE",
                **common),
            "pointwise": Conv2DLayer.Params().Set(
                filter_shape=(1, 1, p.input_dim * p.depth_multiplier, p.output_dim),
                has_bias=p.has_bias, activation=p.activation, **common),
        }

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        inputs = tf.convert_to_tensor(inputs)
        _check_input(self.path, inputs.shape, self.params.input_dim, "input_dim")
        out = self.depthwise.FProp(theta.depthwise, inputs)
        return self.pointwise.FProp(theta.pointwise, out)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        children = cls.declare_children(p)
        shape = base_layer.to_shape(inputs)
        _check_input(p.name or cls.__name__, shape, p.input_dim, "input_dim")
        metas = composite.chain_meta(list(children.values()), shape)
        return base_layer.fprop_meta(sum(m.flops for m in metas), metas[-1].out_shapes,
                                     sum(m.num_params for m in metas), p.fprop_dtype or p.dtype,
                                     memory=layer_memory.MemoryRecord(weight_op_bytes=layer_memory.weight_op_bytes(metas)))


__all__ = ["Conv2DLayer", "DepthwiseConv2DLayer", "SeparableConv2DLayer", "conv_output_size",
    "same_padding", "to_pair"]
