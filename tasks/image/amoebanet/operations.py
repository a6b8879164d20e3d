"""AmoebaNet's operations: what a cell applies to a hidden state.

`parse_operation` reads an operation name ('1x1', 'max_pool_3x3', 'separable_3x3_2', ...);
`AmoebaOpLayer` builds the operation as child layers (ReLU-conv-BN stacks, pools, separable
convolutions, drop-path); `FactorizedReductionLayer` aligns a hidden state to another's size
and depth; `SubsampleLayer` is its strided 1x1 pool.
"""

from __future__ import annotations

import re
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import conv, dropout, pooling
from tasks.image.amoebanet._common import (
    InstantiableParams,
    Params,
    bn_step,
    check_nhwc,
    conv_step,
    define_bn_params,
    dtype_of,
    inherit,
)
from tasks.image.amoebanet._wiring import (
    RELU,
    ShapeWiring,
    TensorWiring,
    chain_children,
    wire_chain,
)

__all__ = ["AmoebaOpLayer", "FactorizedReductionLayer", "SubsampleLayer", "parse_operation"]


class SubsampleLayer(base_layer.BaseLayer):
    """Keeps every `stride`-th pixel: x[:, ::s, ::s, :], i.e. a 1x1 average pool with stride s.

    PoolingLayer cannot express it (tf.nn.pool rejects strides larger than the window).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("stride", 2, "Subsampling stride along H and W.")
        return p

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        del theta
        s = self.params.stride
        return tf.cast(inputs, self.fprop_dtype)[:, ::s, ::s, :]

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        shape = base_layer.to_shape(inputs)
        if shape.rank != 4 or not shape.is_fully_defined():
            raise ValueError(f"{p.name or cls.__name__}: FPropMeta needs a fully defined NHWC "
                             f"shape, got {shape}.")
        b, h, w, c = shape.as_list()
        s = p.stride
        # The gradient of a strided slice is the input's size.
        meta = base_layer.fprop_meta(
            0, tf.TensorShape([b, -(-h // s), -(-w // s), c]), 0, dtype_of(p),
            memory=layer_memory.MemoryRecord(
                saved_activation_bytes=0,
                backward_temporary_bytes=base_layer.activation_bytes(shape, dtype_of(p)),
                saved_covers_input=True))
        meta.update(kept_input=False, kept_output=False, kept_inside_bytes=0)  # A slice.
        return meta


_POOL_RE = re.compile(r"^(avg|max)_pool_(\d+)x(\d+)$")
_SEP_RE = re.compile(r"^(?:dil_(\d+)_)?separable_(\d+)x(\d+)(?:_(\d+))?$")
_DILATED_RE = re.compile(r"^dilated_3x3_rate_(\d+)$")
_CONV_OPS = ("3x3", "1x3_3x1", "1x7_7x1")


def parse_operation(operation: str) -> NestedMap:
    """The kind and hyperparameters of an operation name.

    Names: 'none', '1x1', '3x3', '1x3_3x1', '1x7_7x1', 'dilated_3x3_rate_<r>',
    '{avg,max}_pool_<k>x<k>', '[dil_<d>_]separable_<k>x<k>[_<n>]' (n stacked
    ReLU-separable-BN layers, dilation d).
    """
    if operation in ("none", "1x1"):
        return NestedMap(kind=operation)
    if operation in _CONV_OPS:
        return NestedMap(kind="conv", dilation=1)
    m = _DILATED_RE.match(operation)
    if m:
        return NestedMap(kind="conv", dilation=int(m.group(1)))
    m = _POOL_RE.match(operation)
    if m and m.group(2) == m.group(3):
        return NestedMap(kind="pool", pooling_type=m.group(1).upper(), window=int(m.group(2)))
    m = _SEP_RE.match(operation)
    if m and m.group(2) == m.group(3):
        return NestedMap(kind="separable", dilation=int(m.group(1) or 1),
                         kernel=int(m.group(2)), num_layers=int(m.group(4) or 1))
    raise ValueError(
        f"Unknown AmoebaNet operation {operation!r}; use 'none', '1x1', '3x3', '1x3_3x1', "
        "'1x7_7x1', 'dilated_3x3_rate_<r>', '{avg,max}_pool_<k>x<k>' or "
        "'[dil_<d>_]separable_<k>x<k>_<n>'.")


class AmoebaOpLayer(base_layer.BaseLayer):
    """One operation of a cell applied to one hidden state: [B, H, W, in] -> [B, H/s, W/s, f].

    As in the reference: convolutions are ReLU-conv-BN (3x3 / 1x3_3x1 / 1x7_7x1 / dilated
    through a 1x1 bottleneck of f/4, 3f/8 for 1x3_3x1); separable ops stack `n`
    ReLU-separable-BN layers (stride on the first); pools are followed by a 1x1 conv + BN
    only when the channels change; 'none' is the identity unless it must stride or change
    channels (then ReLU-1x1-BN). Every op but 'none' ends with drop-path.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("operation", "none", "Operation name, see `parse_operation`.")
        p.Define("input_dim", 0, "Channels of the hidden state the op is applied to.")
        p.Define("filters", 0, "Output channels.")
        p.Define("stride", 1, "Spatial stride (1, or 2 on a reduction cell's inputs).")
        p.Define("drop_path_keep_prob", 1.0,
                 "Keep probability of the drop-path after the op (already scheduled).")
        define_bn_params(p)
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, InstantiableParams]:
        return chain_children(cls._steps(p))

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        self._chain = self._steps(self.params)

    @classmethod
    def _steps(cls, p: Params) -> list[Any]:
        """The op as a chain: (name, params) children and RELU markers, in order."""
        where = p.name or cls.__name__
        if p.input_dim <= 0 or p.filters <= 0:
            raise ValueError(f"{where}: p.input_dim and p.filters must be > 0, got "
                             f"{p.input_dim} and {p.filters}.")
        if p.stride not in (1, 2):
            raise ValueError(f"{where}: p.stride must be 1 or 2, got {p.stride}.")
        op = parse_operation(p.operation)
        cin, f, s = p.input_dim, p.filters, p.stride
        steps: list[Any] = []
        if op.kind == "none":
            if s == 1 and cin == f:
                return []
            return [RELU, conv_step(p, "conv_1x1", (1, 1), cin, f, (s, s)),
                    bn_step(p, "bn_1", f)]
        if op.kind == "1x1":
            steps = [RELU, conv_step(p, "conv_1x1", (1, 1), cin, f, (s, s)),
                     bn_step(p, "bn_1", f)]
        elif op.kind == "pool":
            steps = [("pool", inherit(p, pooling.PoolingLayer.Params().Set(
                pooling_type=op.pooling_type, window_shape=op.window, window_stride=s,
                padding="SAME")))]
            if cin != f:
                steps += [conv_step(p, "conv_1x1", (1, 1), cin, f), bn_step(p, "bn_1", f)]
        elif op.kind == "separable":
            for i in range(1, op.num_layers + 1):
                steps += [RELU, (f"sep_{i}", inherit(
                    p, conv.SeparableConv2DLayer.Params().Set(
                        kernel_size=op.kernel, input_dim=cin if i == 1 else f, output_dim=f,
                        stride=s if i == 1 else 1, dilation_rate=op.dilation))),
                          bn_step(p, f"bn_sep_{i}", f)]
        else:  # conv
            if op.dilation > 1 and s > 1:
                raise ValueError(f"{where}: {p.operation!r} cannot be strided (TF convolutions "
                                 "support stride or dilation, not both); use it only on "
                                 "non-input hidden states of a reduction cell.")
            reduced = (3 * f) // 8 if p.operation == "1x3_3x1" else f // 4
            if reduced < 1:
                steps = [RELU] + cls._conv_core(p, cin, f) + [bn_step(p, "bn", f)]
            else:
                steps = [RELU, conv_step(p, "pre_1x1", (1, 1), cin, reduced),
                         bn_step(p, "pre_bn", reduced), RELU]
                steps += cls._conv_core(p, reduced, reduced)
                steps += [bn_step(p, "bn", reduced), RELU,
                          conv_step(p, "post_1x1", (1, 1), reduced, f), bn_step(p, "post_bn", f)]
        if p.drop_path_keep_prob < 1.0:
            steps.append(("drop_path", inherit(p, dropout.DropPathLayer.Params().Set(
                keep_prob=p.drop_path_keep_prob))))
        return steps

    @classmethod
    def _conv_core(cls, p: Params, cin: int, cout: int) -> list[Any]:
        s = p.stride
        op = parse_operation(p.operation)
        if p.operation == "1x7_7x1" or p.operation == "1x3_3x1":
            k = 7 if p.operation == "1x7_7x1" else 3
            return [conv_step(p, f"conv_1x{k}", (1, k), cin, cout, (1, s)),
                    bn_step(p, f"bn_1x{k}_{k}x1", cout), RELU,
                    conv_step(p, f"conv_{k}x1", (k, 1), cout, cout, (s, 1))]
        return [conv_step(p, "conv_3x3", (3, 3), cin, cout, (s, s), dilation=op.dilation)]

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        inputs = tf.convert_to_tensor(inputs)
        check_nhwc(self.path, inputs.shape, self.params.input_dim, "input_dim")
        return wire_chain(TensorWiring(self, theta), self._chain,
                          tf.cast(inputs, self.fprop_dtype))

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        shape = base_layer.to_shape(inputs)
        check_nhwc(p.name or cls.__name__, shape, p.input_dim, "input_dim")
        wiring = ShapeWiring(cls, p)
        out = wire_chain(wiring, cls._steps(p), shape)
        return wiring.fprop_meta(shape, out)


class FactorizedReductionLayer(base_layer.BaseLayer):
    """Reduces a hidden state to `output_dim` channels (and halves H, W when stride is 2).

    Stride 1: 1x1 conv + BN. Stride 2 (NASNet's factorized reduction): two 1x1 convs of
    output_dim / 2 channels on the even-offset and odd-offset pixel grids (a strided 1x1 avg
    pool of x and of x shifted by one pixel with zero padding), concatenated, then BN; no
    information is dropped by the striding. Optionally preceded by a ReLU.
    The strided 1x1 pools are `SubsampleLayer` children.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Input channels.")
        p.Define("output_dim", 0, "Output channels (even when stride is 2).")
        p.Define("stride", 2, "1 or 2.")
        p.Define("pre_relu", True, "Apply a ReLU to the input first.")
        define_bn_params(p)
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, InstantiableParams]:
        where = p.name or cls.__name__
        if p.input_dim <= 0 or p.output_dim <= 0:
            raise ValueError(f"{where}: p.input_dim and p.output_dim must be > 0, got "
                             f"{p.input_dim} and {p.output_dim}.")
        if p.stride == 1:
            return dict([conv_step(p, "path_conv", (1, 1), p.input_dim, p.output_dim),
                         bn_step(p, "path_bn", p.output_dim)])
        if p.stride != 2:
            raise ValueError(f"{where}: p.stride must be 1 or 2, got {p.stride}.")
        if p.output_dim % 2:
            raise ValueError(f"{where}: a stride-2 factorized reduction needs an even "
                             f"p.output_dim, got {p.output_dim}; use an even filter count.")
        half = p.output_dim // 2
        pool = inherit(p, SubsampleLayer.Params().Set(stride=2))
        return dict([("path1_pool", pool), conv_step(p, "path1_conv", (1, 1), p.input_dim, half),
                     ("path2_pool", pool.Copy()),
                     conv_step(p, "path2_conv", (1, 1), p.input_dim, half),
                     bn_step(p, "final_path_bn", p.output_dim)])

    @classmethod
    def _wire(cls, p: Params, wiring: TensorWiring | ShapeWiring, x: Any) -> Any:
        """The structure, run by FProp on tensors and by FPropMeta on shapes."""
        if p.pre_relu:
            x = wiring.relu(x)
        if p.stride == 1:
            return wiring.child("path_bn", wiring.child("path_conv", x))
        path1 = wiring.child("path1_conv", wiring.child("path1_pool", x))
        path2 = wiring.child("path2_conv", wiring.child("path2_pool", wiring.shift(x)))
        return wiring.child("final_path_bn", wiring.concat([path1, path2]))

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        x = tf.convert_to_tensor(inputs)
        check_nhwc(self.path, x.shape, self.params.input_dim, "input_dim")
        return self._wire(self.params, TensorWiring(self, theta), tf.cast(x, self.fprop_dtype))

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        shape = base_layer.to_shape(inputs)
        check_nhwc(p.name or cls.__name__, shape, p.input_dim, "input_dim")
        wiring = ShapeWiring(cls, p)
        out = cls._wire(p, wiring, shape)
        return wiring.fprop_meta(shape, out)
