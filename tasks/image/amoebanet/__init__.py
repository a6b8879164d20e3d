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

The package, one concept per module: `operations` (what a cell applies to a hidden state),
`cells` (the evolved cell specs and the cell layer), `heads` (stem, aux head, head) and
`network` (the hyperparameters and the layer list). Everything public is re-exported here,
so `from tasks.image import amoebanet; amoebanet.amoebanet_layers(...)` is the entry point.
"""

from tasks.image.amoebanet.cells import (
    CELL_SPECS,
    AmoebaNetCell,
    CellSpec,
    scheduled_keep_prob,
)
from tasks.image.amoebanet.heads import AuxHeadLayer, HeadLayer, StemLayer
from tasks.image.amoebanet.network import (
    AmoebaNetParams,
    amoebanet_layers,
    input_shapes,
    layer_metas,
    num_params,
    total_flops,
)
from tasks.image.amoebanet.operations import (
    AmoebaOpLayer,
    FactorizedReductionLayer,
    SubsampleLayer,
    parse_operation,
)

__all__ = [
    "CELL_SPECS",
    "AmoebaNetCell",
    "AmoebaNetParams",
    "AmoebaOpLayer",
    "AuxHeadLayer",
    "CellSpec",
    "FactorizedReductionLayer",
    "HeadLayer",
    "StemLayer",
    "SubsampleLayer",
    "amoebanet_layers",
    "input_shapes",
    "layer_metas",
    "num_params",
    "parse_operation",
    "scheduled_keep_prob",
    "total_flops",
]
