"""A Keras loss as a pipeline's last layer: NestedMap(x, y[, sample_weight]) -> loss.

PipeliningLayer trains a layer list whose last layer returns a NestedMap with a scalar
`loss` per micro-batch; the mini-batch loss is their mean, or their mean weighted by a
scalar `loss_weight` output. `KerasLossLayer` computes a Keras loss
(`'sparse_categorical_crossentropy'`, `keras.losses.Huber(reduction='sum')`, ...) on the
boundary map's predictions `x` and labels `y` so that this combination is exactly the
loss Keras' `Model.fit` computes on the whole mini-batch, for every reduction:

- 'sum_over_batch_size' / 'mean' (the default): the micro-batch's weighted sum over its
  number of loss values; equal micro-batches weigh equally. With a Keras mask on the
  predictions (entry `x_mask`), Keras divides by the number of unmasked values of the
  whole mini-batch: the layer returns its sum over its own unmasked count and that count
  as `loss_weight`.
- 'mean_with_sample_weight': likewise with the micro-batch's total sample weight (times
  the mask) as `loss_weight`: the mini-batch loss divides by the whole batch's total.
- 'sum': the micro-batch's sum times the number of micro-batches (the scalar input
  `num_micro_batches`, which PipelinedModel passes), so the mean over micro-batches is
  the sum.

`p.keras_loss_weight` (compile's `loss_weights` for the one output) multiplies the loss; a
scalar input `loss_scale` (mixed-precision loss scaling) multiplies it too.

Outputs: `loss` (with labels), `predictions` (the micro-batch's `x`, concatenated over
micro-batches by the pipeline) and `predictions_mask` when `x` has a mask. Without
labels (inference) only the predictions.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> p = KerasLossLayer.Params().Set(name='loss', loss='sparse_categorical_crossentropy')
    >>> layer = p.Instantiate()
    >>> out = layer.FProp(layer.theta, NestedMap(x=tf.fill([2, 3], 1 / 3), y=tf.zeros([2])))
    >>> round(float(out.loss), 4)
    1.0986
"""

from __future__ import annotations

import copy
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.masking import set_keras_mask
from keras.src.losses import LossFunctionWrapper  # What compile() wraps loss functions in.
from keras.src.losses.loss import apply_mask

from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap

__all__ = ["KerasLossLayer", "check_reduction", "make_loss", "micro_batch_loss", "reduction_of",
           "serialize_loss", "sparse_accuracy", "SUPPORTED_REDUCTIONS"]

# Reductions whose mini-batch loss the micro-batches reproduce exactly (module doc).
SUPPORTED_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")

# Per prediction element: a log, a multiply and a sum (cross-entropy-like losses).
LOSS_FLOPS_PER_ELEMENT = 3


def make_loss(config: Any) -> keras.losses.Loss:
    """A Keras Loss object from a name, a serialized loss or a loss, as `compile` makes it.

    Example:
        >>> float(make_loss('mse')(tf.zeros([2, 1]), tf.ones([2, 1])))
        1.0
    """
    loss = keras.losses.get(config)
    if loss is None:
        raise ValueError(f"No Keras loss for {config!r}; pass a name such as "
                         "'sparse_categorical_crossentropy' or a keras.losses.Loss.")
    if not isinstance(loss, keras.losses.Loss):
        loss = LossFunctionWrapper(loss, name=getattr(loss, "__name__", None))
    return loss


def reduction_of(loss: keras.losses.Loss) -> str | None:
    """The reduction a Keras loss applies to its per-example values."""
    return getattr(loss, "reduction", "sum_over_batch_size")


def serialize_loss(loss: Any) -> Any:
    """What `KerasLossLayer.Params().loss` holds for `loss` (a name stays a name).

    Example:
        >>> serialize_loss(keras.losses.Huber())['class_name']
        'Huber'
    """
    return loss if isinstance(loss, str) else keras.losses.serialize(loss)


def check_reduction(loss: keras.losses.Loss, where: str) -> None:
    """Refuses (one line) a loss whose reduction the micro-batches cannot reproduce ('none').

    Example:
        >>> check_reduction(make_loss('mse'), 'loss')   # 'sum_over_batch_size': trains.
    """
    if reduction_of(loss) not in SUPPORTED_REDUCTIONS:
        raise ValueError(
            f"{where}: the loss's reduction={reduction_of(loss)!r} returns a loss per example, "
            "not one number a pipeline can train on; use one of "
            f"{', '.join(repr(r) for r in SUPPORTED_REDUCTIONS)}.")


def micro_batch_loss(loss: keras.losses.Loss, x: tf.Tensor, mask: Any, y: Any,
                     sample_weight: Any = None, num_micro_batches: Any = None,
                     where: str = "KerasLossLayer") -> tuple[tf.Tensor, tf.Tensor | None]:
    """(loss, loss_weight or None) of one micro-batch, whose (weighted) mean over the
    micro-batches is Keras' loss of the whole mini-batch; see the module doc.

    `mask`: the Keras mask of the predictions `x` (or None); `num_micro_batches` is needed
    for reduction='sum' only.
    """
    reduction = reduction_of(loss)
    if mask is not None:
        x = tf.identity(x)  # Its own tensor: the mask attribute is set on it.
        set_keras_mask(x, mask)
    # The weighted, masked values before the reduction, by Keras' own code.
    unreduced = copy.copy(loss)
    unreduced.reduction = "none"
    values = tf.cast(unreduced(y, x, sample_weight=sample_weight), tf.float32)
    total = tf.reduce_sum(values)
    if reduction == "sum":
        if num_micro_batches is None:
            raise ValueError(
                f"{where}: reduction='sum' needs the scalar input num_micro_batches "
                "(PipelinedModel passes it); use reduction='sum_over_batch_size'.")
        return total * tf.cast(num_micro_batches, tf.float32), None
    count = None  # The micro-batch's share of Keras' divisor, when it varies.
    if reduction == "mean_with_sample_weight":
        if sample_weight is not None or mask is not None:
            weights = None if sample_weight is None else tf.cast(sample_weight, tf.float32)
            count = tf.reduce_sum(apply_mask(weights, mask, tf.float32, reduction))
    elif mask is not None:
        count = tf.reduce_sum(tf.cast(mask, tf.float32))
    if count is None:
        return tf.math.divide_no_nan(total, tf.cast(tf.size(values), tf.float32)), None
    return tf.math.divide_no_nan(total, count), count


def sparse_accuracy(x: tf.Tensor, y: Any, mask: Any = None) -> tf.Tensor:
    """The share of examples (or unmasked positions) whose largest prediction is the integer
    label `y`.

    Example:
        >>> float(sparse_accuracy(tf.constant([[0.1, 0.9], [0.8, 0.2]]), tf.constant([1, 1])))
        0.5
    """
    predicted = tf.argmax(x, axis=-1, output_type=tf.int32)
    correct = tf.cast(tf.equal(
        predicted, tf.reshape(tf.cast(y, tf.int32), tf.shape(predicted))), tf.float32)
    if mask is None:
        return tf.reduce_mean(correct)
    valid = tf.cast(tf.reshape(mask, tf.shape(correct)), tf.float32)
    return tf.math.divide_no_nan(tf.reduce_sum(correct * valid), tf.reduce_sum(valid))


class KerasLossLayer(base_layer.BaseLayer):
    """Applies a Keras loss to a pipeline's last boundary map; see the module doc."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("loss", None,
                 "The Keras loss: a name ('sparse_categorical_crossentropy') or a "
                 "serialized keras.losses.Loss (keras_loss.serialize_loss(loss)). None: "
                 "inference only until `set_loss` (a Keras model sets it in compile).")
        p.Define("keras_loss_weight", None,
                 "A float that multiplies the loss (compile's loss_weights), or None.")
        p.Define("sparse_accuracy", False,
                 "Also return `accuracy`: the share of examples whose largest prediction is "
                 "the label y (integer class ids; masked positions excluded), e.g. for "
                 "trainer.py's eval summaries.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self._loss = None
        self.set_loss(self.params.loss, self.params.keras_loss_weight)

    def set_loss(self, loss: Any, loss_weight: float | None = None) -> None:
        """Uses `loss` (any form `compile(loss=...)` takes), times `loss_weight`, from now on."""
        self._loss = make_loss(loss) if loss is not None else None
        self._loss_weight = loss_weight
        if self._loss is not None:
            check_reduction(self._loss, self.path)

    @property
    def loss(self) -> keras.losses.Loss | None:
        """The Keras loss the layer trains with (None: inference only)."""
        return self._loss

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        """NestedMap(predictions=x) plus, when `inputs` has labels `y`, the scalar `loss`."""
        del theta  # No weights.
        if not isinstance(inputs, NestedMap) or "x" not in inputs:
            raise ValueError(f"{self.path}: expects NestedMap(x=predictions, y=labels"
                             f"[, sample_weight]), got {type(inputs).__name__}.")
        x, mask = inputs.x, inputs.get("x_mask")
        out = NestedMap(predictions=x)
        if mask is not None:
            out.predictions_mask = mask
        y = inputs.get("y")
        if y is None:
            return out
        if self._loss is None:
            raise ValueError(f"{self.path}: no loss to train with; compile the model with "
                             "loss=... (or set p.loss).")
        loss, weight = micro_batch_loss(self._loss, x, mask, y, inputs.get("sample_weight"),
                                        inputs.get("num_micro_batches"), self.path)
        if self._loss_weight is not None:
            loss = loss * tf.cast(self._loss_weight, loss.dtype)
        if inputs.get("loss_scale") is not None:
            loss = loss * tf.cast(inputs.loss_scale, loss.dtype)
        out.loss = loss
        if weight is not None:
            out.loss_weight = weight
        if self.params.sparse_accuracy:
            out.accuracy = sparse_accuracy(x, y, mask)
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        shape = tf.TensorShape(base_layer.to_shape(
            inputs.x if isinstance(inputs, NestedMap) else inputs))
        flops = LOSS_FLOPS_PER_ELEMENT * int(shape.num_elements() or 0)
        out = NestedMap(predictions=shape, loss=tf.TensorShape([]))
        if isinstance(inputs, NestedMap) and inputs.get("x_mask") is not None:
            out.predictions_mask = tf.TensorShape(base_layer.to_shape(inputs.x_mask))
        if p.sparse_accuracy:
            out.accuracy = tf.TensorShape([])
        return base_layer.fprop_meta(flops, out, 0, tf.float32)
