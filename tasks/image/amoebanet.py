"""AmoebaNet (Real et al. 2019) as a flat list of pipeline-ready layers, sized as in GPipe.

The network is a stem, then `num_reduction_cells + 1` stacks of L normal cells separated by
reduction cells, then a classifier head (ReLU, global average pool, dropout, softmax). GPipe's
AmoebaNet-D (L, F) has 3 stacks of L = 6 normal cells (18 in all, GPipe's "(18, F)"); F is the
filter count of the first stack and it doubles at every reduction.

A cell combines the outputs of the two previous cells, so every layer boundary carries a
NestedMap:

    x       [B, H, W, C]       output of the previous cell
    prev_x  [B, H', W', C']    output of the cell before it (H' is H or 2H)
    label   [B] int32          passed through untouched, like any other field
    aux_xent, aux_correct [B]  added by the auxiliary head, consumed by the head

Cell structure (following the public TensorFlow TPU AmoebaNet implementation):
  * hidden state 0 = BN(conv1x1(relu(x))) with `filters` channels; hidden state 1 = prev_x
    aligned to x: a factorized reduction when prev_x is spatially twice as large, a
    ReLU-1x1-BN when only the channels differ, prev_x itself otherwise (and x itself for the
    first cell, which has no previous cell);
  * 5 combinations: each applies two operations to two earlier hidden states and adds them;
    operations on states 0 and 1 use the cell's stride (2 in reduction cells);
  * output: the channel concatenation of the hidden states no combination used.
Every convolution, batch norm, pooling and drop-path is a child layer, so `FPropMeta` counts
flops and parameters from the real convolutions without allocating anything.

Drop-path follows a linear schedule over depth: cell k (of `total_num_cells`, stem cells and
reduction cells included) keeps a path with probability 1 - (k + 1) / total * (1 - keep).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import tensorflow as tf

from lingvo_lite import base_layer, fprop_context, hyperparams
from lingvo_lite.layers import composite, conv, dropout, losses, normalization, pooling
from lingvo_lite.nested_map import NestedMap

Params = hyperparams.Params
InstantiableParams = hyperparams.InstantiableParams

_CELL_TYPES = ("normal", "reduction")
_STEM_TYPES = ("imagenet", "cifar")
_RELU = "relu"  # Step marker of `_StepsLayer`: an elementwise ReLU, not a child layer.


@dataclasses.dataclass(frozen=True)
class CellSpec:
    """One evolved cell: operations[2i], operations[2i+1] are applied to hidden states
    hiddenstate_indices[2i], [2i+1] and summed into hidden state 2 + i; hidden states whose
    `used_hiddenstates` entry is 0 are concatenated into the cell output."""

    operations: tuple[str, ...]
    hiddenstate_indices: tuple[int, ...]
    used_hiddenstates: tuple[int, ...]


# The evolved cells of Real et al. 2019 (Figure 7 and appendix), in the encoding of the
# public TensorFlow TPU implementation.
CELL_SPECS: dict[str, dict[str, CellSpec]] = {
    "D": {
        "normal": CellSpec(
            ("1x1", "max_pool_3x3", "none", "1x7_7x1", "1x1", "1x7_7x1",
             "max_pool_3x3", "none", "avg_pool_3x3", "1x1"),
            (1, 1, 1, 0, 0, 0, 2, 2, 1, 5),
            (0, 1, 1, 0, 0, 1, 0)),
        "reduction": CellSpec(
            ("max_pool_2x2", "max_pool_3x3", "none", "3x3", "1x7_7x1",
             "max_pool_3x3", "none", "max_pool_2x2", "avg_pool_3x3", "1x1"),
            (0, 0, 2, 1, 2, 2, 3, 1, 2, 3),
            (1, 1, 1, 1, 0, 0, 0)),
    },
    "B": {
        "normal": CellSpec(
            ("1x1", "max_pool_3x3", "none", "separable_3x3_2", "1x1",
             "separable_3x3_2", "1x1", "none", "avg_pool_3x3", "1x1"),
            (1, 1, 1, 0, 1, 0, 2, 2, 1, 5),
            (0, 1, 1, 0, 0, 1, 0)),
        "reduction": CellSpec(
            ("max_pool_2x2", "max_pool_3x3", "none", "3x3", "dil_2_separable_5x5_2",
             "max_pool_3x3", "none", "separable_3x3_2", "avg_pool_3x3", "1x1"),
            (0, 0, 2, 1, 2, 2, 3, 1, 4, 3),
            (1, 1, 1, 1, 1, 0, 0)),
    },
}


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _dtype(p: Params) -> tf.DType:
    return p.fprop_dtype or p.dtype


def _inherit(parent: Params, child: InstantiableParams) -> InstantiableParams:
    """`child` with the parent's variable and activation dtypes (children don't inherit them)."""
    return child.Set(dtype=parent.dtype, fprop_dtype=parent.fprop_dtype)


def _conv(p: Params, name: str, kernel: tuple[int, int], cin: int, cout: int,
          stride: tuple[int, int] = (1, 1), dilation: int = 1,
          padding: str = "SAME") -> tuple[str, InstantiableParams]:
    return name, _inherit(p, conv.Conv2DLayer.Params().Set(
        filter_shape=(kernel[0], kernel[1], cin, cout), filter_stride=stride,
        dilation_rate=(dilation, dilation), padding=padding, has_bias=False))


def _bn(p: Params, name: str, dim: int) -> tuple[str, InstantiableParams]:
    return name, _inherit(p, normalization.BatchNormLayer.Params().Set(
        dim=dim, decay=p.batch_norm_decay, epsilon=p.batch_norm_epsilon))


def _define_bn_params(p: Params) -> None:
    p.Define("batch_norm_decay", 0.9997, "Moving-average decay of every batch norm.")
    p.Define("batch_norm_epsilon", 1e-3, "Epsilon of every batch norm.")


def _num_elements(shape: tf.TensorShape) -> int:
    return int(shape.num_elements() or 0)


def _check_nhwc(where: str, shape: tf.TensorShape, channels: int, param: str) -> None:
    shape = tf.TensorShape(shape)
    if shape.rank != 4:
        raise ValueError(f"{where}: expected an NHWC tensor, got shape {shape}.")
    if shape[-1] is not None and shape[-1] != channels:
        raise ValueError(f"{where}: input has {shape[-1]} channels but p.{param}={channels}; "
                         f"set p.{param}={shape[-1]}.")


def _boundary(where: str, inputs: Any, *keys: str) -> NestedMap:
    if not isinstance(inputs, NestedMap):
        raise ValueError(f"{where}: expects a NestedMap boundary (fields {list(keys)} plus "
                         f"passthrough fields), got {type(inputs).__name__}.")
    for key in keys:
        if key not in inputs:
            raise ValueError(f"{where}: the input NestedMap has no '{key}' field (it has "
                             f"{sorted(inputs.keys())}); check the layer order.")
    return inputs


class _StepsLayer(base_layer.BaseLayer):
    """A chain of named child layers and ReLUs, declared once by `_Steps(p)`.

    `_Steps` returns [(name, params)], where params None means an elementwise ReLU. Both
    `__init__` and the cost model read the same declaration, so FPropMeta cannot drift
    from FProp.
    """

    @classmethod
    def _Steps(cls, p: Params) -> list[tuple[str, InstantiableParams | None]]:  # noqa: N802
        raise NotImplementedError(f"{cls.__name__}._Steps")

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        self._steps = self._Steps(self.params)
        for name, step in self._steps:
            if step is not None:
                self.CreateChild(name, step)

    def _RunSteps(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:  # noqa: N802
        for name, step in self._steps:
            if step is None:
                x = tf.nn.relu(x)
            else:
                x = self.children[name].FProp(theta[name], x)
        return x

    @classmethod
    def _StepsMeta(cls, p: Params, shape: tf.TensorShape  # noqa: N802
                   ) -> tuple[float, tf.TensorShape, int, dict[str, int]]:
        """(flops, output shape, num_params, extra_param_counts) of the chain on `shape`."""
        flops, num_params, metas, saved = 0.0, 0, [], 0
        for _, step in cls._Steps(p):
            if step is None:
                flops += _num_elements(shape)  # One max per element.
                saved += base_layer.activation_bytes(shape, _dtype(p))
                continue
            meta = step.cls.FPropMeta(step, shape)
            metas.append(meta)
            flops += meta.flops
            num_params += meta.num_params
            saved += base_layer.saved_activation_bytes(meta)
            shape = meta.out_shapes[0]
        return (flops, shape, num_params,
                {**base_layer.extra_param_counts(metas), "saved_activation_bytes": saved})


class SubsampleLayer(base_layer.BaseLayer):
    """Keeps every `stride`-th pixel: x[:, ::s, ::s, :], i.e. a 1x1 average pool with stride s.

    PoolingLayer cannot express it (tf.nn.pool rejects strides larger than the window).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("stride", 2, "Subsampling stride along H and W.")
        return p

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:  # noqa: N802
        del theta
        s = self.params.stride
        return tf.cast(inputs, self.fprop_dtype)[:, ::s, ::s, :]

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        shape = base_layer.to_shape(inputs)
        if shape.rank != 4 or not shape.is_fully_defined():
            raise ValueError(f"{p.name or cls.__name__}: FPropMeta needs a fully defined NHWC "
                             f"shape, got {shape}.")
        b, h, w, c = shape.as_list()
        s = p.stride
        return base_layer.fprop_meta(0, tf.TensorShape([b, -(-h // s), -(-w // s), c]), 0,
                                     _dtype(p))


# ---------------------------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------------------------

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


class AmoebaOpLayer(_StepsLayer):
    """One operation of a cell applied to one hidden state: [B, H, W, in] -> [B, H/s, W/s, f].

    As in the reference: convolutions are ReLU-conv-BN (3x3 / 1x3_3x1 / 1x7_7x1 / dilated
    through a 1x1 bottleneck of f/4, 3f/8 for 1x3_3x1); separable ops stack `n`
    ReLU-separable-BN layers (stride on the first); pools are followed by a 1x1 conv + BN
    only when the channels change; 'none' is the identity unless it must stride or change
    channels (then ReLU-1x1-BN). Every op but 'none' ends with drop-path.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("operation", "none", "Operation name, see `parse_operation`.")
        p.Define("input_dim", 0, "Channels of the hidden state the op is applied to.")
        p.Define("filters", 0, "Output channels.")
        p.Define("stride", 1, "Spatial stride (1, or 2 on a reduction cell's inputs).")
        p.Define("drop_path_keep_prob", 1.0,
                 "Keep probability of the drop-path after the op (already scheduled).")
        _define_bn_params(p)
        return p

    @classmethod
    def _Steps(cls, p: Params) -> list[tuple[str, InstantiableParams | None]]:  # noqa: N802
        where = p.name or cls.__name__
        if p.input_dim <= 0 or p.filters <= 0:
            raise ValueError(f"{where}: p.input_dim and p.filters must be > 0, got "
                             f"{p.input_dim} and {p.filters}.")
        if p.stride not in (1, 2):
            raise ValueError(f"{where}: p.stride must be 1 or 2, got {p.stride}.")
        op = parse_operation(p.operation)
        cin, f, s = p.input_dim, p.filters, p.stride
        steps: list[tuple[str, InstantiableParams | None]] = []
        if op.kind == "none":
            if s == 1 and cin == f:
                return []
            return [(_RELU, None), _conv(p, "conv_1x1", (1, 1), cin, f, (s, s)),
                    _bn(p, "bn_1", f)]
        if op.kind == "1x1":
            steps = [(_RELU, None), _conv(p, "conv_1x1", (1, 1), cin, f, (s, s)),
                     _bn(p, "bn_1", f)]
        elif op.kind == "pool":
            steps = [("pool", _inherit(p, pooling.PoolingLayer.Params().Set(
                pooling_type=op.pooling_type, window_shape=op.window, window_stride=s,
                padding="SAME")))]
            if cin != f:
                steps += [_conv(p, "conv_1x1", (1, 1), cin, f), _bn(p, "bn_1", f)]
        elif op.kind == "separable":
            for i in range(1, op.num_layers + 1):
                steps += [(_RELU, None), (f"sep_{i}", _inherit(
                    p, conv.SeparableConv2DLayer.Params().Set(
                        kernel_size=op.kernel, input_dim=cin if i == 1 else f, output_dim=f,
                        stride=s if i == 1 else 1, dilation_rate=op.dilation))),
                          _bn(p, f"bn_sep_{i}", f)]
        else:  # conv
            if op.dilation > 1 and s > 1:
                raise ValueError(f"{where}: {p.operation!r} cannot be strided (TF convolutions "
                                 "support stride or dilation, not both); use it only on "
                                 "non-input hidden states of a reduction cell.")
            reduced = (3 * f) // 8 if p.operation == "1x3_3x1" else f // 4
            if reduced < 1:
                steps = [(_RELU, None)] + cls._ConvCore(p, cin, f) + [_bn(p, "bn", f)]
            else:
                steps = [(_RELU, None), _conv(p, "pre_1x1", (1, 1), cin, reduced),
                         _bn(p, "pre_bn", reduced), (_RELU, None)]
                steps += cls._ConvCore(p, reduced, reduced)
                steps += [_bn(p, "bn", reduced), (_RELU, None),
                          _conv(p, "post_1x1", (1, 1), reduced, f), _bn(p, "post_bn", f)]
        if p.drop_path_keep_prob < 1.0:
            steps.append(("drop_path", _inherit(p, dropout.DropPathLayer.Params().Set(
                keep_prob=p.drop_path_keep_prob))))
        return steps

    @classmethod
    def _ConvCore(cls, p: Params, cin: int, cout: int) -> list[tuple[str, Any]]:  # noqa: N802
        s = p.stride
        op = parse_operation(p.operation)
        if p.operation == "1x7_7x1" or p.operation == "1x3_3x1":
            k = 7 if p.operation == "1x7_7x1" else 3
            return [_conv(p, f"conv_1x{k}", (1, k), cin, cout, (1, s)),
                    _bn(p, f"bn_1x{k}_{k}x1", cout), (_RELU, None),
                    _conv(p, f"conv_{k}x1", (k, 1), cout, cout, (s, 1))]
        return [_conv(p, "conv_3x3", (3, 3), cin, cout, (s, s), dilation=op.dilation)]

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:  # noqa: N802
        inputs = tf.convert_to_tensor(inputs)
        _check_nhwc(self.path, inputs.shape, self.params.input_dim, "input_dim")
        return self._RunSteps(theta, tf.cast(inputs, self.fprop_dtype))

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        shape = base_layer.to_shape(inputs)
        _check_nhwc(p.name or cls.__name__, shape, p.input_dim, "input_dim")
        flops, out, num_params, extra = cls._StepsMeta(p, shape)
        return base_layer.fprop_meta(flops, out, num_params, _dtype(p), **extra)


class FactorizedReductionLayer(base_layer.BaseLayer):
    """Reduces a hidden state to `output_dim` channels (and halves H, W when stride is 2).

    Stride 1: 1x1 conv + BN. Stride 2 (NASNet's factorized reduction): two 1x1 convs of
    output_dim / 2 channels on the even-offset and odd-offset pixel grids (a strided 1x1 avg
    pool of x and of x shifted by one pixel with zero padding), concatenated, then BN; no
    information is dropped by the striding. Optionally preceded by a ReLU.
    The strided 1x1 pools are `SubsampleLayer` children.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("input_dim", 0, "Input channels.")
        p.Define("output_dim", 0, "Output channels (even when stride is 2).")
        p.Define("stride", 2, "1 or 2.")
        p.Define("pre_relu", True, "Apply a ReLU to the input first.")
        _define_bn_params(p)
        return p

    @classmethod
    def _Children(cls, p: Params) -> list[tuple[str, InstantiableParams]]:  # noqa: N802
        where = p.name or cls.__name__
        if p.input_dim <= 0 or p.output_dim <= 0:
            raise ValueError(f"{where}: p.input_dim and p.output_dim must be > 0, got "
                             f"{p.input_dim} and {p.output_dim}.")
        if p.stride == 1:
            return [_conv(p, "path_conv", (1, 1), p.input_dim, p.output_dim),
                    _bn(p, "path_bn", p.output_dim)]
        if p.stride != 2:
            raise ValueError(f"{where}: p.stride must be 1 or 2, got {p.stride}.")
        if p.output_dim % 2:
            raise ValueError(f"{where}: a stride-2 factorized reduction needs an even "
                             f"p.output_dim, got {p.output_dim}; use an even filter count.")
        half = p.output_dim // 2
        pool = _inherit(p, SubsampleLayer.Params().Set(stride=2))
        return [("path1_pool", pool), _conv(p, "path1_conv", (1, 1), p.input_dim, half),
                ("path2_pool", pool.Copy()), _conv(p, "path2_conv", (1, 1), p.input_dim, half),
                _bn(p, "final_path_bn", p.output_dim)]

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        for name, child in self._Children(self.params):
            self.CreateChild(name, child)

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:  # noqa: N802
        p = self.params
        x = tf.convert_to_tensor(inputs)
        _check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        x = tf.cast(x, self.fprop_dtype)
        if p.pre_relu:
            x = tf.nn.relu(x)
        if p.stride == 1:
            return self.path_bn.FProp(theta.path_bn, self.path_conv.FProp(theta.path_conv, x))
        path1 = self.path1_conv.FProp(theta.path1_conv, self.path1_pool.FProp(None, x))
        shifted = tf.pad(x, [[0, 0], [0, 1], [0, 1], [0, 0]])[:, 1:, 1:, :]
        path2 = self.path2_conv.FProp(theta.path2_conv, self.path2_pool.FProp(None, shifted))
        return self.final_path_bn.FProp(theta.final_path_bn, tf.concat([path1, path2], -1))

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        shape = base_layer.to_shape(inputs)
        _check_nhwc(p.name or cls.__name__, shape, p.input_dim, "input_dim")
        children = dict(cls._Children(p))
        flops = _num_elements(shape) if p.pre_relu else 0
        if p.stride == 1:
            metas = composite.chain_meta([children["path_conv"], children["path_bn"]], shape)
        else:
            path = composite.chain_meta([children["path1_pool"], children["path1_conv"]], shape)
            metas = path + path  # The shifted path has the same shapes and cost.
            concat = path[-1].out_shapes[0][:-1].concatenate([p.output_dim])
            metas.append(children["final_path_bn"].cls.FPropMeta(children["final_path_bn"],
                                                                  concat))
        return base_layer.fprop_meta(
            flops + sum(m.flops for m in metas), metas[-1].out_shapes[0],
            sum(m.num_params for m in metas), _dtype(p), **base_layer.extra_param_counts(metas))


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------

# Of the bytes of all its ops' outputs, the share a cell keeps for its backward (the rest, e.g.
# a batch norm's output that only feeds a ReLU, is freed once consumed); fitted on measured
# per-device peaks without re-materialisation (bench/memory_model_check.py).
CELL_SAVED_FRACTION = 0.65


def scheduled_keep_prob(keep_prob: float, cell_index: int, total_num_cells: int) -> float:
    """Linear drop-path schedule over depth: 1 - (cell_index + 1) / total * (1 - keep_prob)."""
    return 1.0 - (cell_index + 1) / total_num_cells * (1.0 - keep_prob)


@dataclasses.dataclass(frozen=True)
class _CellPlan:
    """Static structure of a cell, derived from its params alone."""

    stride: int
    prev_align: str  # 'none' (use prev_x / x as is), 'conv' (ReLU-1x1-BN) or 'factorized'.
    op_params: list[InstantiableParams]
    op_inputs: list[int]  # Hidden state each op reads.
    reductions: dict[int, InstantiableParams]  # Unused hidden states that must be aligned.
    concat: list[int]  # Hidden states concatenated into the output.
    out_dim: int


class AmoebaNetCell(base_layer.BaseLayer):
    """A normal or reduction AmoebaNet cell on the NestedMap(x, prev_x, ...) boundary.

    FProp returns the input NestedMap with x = the cell output and prev_x = the input x;
    other fields pass through. The output has `filters * (number of unused hidden states)`
    channels; a reduction cell halves H and W (ceil).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("cell_type", "normal", f"One of {_CELL_TYPES}.")
        p.Define("operations", (), "2 * num_combinations operation names (`parse_operation`).")
        p.Define("hiddenstate_indices", (), "Hidden state each operation reads (0 = x after "
                 "the base 1x1, 1 = aligned prev_x, 2 + i = combination i).")
        p.Define("used_hiddenstates", (), "2 + num_combinations flags; states with 0 form the "
                 "output.")
        p.Define("filters", 0, "Channels of every hidden state (F times the filter scaling).")
        p.Define("stride", None, "Stride of operations on states 0 and 1: None means 1 for "
                 "'normal' and 2 for 'reduction' cells.")
        p.Define("input_dim", 0, "Channels of x.")
        p.Define("prev_input_dim", 0, "Channels of prev_x; 0 when there is no previous cell "
                 "output (the first cell after the stem conv), then x is used in its place.")
        p.Define("prev_stride", 1, "Ratio of prev_x's spatial size to x's: 1, or 2 when the "
                 "previous cell was a reduction (prev_x then gets a factorized reduction).")
        p.Define("drop_path_keep_prob", 1.0, "Drop-path keep probability of the last cell; "
                 "scheduled linearly over depth by cell_index / total_num_cells.")
        p.Define("total_num_cells", 1, "Number of cells in the network (stem, normal and "
                 "reduction cells) for the drop-path schedule.")
        p.Define("cell_index", 0, "Position of this cell among total_num_cells.")
        _define_bn_params(p)
        return p

    @classmethod
    def _Plan(cls, p: Params) -> _CellPlan:  # noqa: N802
        where = p.name or cls.__name__
        if p.cell_type not in _CELL_TYPES:
            raise ValueError(f"{where}: p.cell_type must be one of {_CELL_TYPES}, "
                             f"got {p.cell_type!r}.")
        stride = p.stride if p.stride is not None else (1 if p.cell_type == "normal" else 2)
        if stride != (1 if p.cell_type == "normal" else 2):
            raise ValueError(f"{where}: a {p.cell_type} cell needs stride "
                             f"{1 if p.cell_type == 'normal' else 2}, got p.stride={p.stride}.")
        ops, idx, used = list(p.operations), list(p.hiddenstate_indices), list(p.used_hiddenstates)
        num_comb = len(ops) // 2
        if not ops or len(ops) % 2 or len(idx) != len(ops) or len(used) != num_comb + 2:
            raise ValueError(
                f"{where}: need an even number of p.operations, as many p.hiddenstate_indices "
                f"and len(operations) / 2 + 2 p.used_hiddenstates; got {len(ops)}, {len(idx)}, "
                f"{len(used)}.")
        for i, j in enumerate(idx):
            if not 0 <= j < 2 + i // 2:
                raise ValueError(f"{where}: p.hiddenstate_indices[{i}]={j} must name an earlier "
                                 f"hidden state (0..{1 + i // 2}).")
        if p.filters <= 0 or p.input_dim <= 0 or p.prev_input_dim < 0:
            raise ValueError(f"{where}: p.filters and p.input_dim must be > 0 and "
                             f"p.prev_input_dim >= 0, got {p.filters}, {p.input_dim}, "
                             f"{p.prev_input_dim}.")
        if p.prev_stride not in (1, 2) or (p.prev_stride == 2 and not p.prev_input_dim):
            raise ValueError(f"{where}: p.prev_stride must be 1, or 2 with a prev_input_dim; "
                             f"got {p.prev_stride}.")
        if not 0 <= p.cell_index < p.total_num_cells:
            raise ValueError(f"{where}: p.cell_index={p.cell_index} must be in "
                             f"[0, p.total_num_cells={p.total_num_cells}).")
        if not 0.0 < p.drop_path_keep_prob <= 1.0:
            raise ValueError(f"{where}: p.drop_path_keep_prob must be in (0, 1], "
                             f"got {p.drop_path_keep_prob}.")
        f = p.filters
        keep = scheduled_keep_prob(p.drop_path_keep_prob, p.cell_index, p.total_num_cells)
        if not p.prev_input_dim:
            prev_align, prev_dim = "none", p.input_dim
        elif p.prev_stride == 2:
            prev_align, prev_dim = "factorized", f
        elif p.prev_input_dim != f:
            prev_align, prev_dim = "conv", f
        else:
            prev_align, prev_dim = "none", f
        # (channels, spatial level) of every hidden state; level 1 = strided by the cell.
        states = [(f, 0), (prev_dim, 0)]
        op_params = []
        for c in range(num_comb):
            levels = []
            for i in (2 * c, 2 * c + 1):
                dim, level = states[idx[i]]
                op_stride = stride if idx[i] < 2 else 1
                op_params.append(_inherit(p, AmoebaOpLayer.Params().Set(
                    operation=ops[i], input_dim=dim, filters=f, stride=op_stride,
                    drop_path_keep_prob=keep if ops[i] != "none" else 1.0,
                    batch_norm_decay=p.batch_norm_decay,
                    batch_norm_epsilon=p.batch_norm_epsilon)))
                levels.append(level + (op_stride == 2))
            if levels[0] != levels[1]:
                raise ValueError(f"{where}: combination {c} adds hidden states of different "
                                 f"spatial sizes (operations {ops[2 * c]!r} on state "
                                 f"{idx[2 * c]}, {ops[2 * c + 1]!r} on state {idx[2 * c + 1]}).")
            states.append((f, levels[0]))
        final_dim, final_level = states[-1]
        concat = [i for i, u in enumerate(used) if not u]
        if not concat:
            raise ValueError(f"{where}: every hidden state is marked used; at least one "
                             "p.used_hiddenstates entry must be 0 to form the output.")
        reductions = {}
        for i in concat:
            dim, level = states[i]
            if (dim, level) != (final_dim, final_level):
                reductions[i] = _inherit(p, FactorizedReductionLayer.Params().Set(
                    input_dim=dim, output_dim=final_dim,
                    stride=2 if level != final_level else 1, pre_relu=False,
                    batch_norm_decay=p.batch_norm_decay,
                    batch_norm_epsilon=p.batch_norm_epsilon))
        return _CellPlan(stride, prev_align, op_params, idx, reductions, concat,
                         final_dim * len(concat))

    @classmethod
    def _FixedChildren(cls, p: Params, plan: _CellPlan) -> list[tuple[str, InstantiableParams]]:  # noqa: N802
        """Children other than the operations: base 1x1, prev alignment, output reductions."""
        kw = dict(batch_norm_decay=p.batch_norm_decay, batch_norm_epsilon=p.batch_norm_epsilon)
        children = [("base", _inherit(p, AmoebaOpLayer.Params().Set(
            operation="1x1", input_dim=p.input_dim, filters=p.filters, **kw)))]
        if plan.prev_align == "factorized":
            children.append(("prev_align", _inherit(p, FactorizedReductionLayer.Params().Set(
                input_dim=p.prev_input_dim, output_dim=p.filters, stride=2, pre_relu=True,
                **kw))))
        elif plan.prev_align == "conv":
            children.append(("prev_align", _inherit(p, AmoebaOpLayer.Params().Set(
                operation="1x1", input_dim=p.prev_input_dim, filters=p.filters, **kw))))
        for i, rp in plan.reductions.items():
            children.append((f"reduce_state_{i}", rp))
        return children

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        self._plan = self._Plan(self.params)
        for name, child in self._FixedChildren(self.params, self._plan):
            self.CreateChild(name, child)
        self.CreateChildren("ops", self._plan.op_params)

    @property
    def plan(self) -> _CellPlan:
        return self._plan

    @property
    def num_operations(self) -> int:
        return len(self._plan.op_params)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:  # noqa: N802
        p = self.params
        plan = self._plan
        inputs = _boundary(self.path, inputs, "x", *(("prev_x",) if p.prev_input_dim else ()))
        x = tf.cast(inputs.x, self.fprop_dtype)
        _check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        if p.prev_input_dim:
            prev = tf.cast(inputs.prev_x, self.fprop_dtype)
            _check_nhwc(self.path + " (prev_x)", prev.shape, p.prev_input_dim, "prev_input_dim")
            self._CheckPrevSize(self.path, x.shape, prev.shape)
            if plan.prev_align != "none":
                prev = self.prev_align.FProp(theta.prev_align, prev)
        else:
            prev = x
        states = [self.base.FProp(theta.base, x), prev]
        for c in range(len(plan.op_params) // 2):
            left, right = 2 * c, 2 * c + 1
            h_left = self.ops[left].FProp(theta.ops[left], states[plan.op_inputs[left]])
            h_right = self.ops[right].FProp(theta.ops[right], states[plan.op_inputs[right]])
            states.append(h_left + h_right)
        outputs = []
        for i in plan.concat:
            h = states[i]
            if i in plan.reductions:
                name = f"reduce_state_{i}"
                h = self.children[name].FProp(theta[name], h)
            outputs.append(h)
        out = inputs.copy()
        out.x = tf.concat(outputs, axis=-1) if len(outputs) > 1 else outputs[0]
        out.prev_x = inputs.x
        return out

    @classmethod
    def _CheckPrevSize(cls, where: str, x_shape: tf.TensorShape,  # noqa: N802
                       prev_shape: tf.TensorShape) -> None:
        """prev_x must be x's size (prev_stride 1) or twice it (prev_stride 2), per p."""
        x_hw, prev_hw = list(x_shape[1:3]), list(prev_shape[1:3])
        if None in x_hw or None in prev_hw:
            return
        same = x_hw == prev_hw
        halved = [-(-d // 2) for d in prev_hw] == x_hw
        if not (same or halved):
            raise ValueError(f"{where}: prev_x spatial size {prev_hw} is neither x's {x_hw} "
                             "nor twice it; the cells are not chained as built.")

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        where = p.name or cls.__name__
        plan = cls._Plan(p)
        shapes = _boundary(where, base_layer.to_shape(inputs), "x",
                           *(("prev_x",) if p.prev_input_dim else ()))
        x = tf.TensorShape(shapes.x)
        _check_nhwc(where, x, p.input_dim, "input_dim")
        fixed = dict(cls._FixedChildren(p, plan))
        flops, num_params, child_metas = 0.0, 0, []
        adds = 0  # Bytes of the combinations' sums, kept like any op output.

        def run(child: InstantiableParams, shape: tf.TensorShape) -> tf.TensorShape:
            nonlocal flops, num_params
            meta = child.cls.FPropMeta(child, shape)
            child_metas.append(meta)
            flops += meta.flops
            num_params += meta.num_params
            return meta.out_shapes[0]

        if p.prev_input_dim:
            prev = tf.TensorShape(shapes.prev_x)
            _check_nhwc(where + " (prev_x)", prev, p.prev_input_dim, "prev_input_dim")
            expected_hw = [-(-d // p.prev_stride) for d in prev[1:3]]
            if expected_hw != x[1:3].as_list():
                raise ValueError(f"{where}: prev_x {prev} reduced by p.prev_stride="
                                 f"{p.prev_stride} does not match x {x}; check prev_stride.")
            if plan.prev_align != "none":
                prev = run(fixed["prev_align"], prev)
        else:
            prev = x
        states = [run(fixed["base"], x), prev]
        for c in range(len(plan.op_params) // 2):
            outs = [run(plan.op_params[i], states[plan.op_inputs[i]])
                    for i in (2 * c, 2 * c + 1)]
            if outs[0] != outs[1]:
                raise ValueError(f"{where}: combination {c} adds shapes {outs[0]} and {outs[1]}.")
            flops += _num_elements(outs[0])  # The add.
            adds += base_layer.activation_bytes(outs[0], _dtype(p))
            states.append(outs[0])
        out_shapes = []
        for i in plan.concat:
            h = states[i]
            if i in plan.reductions:
                h = run(plan.reductions[i], h)
            out_shapes.append(h)
        out = shapes.copy()
        out.x = out_shapes[0][:-1].concatenate([plan.out_dim])
        out.prev_x = x
        saved = (sum(base_layer.saved_activation_bytes(m) for m in child_metas) + adds
                 + base_layer.activation_bytes(out.x, _dtype(p)))  # + the concatenation.
        saved = int(CELL_SAVED_FRACTION * saved)
        return base_layer.fprop_meta(flops, out, num_params, _dtype(p),
                                     **base_layer.extra_param_counts(child_metas),
                                     saved_activation_bytes=saved)


# ---------------------------------------------------------------------------------------------
# Stem and heads
# ---------------------------------------------------------------------------------------------


class StemLayer(_StepsLayer):
    """The stem convolution: NestedMap(image, label, ...) -> NestedMap(x, label, ...).

    'imagenet': 3x3 conv, stride 2, VALID, + BN (the builder follows it with two reduction
    cells at filter scalings 1/4 and 1/2). 'cifar': 3x3 conv, stride 1, VALID, + BN. No ReLU:
    every cell starts with one. The output has no prev_x: the first cell uses x in its place.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("stem_type", "imagenet", f"One of {_STEM_TYPES}.")
        p.Define("input_dim", 3, "Image channels.")
        p.Define("filters", 32, "Output channels of the stem conv.")
        p.Define("image_key", "image", "Field of the input NestedMap holding the images.")
        _define_bn_params(p)
        return p

    @classmethod
    def _Steps(cls, p: Params) -> list[tuple[str, InstantiableParams | None]]:  # noqa: N802
        if p.stem_type not in _STEM_TYPES:
            raise ValueError(f"{p.name or cls.__name__}: p.stem_type must be one of "
                             f"{_STEM_TYPES}, got {p.stem_type!r}.")
        s = 2 if p.stem_type == "imagenet" else 1
        return [_conv(p, "conv0", (3, 3), p.input_dim, p.filters, (s, s), padding="VALID"),
                _bn(p, "conv0_bn", p.filters)]

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:  # noqa: N802
        key = self.params.image_key
        inputs = _boundary(self.path, inputs, key)
        out = inputs.copy()
        del out[key]
        out.x = self._RunSteps(theta, tf.cast(inputs[key], self.fprop_dtype))
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        shapes = _boundary(p.name or cls.__name__, base_layer.to_shape(inputs), p.image_key)
        flops, x, num_params, extra = cls._StepsMeta(p, tf.TensorShape(shapes[p.image_key]))
        out = shapes.copy()
        del out[p.image_key]
        out.x = x
        return base_layer.fprop_meta(flops, out, num_params, _dtype(p), **extra)


def _per_example_correct(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tf.Tensor:
    """1.0 where the label is among the top-k logits (float32 [B])."""
    k = min(k, logits.shape[-1])
    return tf.cast(tf.math.in_top_k(tf.cast(labels, tf.int32), tf.cast(logits, tf.float32), k),
                   tf.float32)


class AuxHeadLayer(base_layer.BaseLayer):
    """The auxiliary classifier: adds per-example `aux_xent` and `aux_correct` [B] to the boundary.

    relu(x) -> 5x5/3 VALID avg pool -> 1x1 conv (128 * s) -> BN -> ReLU -> conv over the
    whole remaining map (768 * s) -> BN -> ReLU -> softmax cross-entropy (with label
    smoothing), s = `aux_scaling`. The HeadLayer turns `aux_xent` into the weighted aux loss;
    per-example values keep the boundary valid under micro-batch splitting.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("input_dim", 0, "Channels of x.")
        p.Define("input_size", (0, 0), "Spatial size (H, W) of x; sets the kernel of the "
                 "second conv, which covers the whole pooled map.")
        p.Define("num_classes", 0, "Number of classes.")
        p.Define("label_smoothing", 0.1, "Label smoothing of the aux cross-entropy.")
        p.Define("aux_scaling", 0.4, "Width multiplier of the 128 and 768 aux convs "
                 "(0.4 in the TF TPU reference).")
        p.Define("label_key", "label", "Field of the boundary holding the int labels.")
        _define_bn_params(p)
        return p

    @classmethod
    def _Children(cls, p: Params) -> list[tuple[str, InstantiableParams]]:  # noqa: N802
        where = p.name or cls.__name__
        h, w = tuple(p.input_size)
        if h < 5 or w < 5:
            raise ValueError(f"{where}: the aux head's 5x5 pool needs a feature map of at least "
                             f"5x5, got p.input_size={p.input_size}; use a larger image_size or "
                             "no aux head (aux_head_weight=0).")
        ph, pw = (h - 5) // 3 + 1, (w - 5) // 3 + 1
        c1, c2 = int(128 * p.aux_scaling), int(768 * p.aux_scaling)
        if c1 < 1 or p.input_dim <= 0 or p.num_classes <= 0:
            raise ValueError(f"{where}: p.input_dim, p.num_classes and int(128 * p.aux_scaling) "
                             f"must be > 0, got {p.input_dim}, {p.num_classes}, {c1}.")
        return [
            ("pool", _inherit(p, pooling.PoolingLayer.Params().Set(
                pooling_type="AVG", window_shape=5, window_stride=3, padding="VALID"))),
            _conv(p, "proj", (1, 1), p.input_dim, c1), _bn(p, "bn0", c1),
            _conv(p, "conv", (ph, pw), c1, c2, padding="VALID"), _bn(p, "bn1", c2),
            ("softmax", _inherit(p, losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=c2, num_classes=p.num_classes, label_smoothing=p.label_smoothing))),
        ]

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        for name, child in self._Children(self.params):
            self.CreateChild(name, child)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:  # noqa: N802
        p = self.params
        inputs = _boundary(self.path, inputs, "x", p.label_key)
        x = tf.cast(inputs.x, self.fprop_dtype)
        _check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        if list(x.shape[1:3]) != list(p.input_size):
            raise ValueError(f"{self.path}: x is {x.shape[1:3]} but p.input_size="
                             f"{p.input_size}; set input_size to the feature map size.")
        h = self.pool.FProp(None, tf.nn.relu(x))
        h = tf.nn.relu(self.bn0.FProp(theta.bn0, self.proj.FProp(theta.proj, h)))
        h = tf.nn.relu(self.bn1.FProp(theta.bn1, self.conv.FProp(theta.conv, h)))
        h = tf.reshape(h, [-1, h.shape[-1]])
        labels = inputs[p.label_key]
        result = self.softmax.FProp(theta.softmax, h, labels)
        out = inputs.copy()
        out.aux_xent = result.per_example_xent
        out.aux_correct = _per_example_correct(result.logits, labels, 1)
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        where = p.name or cls.__name__
        shapes = _boundary(where, base_layer.to_shape(inputs), "x", p.label_key)
        x = tf.TensorShape(shapes.x)
        _check_nhwc(where, x, p.input_dim, "input_dim")
        children = dict(cls._Children(p))
        metas = composite.chain_meta(
            [children[k] for k in ("pool", "proj", "bn0", "conv", "bn1")], x)
        relu_flops = (_num_elements(x) + _num_elements(metas[2].out_shapes[0])
                      + _num_elements(metas[4].out_shapes[0]))
        batch = x[0]
        soft = children["softmax"]
        soft_meta = soft.cls.FPropMeta(soft, tf.TensorShape([batch, soft.input_dim]))
        flops = sum(m.flops for m in metas) + soft_meta.flops + relu_flops
        num_params = sum(m.num_params for m in metas) + soft_meta.num_params
        out = shapes.copy()
        out.aux_xent = tf.TensorShape([batch])
        out.aux_correct = tf.TensorShape([batch])
        # The whole head only serves training (evaluation drops it).
        non_trainable = base_layer.extra_param_counts(metas)["non_trainable_params"]
        return base_layer.fprop_meta(flops, out, num_params, _dtype(p),
                                     non_trainable_params=non_trainable,
                                     training_only_params=num_params - non_trainable)


class HeadLayer(base_layer.BaseLayer):
    """The classifier and loss: ReLU, global average pool, dropout, softmax cross-entropy.

    Returns NestedMap(logits [B, num_classes], per_example_xent [B], main_loss, loss,
    accuracy (top-1), top5_accuracy) and, with an aux head (aux_weight > 0), aux_loss and
    aux_accuracy. In training loss = main_loss + aux_weight * aux_loss; in evaluation
    loss = main_loss (the reference drops the aux head outside training).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("input_dim", 0, "Channels of x.")
        p.Define("num_classes", 0, "Number of classes.")
        p.Define("label_smoothing", 0.1, "Label smoothing of the cross-entropy.")
        p.Define("dropout_keep_prob", 0.5, "Keep probability of the dropout before the logits.")
        p.Define("aux_weight", 0.0, "Weight of the aux head's loss; > 0 requires `aux_xent` "
                 "in the input (an AuxHeadLayer earlier in the network).")
        p.Define("label_key", "label", "Field of the boundary holding the int labels.")
        return p

    @classmethod
    def _Children(cls, p: Params) -> list[tuple[str, InstantiableParams]]:  # noqa: N802
        if p.aux_weight < 0:
            raise ValueError(f"{p.name or cls.__name__}: p.aux_weight must be >= 0, "
                             f"got {p.aux_weight}.")
        return [
            ("pool", _inherit(p, pooling.GlobalPoolingLayer.Params().Set(pooling_type="AVG"))),
            ("dropout", _inherit(p, dropout.DropoutLayer.Params().Set(
                keep_prob=p.dropout_keep_prob))),
            ("softmax", _inherit(p, losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=p.input_dim, num_classes=p.num_classes,
                label_smoothing=p.label_smoothing))),
        ]

    def __init__(self, params: InstantiableParams) -> None:
        super().__init__(params)
        for name, child in self._Children(self.params):
            self.CreateChild(name, child)

    def _Keys(self) -> tuple[str, ...]:  # noqa: N802
        p = self.params
        return ("x", p.label_key) + (("aux_xent", "aux_correct") if p.aux_weight > 0 else ())

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:  # noqa: N802
        p = self.params
        inputs = _boundary(self.path, inputs, *self._Keys())
        x = tf.cast(inputs.x, self.fprop_dtype)
        _check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        h = self.dropout.FProp(None, self.pool.FProp(None, tf.nn.relu(x)))
        labels = inputs[p.label_key]
        result = self.softmax.FProp(theta.softmax, h, labels)
        out = NestedMap(
            logits=result.logits,
            per_example_xent=result.per_example_xent,
            main_loss=result.loss,
            loss=result.loss,
            accuracy=result.accuracy,
            top5_accuracy=tf.reduce_mean(_per_example_correct(result.logits, labels, 5)),
        )
        if p.aux_weight > 0:
            out.aux_loss = tf.reduce_mean(tf.cast(inputs.aux_xent, tf.float32))
            out.aux_accuracy = tf.reduce_mean(tf.cast(inputs.aux_correct, tf.float32))
            if fprop_context.current().training:
                out.loss = result.loss + p.aux_weight * out.aux_loss
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:  # noqa: N802
        where = p.name or cls.__name__
        keys = ("x", p.label_key) + (("aux_xent", "aux_correct") if p.aux_weight > 0 else ())
        shapes = _boundary(where, base_layer.to_shape(inputs), *keys)
        x = tf.TensorShape(shapes.x)
        _check_nhwc(where, x, p.input_dim, "input_dim")
        children = dict(cls._Children(p))
        metas = composite.chain_meta([children["pool"], children["dropout"]], x)
        soft = children["softmax"]
        soft_meta = soft.cls.FPropMeta(soft, metas[-1].out_shapes[0])
        batch = x[0]
        flops = (_num_elements(x) + sum(m.flops for m in metas) + soft_meta.flops
                 + 5 * batch * p.num_classes)  # ReLU, pool, dropout, softmax, top-5 compares.
        scalar = tf.TensorShape([])
        out = NestedMap(
            logits=tf.TensorShape([batch, p.num_classes]),
            per_example_xent=tf.TensorShape([batch]),
            main_loss=scalar, loss=scalar, accuracy=scalar, top5_accuracy=scalar)
        if p.aux_weight > 0:
            out.aux_loss = scalar
            out.aux_accuracy = scalar
        return base_layer.fprop_meta(flops, out, soft_meta.num_params, tf.float32)


# ---------------------------------------------------------------------------------------------
# The network
# ---------------------------------------------------------------------------------------------


def AmoebaNetParams() -> Params:  # noqa: N802 (Lingvo-style params constructor)
    """Hyperparameters of a whole AmoebaNet; `amoebanet_layers` turns them into layers.

    GPipe's AmoebaNet-D (18, 208) is variant='D', num_normal_cells=6, filters=208.
    """
    p = Params()
    p.Define("variant", "D", f"Cell variant, one of {sorted(CELL_SPECS)}.")
    p.Define("num_normal_cells", 6, "L: normal cells per stack (GPipe's L is 3x this).")
    p.Define("filters", 208, "F: filters of the first stack; doubles at each reduction.")
    p.Define("num_reduction_cells", 2, "Reduction cells between the stacks (stacks = this + 1).")
    p.Define("image_size", 224, "Input height and width.")
    p.Define("num_channels", 3, "Input image channels.")
    p.Define("num_classes", 1000, "Number of classes.")
    p.Define("stem_type", "imagenet",
             "'imagenet': stride-2 conv + 2 reduction cells; 'cifar': stride-1 conv.")
    p.Define("stem_filters", 32, "Output channels of the stem conv.")
    p.Define("drop_path_keep_prob", 0.7, "Drop-path keep probability of the last cell.")
    p.Define("dropout_keep_prob", 0.5, "Dropout keep probability before the logits.")
    p.Define("label_smoothing", 0.1, "Label smoothing of the cross-entropy.")
    p.Define("aux_head_weight", 0.4, "Weight of the auxiliary head's loss; 0 = no aux head.")
    p.Define("aux_scaling", 0.4, "Width multiplier of the aux head's convs.")
    p.Define("batch_norm_decay", 0.9997, "Batch norm moving-average decay.")
    p.Define("batch_norm_epsilon", 1e-3, "Batch norm epsilon.")
    p.Define("dtype", tf.float32, "Variable dtype.")
    p.Define("fprop_dtype", None, "Activation dtype (e.g. tf.bfloat16); None = dtype.")
    return p


def _validate_network(p: Params) -> None:
    if p.variant not in CELL_SPECS:
        raise ValueError(f"AmoebaNetParams: variant must be one of {sorted(CELL_SPECS)}, "
                         f"got {p.variant!r}.")
    if p.stem_type not in _STEM_TYPES:
        raise ValueError(f"AmoebaNetParams: stem_type must be one of {_STEM_TYPES}, "
                         f"got {p.stem_type!r}.")
    for name in ("num_normal_cells", "filters", "image_size", "num_classes", "stem_filters",
                 "num_channels"):
        if getattr(p, name) < 1:
            raise ValueError(f"AmoebaNetParams: {name} must be >= 1, got {getattr(p, name)}.")
    if p.num_reduction_cells < 0:
        raise ValueError("AmoebaNetParams: num_reduction_cells must be >= 0.")
    if p.aux_head_weight > 0 and p.num_reduction_cells < 2:
        raise ValueError("AmoebaNetParams: the aux head sits before the second reduction cell; "
                         "set num_reduction_cells >= 2 or aux_head_weight=0.")
    min_filters = 8 if p.stem_type == "imagenet" else 2
    if p.filters % min_filters:
        raise ValueError(f"AmoebaNetParams: filters={p.filters} must be a multiple of "
                         f"{min_filters} (factorized reductions need even filter counts at "
                         "every filter scaling).")


def amoebanet_layers(p: Params) -> list[InstantiableParams]:
    """The flat list of layer params a PipeliningLayer partitions.

    [stem, (imagenet: 2 stem reduction cells), L normal cells, (reduction cell, L normal
    cells) x num_reduction_cells, head], with the aux head (if aux_head_weight > 0) after the
    last normal cell before the second reduction cell, where the reference attaches it.
    Input: NestedMap(image=[B, S, S, C] float, label=[B] int); see `input_shapes`.
    """
    _validate_network(p)
    spec = CELL_SPECS[p.variant]
    num_stem_cells = 2 if p.stem_type == "imagenet" else 0
    total_cells = num_stem_cells + p.num_reduction_cells + p.num_normal_cells * (
        p.num_reduction_cells + 1)
    common = dict(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
    bn = dict(batch_norm_decay=p.batch_norm_decay, batch_norm_epsilon=p.batch_norm_epsilon)
    layers: list[InstantiableParams] = [StemLayer.Params().Set(
        name="stem", stem_type=p.stem_type, input_dim=p.num_channels,
        filters=p.stem_filters, **common, **bn)]
    size = conv.conv_output_size(p.image_size, 3, 2 if p.stem_type == "imagenet" else 1, 1,
                                 "VALID")
    # Running state of the boundary: channels of x and prev_x, spatial ratio prev_x / x.
    state = dict(x=p.stem_filters, prev=0, prev_stride=1, size=size, index=0)

    def add_cell(name: str, cell_type: str, filters: int) -> None:
        cell_spec = spec[cell_type]
        cp = AmoebaNetCell.Params().Set(
            name=name, cell_type=cell_type, operations=list(cell_spec.operations),
            hiddenstate_indices=list(cell_spec.hiddenstate_indices),
            used_hiddenstates=list(cell_spec.used_hiddenstates), filters=filters,
            input_dim=state["x"], prev_input_dim=state["prev"],
            prev_stride=state["prev_stride"], drop_path_keep_prob=p.drop_path_keep_prob,
            total_num_cells=total_cells, cell_index=state["index"], **common, **bn)
        stride = 2 if cell_type == "reduction" else 1
        state.update(prev=state["x"], x=AmoebaNetCell._Plan(cp).out_dim, prev_stride=stride,
                     size=-(-state["size"] // stride), index=state["index"] + 1)
        layers.append(cp)

    for i in range(num_stem_cells):
        add_cell(f"stem_cell_{i}", "reduction", int(p.filters * 2.0 ** (i - num_stem_cells)))
    for stack in range(p.num_reduction_cells + 1):
        if stack > 0:
            add_cell(f"reduction_cell_{stack - 1}", "reduction", p.filters * 2 ** stack)
        for j in range(p.num_normal_cells):
            add_cell(f"cell_{stack * p.num_normal_cells + j}", "normal", p.filters * 2 ** stack)
        if stack == 1 and p.aux_head_weight > 0:
            aux = AuxHeadLayer.Params().Set(
                name="aux_head", input_dim=state["x"], input_size=(state["size"],) * 2,
                num_classes=p.num_classes, label_smoothing=p.label_smoothing,
                aux_scaling=p.aux_scaling, **common, **bn)
            AuxHeadLayer._Children(aux)  # Validates the feature map size now.
            layers.append(aux)
    layers.append(HeadLayer.Params().Set(
        name="head", input_dim=state["x"], num_classes=p.num_classes,
        label_smoothing=p.label_smoothing, dropout_keep_prob=p.dropout_keep_prob,
        aux_weight=p.aux_head_weight, **common))
    return layers


def input_shapes(p: Params, batch_size: int) -> NestedMap:
    """Shapes of one input batch: NestedMap(image=[B, S, S, C], label=[B])."""
    return NestedMap(image=tf.TensorShape([batch_size, p.image_size, p.image_size,
                                           p.num_channels]),
                     label=tf.TensorShape([batch_size]))


def layer_metas(layer_params: list[Params], input_shape: Any) -> list[NestedMap]:
    """FPropMeta of every layer, chained from `input_shape` (a NestedMap of shapes, or the
    image shape [B, H, W, C], in which case labels [B] are assumed)."""
    if not isinstance(input_shape, NestedMap):
        image = tf.TensorShape(input_shape)
        input_shape = NestedMap(image=image, label=tf.TensorShape([image[0]]))
    return composite.chain_meta(list(layer_params), base_layer.to_shape(input_shape))


def num_params(layer_params: list[Params], input_shape: Any) -> int:
    """Total weight elements (moving BN statistics included) from FPropMeta; allocates nothing."""
    return sum(m.num_params for m in layer_metas(layer_params, input_shape))


def total_flops(layer_params: list[Params], input_shape: Any) -> float:
    """Forward flops of one batch of `input_shape`, from FPropMeta."""
    return math.fsum(m.flops for m in layer_metas(layer_params, input_shape))
