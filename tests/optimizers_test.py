"""Optimizers against hand computations in numpy and, for RMSProp, TensorFlow 1's own kernel.

Each optimizer runs several steps on a variable with varying gradients and a varying learning
rate; the reference applies the published update rule step by step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite import optimizers

STEPS = 5


def _gradients(shape=(3, 2), seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(STEPS)]


def _learning_rates() -> list[float]:
    return [0.1, 0.05, 0.2, 0.01, 0.1]


def _run(opt_params, start: np.ndarray, grads, lrs) -> np.ndarray:
    var = tf.Variable(start)
    opt = opt_params.Instantiate()
    opt.create_slots([var])
    for g, lr in zip(grads, lrs):
        opt.apply([(tf.constant(g), var)], tf.constant(lr))
    return var.numpy()


class OptimizerTest(tf.test.TestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        self.start = np.random.default_rng(1).normal(size=(3, 2)).astype(np.float32)
        self.grads = _gradients()
        self.lrs = _learning_rates()

    def test_plain_sgd(self):
        want = self.start.astype(np.float64)
        for g, lr in zip(self.grads, self.lrs):
            want = want - lr * g
        got = _run(optimizers.SGD.Params(), self.start, self.grads, self.lrs)
        self.assertAllClose(want, got, rtol=1e-6, atol=1e-6)

    @parameterized.parameters(False, True)
    def test_momentum_sgd(self, nesterov):
        mu = 0.9
        want, velocity = self.start.astype(np.float64), np.zeros_like(self.start, np.float64)
        for g, lr in zip(self.grads, self.lrs):
            velocity = mu * velocity + g
            step = g + mu * velocity if nesterov else velocity
            want = want - lr * step
        got = _run(optimizers.SGD.Params().Set(momentum=mu, nesterov=nesterov), self.start,
                   self.grads, self.lrs)
        self.assertAllClose(want, got, rtol=1e-6, atol=1e-6)

    def test_adam_with_bias_correction(self):
        b1, b2, eps = 0.9, 0.999, 1e-8
        want = self.start.astype(np.float64)
        m = np.zeros_like(want)
        v = np.zeros_like(want)
        for t, (g, lr) in enumerate(zip(self.grads, self.lrs), start=1):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            want = want - lr * m_hat / (np.sqrt(v_hat) + eps)
        got = _run(optimizers.Adam.Params(), self.start, self.grads, self.lrs)
        self.assertAllClose(want, got, rtol=1e-5, atol=1e-6)

    def test_rmsprop_epsilon_inside_the_square_root(self):
        decay, mu, eps = 0.9, 0.9, 0.1
        want = self.start.astype(np.float64)
        mean_square = np.ones_like(want)  # TF1 starts the mean square at 1.
        velocity = np.zeros_like(want)
        for g, lr in zip(self.grads, self.lrs):
            mean_square = decay * mean_square + (1 - decay) * g * g
            velocity = mu * velocity + lr * g / np.sqrt(mean_square + eps)
            want = want - velocity
        params = optimizers.RMSProp.Params().Set(decay=decay, momentum=mu, epsilon=eps)
        got = _run(params, self.start, self.grads, self.lrs)
        self.assertAllClose(want, got, rtol=1e-5, atol=1e-6)

    def test_rmsprop_equals_tensorflow_1_rmsprop(self):
        # The GPipe/AmoebaNet recipe ran TF1's RMSPropOptimizer; its kernel is the reference.
        decay, mu, eps = 0.9, 0.9, 0.1
        var = tf.Variable(self.start)
        learning_rate = tf.Variable(0.0)
        tf1 = tf.compat.v1.train.RMSPropOptimizer(lambda: learning_rate.read_value(),
                                                  decay=decay, momentum=mu, epsilon=eps)
        for g, lr in zip(self.grads, self.lrs):
            learning_rate.assign(lr)
            tf1.apply_gradients([(tf.constant(g), var)])
        params = optimizers.RMSProp.Params().Set(decay=decay, momentum=mu, epsilon=eps)
        got = _run(params, self.start, self.grads, self.lrs)
        self.assertAllClose(var.numpy(), got, rtol=1e-6, atol=1e-6)

    def test_slots_live_beside_their_variables_and_are_named_after_them(self):
        with tf.device("/device:CPU:1"):
            var = tf.Variable(tf.zeros([2]), name="w")
        opt = optimizers.Adam.Params().Instantiate()
        opt.create_slots([var])
        slots = opt.slot_variables()
        self.assertCountEqual(["w:0/m", "w:0/v", "w:0/t"], slots)
        for slot in slots.values():
            self.assertEqual("CPU:1", slot.device.rsplit("/device:", 1)[1])

    def test_missing_slots_are_an_error(self):
        var = tf.Variable(tf.zeros([2]))
        with self.assertRaisesRegex(ValueError, "call create_slots"):
            optimizers.SGD.Params().Instantiate().apply([(tf.ones([2]), var)], 0.1)


if __name__ == "__main__":
    tf.test.main()
