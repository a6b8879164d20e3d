"""A Keras 3 layer as a lingvo-lite layer: Params, theta, stateless FProp, FPropMeta.

`KerasLayer.Params()` holds the Keras layer's serialized config
(`keras.saving.serialize_keras_object`), so `ToText`/`FromText`, `inspect_params` and
overrides work on it (e.g. `network.layers[2].keras_layer[config][rate] : 0.2`). Instantiated
inside a pipeline cell's device scope, the layer builds its Keras weights there; their
`tf.Variable`s are this layer's variables and `theta`. `FProp(theta, x)` runs the
Keras layer with `stateless_call` on theta, so the pipeline can read a cell's weights
on the cell's device, differentiate with respect to them and recompute the forward.
A nested `Sequential` or functional model is one layer. The layer is called as Keras calls
it (`Layer.__call__` under a stateless scope): inputs cast to its compute dtype and weights
autocast under a mixed dtype policy, and a Keras mask passed in and computed for the output
(it travels in the boundary map's `<field>_mask` entry). A layer that adds a loss in its call
(`add_loss`) is refused: the pipeline trains the compiled loss only.

State is made exact under micro-batching and recomputation (any depth of nesting):
- Dropout, SpatialDropout*, GaussianNoise and GaussianDropout draw, for the examples
  of a micro-batch, exactly the rows Keras draws for the whole mini-batch
  (`keras_random`), from the seed-generator state in theta. A recomputation reads the
  same theta, hence the same masks; the state advances once per mini-batch (as one
  Keras `fit` step advances it), through the step's `UpdateCollector`.
- BatchNormalization normalises each micro-batch with its own moments (GPipe) and
  reports them; the moving mean and variance are updated once per mini-batch from the
  exactly pooled moments, with Keras' momentum formula.
- Any other layer that draws random numbers, uses batch renormalisation, or changes a
  non-trainable weight in its call is refused with an error naming it.

Inputs: a tensor, or a NestedMap whose `p.field` entry the layer transforms (the
other entries, e.g. the labels, pass through).

Example:
    >>> import keras
    >>> import tensorflow as tf
    >>> from lingvo_lite.layers import keras_layer
    >>> p = keras_layer.KerasLayer.Params().Set(
    ...     name='dense', keras_layer=keras_layer.serialize(keras.layers.Dense(4)),
    ...     input_shape=[3])
    >>> layer = p.Instantiate()
    >>> layer.FProp(layer.theta, tf.ones([2, 3])).shape
    TensorShape([2, 4])
"""

from __future__ import annotations

import contextlib
import copy
import random
import re
import threading
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.backend.common.stateless_scope import StatelessScope

from lingvo_lite.core import base_layer, fprop_context, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import keras_flops, keras_random, layer_config
from lingvo_lite.layers.normalization import pool_moments

__all__ = [
    "added_loss_error",
    "adopt_layer_variables",
    "adopt_variable",
    "check_call_state",
    "describe",
    "LiveLayer",
    "check_supported",
    "deserialize",
    "iter_keras_layers",
    "KerasLayer",
    "refusing_raw_random",
    "live_layer_of",
    "mask_key",
    "serialize",
    "variable_keys",
]

_DROPOUT_CLASSES = (keras.layers.Dropout,)  # SpatialDropout1D/2D/3D subclass Dropout.
_NOISE_CLASSES = (keras.layers.GaussianNoise, keras.layers.GaussianDropout)
_local = threading.local()


class LiveLayer:
    """The user's own Keras layer object, carried by Params by reference.

    Copies of the Params share it (a layer and its weights are not copied), and two
    handles are equal when they hold the same object. Its text form names the class and
    the layer; the Params' `keras_layer` entry beside it shows the layer's config.

    Example:
        >>> dense = keras.layers.Dense(4, name='d')
        >>> handle = LiveLayer(dense)
        >>> copy.deepcopy(handle).layer is dense, handle
        (True, <live Dense 'd'>)
    """

    def __init__(self, layer: keras.layers.Layer) -> None:
        self.layer = layer
        self.description = describe(layer)

    def __deepcopy__(self, memo: dict) -> LiveLayer:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LiveLayer) and other.layer is self.layer

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<live {type(self.layer).__name__} '{self.layer.name}'>"


def describe(layer: Any) -> dict:
    """A layer's serialized config for display and overrides, or, when its `get_config()`
    fails, {'class_name', 'module', 'config': {'name'}}: a layer that runs as the user's
    object needs no config.

    Example:
        >>> describe(keras.layers.Dense(3, name='d'))['config']['units']
        3
    """
    try:
        return keras.saving.serialize_keras_object(layer)
    except Exception:  # noqa: BLE001 - any get_config() error; the layer still runs.
        return {"class_name": type(layer).__name__, "module": type(layer).__module__,
                "config": {"name": getattr(layer, "name", type(layer).__name__)}}


def serialize(layer: keras.layers.Layer) -> dict:
    """A Keras layer's serialized config, as `KerasLayer.Params().keras_layer` holds it.

    Example:
        >>> deserialize(serialize(keras.layers.Dense(4))).units
        4

    A config the layer cannot be rebuilt from is refused in one line (layer_config.py).
    """
    return layer_config.rebuildable_config(layer)


def deserialize(config: dict) -> keras.layers.Layer:
    """A fresh Keras layer from `serialize`'s output (custom classes must be registered)."""
    # Keras pops entries from the config it deserializes (the params' copy must survive),
    # and inside keras.models.load_model it would hand back an already deserialized
    # object for a `shared_object_id`: every KerasLayer needs its own.
    return keras.saving.deserialize_keras_object(_unshared(copy.deepcopy(config)))


def _unshared(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _unshared(v) for k, v in config.items() if k != "shared_object_id"}
    if isinstance(config, list):
        return [_unshared(v) for v in config]
    return config


def _sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """`layer` and every layer nested in it, depth first, each once."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def variable_keys(layer: keras.layers.Layer) -> dict[int, str]:
    """Theta key of each variable of `layer`, by `id`: stable across processes and builds.

    The layer's own variables keep their names ('kernel', 'moving_mean'); a nested
    layer's are prefixed with its class and depth-first position, not its name (Keras
    numbers unnamed layers and seed generators with process-wide counters), e.g.
    'batch_normalization_4_gamma'; a random layer's seed state is '..._seed_state'.

    Example:
        >>> dense = keras.layers.Dense(2)
        >>> dense.build((None, 3))
        >>> sorted(variable_keys(dense).values())
        ['bias', 'kernel']
    """
    keys: dict[int, str] = {}
    used: set[str] = set()
    for i, sub in enumerate(_sublayers(layer)):
        prefix = "" if sub is layer else f"{_snake(type(sub).__name__)}_{i}_"
        owned = [(v, v.name) for v in sub._trainable_variables + sub._non_trainable_variables]
        owned += [(g.state, "seed_state") for g in getattr(sub, "_seed_generators", [])]
        for v, name in owned:
            key = re.sub(r"\W", "_", prefix + name)
            if key[0].isdigit():
                key = "v_" + key
            base, n = key, 1
            while key in used:
                key, n = f"{base}_{n}", n + 1
            used.add(key)
            keys[id(v)] = key
    return keys


def check_supported(layer: keras.layers.Layer) -> None:
    """Raises a ValueError naming any (nested) layer whose state cannot be made exact.

    Example:
        >>> check_supported(keras.layers.Dropout(0.5))  # Mapped: exact.
        >>> check_supported(keras.layers.AlphaDropout(0.5, name='a'))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Keras layer 'a' (AlphaDropout) draws random numbers, ...
    """
    for sub in _sublayers(layer):
        name = f"'{sub.name}' ({type(sub).__name__})"
        if isinstance(sub, keras.layers.BatchNormalization) and sub.renorm:
            raise ValueError(
                f"Keras layer {name} uses batch renormalisation, whose moving statistics "
                "cannot be pooled exactly over micro-batches; set renorm=False.")
        if getattr(sub, "stateful", False):
            raise ValueError(
                f"Keras layer {name} is stateful (it carries state from one batch to the "
                "next), which micro-batching cannot reproduce; set stateful=False.")
        own_seeds = [g for g in getattr(sub, "_seed_generators", [])]
        if own_seeds and not isinstance(sub, _DROPOUT_CLASSES + _NOISE_CLASSES) and \
                _may_draw(sub):
            if hasattr(sub, "recurrent_dropout"):
                raise ValueError(
                    f"Keras layer {name} draws random numbers (dropout={sub.dropout}, "
                    f"recurrent_dropout={sub.recurrent_dropout}), which lingvo-lite cannot "
                    "make the same for every micro-batch split and recomputation; set both "
                    "to 0 (a Dropout layer before or after it is supported).")
            raise ValueError(
                f"Keras layer {name} draws random numbers, and lingvo-lite can only make "
                "Dropout, SpatialDropout*, GaussianNoise and GaussianDropout draw the same "
                "values for every micro-batch split and recomputation; remove it from the "
                "pipelined layers (or run it outside the pipeline).")


def check_call_state(layer: keras.layers.Layer, input_shape: Any,
                     input_dtype: Any = tf.float32) -> None:
    """Raises a ValueError naming any weight a training call of `layer` writes that
    lingvo-lite cannot make exact (all but batch norm's statistics and seed states),
    any layer that adds a loss in its call (add_loss), and any that draws random numbers
    outside Keras' seed generators.

    Runs the layer once on zeros of one example; call it inside `tf.Graph().as_default()`
    or a traced function so nothing executes (pipeline_params does).

    Example:
        >>> with tf.Graph().as_default():
        ...     bn = keras.layers.BatchNormalization()
        ...     bn.build((None, 3))
        ...     check_call_state(bn, [3])  # Its moving statistics are pooled: accepted.
    """
    handled = set()
    for sub in _sublayers(layer):
        if isinstance(sub, keras.layers.BatchNormalization):
            handled.update((id(sub.moving_mean), id(sub.moving_variance)))
        elif _seed_state(sub) is not None:
            handled.add(id(_seed_state(sub)))
    trainable = [tf.zeros(v.shape, v.dtype) for v in layer.trainable_variables]
    non_trainable = [tf.zeros(v.shape, v.dtype) for v in layer.non_trainable_variables]
    kwargs = {"training": True} if getattr(layer, "_call_has_training_arg", True) else {}
    with refusing_raw_random(layer):
        _, new, losses = stateless_call(layer, trainable, non_trainable,
                                        tf.zeros([1, *input_shape], input_dtype), None, kwargs)
    if losses:
        raise ValueError(added_loss_error(layer))
    for v, old, value in zip(layer.non_trainable_variables, non_trainable, new):
        if value is not old and id(v) not in handled:
            raise ValueError(state_error(layer, v.path))


def _may_draw(layer: keras.layers.Layer) -> bool:
    """Whether a layer that owns a seed generator may draw with it in a call.

    Keras' recurrent cells (LSTMCell, GRUCell, SimpleRNNCell) always own one but draw only
    with dropout or recurrent_dropout > 0, and a layer with a `rate` (keras-hub's DropPath)
    only with rate > 0; should one draw anyway, its seed state changes
    and `check_call_state` / FProp refuse it.
    """
    rates = [getattr(layer, name) for name in ("rate", "dropout", "recurrent_dropout")
             if isinstance(getattr(layer, name, None), (int, float))]
    return not rates or any(rate > 0 for rate in rates)


def _seed_state(layer: keras.layers.Layer) -> Any:
    """The seed-generator state of a mapped random layer; None when it draws nothing.

    Keras 3 gives Dropout(rate=0.0) (e.g. inside MultiHeadAttention(dropout=0.0)) no
    seed generator at all.
    """
    if not isinstance(layer, _DROPOUT_CLASSES + _NOISE_CLASSES):
        return None
    generator = getattr(layer, "seed_generator", None)
    return None if generator is None else generator.state


def mask_key(field: str) -> str:
    """The boundary-map entry that carries the Keras mask of entry `field` ('x' -> 'x_mask')."""
    return f"{field}_mask"


def stateless_call(layer: keras.layers.Layer, trainable: list[Any], non_trainable: list[Any],
                   x: Any, mask: Any, kwargs: dict[str, Any]) -> tuple[Any, list[Any], list[Any]]:
    """`layer(x, **kwargs)` with its variables read from the given values, as Keras calls it.

    Unlike `Layer.stateless_call` (which runs `call` directly), this goes through
    `Layer.__call__`: inputs are cast to the layer's compute dtype and its variables
    autocast under a mixed dtype policy, and `mask` reaches the layer and its output
    mask is computed, exactly as in a plain Keras model.

    Returns (outputs, new non-trainable values, losses the call added with add_loss).
    """
    mapping = list(zip(layer.trainable_variables, trainable))
    mapping += list(zip(layer.non_trainable_variables, non_trainable))
    if mask is not None:
        x = tf.identity(x)  # Its own tensor: the mask attribute is set on it.
        set_keras_mask(x, mask)
    with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        y = layer(x, **kwargs)
        losses = list(scope.losses)
    return y, [scope.get_current_value(v) for v in layer.non_trainable_variables], losses


# Ops that draw from a random state outside Keras' seed generators (tf.random.*, the old
# tf.compat.v1 ops, tf.random.Generator): each micro-batch and each recomputation would draw
# its own values.
_STATEFUL_RANDOM_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2", "StatefulUniform", "StatefulUniformInt",
    "StatefulUniformFullInt", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
    "RngReadAndSkip", "RngSkip"})


@contextlib.contextmanager
def refusing_raw_random(layer: Any, check: bool = True) -> Iterator[None]:
    """Raises a one-line ValueError if the ops the block traces draw random numbers outside
    Keras' seed generators (checked when tracing a graph, and only if `check`)."""
    graph = tf.compat.v1.get_default_graph()
    if not check or tf.executing_eagerly():
        yield
        return
    before = len(graph.get_operations())
    yield
    drawn = sorted({op.type for op in graph.get_operations()[before:]} & _STATEFUL_RANDOM_OPS)
    if drawn:
        raise ValueError(
            f"Keras layer '{layer.name}' ({type(layer).__name__}) draws random numbers outside "
            f"Keras' seed generators ({drawn[0]}: tf.random.* or tf.random.Generator), which "
            "would differ for every micro-batch and recomputation; draw the noise with a "
            "keras.layers.Dropout or GaussianNoise layer, or keep the layer out of the pipeline.")


def added_loss_error(layer: keras.layers.Layer) -> str:
    return (f"Keras layer '{layer.name}' ({type(layer).__name__}) adds a loss in its call "
            "(add_loss); the pipeline trains only the compiled loss and would drop it: "
            "compute that term in compile(loss=...) or remove it.")


def state_error(layer: keras.layers.Layer, what: str) -> str:
    return (f"Keras layer '{layer.name}' ({type(layer).__name__}) changes its non-trainable "
            f"weight '{what}' in its call; lingvo-lite cannot make such state exact under "
            "micro-batching and recomputation, so it refuses the layer: keep it out of the "
            "pipeline.")


class Recorder:
    """What the patched Keras layers see and report during one FProp."""

    def __init__(self, ctx: fprop_context.FPropContext) -> None:
        self.ctx = ctx
        self.moments: dict[int, NestedMap] = {}


def _recorder() -> Recorder | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class Recording:
    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def __enter__(self) -> Recorder:
        if not hasattr(_local, "stack"):
            _local.stack = []
        _local.stack.append(self._recorder)
        return self._recorder

    def __exit__(self, *exc: Any) -> None:
        _local.stack.pop()


def _patch_dropout(layer: keras.layers.Dropout) -> None:
    original = layer.call

    def call(inputs: Any, training: bool = False) -> Any:
        rec = _recorder()
        if rec is None:
            return original(inputs, training=training)
        if not training or layer.rate <= 0:
            return inputs
        if hasattr(layer, "_get_noise_shape"):
            noise_shape = layer._get_noise_shape(inputs)
        else:
            noise_shape = layer.noise_shape
        dynamic = tf.shape(inputs)
        if noise_shape is None:
            concrete = dynamic
        else:
            concrete = tf.stack([dynamic[i] if d is None else d for i, d in enumerate(noise_shape)])
        # A noise shape of 1 along the batch, as the user gave it (not a micro-batch of 1).
        shared = layer.noise_shape is not None and layer.noise_shape[0] == 1
        return keras_random.dropout(inputs, layer.rate, concrete,
                                    layer.seed_generator.state.value, rec.ctx.example_offset,
                                    shared, xla=rec.ctx.jit_compile)

    object.__setattr__(layer, "call", call)


def _patch_noise(layer: keras.layers.Layer) -> None:
    original = layer.call
    gaussian_dropout = isinstance(layer, keras.layers.GaussianDropout)

    def call(inputs: Any, training: bool = False) -> Any:
        rec = _recorder()
        if rec is None:
            return original(inputs, training=training)
        inputs = tf.convert_to_tensor(inputs)
        if not training or not _draws(layer):
            return inputs
        state = layer.seed_generator.state.value
        offset = rec.ctx.example_offset
        dtype = tf.as_dtype(layer.compute_dtype)
        if gaussian_dropout:
            stddev = (layer.rate / (1.0 - layer.rate)) ** 0.5
            return inputs * keras_random.normal(tf.shape(inputs), 1.0, stddev, state, offset, dtype)
        return inputs + keras_random.normal(tf.shape(inputs), 0.0, layer.stddev, state, offset,
                                            dtype)

    object.__setattr__(layer, "call", call)


def _draws(layer: keras.layers.Layer) -> bool:
    """Whether a patched random layer draws (hence advances its seed) in a training call."""
    if isinstance(layer, _DROPOUT_CLASSES) or isinstance(layer, keras.layers.GaussianDropout):
        return layer.rate > 0
    return layer.stddev > 0


def refuse_random_under_xla(layers: Any) -> None:
    """Refuses (one line) XLA for cells with a layer that draws normal noise in training:
    XLA draws a normal tensor as pairs across its whole batch, so a micro-batch cannot
    draw its rows of it (keras_random). Dropout draws uniform values: exact under XLA."""
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            continue
        for sub in _sublayers(layer):
            if isinstance(sub, _NOISE_CLASSES) and _draws(sub):
                raise ValueError(
                    f"PipelinedModel.compile: jit_compile=True with Keras layer '{sub.name}' "
                    f"({type(sub).__name__}), which draws normal noise: XLA pairs the values "
                    "of a whole batch's draw, so no micro-batch can draw its rows of it; use "
                    "jit_compile=False (or 'auto', which is False on CPUs).")


def _patch_batch_norm(layer: keras.layers.BatchNormalization) -> None:
    original = layer._moments

    def moments(inputs: Any, mask: Any) -> Any:
        mean, variance = original(inputs, mask)
        rec = _recorder()
        if rec is not None:
            if mask is None:
                shape = tf.shape(inputs)
                count = tf.reduce_prod(tf.gather(shape, list(layer._reduction_axes)))
            else:
                count = tf.reduce_sum(tf.cast(mask, tf.float32))
            rec.moments[id(layer)] = NestedMap(
                count=tf.cast(count, tf.float32), mean=tf.stop_gradient(mean),
                variance=tf.stop_gradient(variance))
        return mean, variance

    object.__setattr__(layer, "_moments", moments)


def _rename(variable: Any, name: str) -> tf.Variable:
    """Gives a Keras variable a tf.Variable named like CreateVariable's (stable, unique).

    Keras names its tf.Variables after layer names it numbers process-wide
    ('batch_normalization_13/beta'); optimizer slots and summaries are keyed by the
    tf.Variable's name, so the Keras variable gets a copy with the layer path's name.
    """
    old = variable.value
    with tf.device(old.device):
        new = tf.Variable(old.read_value(), trainable=old.trainable, name=name,
                          aggregation=old.aggregation, synchronization=old.synchronization)
    variable._value = new  # What the TF backend's Variable reads and writes.
    return new


def adopt_variable(variable: Any, name: str) -> tf.Variable:
    """A tf.Variable on the current device holding the user's variable's value, which the
    user's variable then reads and writes: the pipeline trains the user's model itself.

    (A second pipeline over the same layer, e.g. another data-parallel replica, gets its
    own copy; the user's variable stays with the first.)
    """
    old = variable.value
    new = tf.Variable(old.read_value() if hasattr(old, "read_value") else old,
                      trainable=variable.trainable, name=name,
                      aggregation=getattr(old, "aggregation", None) or
                      tf.VariableAggregation.NONE,
                      synchronization=getattr(old, "synchronization", None) or
                      tf.VariableSynchronization.AUTO)
    if not getattr(variable, "_lingvo_adopted", False):
        variable._value = new  # What the TF backend's Variable reads and writes.
        variable._lingvo_adopted = True
    return new


def adopt_layer_variables(layer: keras.layers.Layer, device: str) -> None:
    """`adopt_variable` for every variable of a layer that runs outside the pipeline (a
    front embedding), on `device`."""
    with tf.device(device):
        for v in layer.variables:
            adopt_variable(v, f"front.{layer.name}.{v.name}")


def live_layer_of(p: hyperparams.Params) -> keras.layers.Layer | None:
    """The user's layer object to run, or None to rebuild it from p.keras_layer (no live
    layer, or its config overridden)."""
    if p.live_layer is None or p.keras_layer != p.live_layer.description:
        return None
    return p.live_layer.layer


def _patch_once(layer: keras.layers.Layer, patch: Any) -> None:
    """Applies `patch` to `layer` unless done before (a live layer may be run by several
    pipeline layers; each patched method falls back to Keras' own outside an FProp)."""
    if not getattr(layer, "_lingvo_patched", False):
        patch(layer)
        object.__setattr__(layer, "_lingvo_patched", True)


class KerasLayer(base_layer.BaseLayer):
    """Runs a Keras layer (or nested Keras model) statelessly on theta; see the module doc."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("keras_layer", None,
                 "The Keras layer's serialized config (keras_layer.serialize(layer)).")
        p.Define("input_shape", None,
                 "Shape of one example of the layer's input (no batch dimension), e.g. "
                 "[8, 8, 1]; the layer's weights are built for it.")
        p.Define("field", "x",
                 "When the input is a NestedMap: the entry the layer transforms (the "
                 "others pass through).")
        p.Define("live_layer", None,
                 "The user's Keras layer object (a LiveLayer): run as it is, on this layer's "
                 "copies of its weights, and its variables then read and write those. "
                 "keras_layer then only describes it; overriding an entry of keras_layer "
                 "rebuilds the layer from the overridden config instead.")
        return p

    @classmethod
    def LiveParams(cls, layer: keras.layers.Layer, **fields: Any) -> hyperparams.Params:
        """Params that run the user's `layer` object (see `live_layer`)."""
        handle = LiveLayer(layer)
        return cls.Params().Set(keras_layer=handle.description, live_layer=handle, **fields)

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if not isinstance(p.keras_layer, dict):
            raise ValueError(f"{self.path}: p.keras_layer must be a serialized Keras layer "
                             "(keras_layer.serialize(layer)), got "
                             f"{type(p.keras_layer).__name__}.")
        live = live_layer_of(p)
        if live is not None:
            layer = live
            check_supported(layer)
        else:
            if p.input_shape is None:
                raise ValueError(f"{self.path}: p.input_shape (one example's shape, without "
                                 "the batch dimension) is needed to build the Keras layer's "
                                 "weights.")
            layer = self._rebuilt_layer(p)
        # Not tracked as a checkpoint dependency: Keras' object graph is named by
        # process-wide counters; the weights are saved through theta's stable keys.
        object.__setattr__(self, "_layer", layer)
        key_of_variable = variable_keys(layer)
        self._trainable_keys = []
        self._non_trainable_keys = []
        for keys, variables in ((self._trainable_keys, layer.trainable_variables),
                                (self._non_trainable_keys, layer.non_trainable_variables)):
            for v in variables:
                key = key_of_variable[id(v)]
                name = f"{self.path}/{key}".replace("/", ".")
                self._private_vars[key] = (adopt_variable if live is not None else _rename)(v, name)
                keys.append(key)
        key_of = {id(v): k for k, v in zip(
            self._trainable_keys + self._non_trainable_keys,
            layer.trainable_variables + layer.non_trainable_variables)}
        self._batch_norms = []
        self._random = []
        for sub in _sublayers(layer):
            if isinstance(sub, keras.layers.BatchNormalization):
                _patch_once(sub, _patch_batch_norm)
                self._batch_norms.append(
                    (sub, key_of[id(sub.moving_mean)], key_of[id(sub.moving_variance)]))
            elif isinstance(sub, _DROPOUT_CLASSES + _NOISE_CLASSES):
                _patch_once(sub, _patch_dropout if isinstance(sub, _DROPOUT_CLASSES)
                            else _patch_noise)
                if _seed_state(sub) is not None:
                    self._random.append((sub, key_of[id(_seed_state(sub))]))
        self._handled = {k for _, m, v in self._batch_norms for k in (m, v)}
        self._handled.update(k for _, k in self._random)

    def _rebuilt_layer(self, p: hyperparams.Params) -> keras.layers.Layer:
        """A fresh layer from p.keras_layer (a registered task's layers, or an override of a
        live layer's config), built for p.input_shape."""
        # Keras seeds unseeded initializers and seed generators from Python's `random`:
        # seed it from random_seed and the layer path, so a run's initial weights repeat.
        state = random.getstate()
        random.seed(int.from_bytes(repr(weight_params.derive_seed(
            p.random_seed, self.path)).encode(), "little"))
        try:
            if p.live_layer is not None:  # Overridden: the config must round-trip.
                layer_config.rebuildable_config(p.live_layer.layer)
            layer = deserialize(p.keras_layer)
            check_supported(layer)
            if not layer.built:
                layer.build((None, *p.input_shape))
        finally:
            random.setstate(state)
        return layer

    @property
    def keras_layer(self) -> keras.layers.Layer:
        """The wrapped Keras layer; its variables are this layer's variables."""
        return self._layer

    def FProp(self, theta: NestedMap, inputs: Any) -> Any:
        """The Keras layer on `inputs` (or on `inputs.<field>`), weights read from theta.

        A Keras mask travels beside its tensor in the entry `mask_key(field)`: the layer
        receives it as Keras would pass it, and its output mask (None removes it) replaces it.
        """
        field = self.params.field
        mask = None
        if isinstance(inputs, NestedMap):
            x = inputs.GetItem(field)
            mask = inputs.get(mask_key(field)) if "." not in field else None
        else:
            x = inputs
        ctx = fprop_context.current()
        trainable = [theta[k] for k in self._trainable_keys]
        non_trainable = [theta[k] for k in self._non_trainable_keys]
        kwargs = {"training": ctx.training} if getattr(
            self._layer, "_call_has_training_arg", True) else {}
        with Recording(Recorder(ctx)) as rec, refusing_raw_random(
                self._layer, check=ctx.training and self._check_random()):
            y, new_non_trainable, losses = stateless_call(
                self._layer, trainable, non_trainable, x, mask, kwargs)
        if losses:
            raise ValueError(added_loss_error(self._layer))
        for key, old, new in zip(self._non_trainable_keys, non_trainable, new_non_trainable):
            if new is not old and key not in self._handled:
                raise ValueError(state_error(self._layer, key))
        if not tf.is_tensor(y):
            raise ValueError(
                f"Keras layer '{self._layer.name}' at {self.path} returns "
                f"{type(y).__name__}; a pipelined Keras layer must return one tensor.")
        if ctx.training and ctx.updates is not None and (self._batch_norms or self._random):
            moments = NestedMap({f"bn_{j}": rec.moments[id(bn)]
                                 for j, (bn, _, _) in enumerate(self._batch_norms)
                                 if id(bn) in rec.moments})
            stats = NestedMap(moments=moments, draws=tf.constant(1.0))
            ctx.updates.add(self, stats)
        out_mask = get_keras_mask(y)
        if not isinstance(inputs, NestedMap):
            if out_mask is not None:
                raise ValueError(
                    f"Keras layer '{self._layer.name}' at {self.path} returns a masked tensor, "
                    "but its input is a bare tensor that cannot carry the mask: give the "
                    "layer a NestedMap input (the mask travels in its "
                    f"'{mask_key(field)}' entry).")
            return y
        out = inputs.copy()
        out.Set(field, y)
        if out_mask is not None or mask is not None:
            out.Set(mask_key(field), out_mask)
        return out

    def _check_random(self) -> bool:
        """True at this layer's first traced training call (its ops are read once)."""
        graph = tf.compat.v1.get_default_graph()
        if getattr(self, "_random_checked_in", None) is graph:
            return False
        object.__setattr__(self, "_random_checked_in", graph)
        return True

    @property
    def uses_batch_statistics(self) -> bool:
        """Whether the layer normalises with statistics of its batch (batch norm, nested too)."""
        return any(bn.trainable for bn, _, _ in self._batch_norms)

    def ApplyUpdates(self, stats_list: list[NestedMap]) -> tf.Operation:
        """Once per mini-batch: pooled batch-norm moments, one seed-generator step.

        Moving statistics follow Keras' formula `moving * momentum + pooled * (1 -
        momentum)` with the exact mean and population variance of the union of the
        micro-batches (`pool_moments`); each drawing random layer's seed state advances
        by [0, 1], as one Keras training step advances it.
        """
        ops = []
        for j, (bn, mean_key, variance_key) in enumerate(self._batch_norms):
            if f"bn_{j}" not in stats_list[0].moments:
                continue  # Not trained (trainable=False): Keras leaves its statistics too.
            mean, variance = pool_moments([s.moments[f"bn_{j}"] for s in stats_list])
            for key, value in ((mean_key, mean), (variance_key, variance)):
                var = self.vars[key]
                moving = tf.cast(var, value.dtype)
                new = moving * bn.momentum + value * (1.0 - bn.momentum)
                ops.append(var.assign(tf.cast(new, var.dtype)))
        for sub, key in self._random:
            if _draws(sub):
                var = self.vars[key]
                ops.append(var.assign(var + tf.constant([0, 1], var.dtype)))
        return tf.group(*ops)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        """Output shape by Keras shape inference, exact parameter counts, flops
        (`keras_flops.layer_flops`: hand formulas, else measured or estimated)."""
        shape = inputs.GetItem(p.field) if isinstance(inputs, NestedMap) else inputs
        shape = tf.TensorShape(base_layer.to_shape(shape))
        if not shape.is_fully_defined():
            raise ValueError(f"{cls.__name__}.FPropMeta needs a fully defined input shape, "
                             f"got {shape}.")
        # Built in a graph: shapes and counts without allocating the weights or starting
        # the TF runtime (inspect_model describes models far too large to allocate). A
        # live layer is already built: its shapes are computed symbolically.
        live = live_layer_of(p)
        with tf.Graph().as_default() if live is None else contextlib.nullcontext():
            layer = live if live is not None else deserialize(p.keras_layer)
            batch_shape = tuple(shape.as_list())
            if not layer.built:
                layer.build((None, *batch_shape[1:]))
            spec = layer.compute_output_spec(keras.KerasTensor(batch_shape))
            out_shape = tf.TensorShape(list(spec.shape))
            flops, _ = keras_flops.layer_flops(layer, [batch_shape], out_shape.as_list())
            num_params = sum(int(tf.TensorShape(v.shape).num_elements()) for v in layer.weights)
            non_trainable = sum(int(tf.TensorShape(v.shape).num_elements())
                                for v in layer.non_trainable_weights)
        if isinstance(inputs, NestedMap):
            out = inputs.copy()
            out.Set(p.field, out_shape)
        else:
            out = out_shape
        # Keras applies its own weights: their gradients are never deferred (weight_ops).
        return base_layer.fprop_meta(flops, out, num_params, p.fprop_dtype or p.dtype,
                                     non_trainable_params=non_trainable,
                                     memory=layer_memory.MemoryRecord(weight_op_bytes=0))


def iter_keras_layers(layers: Any) -> Iterator[keras.layers.Layer]:
    """The Keras layers of a `keras.Sequential` or a list of layers, inputs skipped.

    Example:
        >>> seq = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> [type(layer).__name__ for layer in iter_keras_layers(seq)]
        ['Dense']
    """
    if isinstance(layers, keras.Sequential):
        layers = layers.layers
    for layer in layers:
        if not isinstance(layer, keras.layers.InputLayer):
            yield layer
