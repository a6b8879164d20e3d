"""Forward flops of Keras layers from shapes alone (a multiply-add counts 2).

Hand formulas cover the common layers: Dense, EinsumDense, Conv1D/2D/3D (and their
transposes), DepthwiseConv1D/2D, SeparableConv1D/2D, MultiHeadAttention, Embedding,
the normalisations, pooling, activations, dropout and reshaping layers. A nested
`Sequential` or functional model is the sum of its layers. Any other layer falls back
to a measurement: its `call` is traced on the input shape and TensorFlow's graph
profiler counts the flops of the traced ops; if that finds none, the estimate is one
flop per output element. The fallback is never silently zero: `layer_flops` says
which method gave the number.

Per-element costs (documented constants, shared with lingvo-lite's own layers where
they exist): normalisations 8, softmax 5, other activations 1 (relu, linear) or 4
(transcendental: sigmoid, tanh, gelu, swish, elu, ...), dropout 3 in training.

Example:
    >>> import keras
    >>> layer_flops(keras.layers.Dense(10), [(4, 3)])
    (280.0, 'formula')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__: list[str] = []

NORM_FLOPS_PER_ELEMENT = 8
SOFTMAX_FLOPS_PER_ELEMENT = 5
DROPOUT_FLOPS_PER_ELEMENT = 3
CHEAP_ACTIVATIONS = ("linear", "relu", "relu6", "leaky_relu", "hard_sigmoid", "hard_silu",
                     "hard_swish", "hard_tanh")

_NORMALIZATIONS = ("BatchNormalization", "LayerNormalization", "GroupNormalization",
                   "UnitNormalization", "RMSNormalization", "SpectralNormalization")
_RESHAPING = ("Flatten", "Reshape", "Permute", "InputLayer", "Identity", "RepeatVector",
              "Cropping1D", "Cropping2D", "Cropping3D", "ZeroPadding1D", "ZeroPadding2D",
              "ZeroPadding3D", "UpSampling1D", "UpSampling2D", "UpSampling3D",
              "ActivityRegularization")
_DROPOUTS = ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
             "GaussianDropout", "GaussianNoise", "AlphaDropout")


def _prod(values: Sequence[Any]) -> int:
    return int(np.prod([int(v) for v in values], dtype=np.int64)) if len(values) else 1


def activation_flops_per_element(activation: Any) -> int:
    """Cost of one element of a Keras activation (name or function).

    Example:
        >>> activation_flops_per_element('relu'), activation_flops_per_element('tanh')
        (1, 4)
    """
    name = activation if isinstance(activation, str) else getattr(activation, "__name__", "")
    name = (name or "linear").lower()
    if name == "linear":
        return 0
    if name in CHEAP_ACTIVATIONS:
        return 1
    if name in ("softmax", "log_softmax"):
        return SOFTMAX_FLOPS_PER_ELEMENT
    return 4


def _activation(layer: Any, out_shape: Sequence[int]) -> int:
    return activation_flops_per_element(getattr(layer, "activation", None)) * _prod(out_shape)


def _channels_first(layer: Any) -> bool:
    return getattr(layer, "data_format", "channels_last") == "channels_first"


def _spatial(shape: Sequence[int], layer: Any) -> list[int]:
    return list(shape[2:]) if _channels_first(layer) else list(shape[1:-1])


def _channels(shape: Sequence[int], layer: Any) -> int:
    return int(shape[1] if _channels_first(layer) else shape[-1])


def _conv(layer: Any, x: Sequence[int], y: Sequence[int]) -> float:
    name = keras_class_name(layer)
    batch = int(x[0])
    c_in = _channels(x, layer)
    c_out = _channels(y, layer)
    kernel = _prod(layer.kernel_size)
    bias = _prod(y) if getattr(layer, "use_bias", False) else 0
    if name.startswith("Depthwise"):
        macs = batch * _prod(_spatial(y, layer)) * c_out * kernel  # c_out = c_in * multiplier
    elif name.startswith("Separable"):
        mid = c_in * layer.depth_multiplier
        out_spatial = _prod(_spatial(y, layer))
        macs = batch * out_spatial * (mid * kernel + mid * c_out)
    elif name.endswith("Transpose"):
        macs = batch * _prod(_spatial(x, layer)) * c_in * kernel * c_out
    else:
        groups = getattr(layer, "groups", 1)
        macs = batch * _prod(_spatial(y, layer)) * c_out * kernel * c_in // groups
    return 2.0 * macs + bias + _activation(layer, y)


def _einsum_dense(layer: Any, x: Sequence[int], y: Sequence[int]) -> float:
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    sizes: dict[str, int] = {}
    for letters, shape in ((inputs, x), (output, y), (kernel, layer.kernel.shape)):
        for letter, size in zip(letters, shape):
            sizes[letter] = int(size)
    macs = _prod(list(sizes.values()))
    bias = _prod(y) if layer.bias is not None else 0
    return 2.0 * macs + bias + _activation(layer, y)


def _attention(layer: Any, shapes: Sequence[Sequence[int]]) -> float:
    query = shapes[0]
    value = shapes[1] if len(shapes) > 1 else query
    key = shapes[2] if len(shapes) > 2 else value
    batch, tq, tv = int(query[0]), _prod(query[1:-1]), _prod(value[1:-1])
    heads, dk, dv = layer.num_heads, layer.key_dim, layer.value_dim or layer.key_dim
    out_shape = layer._output_shape
    if out_shape is None:
        out_dim = int(query[-1])
    else:
        out_dim = _prod(out_shape if isinstance(out_shape, (tuple, list)) else [out_shape])
    macs = batch * (tq * query[-1] * heads * dk + tv * key[-1] * heads * dk
                    + tv * value[-1] * heads * dv + heads * tq * tv * (dk + dv)
                    + tq * heads * dv * out_dim)
    bias = 0
    if layer.use_bias:
        bias = batch * (tq * heads * dk + tv * heads * (dk + dv) + tq * out_dim)
    return 2.0 * macs + bias + SOFTMAX_FLOPS_PER_ELEMENT * batch * heads * tq * tv


def _pool(layer: Any, x: Sequence[int], y: Sequence[int]) -> float:
    if keras_class_name(layer).startswith("Global"):
        return float(_prod(x))
    return float(_prod(y) * _prod(layer.pool_size))


def keras_class_name(layer: Any) -> str:
    """The name of the Keras layer class `layer` is (or subclasses): formulas are chosen by
    what a layer computes, so a keras-hub block named 'FusedMBConvBlock' (a Layer) is not
    taken for a convolution, while a ReversibleEmbedding is an Embedding.

    Example:
        >>> class MyConvBlock(keras.layers.Layer):
        ...     pass
        >>> keras_class_name(MyConvBlock()), keras_class_name(keras.layers.Conv2D(2, 3))
        ('Layer', 'Conv2D')
    """
    for cls in type(layer).__mro__:
        if cls.__module__.startswith("keras.src.layers."):
            return cls.__name__
    return type(layer).__name__


def formula_flops(layer: Any, in_shapes: Sequence[Sequence[int]],
                  out_shape: Sequence[int]) -> float | None:
    """Hand-formula flops of `layer` (inputs `in_shapes`, output `out_shape`), else None.

    Example:
        >>> formula_flops(keras.layers.Conv1D(4, 3), [(1, 5, 2)], (1, 3, 4))
        156.0
    """
    name = keras_class_name(layer)
    x = [int(d) for d in in_shapes[0]]
    y = [int(d) for d in out_shape]
    if name == "Dense":
        bias = _prod(y) if layer.use_bias else 0
        return 2.0 * _prod(x) * layer.units + bias + _activation(layer, y)
    if name == "EinsumDense":
        return _einsum_dense(layer, x, y)
    if "Conv" in name and hasattr(layer, "kernel_size"):
        return _conv(layer, x, y)
    if name == "MultiHeadAttention":
        return _attention(layer, [[int(d) for d in s] for s in in_shapes])
    if name == "Embedding":
        return float(_prod(y))  # One copy per output element: a gather, no arithmetic.
    if name in _NORMALIZATIONS:
        return float(NORM_FLOPS_PER_ELEMENT * _prod(x))
    if "Pooling" in name:
        return _pool(layer, x, y)
    if name == "Activation":
        return float(activation_flops_per_element(layer.activation) * _prod(y))
    if name == "Softmax":
        return float(SOFTMAX_FLOPS_PER_ELEMENT * _prod(y))
    if name in ("ReLU", "LeakyReLU", "PReLU"):
        return float(_prod(y))
    if name == "ELU":
        return float(4 * _prod(y))
    if name in _DROPOUTS:
        return float(DROPOUT_FLOPS_PER_ELEMENT * _prod(x))
    if name in _RESHAPING:
        return 0.0  # Data movement only: genuinely no arithmetic.
    if name in ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"):
        return float((len(in_shapes) - 1) * _prod(y))
    if name == "Concatenate":
        return 0.0
    return None


def _submodel_flops(model: keras.Model, batch: int) -> float | None:
    """Sum over a built nested model's layers, from each layer's recorded input shapes."""
    total = 0.0
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            inputs = tf.nest.flatten(layer.input)
            outputs = tf.nest.flatten(layer.output)
        except (AttributeError, ValueError):
            return None
        shapes = [[batch if d is None else d for d in t.shape] for t in inputs]
        out = [batch if d is None else d for d in outputs[0].shape]
        flops, _ = layer_flops(layer, shapes, out)
        total += flops
    return total


def measured_flops(layer: Any, in_shapes: Sequence[Sequence[int]]) -> float:
    """Flops TensorFlow's profiler counts in `layer.call` traced on `in_shapes` (training).

    Example:
        >>> measured_flops(keras.layers.Dense(2, use_bias=False), [(1, 3)])
        12.0
    """
    specs = [tf.TensorSpec(s, tf.float32) for s in in_shapes]

    def call(*xs: tf.Tensor) -> Any:
        return layer(*xs, training=True)

    graph = tf.function(call, autograph=False).get_concrete_function(*specs).graph
    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    stats = tf.compat.v1.profiler.profile(graph, options=options)
    return float(stats.total_float_ops)


def layer_flops(layer: Any, in_shapes: Sequence[Sequence[int]],
                out_shape: Sequence[int] | None = None) -> tuple[float, str]:
    """(flops, method) of one built Keras layer; method is 'formula', 'sum of layers',
    'measured' (TF profiler on the traced call) or 'estimated' (1 flop per output element).
    """
    in_shapes = [list(s) for s in in_shapes]
    if out_shape is None:
        spec = layer.compute_output_spec(*[keras.KerasTensor(s) for s in in_shapes])
        out_shape = list(tf.nest.flatten(spec)[0].shape)
    flops = formula_flops(layer, in_shapes, out_shape)
    if flops is not None:
        return flops, "formula"
    if isinstance(layer, keras.Model):
        flops = _submodel_flops(layer, int(in_shapes[0][0]))
        if flops is not None:
            return flops, "sum of layers"
    try:
        flops = measured_flops(layer, in_shapes)
    except (ValueError, TypeError, NotImplementedError):
        flops = 0.0
    if flops > 0:
        return flops, "measured"
    return float(math.prod(int(d) for d in out_shape)), "estimated"
