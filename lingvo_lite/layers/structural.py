"""Glue layers for pipelines whose cell boundary is a NestedMap.

A pipeline passes one NestedMap between cells (e.g. `NestedMap(x=..., paddings=...)`);
`FieldLayer` applies an ordinary tensor layer to one entry and passes the
others through, so tensor layers can be stacked into such a pipeline.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory
from lingvo_lite.core.nested_map import NestedMap

__all__ = ["FieldLayer", "FieldsLayer", "IdentityLayer", "shapes_of"]


def _check_map(value: Any, where: str) -> NestedMap:
    if not isinstance(value, NestedMap):
        raise ValueError(f"{where}: FieldLayer expects a NestedMap input, got "
                         f"{type(value).__name__}.")
    return value


def _get_field(value: NestedMap, field: str, where: str) -> Any:
    try:
        return value.GetItem(field)
    except KeyError:
        raise ValueError(
            f"{where}: p.field={field!r} is not in the input NestedMap (keys: "
            f"{sorted(value.keys())}); set p.field to one of them."
        ) from None


def _validate(p: hyperparams.Params, where: str) -> None:
    if not p.field:
        raise ValueError(f"{where}: p.field must name the NestedMap entry to transform.")
    if p.sub is None:
        raise ValueError(f"{where}: p.sub must be the params of the layer applied to "
                         f"p.field={p.field!r}.")


class FieldLayer(base_layer.BaseLayer):
    """Applies `sub` to `inputs.<field>` and stores the result in `<output_field>`.

    Other entries pass through unchanged; the input NestedMap is not modified
    (a new NestedMap is returned). `field` and `output_field` may be dotted
    paths such as 'enc.x'.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("field", "", "Name (or dotted path) of the NestedMap entry to transform.")
        p.Define("sub", None, "Params of the layer applied to that entry.")
        p.Define("output_field", None, "Where to store the result; None means `field`.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        _validate(self.params, self.path)
        self.CreateChild("sub", self.params.sub)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        p = self.params
        inputs = _check_map(inputs, self.path)
        value = _get_field(inputs, p.field, self.path)
        out = inputs.DeepCopy()
        out.Set(p.output_field or p.field, self.sub.FProp(theta.sub, value))
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        _validate(p, where)
        shapes = base_layer.to_shape(_check_map(inputs, where))
        meta = p.sub.cls.FPropMeta(p.sub, _get_field(shapes, p.field, where))
        if len(meta.out_shapes) != 1:
            raise ValueError(f"{where}: p.sub must return a single tensor, its FPropMeta "
                             f"gives {len(meta.out_shapes)} outputs.")
        out = shapes.DeepCopy()
        out.Set(p.output_field or p.field, meta.out_shapes[0])
        return base_layer.fprop_meta(meta.flops, out, meta.num_params, p.fprop_dtype or p.dtype,
                                     **base_layer.extra_param_counts([meta]),
                                     memory=layer_memory.wrapped(meta))


class IdentityLayer(base_layer.BaseLayer):
    """Returns its inputs unchanged (one value, or a tuple for several arguments)."""

    def FProp(self, theta: NestedMap, *inputs: Any) -> Any:
        del theta  # No weights.
        return inputs[0] if len(inputs) == 1 else tuple(inputs)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:
        shapes = tuple(base_layer.to_shape(s) for s in input_shapes)
        return base_layer.fprop_meta(0, shapes, 0, p.fprop_dtype or p.dtype)


def shapes_of(value: Any) -> Any:
    """The (nested) static shapes of a tensor or NestedMap of tensors, for FPropMeta."""
    if isinstance(value, NestedMap):
        return value.Transform(lambda t: tf.TensorShape(t.shape))
    return tf.TensorShape(tf.convert_to_tensor(value).shape)


class FieldsLayer(base_layer.BaseLayer):
    """Calls `sub` with several NestedMap entries as positional arguments.

    The typical use ends a pipeline: `FieldsLayer(fields=['x', 'labels'],
    sub=SoftmaxCrossEntropyLayer...)` turns the boundary map into the loss
    layer's `(inputs, class_ids)` and returns its output NestedMap. With
    `output_field` set, the result is stored there and the other entries pass
    through instead.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("fields", [], "Entries (dotted paths allowed) passed to sub.FProp, in order.")
        p.Define("sub", None, "Params of the layer to call.")
        p.Define("output_field", None,
                 "None: return sub's output. Else store it in this entry of the input map.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        if not self.params.fields or self.params.sub is None:
            raise ValueError(f"{self.path}: FieldsLayer needs p.fields (entry names) and p.sub.")
        self.CreateChild("sub", self.params.sub)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> Any:
        inputs = _check_map(inputs, self.path)
        args = [_get_field(inputs, f, self.path) for f in self.params.fields]
        result = self.sub.FProp(theta.sub, *args)
        if self.params.output_field is None:
            return result
        out = inputs.DeepCopy()
        out.Set(self.params.output_field, result)
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        shapes = base_layer.to_shape(_check_map(inputs, where))
        args = [_get_field(shapes, f, where) for f in p.fields]
        meta = p.sub.cls.FPropMeta(p.sub, *args)
        out = meta.out_shapes[0] if len(meta.out_shapes) == 1 else meta.out_shapes
        if p.output_field is not None:
            stored, out = out, shapes.DeepCopy()
            out.Set(p.output_field, stored)
        return base_layer.fprop_meta(meta.flops, out, meta.num_params, p.fprop_dtype or p.dtype,
                                     **base_layer.extra_param_counts([meta]),
                                     memory=layer_memory.wrapped(meta))
