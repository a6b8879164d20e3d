"""An AmoebaNet as a flat list of pipeline-ready layers: its hyperparameters
(`AmoebaNetParams`), the layer list (`amoebanet_layers`) and its cost from FPropMeta."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, conv
from tasks.image.amoebanet._common import InstantiableParams, Params
from tasks.image.amoebanet.cells import CELL_SPECS, AmoebaNetCell
from tasks.image.amoebanet.heads import STEM_TYPES, AuxHeadLayer, HeadLayer, StemLayer

__all__ = ["AmoebaNetParams", "amoebanet_layers", "input_shapes", "layer_metas", "num_params",
           "total_flops"]


def AmoebaNetParams() -> Params:
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
    if p.stem_type not in STEM_TYPES:
        raise ValueError(f"AmoebaNetParams: stem_type must be one of {STEM_TYPES}, "
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
        state.update(prev=state["x"], x=AmoebaNetCell.output_dim(cp), prev_stride=stride,
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
            AuxHeadLayer.declare_children(aux)  # Validates the feature map size now.
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
