"""The core every other package builds on: Params, NestedMap, the base layer, its weights and
the per-call context, devices.

`hyperparams` (Params, InstantiableParams), `nested_map` (NestedMap), `base_layer` (BaseLayer:
`CreateVariable`, `CreateChild`, `FProp(theta, ...)`, `FPropMeta`), `weight_params` (how a weight
is made), `fprop_context` (what one forward call sees: training or not, the step's random seeds,
side updates), `devices` and `colocation` (logical devices, placing ops beside their weights),
`layer_memory` (a layer's bytes from its FPropMeta). This package imports no other package of
lingvo_lite.

>>> from lingvo_lite import core
>>> core.NestedMap(a=1).a
1

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "Params": "lingvo_lite.core.hyperparams",
    "InstantiableParams": "lingvo_lite.core.hyperparams",
    "NestedMap": "lingvo_lite.core.nested_map",
    "BaseLayer": "lingvo_lite.core.base_layer",
    "WeightParams": "lingvo_lite.core.weight_params",
    "WeightInit": "lingvo_lite.core.weight_params",
    "fprop_context": "lingvo_lite.core.fprop_context",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
