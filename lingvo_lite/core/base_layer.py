"""BaseLayer: Lingvo's layer contract on top of `tf.Module`.

A layer is built from its hyperparameters (`Params()`), owns its variables and
children, and exposes a stateless forward `FProp(theta, *inputs)`: every weight
it reads comes from `theta`, a NestedMap tree mirroring the layer tree. That is
what lets the pipeline read a cell's weights on the cell's device, differentiate
with respect to them, and recompute the forward later.

`FPropMeta(p, *input_shapes)` is a classmethod cost model that needs neither
variables nor data: forward flops, output shapes, parameter count and output
activation bytes, and optionally a memory record (`layer_memory`). The partitioner
balances cells with it, and `trainer.py --mode=inspect_model` describes models far too
large to allocate.

A layer with children declares them once, from its Params, in the classmethod
`declare_children(p)`: construction creates exactly those children, and
`FPropMeta` costs the same params without instantiating anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import tensorflow as tf

from lingvo_lite.core import hyperparams, weight_params
from lingvo_lite.core.nested_map import NestedMap

_build_stack = threading.local()


def _parent_stack() -> list[BaseLayer]:
    if not hasattr(_build_stack, "layers"):
        _build_stack.layers = []
    return _build_stack.layers


def to_shape(shape: Any) -> Any:
    """Normalises a shape spec: TensorShape, list/tuple of ints, or a NestedMap of those."""
    if isinstance(shape, NestedMap):
        return shape.Transform(to_shape)
    if isinstance(shape, tf.TensorSpec):
        return shape.shape
    return tf.TensorShape(shape)


def _leaf_shapes(shapes: Any) -> list[tf.TensorShape]:
    if isinstance(shapes, NestedMap):
        return [s for s in shapes.Flatten() if s is not None]
    if isinstance(shapes, (tuple, list)) and not isinstance(shapes, tf.TensorShape):
        if shapes and all(d is None or isinstance(d, int) for d in shapes):
            return [tf.TensorShape(shapes)]  # One shape written as a list of dimensions.
        return [leaf for s in shapes for leaf in _leaf_shapes(s)]
    return [shapes]


def activation_bytes(shapes: Any, dtype: tf.DType = tf.float32) -> int:
    """Bytes of the tensors with the given (nested) shapes, all of `dtype`.

    A list or tuple of ints is one shape; of shapes, several:

    >>> activation_bytes([2, 3]), activation_bytes(([2, 3], tf.TensorShape([4])))
    (24, 40)
    """
    total = 0
    for s in _leaf_shapes(shapes):
        total += int(tf.TensorShape(s).num_elements() or 0)
    return total * tf.as_dtype(dtype).size


EXTRA_PARAM_COUNTS = ("non_trainable_params", "training_only_params")


def extra_param_counts(metas: Any) -> dict[str, int]:
    """Sums of the children's `non_trainable_params` and `training_only_params`."""
    return {key: sum(int(m.get(key, 0)) for m in metas) for key in EXTRA_PARAM_COUNTS}


def fprop_meta(flops: float, out_shapes: Any, num_params: int = 0,
               dtype: tf.DType = tf.float32, non_trainable_params: int = 0,
               training_only_params: int = 0, memory: Any = None) -> NestedMap:
    """Builds the NestedMap every `FPropMeta` returns.

    Args:
      flops: forward floating point operations (a multiply-add counts 2).
      out_shapes: the shape of `FProp`'s result, or a tuple of them when `FProp`
        returns several values; NestedMaps of shapes are allowed.
      num_params: number of weight elements the layer (with children) owns.
      dtype: activation dtype, for `out_bytes`.
      non_trainable_params: how many of `num_params` are not trained (e.g. batch
        norm's moving statistics); composite layers pass their children's sum
        (`extra_param_counts`).
      training_only_params: how many of the trainable ones only serve training (e.g.
        an auxiliary head's), which papers leave out of a model's size.
      memory: optionally, the layer's memory declarations, a `layer_memory.MemoryRecord`
        (what it keeps for its backward, its gradient temporaries); the memory model uses
        defaults for whatever is not declared.

    >>> meta = fprop_meta(2 * 8 * 4 * 4, tf.TensorShape([8, 4]), num_params=20)
    >>> meta.flops, meta.out_bytes, meta.num_params
    (256.0, 128, 20)
    """
    if not isinstance(out_shapes, tuple):
        out_shapes = (out_shapes,)
    meta = NestedMap(
        flops=float(flops),
        out_shapes=out_shapes,
        num_params=int(num_params),
        non_trainable_params=int(non_trainable_params),
        training_only_params=int(training_only_params),
        out_bytes=activation_bytes(out_shapes, dtype),
    )
    if memory is not None:
        meta.memory = memory
    return meta


class BaseLayer(tf.Module):
    """Base class of every layer. Subclasses define Params, FProp, FPropMeta, and either
    `declare_children` (children derived from the params) or __init__ (variables, or
    children that need more than params, e.g. a device per child)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define("name", "", "Layer name; unique among its siblings.")
        p.Define("dtype", tf.float32, "Dtype of the layer's variables.")
        p.Define(
            "fprop_dtype", None,
            "Dtype of activations in FProp (e.g. tf.bfloat16 for mixed precision); "
            "None means `dtype`.",
        )
        p.Define(
            "params_init", weight_params.WeightInit.Xavier(1.0),
            "Default initialiser of the layer's weights.",
        )
        p.Define(
            "random_seed", None,
            "Seed for weight initialisation and dropout; None inherits the parent's "
            "(0 at the root). Seeds are combined with the variable's path.",
        )
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        if not params.name:
            raise ValueError(
                f"{type(self).__name__}: params.name is empty; set p.name (children get "
                "their name from CreateChild)."
            )
        parents = _parent_stack()
        parent = parents[-1] if parents else None
        params = params.Copy()
        if params.random_seed is None and parent is not None:
            params.random_seed = parent.params.random_seed
        params.Freeze()
        super().__init__(name=params.name)
        self._params = params
        self._path = f"{parent.path}/{params.name}" if parent is not None else params.name
        self._private_vars = NestedMap()
        self._private_children = NestedMap()
        for name, child in self.declare_children(params).items():
            if isinstance(child, (list, tuple)):
                self.CreateChildren(name, child)
            else:
                self.CreateChild(name, child)

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        """The layer's children, from its params alone: {name: Params or list of Params}.

        The one declaration of a layer's structure. `BaseLayer.__init__` creates each
        entry (a Params with `CreateChild`, a list with `CreateChildren`), so the child is
        `self.<name>` and its weights `theta.<name>`; the classmethod `FPropMeta` calls it
        too, to cost the very same children from their params without instantiating any.
        Entries are in application order where there is one; validate `p` here, since
        both construction and costing pass through. The default declares none.

        >>> from lingvo_lite.layers import composite, dense
        >>> class TwoDense(BaseLayer):
        ...     @classmethod
        ...     def Params(cls):
        ...         p = super().Params()
        ...         p.Define("dims", (4, 8, 2), "Input, hidden and output depth.")
        ...         return p
        ...
        ...     @classmethod
        ...     def declare_children(cls, p):
        ...         d_in, hidden, d_out = p.dims
        ...         proj = dense.ProjectionLayer.Params()
        ...         return {"first": proj.Copy().Set(input_dim=d_in, output_dim=hidden),
        ...                 "second": proj.Copy().Set(input_dim=hidden, output_dim=d_out)}
        ...
        ...     def FProp(self, theta, x):
        ...         return self.second.FProp(theta.second, self.first.FProp(theta.first, x))
        ...
        ...     @classmethod
        ...     def FPropMeta(cls, p, x_shape):
        ...         metas = composite.chain_meta(list(cls.declare_children(p).values()),
        ...                                      x_shape)
        ...         return composite.sum_meta(metas, (x_shape,), p.dtype)
        >>> layer = TwoDense.Params().Set(name="net").Instantiate()
        >>> layer.first.params.output_dim, layer(tf.ones([3, 4])).shape.as_list()
        (8, [3, 2])
        >>> TwoDense.FPropMeta(TwoDense.Params(), tf.TensorShape([3, 4])).num_params
        58
        """
        del p
        return {}

    # -- structure -----------------------------------------------------------

    @property
    def params(self) -> hyperparams.InstantiableParams:
        """The layer's frozen hyperparameters."""
        return self._params

    @property
    def path(self) -> str:
        """Slash-separated path from the root layer, e.g. 'model/enc/layer_3'."""
        return self._path

    @property
    def fprop_dtype(self) -> tf.DType:
        return self.params.fprop_dtype or self.params.dtype

    @property
    def children(self) -> NestedMap:
        return self._private_children

    def _instantiate_child(self, name: str, params: hyperparams.InstantiableParams) -> BaseLayer:
        params = params.Copy()
        params.name = name
        stack = _parent_stack()
        stack.append(self)
        try:
            return params.Instantiate()
        finally:
            stack.pop()

    def CreateChild(self, name: str, params: hyperparams.InstantiableParams) -> BaseLayer:
        """Instantiates `params` as child `name`; reachable as `self.<name>` and in theta."""
        self._check_new_name(name)
        child = self._instantiate_child(name, params)
        self._private_children[name] = child
        return child

    def CreateChildren(
        self,
        name: str,
        params_list: Sequence[hyperparams.InstantiableParams],
        devices: Sequence[str | None] | None = None,
        scopes: Sequence[Callable[[], ContextManager[Any]]] | None = None,
    ) -> list[BaseLayer]:
        """Instantiates a list of children `<name>_<i>`; theta.<name> is a list.

        `devices[i]`, when given, is the device child i's variables are created on;
        alternatively `scopes[i]()` is the context they are created in (e.g. a
        TPUStrategy's logical device). Otherwise (or where devices[i] is None) the children
        are created where this layer is: under the caller's device scope.
        """
        self._check_new_name(name)
        if devices is not None and scopes is not None:
            raise ValueError(f"{self.path}: CreateChildren takes devices or scopes, not both.")
        if scopes is None:
            # Not tf.device(None): that clears the enclosing device scope, which put the
            # nested children of a pipeline cell on the default device.
            scopes = [(lambda d=d: tf.device(d)) if d is not None else contextlib.nullcontext
                      for d in devices or [None] * len(params_list)]
        children = []
        for i, (p, scope) in enumerate(zip(params_list, scopes)):
            with scope():
                children.append(self._instantiate_child(f"{name}_{i}", p))
        self._private_children[name] = children
        return children

    def CreateVariable(
        self, name: str, wp: weight_params.WeightParams, trainable: bool = True
    ) -> tf.Variable:
        """Creates a variable deterministically initialised from `wp` and the seed."""
        self._check_new_name(name)
        dtype = wp.dtype or self.params.dtype
        full_name = f"{self.path}/{name}"
        wp_init = wp if wp.init is not None else _with_init(wp, self.params.params_init)
        seed = weight_params.derive_seed(self.params.random_seed, full_name)
        var = tf.Variable(
            weight_params.initial_value(wp_init, seed, dtype),
            trainable=trainable,
            name=full_name.replace("/", "."),
        )
        self._private_vars[name] = var
        return var

    def _check_new_name(self, name: str) -> None:
        if name in self._private_vars or name in self._private_children:
            raise ValueError(f"{self.path}: '{name}' is already a variable or child of this layer.")

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: expose children and variables by name.
        private = self.__dict__
        for store in ("_private_children", "_private_vars"):
            if store in private and name in private[store]:
                return private[store][name]
        raise AttributeError(f"{type(self).__name__} '{private.get('_path', '?')}' has no "
                             f"attribute, child or variable '{name}'.")

    # -- weights -------------------------------------------------------------

    @property
    def vars(self) -> NestedMap:
        """NestedMap of this layer's and all descendants' variables."""
        tree = NestedMap(self._private_vars)
        for name, child in self._private_children.items():
            if isinstance(child, list):
                tree[name] = [c.vars for c in child]
            else:
                tree[name] = child.vars
        return tree

    @property
    def theta(self) -> NestedMap:
        """The weights FProp reads; by default the variables themselves."""
        return self.vars

    def FPropDefaultTheta(self, *args: Any, **kwargs: Any) -> Any:
        """FProp with this layer's own variables as theta."""
        return self.FProp(self.theta, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.FPropDefaultTheta(*args, **kwargs)

    def FProp(self, theta: NestedMap, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.FProp")

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, *input_shapes: Any) -> NestedMap:
        """Cost of FProp from input shapes alone; see `fprop_meta`."""
        raise NotImplementedError(f"{cls.__name__}.FPropMeta")

    def ApplyUpdates(self, stats_list: list[Any]) -> tf.Operation:
        """Applies statistics this layer reported to an UpdateCollector (e.g. batch norm)."""
        raise NotImplementedError(f"{type(self).__name__} reported updates but cannot apply them.")

    def CastTheta(self, theta: NestedMap) -> NestedMap:
        """theta with floating weights cast to the fprop dtype (mixed precision)."""
        dtype = self.fprop_dtype
        if dtype == self.params.dtype:
            return theta
        return theta.Transform(
            lambda w: tf.cast(w, dtype) if w is not None and w.dtype.is_floating else w
        )


def _with_init(
    wp: weight_params.WeightParams, init: weight_params.WeightInit
) -> weight_params.WeightParams:
    return dataclasses.replace(wp, init=init)


__all__ = ["BaseLayer", "fprop_meta", "activation_bytes", "extra_param_counts", "to_shape",
           "EXTRA_PARAM_COUNTS"]
