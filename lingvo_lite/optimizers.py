"""Optimizers that keep their slots beside the weights they update.

Written here rather than borrowed from Keras so that (1) each slot variable is
created on its weight's device, so a pipeline cell's update runs on the cell's
device, (2) they work on plain `tf.Variable`s, and (3) the update rules are the
classic TF ones the GPipe paper used (TF1 RMSProp with its epsilon inside the
square root and mean-square accumulator starting at 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from lingvo_lite import colocation, hyperparams

__all__ = ["Adam", "BaseOptimizer", "RMSProp", "SGD"]


class BaseOptimizer:
    """Applies gradients with a given learning rate; owns the slot variables."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = hyperparams.InstantiableParams(cls)
        p.Define("name", cls.__name__, "Optimizer name.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        self.params = params.Copy().Freeze()
        self._slots: dict[str, dict[str, tf.Variable]] = {}

    def _slot_names(self) -> dict[str, float]:
        """Slot name -> initial value."""
        return {}

    def create_slots(self, variables: Sequence[tf.Variable]) -> None:
        """Creates slots eagerly, each on its variable's device (call before tracing)."""
        for var in variables:
            key = var.name
            if key in self._slots:
                continue
            with colocation.colocated(var):
                self._slots[key] = {
                    name: tf.Variable(
                        tf.fill(var.shape, tf.cast(init, var.dtype)), trainable=False,
                        name=f"{var.name.split(':')[0]}.{name}")
                    for name, init in self._slot_names().items()
                }

    def slot_variables(self, variables: Sequence[tf.Variable] | None = None
                       ) -> dict[str, tf.Variable]:
        """The slots of `variables` (default: all), keyed '<variable name>/<slot name>'."""
        names = None if variables is None else {v.name for v in variables}
        return {
            f"{var_name}/{slot}": v
            for var_name, slots in sorted(self._slots.items())
            if names is None or var_name in names
            for slot, v in sorted(slots.items())
        }

    def copy_slots(self, source: tf.Variable, target: tf.Variable) -> None:
        """Sets `target`'s slots to `source`'s values (data-parallel replicas)."""
        for name, slot in self._slots.get(source.name, {}).items():
            self._slots[target.name][name].assign(slot)

    def apply(self, grads_and_vars: Sequence[tuple[tf.Tensor, tf.Variable]],
              learning_rate: tf.Tensor) -> tf.Operation:
        """Updates each variable on its own device; returns the grouped update op."""
        updates = []
        for grad, var in grads_and_vars:
            if grad is None:
                continue
            if var.name not in self._slots:
                raise ValueError(
                    f"Optimizer has no slots for {var.name}; call create_slots(variables) "
                    "before the first (traced) step."
                )
            # Only once the gradient exists: a slot's decay (beta * m) needs no gradient and
            # would otherwise run at the step's start and hold a weight-sized temporary
            # through the whole forward and backward.
            with colocation.colocated(var), tf.control_dependencies(
                    tf.nest.flatten(grad, expand_composites=True)):
                lr = tf.cast(learning_rate, var.dtype)
                updates.append(self._apply_one(grad, var, self._slots[var.name], lr))
        return tf.group(*updates)

    def _apply_one(self, grad: tf.Tensor, var: tf.Variable, slots: dict[str, tf.Variable],
                   lr: tf.Tensor) -> tf.Operation:
        raise NotImplementedError


class SGD(BaseOptimizer):
    """Plain gradient descent, or momentum (optionally Nesterov) when momentum > 0."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("momentum", 0.0, "Momentum; 0 disables it.")
        p.Define("nesterov", False, "Nesterov momentum.")
        return p

    def _slot_names(self) -> dict[str, float]:
        return {"momentum": 0.0} if self.params.momentum else {}

    def _apply_one(self, grad, var, slots, lr):  # noqa: ANN001
        p = self.params
        if not p.momentum:
            return var.assign_sub(lr * grad)
        mom = slots["momentum"].assign(p.momentum * slots["momentum"] + grad)
        step = grad + p.momentum * mom if p.nesterov else mom
        return var.assign_sub(lr * step)


class Adam(BaseOptimizer):
    """Adam (Kingma & Ba) with bias correction."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("beta1", 0.9, "Decay of the first moment.")
        p.Define("beta2", 0.999, "Decay of the second moment.")
        p.Define("epsilon", 1e-8, "Added to the denominator.")
        return p

    def _slot_names(self) -> dict[str, float]:
        return {"m": 0.0, "v": 0.0, "t": 0.0}

    def _apply_one(self, grad, var, slots, lr):  # noqa: ANN001
        p = self.params
        t = slots["t"].assign_add(tf.ones_like(slots["t"]))
        m = slots["m"].assign(p.beta1 * slots["m"] + (1 - p.beta1) * grad)
        v = slots["v"].assign(p.beta2 * slots["v"] + (1 - p.beta2) * tf.square(grad))
        m_hat = m / (1 - tf.pow(tf.cast(p.beta1, var.dtype), t))
        v_hat = v / (1 - tf.pow(tf.cast(p.beta2, var.dtype), t))
        return var.assign_sub(lr * m_hat / (tf.sqrt(v_hat) + p.epsilon))


class RMSProp(BaseOptimizer):
    """TF1 RMSProp, as in the GPipe/AmoebaNet recipe (decay 0.9, epsilon 0.1 inside the sqrt)."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("decay", 0.9, "Decay of the mean square.")
        p.Define("momentum", 0.9, "Momentum.")
        p.Define("epsilon", 1.0, "Added to the mean square inside the square root.")
        return p

    def _slot_names(self) -> dict[str, float]:
        return {"ms": 1.0, "momentum": 0.0}

    def _apply_one(self, grad, var, slots, lr):  # noqa: ANN001
        p = self.params
        ms = slots["ms"].assign(p.decay * slots["ms"] + (1 - p.decay) * tf.square(grad))
        mom = slots["momentum"].assign(
            p.momentum * slots["momentum"] + lr * grad / tf.sqrt(ms + p.epsilon))
        return var.assign_sub(mom)
