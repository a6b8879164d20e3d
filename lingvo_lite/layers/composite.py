"""Composite layers: a sequence of layers, and one layer repeated."""

from __future__ import annotations

from typing import Any

from lingvo_lite import base_layer, hyperparams
from lingvo_lite.nested_map import NestedMap


def _as_args(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def chain_fprop(layers: list[base_layer.BaseLayer], thetas: list[NestedMap], *args: Any) -> Any:
    """Feeds each layer the previous one's output (a tuple output is splatted)."""
    for layer, layer_theta in zip(layers, thetas):
        args = _as_args(layer.FProp(layer_theta, *args))
    return args if len(args) > 1 else args[0]


def chain_meta(layer_params: list[hyperparams.Params], *input_shapes: Any) -> list[NestedMap]:
    """FPropMeta of each layer of a chain, each fed the previous one's out_shapes."""
    metas = []
    shapes = input_shapes
    for p in layer_params:
        meta = p.cls.FPropMeta(p, *shapes)
        metas.append(meta)
        shapes = meta.out_shapes
    return metas


def sum_meta(metas: list[NestedMap], input_shapes: tuple, dtype: Any) -> NestedMap:
    """The FPropMeta of a chain: flops, params and saved activations add up, shapes are the
    last layer's."""
    out_shapes = metas[-1].out_shapes if metas else input_shapes
    return base_layer.fprop_meta(
        flops=sum(m.flops for m in metas),
        out_shapes=tuple(out_shapes),
        num_params=sum(m.num_params for m in metas),
        dtype=dtype,
        **base_layer.extra_param_counts(metas),
        saved_activation_bytes=sum(base_layer.saved_activation_bytes(m) for m in metas),
    )


class SequentialLayer(base_layer.BaseLayer):
    """Applies `sub` layers in order; a tuple output is splatted into the next FProp."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("sub", [], "List of layer params, applied in order.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self.CreateChildren("sub", self.params.sub)

    def FProp(self, theta: NestedMap, *args: Any) -> Any:  # noqa: N802
        return chain_fprop(self.sub, theta.sub, *args)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:  # noqa: N802
        return sum_meta(chain_meta(list(p.sub), *input_shapes), input_shapes,
                        p.fprop_dtype or p.dtype)


class RepeatLayer(base_layer.BaseLayer):
    """Applies `repeat` independent copies of `body` in sequence (e.g. L identical blocks)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:  # noqa: N802
        p = super().Params()
        p.Define("body", None, "Params of the repeated layer.")
        p.Define("repeat", 1, "Number of copies, >= 1.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if p.body is None:
            raise ValueError(f"{self.path}: RepeatLayer needs p.body (the layer to repeat).")
        if p.repeat < 1:
            raise ValueError(f"{self.path}: p.repeat must be >= 1, got {p.repeat}.")
        self.CreateChildren("body", [p.body] * p.repeat)

    def FProp(self, theta: NestedMap, *args: Any) -> Any:  # noqa: N802
        return chain_fprop(self.body, theta.body, *args)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:  # noqa: N802
        return sum_meta(chain_meta([p.body] * p.repeat, *input_shapes), input_shapes,
                        p.fprop_dtype or p.dtype)
