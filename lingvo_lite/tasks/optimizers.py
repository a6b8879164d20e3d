"""Optimizers that keep their slots beside the weights they update.

Written here rather than borrowed from Keras so that (1) each slot variable is
created on its weight's device, so a pipeline cell's update runs on the cell's
device, (2) they work on plain `tf.Variable`s, and (3) the update rules are the
classic TF ones the GPipe paper used (TF1 RMSProp with its epsilon inside the
square root and mean-square accumulator starting at 1).

SGD, RMSProp and Adam update a plain variable with TensorFlow's fused training kernels
(`ResourceApplyMomentum`, `ResourceApplyRMSProp`, `ResourceApplyAdam`, ...), which write the
weight and its slots in place: the update allocates no weight-sized temporaries, so a device's
peak does not depend on when the executor frees them. Distributed variables (a TPUStrategy's)
use the same rules written as tensor ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from lingvo_lite.core import colocation, hyperparams

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

    def _scalar_slots(self) -> frozenset[str]:
        """Slots that hold one number per weight (a step count) rather than one per element."""
        return frozenset()

    def weight_sized_slots(self) -> int:
        """How many slots the size of its weight each trainable weight gets."""
        return len(set(self._slot_names()) - self._scalar_slots())

    def create_slots(self, variables: Sequence[tf.Variable]) -> None:
        """Creates slots eagerly, each on its variable's device (call before tracing)."""
        for var in variables:
            key = var.name
            if key in self._slots:
                continue
            with colocation.colocated(var):
                self._slots[key] = {
                    name: tf.Variable(
                        tf.fill([] if name in self._scalar_slots() else var.shape,
                                tf.cast(init, var.dtype)), trainable=False,
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

    @property
    def updates_elementwise(self) -> bool:
        """Whether each element's update reads only that element (of the weight, gradient and
        slots), so a slice of a weight can be updated alone (`update_shard`)."""
        return type(self).update_shard is not BaseOptimizer.update_shard

    def update_shard(self, grad: tf.Tensor, value: tf.Tensor, slots: dict[str, tf.Variable],
                     lr: tf.Tensor) -> tf.Tensor:
        """Updates a flat slice of a weight (ZeRO-1, lingvo_lite/tasks/sharded_optimizer.py).

        `grad` and `value` are the slice of the gradient and of the weight; `slots` the
        slice's slot variables (scalar slots whole). Writes the slots and returns the
        slice's new value, by the fused kernel's formula element by element.
        """
        raise NotImplementedError(f"{type(self).__name__} has no element-wise update_shard.")


def _fused(grad: tf.Tensor, var: tf.Variable) -> tf.Tensor | None:
    """`grad` as a dense tensor when `var` is a plain resource variable that a fused training
    kernel can update in place; None otherwise (the update is then written as tensor ops)."""
    if isinstance(var, tf.distribute.DistributedValues) or not hasattr(var, "handle"):
        return None
    return tf.convert_to_tensor(grad, dtype=var.dtype)


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
        dense = _fused(grad, var)
        if dense is not None and not p.momentum:
            return tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr,
                                                           delta=dense)
        if dense is not None:  # accum = momentum * accum + grad; var -= lr * (accum or,
            # Nesterov, grad + momentum * accum).
            return tf.raw_ops.ResourceApplyMomentum(
                var=var.handle, accum=slots["momentum"].handle, lr=lr, grad=dense,
                momentum=tf.cast(p.momentum, var.dtype), use_nesterov=p.nesterov)
        if not p.momentum:
            return var.assign_sub(lr * grad)
        mom = slots["momentum"].assign(p.momentum * slots["momentum"] + grad)
        step = grad + p.momentum * mom if p.nesterov else mom
        return var.assign_sub(lr * step)

    def update_shard(self, grad, value, slots, lr):  # noqa: ANN001
        p = self.params  # ResourceApplyGradientDescent / ResourceApplyMomentum's formulas.
        if not p.momentum:
            return value - grad * lr
        momentum = tf.cast(p.momentum, value.dtype)
        accum = slots["momentum"].assign(slots["momentum"] * momentum + grad)
        if p.nesterov:
            return value - (grad * lr + accum * momentum * lr)
        return value - accum * lr


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

    def _scalar_slots(self) -> frozenset[str]:
        return frozenset({"t"})  # The weight's step count.

    def _apply_one(self, grad, var, slots, lr):  # noqa: ANN001
        p = self.params
        t = slots["t"].assign_add(tf.ones([], var.dtype))
        beta1, beta2 = tf.cast(p.beta1, var.dtype), tf.cast(p.beta2, var.dtype)
        beta1_power, beta2_power = tf.pow(beta1, t), tf.pow(beta2, t)
        dense = _fused(grad, var)
        if dense is not None:
            # The kernel computes lr sqrt(1 - beta2^t) / (1 - beta1^t) m / (sqrt(v) + eps'),
            # which is lr m_hat / (sqrt(v_hat) + epsilon) for eps' = epsilon sqrt(1 - beta2^t).
            return tf.raw_ops.ResourceApplyAdam(
                var=var.handle, m=slots["m"].handle, v=slots["v"].handle,
                beta1_power=beta1_power, beta2_power=beta2_power, lr=lr, beta1=beta1,
                beta2=beta2, epsilon=tf.cast(p.epsilon, var.dtype) * tf.sqrt(1 - beta2_power),
                grad=dense)
        m = slots["m"].assign(beta1 * slots["m"] + (1 - beta1) * grad)
        v = slots["v"].assign(beta2 * slots["v"] + (1 - beta2) * tf.square(grad))
        m_hat = m / (1 - beta1_power)
        v_hat = v / (1 - beta2_power)
        return var.assign_sub(lr * m_hat / (tf.sqrt(v_hat) + p.epsilon))

    def update_shard(self, grad, value, slots, lr):  # noqa: ANN001
        p = self.params  # ResourceApplyAdam's formula (see _apply_one for its epsilon).
        one = tf.ones([], value.dtype)
        t = slots["t"].assign_add(one)
        beta1, beta2 = tf.cast(p.beta1, value.dtype), tf.cast(p.beta2, value.dtype)
        beta1_power, beta2_power = tf.pow(beta1, t), tf.pow(beta2, t)
        epsilon = tf.cast(p.epsilon, value.dtype) * tf.sqrt(one - beta2_power)
        alpha = lr * tf.sqrt(one - beta2_power) / (one - beta1_power)
        m = slots["m"].assign_add((grad - slots["m"]) * (one - beta1))
        v = slots["v"].assign_add((tf.square(grad) - slots["v"]) * (one - beta2))
        return value - (m * alpha) / (tf.sqrt(v) + epsilon)


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
        dense = _fused(grad, var)
        if dense is not None:  # The same rule in one kernel, in place.
            return tf.raw_ops.ResourceApplyRMSProp(
                var=var.handle, ms=slots["ms"].handle, mom=slots["momentum"].handle, lr=lr,
                rho=tf.cast(p.decay, var.dtype), momentum=tf.cast(p.momentum, var.dtype),
                epsilon=tf.cast(p.epsilon, var.dtype), grad=dense)
        ms = slots["ms"].assign(p.decay * slots["ms"] + (1 - p.decay) * tf.square(grad))
        mom = slots["momentum"].assign(
            p.momentum * slots["momentum"] + lr * grad / tf.sqrt(ms + p.epsilon))
        return var.assign_sub(mom)

    def update_shard(self, grad, value, slots, lr):  # noqa: ANN001
        p = self.params  # ResourceApplyRMSProp's formula.
        dtype = value.dtype
        ms = slots["ms"].assign_add(
            (tf.square(grad) - slots["ms"]) * (1 - tf.cast(p.decay, dtype)))
        mom = slots["momentum"].assign(slots["momentum"] * tf.cast(p.momentum, dtype)
                                       + (grad * lr) / tf.sqrt(ms + tf.cast(p.epsilon, dtype)))
        return value - mom
