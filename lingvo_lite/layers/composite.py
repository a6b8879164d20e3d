"""Composite layers: a sequence of layers, and one layer repeated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lingvo_lite.core import base_layer, hyperparams, layer_memory
from lingvo_lite.core.nested_map import NestedMap


def _as_args(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def chain_fprop(layers: list[base_layer.BaseLayer], thetas: list[NestedMap], *args: Any) -> Any:
    """Feeds each layer the previous one's output (a tuple output is splatted)."""
    for layer, layer_theta in zip(layers, thetas):
        args = _as_args(layer.FProp(layer_theta, *args))
    return args if len(args) > 1 else args[0]


def chain_meta(layer_params: Sequence[hyperparams.Params], *input_shapes: Any,
               input_name: str = "the input") -> list[NestedMap]:
    """FPropMeta of each layer of a chain, each fed the previous one's out_shapes.

    The one place a chain of layers is costed (composite layers, a PipeliningLayer's
    layers, a whole network). A layer whose FPropMeta rejects its input raises a
    ValueError naming the layer, its index and the shapes it was given; `input_name`
    names the chain's input in that message.

    >>> from lingvo_lite.layers import dense
    >>> proj = dense.ProjectionLayer.Params().Set(name="p", input_dim=4, output_dim=2)
    >>> [m.num_params for m in chain_meta([proj, proj.Copy().Set(input_dim=2)], [3, 4])]
    [10, 6]
    """
    metas = []
    shapes = input_shapes
    for i, p in enumerate(layer_params):
        try:
            meta = p.cls.FPropMeta(p, *shapes)
        except (ValueError, TypeError) as e:
            source = f"the output of layer {i - 1}" if i else input_name
            raise ValueError(
                f"Layer {i} ({p.name or p.cls.__name__}) cannot take {source} "
                f"(shapes {shapes}): {e}"
            ) from e
        metas.append(meta)
        shapes = meta.out_shapes
    return metas


def sum_meta(metas: list[NestedMap], input_shapes: tuple, dtype: Any) -> NestedMap:
    """The FPropMeta of a chain: flops, params and saved activations add up, shapes are the
    last layer's, and its gradient temporaries are its largest layer's (it back-propagates
    through one layer after another)."""
    out_shapes = metas[-1].out_shapes if metas else input_shapes
    return base_layer.fprop_meta(flops=sum(m.flops for m in metas), out_shapes=tuple(out_shapes),
                                 num_params=sum(m.num_params for m in metas), dtype=dtype,
                                 **base_layer.extra_param_counts(metas),
                                 memory=layer_memory.composite(metas))


class SequentialLayer(base_layer.BaseLayer):
    """Applies `sub` layers in order; a tuple output is splatted into the next FProp."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("sub", [], "List of layer params, applied in order.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        return {"sub": list(p.sub)}

    def FProp(self, theta: NestedMap, *args: Any) -> Any:
        return chain_fprop(self.sub, theta.sub, *args)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:
        return sum_meta(chain_meta(cls.declare_children(p)["sub"], *input_shapes),
                        input_shapes, p.fprop_dtype or p.dtype)


class RepeatLayer(base_layer.BaseLayer):
    """Applies `repeat` independent copies of `body` in sequence (e.g. L identical blocks)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("body", None, "Params of the repeated layer.")
        p.Define("repeat", 1, "Number of copies, >= 1.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        if p.body is None:
            raise ValueError(f"{p.name}: RepeatLayer needs p.body (the layer to repeat).")
        if p.repeat < 1:
            raise ValueError(f"{p.name}: p.repeat must be >= 1, got {p.repeat}.")
        return {"body": [p.body] * p.repeat}

    def FProp(self, theta: NestedMap, *args: Any) -> Any:
        return chain_fprop(self.body, theta.body, *args)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:
        return sum_meta(chain_meta(cls.declare_children(p)["body"], *input_shapes),
                        input_shapes, p.fprop_dtype or p.dtype)


__all__ = ["SequentialLayer", "RepeatLayer", "chain_fprop", "chain_meta", "sum_meta"]
