"""Weight descriptions: how a variable is shaped and initialised.

Initialisation is deterministic: a variable's initial value depends only on its
`WeightInit`, its shape and a seed derived from the layer's `random_seed` and
the variable's path, so the same model built twice (or on another device
layout) starts from bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import tensorflow as tf

__all__ = ["derive_seed", "initial_value", "WeightInit", "WeightParams"]


@dataclasses.dataclass(frozen=True)
class WeightInit:
    """An initialisation method and its scale.

    Use the constructors: `WeightInit.Gaussian(scale)`, `Uniform(scale)`,
    `Xavier(scale)`, `HeNormal(scale)`, `Constant(value)`.
    """

    method: str
    scale: float

    @staticmethod
    def Gaussian(scale: float = 1.0) -> WeightInit:
        return WeightInit("gaussian", scale)

    @staticmethod
    def Uniform(scale: float = 1.0) -> WeightInit:
        return WeightInit("uniform", scale)

    @staticmethod
    def Xavier(scale: float = 1.0) -> WeightInit:
        """Glorot uniform: U(-a, a), a = scale * sqrt(6 / (fan_in + fan_out))."""
        return WeightInit("xavier", scale)

    @staticmethod
    def HeNormal(scale: float = 1.0) -> WeightInit:
        """Truncated-free He normal: N(0, scale * 2 / fan_in)."""
        return WeightInit("he_normal", scale)

    @staticmethod
    def Constant(value: float = 0.0) -> WeightInit:
        return WeightInit("constant", value)


@dataclasses.dataclass(frozen=True)
class WeightParams:
    """Shape, initialiser and dtype of one variable."""

    shape: tuple[int, ...]
    init: WeightInit | None = None
    dtype: tf.DType | None = None
    # For convolution kernels: how many leading dims form the receptive field.
    fan_in_axes: tuple[int, ...] | None = None
    fan_out_axes: tuple[int, ...] | None = None

    def num_elements(self) -> int:
        return math.prod(self.shape)


def _fans(wp: WeightParams) -> tuple[float, float]:
    shape = wp.shape
    if not shape:
        return 1.0, 1.0
    if wp.fan_in_axes is not None:
        fan_in = math.prod(shape[a] for a in wp.fan_in_axes)
        fan_out = math.prod(shape[a] for a in (wp.fan_out_axes or ()))
        return float(fan_in), float(max(fan_out, 1))
    if len(shape) == 1:
        return float(shape[0]), float(shape[0])
    receptive = math.prod(shape[:-2])
    return float(shape[-2] * receptive), float(shape[-1] * receptive)


def derive_seed(random_seed: int | None, path: str) -> tuple[int, int]:
    """A stateless-RNG seed pair from a user seed and a stable name."""
    base = 0 if random_seed is None else int(random_seed)
    return (base & 0x7FFFFFFF, zlib.crc32(path.encode("utf-8")) & 0x7FFFFFFF)


def initial_value(wp: WeightParams, seed: Sequence[int], dtype: tf.DType) -> tf.Tensor:
    """The deterministic initial value of a variable described by `wp`."""
    init = wp.init or WeightInit.Xavier()
    shape = list(wp.shape)
    fan_in, fan_out = _fans(wp)
    if init.method == "constant":
        return tf.fill(shape, tf.cast(init.scale, dtype))
    if init.method == "gaussian":
        value = init.scale * tf.random.stateless_normal(shape, seed=seed)
    elif init.method == "uniform":
        value = tf.random.stateless_uniform(shape, seed=seed, minval=-init.scale, maxval=init.scale)
    elif init.method == "xavier":
        limit = init.scale * math.sqrt(6.0 / (fan_in + fan_out))
        value = tf.random.stateless_uniform(shape, seed=seed, minval=-limit, maxval=limit)
    elif init.method == "he_normal":
        value = math.sqrt(init.scale * 2.0 / fan_in) * tf.random.stateless_normal(shape, seed=seed)
    else:
        raise ValueError(
            f"Unknown WeightInit method {init.method!r}; use WeightInit.Gaussian, Uniform, "
            "Xavier, HeNormal or Constant."
        )
    return tf.cast(value, dtype)
