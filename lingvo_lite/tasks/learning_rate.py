"""Learning-rate schedules: a multiplier of the base learning rate as a function of the step."""

from __future__ import annotations

import math

import tensorflow as tf

from lingvo_lite.core import hyperparams

__all__ = ["BaseSchedule", "Constant", "CosineDecay", "ExponentialDecay", "TransformerSchedule"]


class BaseSchedule:
    """`value(step)` is the factor the base learning rate is multiplied by."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        return hyperparams.InstantiableParams(cls)

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        self.params = params.Copy().Freeze()

    def value(self, step: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError


class Constant(BaseSchedule):
    def value(self, step: tf.Tensor) -> tf.Tensor:
        return tf.constant(1.0)


class ExponentialDecay(BaseSchedule):
    """decay_rate ** (step / decay_steps), staircase optional, after a linear warm-up.

    The AmoebaNet recipe decays by 0.97 every 3 epochs: decay_steps = 3 epochs of steps.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("decay_rate", 0.97, "Multiplier per decay_steps.")
        p.Define("decay_steps", 1000, "Steps per decay.")
        p.Define("staircase", True, "Decay in whole steps of decay_steps.")
        p.Define("warmup_steps", 0, "Linear warm-up from 0 over these steps.")
        return p

    def value(self, step: tf.Tensor) -> tf.Tensor:
        p = self.params
        step = tf.cast(step, tf.float32)
        exponent = step / float(p.decay_steps)
        if p.staircase:
            exponent = tf.floor(exponent)
        factor = tf.pow(float(p.decay_rate), exponent)
        if p.warmup_steps:
            factor *= tf.minimum(1.0, (step + 1.0) / float(p.warmup_steps))
        return factor


class TransformerSchedule(BaseSchedule):
    """Vaswani et al.: model_dim^-0.5 * min((step+1)^-0.5, (step+1) * warmup^-1.5)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("warmup_steps", 4000, "Warm-up steps.")
        p.Define("model_dim", 512, "Model dimension.")
        return p

    def value(self, step: tf.Tensor) -> tf.Tensor:
        p = self.params
        step = tf.cast(step, tf.float32) + 1.0
        return p.model_dim ** -0.5 * tf.minimum(step ** -0.5, step * p.warmup_steps ** -1.5)


class CosineDecay(BaseSchedule):
    """Linear warm-up, then half a cosine from 1 down to `final_factor` at `total_steps`."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("warmup_steps", 0, "Linear warm-up steps.")
        p.Define("total_steps", 1000, "Step at which the factor reaches final_factor.")
        p.Define("final_factor", 0.0, "Factor at the end.")
        return p

    def value(self, step: tf.Tensor) -> tf.Tensor:
        p = self.params
        step = tf.cast(step, tf.float32)
        span = max(p.total_steps - p.warmup_steps, 1)
        progress = tf.clip_by_value((step - p.warmup_steps) / span, 0.0, 1.0)
        cosine = p.final_factor + (1 - p.final_factor) * 0.5 * (1 + tf.cos(math.pi * progress))
        if p.warmup_steps:
            return tf.where(step < p.warmup_steps, (step + 1) / p.warmup_steps, cosine)
        return cosine
