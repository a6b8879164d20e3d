"""AmoebaNet's cells: the evolved cell specs and the cell layer that wires their operations.

A cell reads the NestedMap boundary (x, prev_x, ...): hidden state 0 is x after a ReLU-1x1-BN,
hidden state 1 is prev_x aligned to x; each combination applies two operations
(`operations.AmoebaOpLayer`) to two earlier hidden states and adds them; the hidden states no
combination used are concatenated into the output.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from tasks.image.amoebanet._common import (
    InstantiableParams,
    Params,
    bn_settings,
    boundary,
    check_nhwc,
    define_bn_params,
    dtype_of,
    inherit,
)
from tasks.image.amoebanet._wiring import ShapeWiring, TensorWiring
from tasks.image.amoebanet.operations import AmoebaOpLayer, FactorizedReductionLayer

__all__ = ["CELL_SPECS", "AmoebaNetCell", "CellSpec", "scheduled_keep_prob"]

_CELL_TYPES = ("normal", "reduction")


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


def scheduled_keep_prob(keep_prob: float, cell_index: int, total_num_cells: int) -> float:
    """Linear drop-path schedule over depth: 1 - (cell_index + 1) / total * (1 - keep_prob)."""
    return 1.0 - (cell_index + 1) / total_num_cells * (1.0 - keep_prob)


class AmoebaNetCell(base_layer.BaseLayer):
    """A normal or reduction AmoebaNet cell on the NestedMap(x, prev_x, ...) boundary.

    FProp returns the input NestedMap with x = the cell output and prev_x = the input x;
    other fields pass through. The output has `filters * (number of unused hidden states)`
    channels; a reduction cell halves H and W (ceil).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
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
        define_bn_params(p)
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, Any]:
        """'base' (ReLU-1x1-BN of x), 'prev_align' (when prev_x must be aligned to x), the
        operations 'ops' (a list, in spec order) and 'reduce_state_<i>' (output hidden
        states aligned to the last one's size)."""
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
        children: dict[str, Any] = {"base": inherit(p, AmoebaOpLayer.Params().Set(
            operation="1x1", input_dim=p.input_dim, filters=f, **bn_settings(p)))}
        if not p.prev_input_dim:
            prev_dim = p.input_dim
        else:
            prev_dim = f
            if p.prev_stride == 2:
                children["prev_align"] = inherit(p, FactorizedReductionLayer.Params().Set(
                    input_dim=p.prev_input_dim, output_dim=f, stride=2, pre_relu=True,
                    **bn_settings(p)))
            elif p.prev_input_dim != f:
                children["prev_align"] = inherit(p, AmoebaOpLayer.Params().Set(
                    operation="1x1", input_dim=p.prev_input_dim, filters=f, **bn_settings(p)))
        # (channels, spatial level) of every hidden state; level 1 = strided by the cell.
        states = [(f, 0), (prev_dim, 0)]
        op_params = []
        for c in range(num_comb):
            levels = []
            for i in (2 * c, 2 * c + 1):
                dim, level = states[idx[i]]
                op_stride = stride if idx[i] < 2 else 1
                op_params.append(inherit(p, AmoebaOpLayer.Params().Set(
                    operation=ops[i], input_dim=dim, filters=f, stride=op_stride,
                    drop_path_keep_prob=keep if ops[i] != "none" else 1.0,
                    **bn_settings(p))))
                levels.append(level + (op_stride == 2))
            if levels[0] != levels[1]:
                raise ValueError(f"{where}: combination {c} adds hidden states of different "
                                 f"spatial sizes (operations {ops[2 * c]!r} on state "
                                 f"{idx[2 * c]}, {ops[2 * c + 1]!r} on state {idx[2 * c + 1]}).")
            states.append((f, levels[0]))
        final_dim, final_level = states[-1]
        concat = cls._output_states(p)
        if not concat:
            raise ValueError(f"{where}: every hidden state is marked used; at least one "
                             "p.used_hiddenstates entry must be 0 to form the output.")
        children["ops"] = op_params
        for i in concat:
            dim, level = states[i]
            if (dim, level) != (final_dim, final_level):
                children[f"reduce_state_{i}"] = inherit(p, FactorizedReductionLayer.Params().Set(
                    input_dim=dim, output_dim=final_dim,
                    stride=2 if level != final_level else 1, pre_relu=False, **bn_settings(p)))
        return children

    @staticmethod
    def _output_states(p: Params) -> list[int]:
        """The hidden states concatenated into the output: those no combination uses."""
        return [i for i, used in enumerate(p.used_hiddenstates) if not used]

    @classmethod
    def output_dim(cls, p: Params) -> int:
        """Channels of the cell's output x (validates `p`)."""
        cls.declare_children(p)
        return p.filters * len(cls._output_states(p))

    @classmethod
    def _wire(cls, p: Params, wiring: TensorWiring | ShapeWiring, x: Any, prev: Any) -> Any:
        """The cell from x and prev_x (None for the first cell: x takes its place); run by
        FProp on tensors and by FPropMeta on shapes."""
        if prev is None:
            prev = x
        elif wiring.has("prev_align"):
            prev = wiring.child("prev_align", prev)
        states = [wiring.child("base", x), prev]
        idx = p.hiddenstate_indices
        for c in range(len(idx) // 2):
            left, right = (wiring.child("ops", states[idx[i]], i) for i in (2 * c, 2 * c + 1))
            states.append(wiring.add(left, right))
        outputs = []
        for i in cls._output_states(p):
            name = f"reduce_state_{i}"
            outputs.append(wiring.child(name, states[i]) if wiring.has(name) else states[i])
        return wiring.concat(outputs)

    @property
    def num_operations(self) -> int:
        return len(self.ops)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        p = self.params
        inputs = boundary(self.path, inputs, "x", *(("prev_x",) if p.prev_input_dim else ()))
        x = tf.cast(inputs.x, self.fprop_dtype)
        check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        prev = None
        if p.prev_input_dim:
            prev = tf.cast(inputs.prev_x, self.fprop_dtype)
            check_nhwc(self.path + " (prev_x)", prev.shape, p.prev_input_dim, "prev_input_dim")
            self._CheckPrevSize(self.path, x.shape, prev.shape)
        out = inputs.copy()
        out.x = self._wire(p, TensorWiring(self, theta), x, prev)
        out.prev_x = inputs.x
        return out

    @classmethod
    def _CheckPrevSize(cls, where: str, x_shape: tf.TensorShape,
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
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        shapes = boundary(where, base_layer.to_shape(inputs), "x",
                          *(("prev_x",) if p.prev_input_dim else ()))
        x = tf.TensorShape(shapes.x)
        check_nhwc(where, x, p.input_dim, "input_dim")
        prev = None
        if p.prev_input_dim:
            prev = tf.TensorShape(shapes.prev_x)
            check_nhwc(where + " (prev_x)", prev, p.prev_input_dim, "prev_input_dim")
            expected_hw = [-(-d // p.prev_stride) for d in prev[1:3]]
            if expected_hw != x[1:3].as_list():
                raise ValueError(f"{where}: prev_x {prev} reduced by p.prev_stride="
                                 f"{p.prev_stride} does not match x {x}; check prev_stride.")
        wiring = ShapeWiring(cls, p)
        out = shapes.copy()
        out.x = cls._wire(p, wiring, x, prev)
        out.prev_x = x
        # What its ops' gradients read; x and prev_x when an op reads them (a max pool).
        held, freeing = wiring.backward_temporaries(out.x)
        return base_layer.fprop_meta(wiring.flops, out, wiring.num_params, dtype_of(p),
                                     **wiring.extra_param_counts(),
                                     memory=layer_memory.MemoryRecord(saved_activation_bytes=wiring.saved_bytes,
                                                                      weight_op_bytes=wiring.weight_op_bytes,
                                                                      backward_temporary_bytes=held,
                                                                      inline_backward_temporary_bytes=freeing,
                                                                      saved_covers_input=True))
