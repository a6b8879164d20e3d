"""Activation functions by name, and their rough cost for `FPropMeta`.

Layers take an `activation` param (a string) so that configurations stay plain
text; this module maps the name to the TF function and to an approximate flop
count per element, used by the partitioner's cost model.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["activation_flops_per_element", "get_activation", "VALID_ACTIVATIONS"]


def _identity(x: tf.Tensor) -> tf.Tensor:
    return x


def _gelu(x: tf.Tensor) -> tf.Tensor:
    # Exact (erf-based) GELU, as in BERT/T5; tf.nn.gelu's default.
    return tf.nn.gelu(x, approximate=False)


_ACTIVATIONS: dict[str, Callable[[tf.Tensor], tf.Tensor]] = {
    "NONE": _identity,
    "RELU": tf.nn.relu,
    "RELU6": tf.nn.relu6,
    "GELU": _gelu,
    "SWISH": tf.nn.silu,
    "SIGMOID": tf.nn.sigmoid,
    "TANH": tf.nn.tanh,
}

# Rough elementwise cost: a compare/add/mul is 1, an exp/erf/tanh about 3.
_FLOPS_PER_ELEMENT: dict[str, int] = {
    "NONE": 0,
    "RELU": 1,
    "RELU6": 2,
    "GELU": 8,
    "SWISH": 5,
    "SIGMOID": 4,
    "TANH": 4,
}

VALID_ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATIONS)


def _check(name: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"Unknown activation {name!r}; set `activation` to one of {list(VALID_ACTIVATIONS)}."
        )
    return name


def get_activation(name: str) -> Callable[[tf.Tensor], tf.Tensor]:
    """The activation function called `name` (e.g. 'RELU'); ValueError if unknown."""
    return _ACTIVATIONS[_check(name)]


def activation_flops_per_element(name: str) -> int:
    """Approximate forward flops per element of activation `name` (0 for 'NONE')."""
    return _FLOPS_PER_ELEMENT[_check(name)]
