"""weight_ops: deferred weight gradients against numpy and against TensorFlow's own gradients."""

import numpy as np
import tensorflow as tf

from lingvo_lite.layers import weight_ops


def _rand(*shape, seed=0):
    return np.random.default_rng(seed + len(shape)).standard_normal(shape).astype(np.float32)


class WeightOpsTest(tf.test.TestCase):

    def test_outside_deferring_it_is_the_plain_op(self):
        x, w = _rand(4, 3), tf.Variable(_rand(3, 2, seed=1))
        with tf.GradientTape() as tape:
            y = weight_ops.matmul(x, w)
        self.assertAllClose(x @ w.numpy(), y)
        self.assertAllClose(x.T @ np.ones([4, 2], np.float32), tape.gradient(y, w))

    def test_matmul_weight_gradient_is_deferred_to_the_record(self):
        x, w = _rand(5, 3), tf.Variable(_rand(3, 4, seed=1))
        dy = _rand(5, 4, seed=2)
        with tf.GradientTape() as tape:
            with weight_ops.deferring([w]) as stash:
                y = weight_ops.matmul(x, w)  # Nothing on y's path but w is watched.
        self.assertIsNone(tape.gradient(y, w, output_gradients=dy))
        (record,) = stash.records
        self.assertAllClose(x, record.x)
        self.assertAllClose(dy, record.dy)
        (grad,) = weight_ops.weight_gradients(stash.records, [w])
        self.assertAllClose(x.T @ dy, grad, rtol=1e-5)

    def test_input_gradient_is_unchanged(self):
        x, w = tf.constant(_rand(5, 3)), tf.Variable(_rand(3, 4, seed=1))
        with tf.GradientTape() as tape:
            tape.watch(x)
            with weight_ops.deferring([w]):
                loss = tf.reduce_sum(tf.tanh(weight_ops.matmul(x, w)))
        h = np.tanh(x.numpy() @ w.numpy())
        self.assertAllClose((1 - h ** 2) @ w.numpy().T, tape.gradient(loss, x), rtol=1e-5)

    def test_every_op_matches_tensorflows_gradient(self):
        cases = [
            (lambda x, w: weight_ops.matmul(x, w, transpose_b=True), [6, 3], [5, 3]),
            (lambda x, w: weight_ops.einsum("btd,dh->bth", x, w), [2, 3, 4], [4, 5]),
            (lambda x, w: weight_ops.conv2d(x, w, [1, 2, 2, 1], "SAME", [1, 1, 1, 1]),
             [2, 6, 6, 3], [3, 3, 3, 4]),
            (lambda x, w: weight_ops.depthwise_conv2d(x, w, [1, 1, 1, 1], "SAME", [2, 2]),
             [2, 6, 6, 3], [3, 3, 3, 2]),
            (weight_ops.dot_last_axis, [2, 3, 4], [4, 5]),
        ]
        for i, (op, x_shape, w_shape) in enumerate(cases):
            with self.subTest(case=i):
                x, w = tf.constant(_rand(*x_shape, seed=i)), tf.constant(_rand(*w_shape))
                with tf.GradientTape() as tape:
                    tape.watch(w)
                    plain = tf.reduce_sum(tf.sin(op(x, w)))
                want = tape.gradient(plain, w)
                with tf.GradientTape() as tape:
                    tape.watch(w)
                    with weight_ops.deferring([w]) as stash:
                        loss = tf.reduce_sum(tf.sin(op(x, w)))
                self.assertIsNone(tape.gradient(loss, w))
                (got,) = weight_ops.weight_gradients(stash.records, [w])
                self.assertAllClose(want, got, rtol=1e-5, atol=1e-5)

    def test_a_weight_used_twice_and_a_weight_not_deferred(self):
        x, w, b = _rand(4, 3), tf.Variable(_rand(3, 3, seed=1)), tf.Variable(_rand(3, seed=2))
        with tf.GradientTape() as tape:
            with weight_ops.deferring([w]) as stash:
                h = weight_ops.matmul(x, w) + b
                loss = tf.reduce_sum(weight_ops.matmul(h, w) * w[0])  # w also used directly.
        partial_w, grad_b = tape.gradient(loss, [w, b])
        self.assertLen(stash.records, 2)
        (deferred,) = weight_ops.weight_gradients(stash.records, [w])
        # numpy: loss = sum((x w + b) w * w[0]).
        wn, bn = w.numpy(), b.numpy()
        h = x @ wn + bn
        dz = np.tile(wn[0], (4, 1))
        dh = dz @ wn.T
        want_w = x.T @ dh + h.T @ dz
        want_w[0] += (h @ wn).sum(0)
        self.assertAllClose(want_w, partial_w + deferred, rtol=1e-4)
        self.assertAllClose(dh.sum(0), grad_b, rtol=1e-4)

    def test_concatenated_records_give_the_sum_of_the_micro_batches(self):
        w = tf.Variable(_rand(3, 2, seed=1))
        per_micro_batch, want = [], 0
        for t in range(3):
            x, dy = _rand(4, 3, seed=10 + t), _rand(4, 2, seed=20 + t)
            with tf.GradientTape() as tape:
                with weight_ops.deferring([w]) as stash:
                    y = weight_ops.matmul(x, w)
            tape.gradient(y, w, output_gradients=dy)
            per_micro_batch.append(stash.records)
            want = want + x.T @ dy
        joined = weight_ops.concatenate(per_micro_batch)
        self.assertLen(joined, 1)
        self.assertEqual([12, 3], joined[0].x.shape.as_list())
        (grad,) = weight_ops.weight_gradients(joined, [w])
        self.assertAllClose(want, grad, rtol=1e-5)

    def test_concatenate_refuses_records_of_different_ops(self):
        w = tf.Variable(_rand(3, 3, seed=1))
        made = []
        for depth in (1, 2):
            with tf.GradientTape() as tape:
                with weight_ops.deferring([w]) as stash:
                    y = _rand(2, 3)
                    for _ in range(depth):
                        y = weight_ops.matmul(y, w)
            tape.gradient(y, w)
            made.append(stash.records)
        with self.assertRaisesRegex(ValueError, "records differ"):
            weight_ops.concatenate(made)

    def test_in_a_tf_function(self):
        w = tf.Variable(_rand(3, 2, seed=1))
        x, dy = _rand(4, 3), _rand(4, 2, seed=3)

        @tf.function
        def split(x, dy):
            with tf.GradientTape() as tape:
                with weight_ops.deferring([w]) as stash:
                    y = weight_ops.matmul(x, w)
            self.assertIsNone(tape.gradient(y, w, output_gradients=dy))
            return weight_ops.weight_gradients(stash.records, [w])[0]

        self.assertAllClose(x.T @ dy, split(x, dy), rtol=1e-5)


if __name__ == "__main__":
    tf.test.main()
