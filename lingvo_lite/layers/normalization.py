"""Normalisation layers: batch norm (with micro-batch statistics pooling) and layer norm.

Batch norm under GPipe: every micro-batch is normalised with its own statistics
(as in the paper), but the moving averages used at evaluation are updated once
per mini-batch with the *exact* statistics of the whole mini-batch, pooled from
the per-micro-batch moments each FProp reports to the `UpdateCollector` of the
current `fprop_context`. So the eval-time model does not depend on how the
batch was split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap

__all__ = ["BatchNormLayer", "check_input_shape", "LayerNorm", "pool_moments"]

# Rough elementwise cost per input element (subtract, square, reduce, scale, shift).
_BN_FLOPS_PER_ELEMENT = 8
_LN_FLOPS_PER_ELEMENT = 8


def check_input_shape(layer_name: str, shape: tf.TensorShape, min_rank: int, dim: int,
                      dim_param: str) -> tf.TensorShape:
    """Checks rank >= `min_rank` and a last dimension equal to `dim` (when known)."""
    shape = tf.TensorShape(shape)
    if shape.rank is not None and shape.rank < min_rank:
        raise ValueError(
            f"{layer_name}: input must have rank >= {min_rank} (batch first, channels last), "
            f"got shape {shape}."
        )
    if shape.rank is not None and shape[-1] is not None and shape[-1] != dim:
        raise ValueError(
            f"{layer_name}: input's last dimension is {shape[-1]} but p.{dim_param} is {dim}; "
            f"set p.{dim_param}={shape[-1]} or feed inputs of depth {dim}."
        )
    return shape


def _num_elements(layer_name: str, shape: tf.TensorShape) -> int:
    if not shape.is_fully_defined():
        raise ValueError(
            f"{layer_name}.FPropMeta needs fully defined input shapes, got {shape}."
        )
    return int(shape.num_elements())


def pool_moments(stats_list: Sequence[NestedMap]) -> tuple[tf.Tensor, tf.Tensor]:
    """Exact mean and population variance of the union of several batches.

    Each entry is `NestedMap(count, mean, variance)` for one batch (count = number
    of elements per channel, variance = population variance). The pooled mean is
    the count-weighted mean; the pooled variance adds to each batch's variance the
    squared offset of its mean from the pooled mean (law of total variance), so it
    equals the variance computed over all elements at once - not a mean of variances.

    Returns:
      (mean, variance), each shaped like the entries' `mean`, float32.
    """
    if not stats_list:
        raise ValueError("pool_moments: stats_list is empty; report at least one batch.")
    counts = tf.stack([tf.cast(s.count, tf.float32) for s in stats_list])  # [T]
    means = tf.stack([tf.cast(s.mean, tf.float32) for s in stats_list])  # [T, dim]
    variances = tf.stack([tf.cast(s.variance, tf.float32) for s in stats_list])  # [T, dim]
    total = tf.reduce_sum(counts)
    weights = tf.reshape(counts / total, [-1] + [1] * (means.shape.rank - 1))
    mean = tf.reduce_sum(weights * means, axis=0)
    variance = tf.reduce_sum(weights * (variances + tf.square(means - mean)), axis=0)
    return mean, variance


class BatchNormLayer(base_layer.BaseLayer):
    """Batch normalisation over every axis but the last (channels-last).

    Training uses the statistics of the batch it is given (in the pipeline a
    micro-batch) and reports them to `fprop_context.current().updates`;
    evaluation uses the moving averages. Statistics and normalisation are
    computed in float32; the output is cast to the fprop dtype.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("dim", 0, "Number of channels (the input's last dimension).")
        p.Define("decay", 0.999, "Moving-average momentum: moving = decay * moving + "
                 "(1 - decay) * batch statistic.")
        p.Define("epsilon", 1e-3, "Added to the variance before the square root.")
        p.Define("use_moving_avg_in_training", False,
                 "Normalise with the moving averages in training too (they are still updated).")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if p.dim <= 0:
            raise ValueError(f"{self.path}: p.dim must be the number of channels (> 0), "
                             f"got {p.dim}.")
        if not 0.0 <= p.decay < 1.0:
            raise ValueError(f"{self.path}: p.decay must be in [0, 1), got {p.decay}.")

        def _const(value: float) -> weight_params.WeightParams:
            return weight_params.WeightParams(
                shape=(p.dim,), init=weight_params.WeightInit.Constant(value))

        self.CreateVariable("beta", _const(0.0))
        self.CreateVariable("gamma", _const(1.0))
        self.CreateVariable("moving_mean", _const(0.0), trainable=False)
        self.CreateVariable("moving_variance", _const(1.0), trainable=False)

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        """Normalises `inputs` [B, ..., dim]; returns the same shape in the fprop dtype."""
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        check_input_shape(f"{type(self).__name__} '{self.path}'", inputs.shape, 2, p.dim, "dim")
        ctx = fprop_context.current()
        x = tf.cast(inputs, tf.float32)
        moving_mean = tf.cast(theta.moving_mean, tf.float32)
        moving_variance = tf.cast(theta.moving_variance, tf.float32)
        if ctx.training:
            axes = list(range(x.shape.rank - 1))
            mean, variance = tf.nn.moments(x, axes=axes)
            if ctx.updates is not None:
                count = tf.cast(tf.reduce_prod(tf.shape(x)[:-1]), tf.float32)
                ctx.updates.add(self, NestedMap(
                    count=count,
                    mean=tf.stop_gradient(mean),
                    variance=tf.stop_gradient(variance),
                ))
            if p.use_moving_avg_in_training:
                mean, variance = moving_mean, moving_variance
        else:
            mean, variance = moving_mean, moving_variance
        out = tf.nn.batch_normalization(
            x, mean, variance,
            offset=tf.cast(theta.beta, tf.float32),
            scale=tf.cast(theta.gamma, tf.float32),
            variance_epsilon=p.epsilon,
        )
        return tf.cast(out, self.fprop_dtype)

    def ApplyUpdates(self, stats_list: list[NestedMap]) -> tf.Operation | None:
        """Updates the moving averages once with the statistics of the whole mini-batch.

        `stats_list` holds what each FProp of this layer reported during one
        training step (one entry per micro-batch). They are pooled exactly with
        `pool_moments` into the mean and population variance of the union of the
        micro-batches, then `moving = decay * moving + (1 - decay) * pooled` for
        the mean and the variance. Called once per step by `UpdateCollector.apply`.

        Returns:
          The grouped assign op (graph mode); None when executing eagerly, where
          the assignments have already happened.
        """
        mean, variance = pool_moments(stats_list)
        decay = self.params.decay
        updates = []
        for var, value in ((self.vars.moving_mean, mean), (self.vars.moving_variance, variance)):
            new_value = decay * var + (1.0 - decay) * tf.cast(value, var.dtype)
            updates.append(var.assign(new_value))
        return tf.group(*updates)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs_shape: Any) -> NestedMap:
        shape = check_input_shape(cls.__name__, base_layer.to_shape(inputs_shape), 2, p.dim, "dim")
        n = _num_elements(cls.__name__, shape)
        return base_layer.fprop_meta(flops=_BN_FLOPS_PER_ELEMENT * n, out_shapes=shape,
                                     num_params=4 * p.dim, dtype=p.fprop_dtype or p.dtype,
                                     non_trainable_params=2 * p.dim,
                                     memory=layer_memory.MemoryRecord(weight_op_bytes=0))


class LayerNorm(base_layer.BaseLayer):
    """Layer normalisation over the last axis, with a learned scale and bias.

    Mean and variance are computed in float32 (also in bfloat16 mode) and the
    result is cast to the fprop dtype.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Depth of the input (its last dimension).")
        p.Define("epsilon", 1e-6, "Added to the variance before the square root.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if p.input_dim <= 0:
            raise ValueError(f"{self.path}: p.input_dim must be > 0, got {p.input_dim}.")
        self.CreateVariable("scale", weight_params.WeightParams(
            shape=(p.input_dim,), init=weight_params.WeightInit.Constant(1.0)))
        self.CreateVariable("bias", weight_params.WeightParams(
            shape=(p.input_dim,), init=weight_params.WeightInit.Constant(0.0)))

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        """Normalises each position of `inputs` [..., input_dim] over its last axis."""
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        check_input_shape(f"{type(self).__name__} '{self.path}'", inputs.shape, 1,
                          p.input_dim, "input_dim")
        x = tf.cast(inputs, tf.float32)
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        # One centred copy serves the variance and the normalisation, so the traced gradient
        # reads one tensor, as FPropMeta counts it (written twice, TensorFlow's graph
        # optimiser merged the two at run time; the measured peaks did not move).
        centered = x - mean
        variance = tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True)
        normed = centered * tf.math.rsqrt(variance + p.epsilon)
        out = normed * tf.cast(theta.scale, tf.float32) + tf.cast(theta.bias, tf.float32)
        return tf.cast(out, self.fprop_dtype)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs_shape: Any) -> NestedMap:
        shape = check_input_shape(cls.__name__, base_layer.to_shape(inputs_shape), 1,
                                  p.input_dim, "input_dim")
        n = _num_elements(cls.__name__, shape)
        return base_layer.fprop_meta(flops=_LN_FLOPS_PER_ELEMENT * n, out_shapes=shape,
                                     num_params=2 * p.input_dim, dtype=p.fprop_dtype or p.dtype,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=((2 * n + n // p.input_dim)
                                                                 * tf.float32.size),
                                         weight_op_bytes=0,
                                                                      saved_covers_input=True))
