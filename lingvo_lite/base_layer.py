"""BaseLayer: Lingvo's layer contract on top of `tf.Module`.

A layer is built from its hyperparameters (`Params()`), owns its variables and
children, and exposes a stateless forward `FProp(theta, *inputs)`: every weight
it reads comes from `theta`, a NestedMap tree mirroring the layer tree. That is
what lets the pipeline read a cell's weights on the cell's device, differentiate
with respect to them, and recompute the forward later.

`FPropMeta(p, *input_shapes)` is a classmethod cost model that needs neither
variables nor data: forward flops, output shapes, parameter count and output
activation bytes. The partitioner balances cells with it, and
`trainer.py --mode=inspect_model` describes models far too large to allocate.

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

from lingvo_lite import hyperparams, weight_params
from lingvo_lite.nested_map import NestedMap

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

# Bytes a layer keeps for its backward, per byte of its output, when its FPropMeta gives no
# `saved_activation_bytes`: its output (each op's output is what TensorFlow keeps for the
# gradient; the layer's input is the previous layer's output). Measured with oneDNN on: about
# 1x for dense layers (matmul, bias and activation fused) and for conv/batch-norm ops; layers
# with larger internals (attention, wide feed-forward, AmoebaNet cells) give their own sum.
DEFAULT_SAVED_ACTIVATION_FACTOR = 1.0
# The default gradient temporaries (`backward_temporary_bytes`), fitted on the Transformer
# blocks of bench/bench_lib.py (BENCHMARKS.md section 9).
DEFAULT_GRADIENT_TEMPORARY_FACTOR = 2.0
DEFAULT_SAVED_GRADIENT_FRACTION = 0.5


def saved_activation_bytes(meta: NestedMap) -> int:
    """Bytes of activations `meta`'s layer keeps for its backward (whole mini-batch).

    The layer's own estimate when its FPropMeta gave one, else
    `DEFAULT_SAVED_ACTIVATION_FACTOR` x its output bytes.

    >>> m = fprop_meta(0, tf.TensorShape([8, 4]))  # 128 output bytes, no estimate.
    >>> saved_activation_bytes(m)
    128
    """
    saved = meta.get("saved_activation_bytes")
    if saved is None:
        return int(DEFAULT_SAVED_ACTIVATION_FACTOR * meta.out_bytes)
    return int(saved)


def backward_temporary_bytes(meta: NestedMap) -> int:
    """Bytes of gradient temporaries while back-propagating through `meta`'s layer (whole
    mini-batch), beyond what it saved.

    The layer's own `backward_temporary_bytes` when its FPropMeta set one, else the default:
    at least the gradient flowing in and the one going out (`DEFAULT_GRADIENT_TEMPORARY_FACTOR`
    x its output), and for layers with large internal activations (attention probabilities, a
    wide hidden layer) `DEFAULT_SAVED_GRADIENT_FRACTION` of what it saved.

    >>> m = fprop_meta(0, tf.TensorShape([8, 4]), saved_activation_bytes=1024)
    >>> backward_temporary_bytes(m)  # max(2 x 128, 0.5 x 1024)
    512
    """
    declared = meta.get("backward_temporary_bytes")
    if declared is not None:
        return int(declared)
    return default_backward_temporary_bytes(meta.out_bytes, saved_activation_bytes(meta))


def default_backward_temporary_bytes(out_bytes: int, saved_bytes: int) -> int:
    """The default estimate of `backward_temporary_bytes()` for a layer with these output and
    saved-activation bytes."""
    return int(max(DEFAULT_GRADIENT_TEMPORARY_FACTOR * out_bytes,
                   DEFAULT_SAVED_GRADIENT_FRACTION * saved_bytes))


def extra_param_counts(metas: Any) -> dict[str, int]:
    """Sums of the children's `non_trainable_params` and `training_only_params`."""
    return {key: sum(int(m.get(key, 0)) for m in metas) for key in EXTRA_PARAM_COUNTS}


def fprop_meta(flops: float, out_shapes: Any, num_params: int = 0,
               dtype: tf.DType = tf.float32, non_trainable_params: int = 0,
               training_only_params: int = 0,
               saved_activation_bytes: int | None = None,
               weight_op_bytes: int | None = None,
               backward_temporary_bytes: int | None = None,
               inline_backward_temporary_bytes: int | None = None,
               deferring_backward_temporary_bytes: int | None = None,
               saved_covers_input: bool = False) -> NestedMap:
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
      saved_activation_bytes: bytes of activations the layer keeps from its forward for
        its backward on the whole mini-batch (the planner's memory model); None: the
        default, `DEFAULT_SAVED_ACTIVATION_FACTOR` x out_bytes (`saved_activation_bytes()`).
      weight_op_bytes: bytes of the inputs and output gradients of the ops that apply its
        weights through `layers.weight_ops` (a matmul's input and output), for the whole
        mini-batch: what a deferred weight gradient holds from B to W (zero-bubble, batched
        weight gradients). None: not declared (the memory model then estimates it).
      backward_temporary_bytes: bytes of gradient temporaries while back-propagating through
        the layer, beyond what it saved (whole mini-batch); None: the default estimate
        (`backward_temporary_bytes()`).
      inline_backward_temporary_bytes: the most its backward holds beyond its saved
        activations when each is freed as soon as the backward has passed its last reader
        (an inline backward, or a re-computing one that does not defer weight gradients);
        None: `backward_temporary_bytes`, as if all stayed until the end.
      deferring_backward_temporary_bytes: the same for an inline backward that defers its
        weight gradients (zero-bubble's B of a micro-batch that kept its activations): the
        records of the sub-layers it has passed stay until W. None: the inline figure.
      saved_covers_input: True when `saved_activation_bytes` lists exactly the tensors the
        layer's gradients read, its input included where they read it (attention, AmoebaNet
        cells): nothing else need hold the input for its backward. False (the default
        estimate's convention): the input is the previous layer's output, counted there,
        and a pipeline cell that starts with this layer keeps its received input until the
        backward (`saved_covers_input()`).
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
    if saved_activation_bytes is not None:
        meta.saved_activation_bytes = int(saved_activation_bytes)
    if weight_op_bytes is not None:
        meta.weight_op_bytes = int(weight_op_bytes)
    if backward_temporary_bytes is not None:
        meta.backward_temporary_bytes = int(backward_temporary_bytes)
    if inline_backward_temporary_bytes is not None:
        meta.inline_backward_temporary_bytes = int(inline_backward_temporary_bytes)
    if deferring_backward_temporary_bytes is not None:
        meta.deferring_backward_temporary_bytes = int(deferring_backward_temporary_bytes)
    if saved_covers_input:
        meta.saved_covers_input = True
    return meta


def saved_covers_input(meta: NestedMap) -> bool:
    """Whether `meta`'s saved activations already count what its backward reads of its input
    (`fprop_meta(saved_covers_input=...)`).

    Measured (BENCHMARKS.md section 9): an AmoebaNet cell on a pipeline's second device keeps
    no copy of its received input beside its saved tensors. Its first op, a ReLU, overwrites
    the received buffer in place, and that buffer is the ReLU output the cell's saved bytes
    count. A dense layer's weight gradient reads its input, which its saved bytes (its
    output) leave to the layer before it.

    >>> saved_covers_input(fprop_meta(0, tf.TensorShape([8, 4])))
    False
    >>> first = fprop_meta(0, tf.TensorShape([8, 4]), saved_covers_input=True)
    >>> saved_covers_input(fprop_meta(0, tf.TensorShape([8, 4]), **composite_memory(
    ...     [first, fprop_meta(0, tf.TensorShape([8, 4]))])))  # A chain: its first layer's.
    True
    """
    return bool(meta.get("saved_covers_input", False))


def weight_op_bytes(metas: Sequence[NestedMap]) -> int | None:
    """The sum of the layers' declared `weight_op_bytes`; None if a layer with trainable
    weights declared none (a composite layer cannot declare a complete sum).

    >>> weight_op_bytes([fprop_meta(0, [2], num_params=3, weight_op_bytes=40),
    ...                  fprop_meta(0, [2])])  # No weights: nothing to declare.
    40
    """
    total = 0
    for m in metas:
        declared = m.get("weight_op_bytes")
        if declared is None:
            if int(m.num_params) > int(m.get("non_trainable_params", 0)):
                return None
            continue
        total += int(declared)
    return total


def deferring_backward_temporary_bytes(metas: Sequence[NestedMap]) -> int:
    """The most a chain of `metas`' layers holds beyond its saved activations while an
    inline backward that defers weight gradients passes it: back-propagating through layer
    i, its own temporaries (as deferring, else held), plus what the layers after i, already
    passed, keep for W beyond what they saved (their output gradients: a matmul's input is
    saved, its output's gradient is not; an undeclared layer with weights: its output).

    >>> a = fprop_meta(0, tf.TensorShape([8, 4]), num_params=16, weight_op_bytes=256,
    ...                saved_activation_bytes=128, backward_temporary_bytes=100)
    >>> deferring_backward_temporary_bytes([a, a])  # Through the first: 100 + (256 - 128).
    228
    """
    worst, passed = 0, 0
    for m in reversed(metas):
        own = m.get("deferring_backward_temporary_bytes")
        worst = max(worst, (backward_temporary_bytes(m) if own is None else int(own)) + passed)
        if int(m.num_params) > int(m.get("non_trainable_params", 0)):
            deferred = m.get("weight_op_bytes")
            passed += (int(m.out_bytes) if deferred is None
                       else max(0, int(deferred) - saved_activation_bytes(m)))
    return worst


def wrapped_memory(meta: NestedMap) -> dict[str, Any]:
    """The memory arguments of `fprop_meta` for a layer that runs one sub-layer and adds
    nothing (e.g. one that picks its input from a NestedMap): the sub-layer's declarations.

    >>> sub = fprop_meta(0, tf.TensorShape([8, 4]), saved_activation_bytes=64,
    ...                  inline_backward_temporary_bytes=32)
    >>> wrapped_memory(sub)["inline_backward_temporary_bytes"]
    32
    """
    return dict(saved_activation_bytes=saved_activation_bytes(meta),
                weight_op_bytes=meta.get("weight_op_bytes"),
                backward_temporary_bytes=backward_temporary_bytes(meta),
                inline_backward_temporary_bytes=meta.get("inline_backward_temporary_bytes"),
                deferring_backward_temporary_bytes=meta.get(
                    "deferring_backward_temporary_bytes"),
                saved_covers_input=saved_covers_input(meta))


def composite_memory(metas: Sequence[NestedMap], saved_extra: int = 0) -> dict[str, Any]:
    """The memory arguments of `fprop_meta` for a layer that runs `metas`' layers one after
    another: it keeps what they keep (plus `saved_extra` bytes of its own), defers what they
    defer, its gradient temporaries are its largest child's (it back-propagates through one
    child after another; deferring, beside the records of the children it passed:
    `deferring_backward_temporary_bytes`), and its saved bytes cover its input when its first
    child's do.

    >>> a = fprop_meta(0, tf.TensorShape([8, 4]), saved_activation_bytes=1024)
    >>> b = fprop_meta(0, tf.TensorShape([8, 4]))  # Saves its output, 128 bytes.
    >>> composite_memory([a, b])["saved_activation_bytes"], composite_memory([a, b])[
    ...     "backward_temporary_bytes"]
    (1152, 512)
    """
    return dict(
        saved_activation_bytes=saved_extra + sum(saved_activation_bytes(m) for m in metas),
        weight_op_bytes=weight_op_bytes(metas),
        backward_temporary_bytes=max(map(backward_temporary_bytes, metas), default=None),
        deferring_backward_temporary_bytes=deferring_backward_temporary_bytes(metas),
        saved_covers_input=bool(metas) and saved_covers_input(metas[0]))


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


__all__ = ["BaseLayer", "fprop_meta", "activation_bytes", "saved_activation_bytes",
           "saved_covers_input", "extra_param_counts", "to_shape", "weight_op_bytes",
           "DEFAULT_SAVED_ACTIVATION_FACTOR", "EXTRA_PARAM_COUNTS"]
