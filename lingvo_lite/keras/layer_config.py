"""A Keras layer's config that rebuilds it, checked once, or a one-line refusal.

The pipeline rebuilds every Keras layer from its serialized config on its cell's device.
Some layers' `get_config()` returns values their constructor does not take (keras-hub
0.32's `ViTPatchingAndEmbedding` returns the derived `num_patches` and `num_positions`):
Keras itself cannot rebuild them. `rebuildable_config` then drops the entries the
constructor refuses and keeps the result only if the rebuilt layer's own config equals the
original (so the dropped values were derived from the others); otherwise, or when the
config cannot be rebuilt at all, it raises a one-line ValueError naming the layer.

Example:
    >>> import keras
    >>> rebuildable_config(keras.layers.Dense(3))['config']['units']
    3
"""

from __future__ import annotations

import copy
import inspect

import keras

__all__ = ["rebuildable_config"]

# Keyword arguments every Keras layer's constructor takes (keras.layers.Layer.__init__).
_LAYER_KWARGS = {"activity_regularizer", "trainable", "dtype", "autocast", "name",
                 "input_dim", "input_shape", "batch_input_shape", "batch_size", "weights",
                 "input_dtype", "sparse", "ragged", "batch_shape"}


def _rebuild(config: dict) -> keras.layers.Layer:
    return keras.saving.deserialize_keras_object(copy.deepcopy(config))


def _accepted(cls: type) -> set[str] | None:
    """The constructor's named keyword arguments (None if it takes any, without passing
    them on to keras.layers.Layer)."""
    names = set()
    for klass in cls.__mro__:
        if klass is keras.layers.Layer or "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return names
    return names | _LAYER_KWARGS


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    unrecognized = next((line for line in lines if "nrecognized keyword" in line), None)
    return unrecognized or (lines[-1] if lines else type(error).__name__)


def rebuildable_config(layer: keras.layers.Layer) -> dict:
    """`keras.saving.serialize_keras_object(layer)`, pruned of entries its constructor
    refuses when they are derived from the others; see the module doc."""
    where = f"PipelinedModel: Keras layer '{layer.name}' ({type(layer).__name__})"
    try:
        config = keras.saving.serialize_keras_object(layer)
    except Exception as e:  # Any get_config() error: one line, not Keras' traceback.
        raise ValueError(f"{where} cannot be serialized: get_config() raised {_first_line(e)}; "
                         "pipeline a layer whose get_config() works.") from None
    if not isinstance(layer, keras.layers.Layer) or isinstance(layer, keras.Model):
        return config
    try:
        _rebuild(config)
        return config
    except (TypeError, ValueError) as e:
        error = _first_line(e)
    accepted = _accepted(type(layer))
    inner = config.get("config", {})
    extra = sorted(set(inner) - accepted) if accepted is not None else []
    if extra:
        pruned = dict(config, config={k: v for k, v in inner.items() if k not in extra})
        try:
            again = keras.saving.serialize_keras_object(_rebuild(pruned))
            if again.get("config") == inner:
                return pruned
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{where} cannot be rebuilt from its get_config(): {error}; make "
                     "get_config() return the constructor's arguments.")
