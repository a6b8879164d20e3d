"""Keras weight regularizers on the pipeline: which are refused, and their penalties added to
the pipelined loss and gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__: list[str] = []


def check_regularizers(layer: keras.layers.Layer, allow_weight_regularizers: bool) -> None:
    """Refuses (one line) a regularizer PipelinedModel cannot honour: activity
    regularizers always, weight regularizers unless `allow_weight_regularizers`."""
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        names = [k for k, v in vars(sub).items() if k.endswith("regularizer") and v is not None
                 and (not allow_weight_regularizers or "activity" in k)]
        if not names:
            continue
        if any("activity" in n for n in names):
            why = ("its penalty depends on the activations of the whole batch and is not "
                   "added to the pipelined loss; remove it")
        else:
            why = ("only PipelinedModel adds weight penalties to the loss; remove it (with "
                   "trainer.py use train.l2_regularizer_weight)")
        raise ValueError(f"Keras layer '{sub.name}' has {', '.join(sorted(names))}: {why}.")


def add_weight_penalties(variables: Sequence[Any], gradients: list[Any], loss: Any,
                         loss_scale: Any) -> Any:
    """Adds each weight regularizer's penalty to `loss` and its gradient to `gradients[i]`
    (in place; penalties are functions of the weights alone, computed on their devices);
    returns the loss. `loss_scale` is mixed float16's scale, 1 otherwise."""
    for i, v in enumerate(variables):
        if v.regularizer is not None:
            with tf.device(v.value.device), tf.GradientTape() as tape:
                penalty = tf.cast(v.regularizer(v), loss.dtype)
                scaled = penalty * loss_scale
            gradients[i] = gradients[i] + tf.cast(tape.gradient(scaled, v.value),
                                                  gradients[i].dtype)
            loss = loss + penalty
    return loss
