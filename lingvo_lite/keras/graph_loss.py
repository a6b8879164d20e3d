"""The compiled loss of a functional Keras model as the pipeline's last layer.

`GraphLossLayer` takes the model's outputs `x` (a tensor, a list or a NestedMap by output
name) with the labels `y` (same structure) and computes each output's loss with
`keras_loss.micro_batch_loss`, the code `PipelinedModel`'s layer-list loss uses, so every
reduction ('sum_over_batch_size', 'mean', 'mean_with_sample_weight', 'sum'), sample
weights, Keras masks and `loss_weights` give Keras' mini-batch loss when the pipeline
averages the micro-batches (weighted by `loss_weight` where Keras divides by a count of
the whole batch). Several outputs' losses are summed, as `Model.compile` does.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.core.nested_map import NestedMap
    >>> layer = GraphLossLayer.Params().Set(name='loss', loss='mse').Instantiate()
    >>> out = layer.FProp(layer.theta, NestedMap(x=tf.ones([2, 1]), y=tf.zeros([2, 1])))
    >>> float(out.loss)
    1.0
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
from keras.src import tree

from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import keras_loss

__all__ = ["GraphLossLayer", "check_losses"]


def _entry(setting: Any, name: Any, index: int) -> Any:
    """One output's entry of a compile setting: by name (dict), position (list) or shared."""
    if isinstance(setting, dict):
        return setting.get(name) if name in setting or len(setting) != 1 else \
            next(iter(setting.values()))
    if isinstance(setting, (list, tuple)):
        return setting[index]
    return setting


def check_losses(loss: Any, several_outputs: bool) -> None:
    """Refuses (one line) a loss the micro-batches cannot reproduce: reduction='none', or
    'mean_with_sample_weight' for one of several outputs (Keras divides each output's loss
    by its own total weight of the whole batch; the pipeline weighs micro-batches by one)."""
    for entry in tree.flatten(loss) if isinstance(loss, (dict, list, tuple)) else [loss]:
        if entry is None:
            continue
        made = keras_loss.make_loss(entry)
        keras_loss.check_reduction(made, "PipelinedModel")
        if several_outputs and keras_loss.reduction_of(made) == "mean_with_sample_weight":
            raise ValueError(
                "PipelinedModel.compile: reduction='mean_with_sample_weight' is not supported "
                "for a model with several outputs (each output divides by its own total sample "
                "weight of the whole batch); use 'sum_over_batch_size' or 'sum'.")


class GraphLossLayer(base_layer.BaseLayer):
    """The compiled loss on the model's outputs: NestedMap(x, y[, sample_weight]) -> loss;
    see the module doc. `set_loss` takes the loss as `compile` does: one loss (for every
    output), a list (one per output, in order) or a dict by output name."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("loss", None, "One Keras loss for the model's one output: a name or a "
                 "serialized keras.losses.Loss (a trainer.py task sets it; PipelinedModel's "
                 "compile calls set_loss).")
        p.Define("loss_weight", None, "A float multiplying the loss (compile's loss_weights).")
        p.Define("sparse_accuracy", False,
                 "Also return `accuracy` of the one output against integer labels (masked "
                 "positions excluded), e.g. for trainer.py's eval summaries.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self._spec: Any = None
        self._weights: Any = None
        if self.params.loss is not None:
            self.set_loss(keras_loss.make_loss(self.params.loss), self.params.loss_weight)

    def set_loss(self, loss: Any, loss_weights: Any = None, several_outputs: bool = False
                 ) -> None:
        """Uses `loss` and `loss_weights` (any form `compile` takes) from now on."""
        check_losses(loss, several_outputs)
        self._spec = loss
        self._weights = loss_weights

    @property
    def loss(self) -> Any:
        return self._spec

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        del theta  # No weights.
        out = NestedMap(predictions=inputs.x)
        mask = inputs.get("x_mask")
        if mask is not None:
            out.predictions_mask = mask
        if inputs.get("y") is None:
            return out
        if self._spec is None:
            raise ValueError(f"{self.path}: no loss to train with; compile the model with "
                             "loss=....")
        weights, num = inputs.get("sample_weight"), inputs.get("num_micro_batches")
        if not isinstance(inputs.x, (NestedMap, list)):
            loss, count = keras_loss.micro_batch_loss(
                keras_loss.make_loss(self._spec), inputs.x, mask, inputs.y, weights, num,
                self.path)
            if count is not None:  # Keras divides by a count of the whole mini-batch.
                out.loss_weight = count
            factor = _entry(self._weights, "", 0)
            out.loss = loss if factor is None else loss * float(factor)
            if self.params.sparse_accuracy:
                out.accuracy = keras_loss.sparse_accuracy(inputs.x, inputs.y, mask)
            return self._scaled(out, inputs)
        names = list(inputs.x) if isinstance(inputs.x, NestedMap) else range(len(inputs.x))
        labels = self._labels_by_output(names, inputs.y)
        total = tf.constant(0.0)
        for i, name in enumerate(names):
            loss = _entry(self._spec, name, i)
            if loss is None:
                continue
            w = weights[name] if isinstance(weights, (dict, list)) else weights
            one, count = keras_loss.micro_batch_loss(
                keras_loss.make_loss(loss), inputs.x[name], None, labels[i], w, num,
                self.path)
            if count is not None:  # check_losses refuses this in compile.
                raise ValueError(f"{self.path}: output {name!r}'s loss divides by a count of "
                                 "the whole batch; use reduction='sum_over_batch_size'.")
            factor = _entry(self._weights, name, i)
            total += one if factor is None else one * float(factor)
        out.loss = total
        return self._scaled(out, inputs)

    def _labels_by_output(self, names: list[Any] | range, y: Any) -> list[Any]:
        """Each output's labels. As Keras' compiled loss takes them: by name or position
        when `y` has the outputs' structure, else its flat labels in order to the outputs
        whose loss is not None (`loss=[fn, None]` with one label array)."""
        if isinstance(y, dict):
            return [y.get(name) for name in names]
        if isinstance(y, (list, tuple)) and len(y) == len(names):
            return list(y)
        flat = list(y) if isinstance(y, (list, tuple)) else [y]
        scored = [i for i, name in enumerate(names) if _entry(self._spec, name, i) is not None]
        if len(flat) != len(scored):
            raise ValueError(
                f"{self.path}: {len(flat)} label arrays for {len(names)} outputs of which "
                f"{len(scored)} have a loss; give one label array per output (or per output "
                "with a loss, in order).")
        labels: list[Any] = [None] * len(names)
        for i, value in zip(scored, flat):
            labels[i] = value
        return labels

    @staticmethod
    def _scaled(out: NestedMap, inputs: NestedMap) -> NestedMap:
        """The loss times the mixed-precision loss scale, if the step passes one."""
        if inputs.get("loss_scale") is not None:
            out.loss = out.loss * tf.cast(inputs.loss_scale, out.loss.dtype)
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        x = inputs.x if isinstance(inputs, NestedMap) else inputs
        elements = sum(int(tf.TensorShape(s).num_elements() or 0)
                       for s in NestedMap(x=x).Flatten())
        out = NestedMap(predictions=x, loss=tf.TensorShape([]))
        if isinstance(inputs, NestedMap) and "x_mask" in inputs:
            out.predictions_mask = inputs.x_mask
        if p.sparse_accuracy:
            out.accuracy = tf.TensorShape([])
        return base_layer.fprop_meta(keras_loss.LOSS_FLOPS_PER_ELEMENT * elements, out, 0,
                                     tf.float32)
