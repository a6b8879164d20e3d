"""Keras' random draws, cut to one micro-batch: the rows the whole mini-batch would get.

Keras 3 (TensorFlow backend) draws a layer's noise with one stateless op per call,
`tf.random.stateless_uniform(noise_shape, seed)` (Dropout) or `stateless_normal`
(GaussianNoise, GaussianDropout), with `seed` the layer's seed-generator state. A
pipeline that calls the layer on micro-batch t (examples [o, o + m) of the
mini-batch) must not draw a fresh [m, ...] tensor from that seed: it must get rows
[o, o + m) of the [N, ...] tensor the unsplit model draws. Those ops are Philox
streams: element e of the flattened tensor comes from counter block e // 4, lane
e % 4 (4 values per block, for the uniform and the Box-Muller normal alike), so the
slice is produced by advancing the 128-bit counter by (o * per_example) // 4 blocks
and dropping the first (o * per_example) % 4 values. Bit for bit what Keras draws for
the whole batch (tests/unit/keras/keras_layer_test.py checks it against Keras' own ops).

Compiled with XLA, the same ops draw other values (XLA's generator, same counter
layout), so a plain model compiled with XLA draws XLA's values: with `xla=True` the
slice is drawn by an XLA-compiled function, also when the pipeline calls the layer
from an uncompiled forward. XLA's normal distribution pairs element i with element
i + N/2 of the whole N-element draw (Box-Muller over the two halves), so a
micro-batch's rows cannot be drawn alone: normal draws have no XLA form here.

Example:
    >>> import numpy as np
    >>> state = tf.constant([7, 0], tf.int64)
    >>> full = tf.random.stateless_uniform([6, 5], seed=keras_seed(state))
    >>> rows = stream_slice('uniform', [2, 5], state, example_offset=3)
    >>> bool(np.array_equal(rows, full[3:5]))
    True
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from tensorflow.python.ops import gen_stateless_random_ops_v2

__all__: list[str] = []

# tf.random.Algorithm.AUTO_SELECT: what Keras' calls use (Philox on CPU and GPU).
_AUTO_SELECT = 3


def keras_seed(state: Any) -> tf.Tensor:
    """The int32 seed pair Keras' TensorFlow backend derives from a seed-generator state."""
    state = tf.convert_to_tensor(state)
    if state.dtype == tf.int32:
        return state
    return tf.cast(tf.math.floormod(state, tf.int32.max - 1), tf.int32)


def _shifted_key_counter(seed: tf.Tensor, start: Any) -> tuple[tf.Tensor, tf.Tensor]:
    key, counter = gen_stateless_random_ops_v2.stateless_random_get_key_counter(seed)
    blocks = tf.cast(start // 4, tf.uint64)
    low = counter[0] + blocks
    high = counter[1] + tf.cast(low < counter[0], tf.uint64)  # Carry into the high word.
    return key, tf.stack([low, high])


def stream_slice(kind: str, noise_shape: Any, state: Any, example_offset: Any,
                 dtype: tf.DType = tf.float32, shared: bool = False,
                 xla: bool = False) -> tf.Tensor:
    """Rows [example_offset, example_offset + noise_shape[0]) of Keras' full-batch draw.

    Args:
      kind: 'uniform' (values in [0, 1)) or 'normal' (standard normal).
      noise_shape: the micro-batch's noise shape; its first entry is the number of
        examples, or 1 when every example shares the noise (`shared`).
      state: the layer's seed-generator state (int64 [2]) at the start of the step.
      example_offset: index of the micro-batch's first example in the mini-batch.
      dtype: float dtype of the values.
      shared: every example shares one draw (a noise shape of 1 along the batch):
        then the offset is ignored.
      xla: draw XLA's values (what the op gives compiled with XLA); 'uniform' only.

    Returns:
      A tensor of `noise_shape`, equal to the corresponding slice of what
      `tf.random.stateless_<kind>(full_shape, keras_seed(state))` returns.
    """
    if xla:
        if kind != "uniform":
            raise ValueError(f"stream_slice: no XLA form of a '{kind}' draw's slice.")
        return _xla_uniform_slice(tf.convert_to_tensor(noise_shape), state, example_offset,
                                  dtype, shared)
    return _stream_slice(kind, noise_shape, state, example_offset, dtype, shared)


def _stream_slice(kind: str, noise_shape: Any, state: Any, example_offset: Any,
                  dtype: tf.DType, shared: bool) -> tf.Tensor:
    shape = tf.cast(tf.convert_to_tensor(noise_shape), tf.int64)
    if shared:
        start = tf.constant(0, tf.int64)
    else:
        start = tf.cast(example_offset, tf.int64) * tf.reduce_prod(shape[1:])
    key, counter = _shifted_key_counter(keras_seed(state), start)
    lead = start % 4
    count = tf.reshape(tf.reduce_prod(shape) + lead, [1])
    op = {"uniform": gen_stateless_random_ops_v2.stateless_random_uniform_v2,
          "normal": gen_stateless_random_ops_v2.stateless_random_normal_v2}[kind]
    values = op(shape=count, key=key, counter=counter, dtype=dtype, alg=_AUTO_SELECT)
    return tf.reshape(values[lead:], shape)


@tf.function(jit_compile=True, autograph=False)
def _xla_uniform_slice(noise_shape: tf.Tensor, state: Any, example_offset: Any,
                       dtype: tf.DType, shared: bool) -> tf.Tensor:
    return _stream_slice("uniform", noise_shape, state, example_offset, dtype, shared)


def dropout(x: tf.Tensor, rate: float, noise_shape: Any, state: Any,
            example_offset: Any, shared: bool = False, xla: bool = False) -> tf.Tensor:
    """`keras.random.dropout(x, rate, noise_shape, seed)` as rows of the full batch's.

    `shared`: the noise shape is 1 along the batch (one mask for every example).
    `xla`: the mask a model compiled with XLA draws.
    """
    x = tf.convert_to_tensor(x)
    if rate >= 1.0:
        return tf.zeros_like(x)
    if rate <= 0.0:
        return x
    # The same ops, in the same order, as tf.nn.experimental.stateless_dropout.
    noise = stream_slice("uniform", noise_shape, state, example_offset, x.dtype, shared, xla)
    noise = noise * (tf.constant(1.0, x.dtype) - tf.constant(0.0, x.dtype)) + tf.constant(
        0.0, x.dtype)
    scaled = x * tf.convert_to_tensor(1 / (1 - rate), dtype=x.dtype)
    return tf.where(noise >= tf.cast(rate, x.dtype), scaled, tf.zeros([], x.dtype))


def normal(shape: Any, mean: float, stddev: float, state: Any, example_offset: Any,
           dtype: tf.DType) -> tf.Tensor:
    """`keras.random.normal(shape, mean, stddev, seed=state)` as rows of the full batch's."""
    values = stream_slice("normal", shape, state, example_offset, dtype)
    return values * tf.cast(stddev, dtype) + tf.cast(mean, dtype)
