"""layer_config.rebuildable_config: a layer whose get_config() returns entries its
constructor refuses is rebuilt without them only if they were derived from the others."""

from __future__ import annotations

import keras
import pytest

from lingvo_lite.keras import keras_layer
from lingvo_lite.keras.layer_config import rebuildable_config


@keras.saving.register_keras_serializable(package="layer_config_test")
class _Derived(keras.layers.Layer):
    """get_config() adds `double`, computed from `units` (as keras-hub's ViT patching layer
    adds num_patches); the constructor does not take it."""

    def __init__(self, units: int, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def get_config(self):
        return {**super().get_config(), "units": self.units, "double": 2 * self.units}


@keras.saving.register_keras_serializable(package="layer_config_test")
class _Stateful(_Derived):
    """`double` is state the constructor cannot restore (it was changed after construction)."""


@keras.saving.register_keras_serializable(package="layer_config_test")
class _Broken(keras.layers.Layer):
    def get_config(self):
        return {**super().get_config(), "size": self.size}  # Never set.


def test_derived_entries_are_dropped_and_the_rebuild_checked():
    config = rebuildable_config(_Derived(3, name="d"))
    assert "double" not in config["config"] and config["config"]["units"] == 3
    assert keras_layer.deserialize(keras_layer.serialize(_Derived(5))).units == 5


def test_entries_that_are_not_derived_are_refused_in_one_line():
    layer = _Stateful(3, name="s")
    layer.get_config = lambda: {**_Derived.get_config(layer), "double": 7}
    with pytest.raises(ValueError) as raised:
        rebuildable_config(layer)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("PipelinedModel: Keras layer 's' (_Stateful) cannot be rebuilt "
                              "from its get_config(): "), message
    assert "double" in message


def test_get_config_errors_are_refused_in_one_line():
    with pytest.raises(ValueError) as raised:
        rebuildable_config(_Broken(name="b"))
    assert str(raised.value) == (
        "PipelinedModel: Keras layer 'b' (_Broken) cannot be serialized: get_config() raised "
        "'_Broken' object has no attribute 'size'; pipeline a layer whose get_config() works.")
