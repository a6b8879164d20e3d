"""A Keras loss as a pipeline's last layer: NestedMap(x, y[, sample_weight]) -> loss.

PipeliningLayer trains a layer list whose last layer returns a NestedMap with a
scalar `loss`, the mean over its micro-batch. `KerasLossLayer` computes a Keras loss
(`'sparse_categorical_crossentropy'`, `keras.losses.Huber()`, ...) on the boundary
map's predictions `x` and labels `y` with Keras' default reduction
('sum_over_batch_size': sum of the weighted per-example losses divided by the number
of examples), so the mean over T equal micro-batches is exactly the mini-batch loss
`Model.fit` computes. Without labels (inference) it returns only the predictions.

Outputs: `loss` (with labels), `predictions` (the micro-batch's `x`, concatenated
over micro-batches by the pipeline) and `num_examples` is deliberately not returned:
the micro-batches weigh equally, as Keras' reduction does.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.nested_map import NestedMap
    >>> p = KerasLossLayer.Params().Set(name='loss', loss='sparse_categorical_crossentropy')
    >>> layer = p.Instantiate()
    >>> out = layer.FProp(layer.theta, NestedMap(x=tf.fill([2, 3], 1 / 3), y=tf.zeros([2])))
    >>> round(float(out.loss), 4)
    1.0986
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.losses import LossFunctionWrapper  # What compile() wraps loss functions in.

from lingvo_lite import base_layer, hyperparams
from lingvo_lite.nested_map import NestedMap

__all__ = ["KerasLossLayer", "make_loss", "serialize_loss"]

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


def serialize_loss(loss: Any) -> Any:
    """What `KerasLossLayer.Params().loss` holds for `loss` (a name stays a name).

    Example:
        >>> serialize_loss(keras.losses.Huber())['class_name']
        'Huber'
    """
    return loss if isinstance(loss, str) else keras.losses.serialize(loss)


class KerasLossLayer(base_layer.BaseLayer):
    """Applies a Keras loss to a pipeline's last boundary map; see the module doc."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("loss", None,
                 "The Keras loss: a name ('sparse_categorical_crossentropy') or a "
                 "serialized keras.losses.Loss (keras_loss.serialize_loss(loss)). None: "
                 "inference only until `set_loss` (a Keras model sets it in compile).")
        p.Define("sparse_accuracy", False,
                 "Also return `accuracy`: the share of examples whose largest prediction is "
                 "the label y (integer class ids), e.g. for trainer.py's eval summaries.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self._loss = make_loss(self.params.loss) if self.params.loss is not None else None

    def set_loss(self, loss: Any) -> None:
        """Uses `loss` (any form `compile(loss=...)` takes) from now on."""
        self._loss = make_loss(loss) if loss is not None else None

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        """NestedMap(predictions=x) plus, when `inputs` has labels `y`, the scalar `loss`."""
        del theta  # No weights.
        if not isinstance(inputs, NestedMap) or "x" not in inputs:
            raise ValueError(f"{self.path}: expects NestedMap(x=predictions, y=labels"
                             f"[, sample_weight]), got {type(inputs).__name__}.")
        out = NestedMap(predictions=inputs.x)
        y = inputs.get("y")
        if y is None:
            return out
        if self._loss is None:
            raise ValueError(f"{self.path}: no loss to train with; compile the model with "
                             "loss=... (or set p.loss).")
        out.loss = tf.cast(self._loss(y, inputs.x, sample_weight=inputs.get("sample_weight")),
                           tf.float32)
        if self.params.sparse_accuracy:
            predicted = tf.argmax(inputs.x, axis=-1, output_type=tf.int32)
            correct = tf.equal(predicted, tf.reshape(tf.cast(y, tf.int32), tf.shape(predicted)))
            out.accuracy = tf.reduce_mean(tf.cast(correct, tf.float32))
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        shape = tf.TensorShape(base_layer.to_shape(
            inputs.x if isinstance(inputs, NestedMap) else inputs))
        flops = LOSS_FLOPS_PER_ELEMENT * int(shape.num_elements() or 0)
        out = NestedMap(predictions=shape, loss=tf.TensorShape([]))
        if p.sparse_accuracy:
            out.accuracy = tf.TensorShape([])
        return base_layer.fprop_meta(flops, out, 0, tf.float32)
