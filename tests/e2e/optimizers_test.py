"""Optimizers against hand computations in numpy and, for RMSProp, TensorFlow 1's own kernel.

Each optimizer runs several steps on a variable with varying gradients and a varying learning
rate; the reference applies the published update rule step by step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
from absl.testing import parameterized
from conftest import REPO

from lingvo_lite.tasks import optimizers

STEPS = 5


def _gradients(shape=(3, 2), seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(STEPS)]


def _learning_rates() -> list[float]:
    return [0.1, 0.05, 0.2, 0.01, 0.1]


def _run(opt_params, start: np.ndarray, grads, lrs, distributed: bool = False) -> np.ndarray:
    """`opt_params` applied step by step to a variable starting at `start`; `distributed`: a
    MirroredStrategy's variable, which the update rules written as tensor ops update."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"]) if distributed else None
    with strategy.scope() if strategy else tf.init_scope():
        var = tf.Variable(start)
        opt = opt_params.Instantiate()
        opt.create_slots([var])
    if distributed:
        assert isinstance(var, tf.distribute.DistributedValues)
    for g, lr in zip(grads, lrs):
        opt.apply([(tf.constant(g), var)], tf.constant(lr))
    return var.numpy()


# The update of a 1 MiB weight inside a tf.function, in a child process with TensorFlow's BFC
# allocator on the CPU (the only way get_memory_info reports peaks there): bytes allocated at
# the update's peak beyond what existed before.
_UPDATE_PEAK_CHILD = r"""
import json, os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
from lingvo_lite.tasks import optimizers

out = {}
for name, params in [("sgd", optimizers.SGD.Params()),
                     ("momentum", optimizers.SGD.Params().Set(momentum=0.9)),
                     ("nesterov", optimizers.SGD.Params().Set(momentum=0.9, nesterov=True)),
                     ("rmsprop", optimizers.RMSProp.Params()),
                     ("adam", optimizers.Adam.Params()), ("tensor_ops", None)]:
    var = tf.Variable(tf.ones([512, 512]))
    opt = params.Instantiate() if params else None
    if opt:
        opt.create_slots([var])
    grad = tf.fill([512, 512], 0.5)

    @tf.function(autograph=False)
    def update(grad):
        if opt:
            opt.apply([(grad, var)], tf.constant(0.1))
        else:  # The control: SGD's rule as tensor ops (0.1 * grad is weight-sized).
            var.assign_sub(0.1 * grad)
        return tf.constant(0)

    update(grad)
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    update(grad)
    out[name] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
print(json.dumps(out))
"""


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

    @parameterized.parameters(
        (optimizers.SGD.Params(),), (optimizers.SGD.Params().Set(momentum=0.9),),
        (optimizers.SGD.Params().Set(momentum=0.9, nesterov=True),),
        (optimizers.RMSProp.Params(),), (optimizers.Adam.Params(),))
    def test_distributed_variables_follow_the_same_rule(self, params):
        # Plain variables take the fused kernels, a strategy's the rules written as tensor ops.
        plain = _run(params, self.start, self.grads, self.lrs)
        mirrored = _run(params, self.start, self.grads, self.lrs, distributed=True)
        self.assertAllClose(plain, mirrored, rtol=1e-6, atol=1e-6)

    def test_fused_updates_allocate_no_weight_sized_temporaries(self):
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run([sys.executable, "-c", _UPDATE_PEAK_CHILD], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(0, proc.returncode, proc.stderr[-3000:])
        extra = json.loads(proc.stdout.strip().splitlines()[-1])
        weight = 512 * 512 * 4
        for name in ("sgd", "momentum", "nesterov", "rmsprop", "adam"):
            self.assertLess(extra[name], weight // 8, name)
        # The same update as tensor ops: the measurement sees its weight-sized temporary.
        self.assertGreaterEqual(extra["tensor_ops"], weight)

    def test_slots_live_beside_their_variables_and_are_named_after_them(self):
        with tf.device("/device:CPU:1"):
            var = tf.Variable(tf.zeros([2]), name="w")
        opt = optimizers.Adam.Params().Instantiate()
        opt.create_slots([var])
        slots = opt.slot_variables()
        self.assertCountEqual(["w:0/m", "w:0/v", "w:0/t"], slots)
        for slot in slots.values():
            self.assertEqual("CPU:1", slot.device.rsplit("/device:", 1)[1])
        self.assertEqual([2], slots["w:0/m"].shape)
        self.assertEqual([], slots["w:0/t"].shape)  # A step count per weight.

    def test_missing_slots_are_an_error(self):
        var = tf.Variable(tf.zeros([2]))
        with self.assertRaisesRegex(ValueError, "call create_slots"):
            optimizers.SGD.Params().Instantiate().apply([(tf.ones([2]), var)], 0.1)


if __name__ == "__main__":
    tf.test.main()
