"""Softmax cross-entropy: the final projection to class logits and the (smoothed) loss."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import weight_ops
from lingvo_lite.layers.normalization import check_input_shape

__all__ = ["SoftmaxCrossEntropyLayer", "xent_with_label_smoothing"]

# Rough per-logit cost of log-softmax (max, subtract, exp, sum, log) and of the smoothed xent.
_SOFTMAX_FLOPS_PER_LOGIT = 5
_XENT_FLOPS_PER_LOGIT = 3


def xent_with_label_smoothing(logits: tf.Tensor, labels: tf.Tensor,
                              label_smoothing: float = 0.0) -> tf.Tensor:
    """Per-example cross-entropy against label-smoothed targets, in float32.

    The target distribution is `(1 - ls) * onehot(label) + ls / num_classes`
    (Szegedy et al. 2016, as in Lingvo), and the loss is
    `-sum_c target_c * log softmax(logits)_c`. TensorFlow's fused kernel computes the loss and
    its gradient `softmax(logits) - targets` together; the backward keeps that one
    [..., num_classes] tensor, where a log-softmax and a product would keep two (the
    log-probabilities and the targets).

    >>> logits = tf.constant([[2.0, 0.0, 0.0]])
    >>> round(float(xent_with_label_smoothing(logits, tf.constant([0]), 0.3)[0]), 4)
    0.6395

    Args:
      logits: [..., num_classes].
      labels: integer class ids in [0, num_classes), shaped like `logits` without its last
        axis.
      label_smoothing: ls in [0, 1).

    Returns:
      [...] float32 cross-entropies.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}.")
    logits = tf.cast(logits, tf.float32)
    num_classes = logits.shape[-1]
    if num_classes is None:
        num_classes = tf.shape(logits)[-1]
    flat_labels = tf.reshape(tf.cast(labels, tf.int32), [-1])

    @tf.custom_gradient
    def fused_xent(flat_logits: tf.Tensor) -> tf.Tensor:
        if label_smoothing == 0.0:
            loss, backprop = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(
                features=flat_logits, labels=flat_labels)
        else:
            uniform = label_smoothing / tf.cast(num_classes, tf.float32)
            targets = tf.one_hot(flat_labels, num_classes, dtype=tf.float32,
                                 on_value=1.0 - label_smoothing + uniform, off_value=uniform)
            loss, backprop = tf.raw_ops.SoftmaxCrossEntropyWithLogits(features=flat_logits,
                                                                      labels=targets)

        def grad(dloss: tf.Tensor) -> tf.Tensor:
            return dloss[:, None] * backprop

        return loss, grad

    loss = fused_xent(tf.reshape(logits, [-1, num_classes]))
    outer = logits.shape[:-1]
    return tf.reshape(loss, outer if outer.is_fully_defined() else tf.shape(logits)[:-1])


class SoftmaxCrossEntropyLayer(base_layer.BaseLayer):
    """Projects [B, ..., input_dim] to class logits and computes a weighted softmax loss.

    FProp returns a NestedMap with `logits` and `log_probs` [B, ..., num_classes],
    `per_example_xent` [B, ...], and the scalars `loss` (weighted mean of the
    cross-entropy), `num_examples` (sum of the weights) and `accuracy` (weighted
    top-1). Logits are computed in the fprop dtype; the softmax and everything
    after it in float32.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Depth of the inputs (their last dimension).")
        p.Define("num_classes", 0, "Number of classes (output logits).")
        p.Define("label_smoothing", 0.0, "Uniform label smoothing ls: targets are "
                 "(1 - ls) * onehot + ls / num_classes.")
        p.Define("has_bias", True, "Add a bias to the logits.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        if p.input_dim <= 0 or p.num_classes <= 0:
            raise ValueError(f"{self.path}: p.input_dim and p.num_classes must be > 0, got "
                             f"{p.input_dim} and {p.num_classes}.")
        if not 0.0 <= p.label_smoothing < 1.0:
            raise ValueError(f"{self.path}: p.label_smoothing must be in [0, 1), "
                             f"got {p.label_smoothing}.")
        self.CreateVariable("weight", weight_params.WeightParams(
            shape=(p.input_dim, p.num_classes)))
        if p.has_bias:
            self.CreateVariable("bias", weight_params.WeightParams(
                shape=(p.num_classes,), init=weight_params.WeightInit.Constant(0.0)))

    def Logits(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        """[B, ..., input_dim] -> float32 logits [B, ..., num_classes]."""
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        check_input_shape(f"{type(self).__name__} '{self.path}'", inputs.shape, 2,
                          p.input_dim, "input_dim")
        theta = self.CastTheta(theta)
        x = tf.cast(inputs, self.fprop_dtype)
        logits = weight_ops.dot_last_axis(x, theta.weight)
        if p.has_bias:
            logits = tf.nn.bias_add(logits, theta.bias)
        return tf.cast(logits, tf.float32)

    def FProp(self, theta: NestedMap, inputs: tf.Tensor, class_ids: tf.Tensor,
              class_weights: tf.Tensor | None = None) -> NestedMap:
        """Logits, cross-entropies and weighted metrics.

        Args:
          theta: this layer's weights.
          inputs: [B, ..., input_dim].
          class_ids: integer labels [B, ...].
          class_weights: [B, ...] example weights (0 for padding), or None for all 1.
        """
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        class_ids = tf.convert_to_tensor(class_ids)
        if not inputs.shape[:-1].is_compatible_with(class_ids.shape):
            raise ValueError(f"{self.path}: class_ids {class_ids.shape} must be the inputs' "
                             f"shape without the last axis, {inputs.shape[:-1]}.")
        logits = self.Logits(theta, inputs)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        per_example_xent = xent_with_label_smoothing(logits, class_ids, p.label_smoothing)
        if class_weights is None:
            weights = tf.ones_like(per_example_xent)
        else:
            weights = tf.cast(class_weights, tf.float32)
        num_examples = tf.reduce_sum(weights)
        loss = tf.math.divide_no_nan(tf.reduce_sum(weights * per_example_xent), num_examples)
        predictions = tf.argmax(logits, axis=-1, output_type=tf.int32)
        correct = tf.cast(tf.equal(predictions, tf.cast(class_ids, tf.int32)), tf.float32)
        accuracy = tf.math.divide_no_nan(tf.reduce_sum(weights * correct), num_examples)
        return NestedMap(
            logits=logits,
            log_probs=log_probs,
            per_example_xent=per_example_xent,
            loss=loss,
            num_examples=num_examples,
            accuracy=accuracy,
        )

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs_shape: Any, class_ids_shape: Any = None,
                  class_weights_shape: Any = None) -> NestedMap:
        shape = check_input_shape(cls.__name__, base_layer.to_shape(inputs_shape), 2,
                                  p.input_dim, "input_dim")
        if not shape.is_fully_defined():
            raise ValueError(f"{cls.__name__}.FPropMeta needs fully defined shapes, got {shape}.")
        outer = shape[:-1]
        logits_shape = outer.concatenate([p.num_classes])
        n = outer.num_elements()
        flops = 2 * n * p.input_dim * p.num_classes
        flops += (_SOFTMAX_FLOPS_PER_LOGIT + _XENT_FLOPS_PER_LOGIT) * n * p.num_classes
        num_params = p.input_dim * p.num_classes
        if p.has_bias:
            flops += n * p.num_classes
            num_params += p.num_classes
        scalar = tf.TensorShape([])
        out_shapes = NestedMap(
            logits=logits_shape,
            log_probs=logits_shape,
            per_example_xent=outer,
            loss=scalar,
            num_examples=scalar,
            accuracy=scalar,
        )
        # A deferred weight gradient holds the projection's input and the logits' gradient.
        size = tf.as_dtype(p.fprop_dtype or p.dtype).size
        return base_layer.fprop_meta(flops, out_shapes, num_params, tf.float32,
                                     memory=layer_memory.MemoryRecord(
                                         weight_op_bytes=n * (p.input_dim + p.num_classes) * size))
