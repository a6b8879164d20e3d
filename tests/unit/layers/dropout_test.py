"""Tests of deterministic dropout: micro-batch invariance, reproducibility, statistics."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, dense, dropout, structural
from lingvo_lite.pipeline import pipelining_layer


def _layer(keep_prob=0.6, name="drop", seed=7, dims=None):
    p = dropout.DropoutLayer.Params().Set(name=name, keep_prob=keep_prob, random_seed=seed,
                                          noise_shape_broadcast_dims=dims)
    return p.Instantiate()


def _run(layer, x, step_seed=11, example_offset=0, training=True):
    with fprop_context.fprop_context(training=training, step_seed=step_seed,
                                     example_offset=example_offset):
        return layer.FPropDefaultTheta(tf.constant(x)).numpy()


def _inputs(shape, seed=0):
    # Strictly positive so that "dropped" is exactly "output == 0".
    return np.random.default_rng(seed).uniform(0.5, 1.5, size=shape).astype(np.float32)


class DropoutTest(tf.test.TestCase):

    def test_micro_batches_match_full_batch_bitwise(self):
        for shape, dims in [([8, 5, 3], None), ([8, 4, 6], [1]), ([8, 7], None)]:
            layer = _layer(dims=dims)
            x = _inputs(shape)
            full = _run(layer, x)
            parts = [_run(layer, x[i:i + 2], example_offset=i) for i in range(0, 8, 2)]
            np.testing.assert_array_equal(full, np.concatenate(parts, axis=0))
            uneven = [_run(layer, x[a:b], example_offset=a) for a, b in [(0, 3), (3, 4), (4, 8)]]
            np.testing.assert_array_equal(full, np.concatenate(uneven, axis=0))
            self.assertTrue(0 < np.mean(full == 0) < 1)

    def test_reproducible_and_seed_dependent(self):
        layer = _layer()
        x = _inputs([4, 64])
        a, b = _run(layer, x, step_seed=5), _run(layer, x, step_seed=5)
        np.testing.assert_array_equal(a, b)
        c = _run(layer, x, step_seed=6)
        self.assertGreater(np.mean((a == 0) != (c == 0)), 0.2)
        # Another layer (other path) or another random_seed draws another mask.
        d = _run(_layer(name="other"), x, step_seed=5)
        self.assertGreater(np.mean((a == 0) != (d == 0)), 0.2)
        e = _run(_layer(seed=8), x, step_seed=5)
        self.assertGreater(np.mean((a == 0) != (e == 0)), 0.2)
        # Large (int64) step seeds work and differ in their high bits.
        f = _run(layer, x, step_seed=5 + (1 << 33))
        self.assertGreater(np.mean((a == 0) != (f == 0)), 0.2)

    def test_seed_comes_from_derive_seed(self):
        layer = _layer(seed=3, name="my_drop")
        self.assertEqual(layer.seed, weight_params.derive_seed(3, "my_drop"))
        x = _inputs([3, 10])
        expected = dropout.dropout(tf.constant(x), 0.6, weight_params.derive_seed(3, "my_drop"),
                                   11, 0)
        np.testing.assert_array_equal(_run(layer, x), expected.numpy())

    def test_keep_fraction_and_independence(self):
        x = np.ones([1000, 1000], np.float32)
        for keep_prob in (0.1, 0.5, 0.9):
            kept = _run(_layer(keep_prob=keep_prob), x) != 0
            n = kept.size
            sigma = np.sqrt(n * keep_prob * (1 - keep_prob))
            self.assertLess(abs(kept.sum() - n * keep_prob), 3 * sigma, msg=str(keep_prob))
        kept = (_run(_layer(keep_prob=0.5), x) != 0).astype(np.float64)
        corr = lambda a, b: np.corrcoef(a.ravel(), b.ravel())[0, 1]  # noqa: E731
        self.assertLess(abs(corr(kept[:-1], kept[1:])), 0.01)  # Neighbouring examples.
        self.assertLess(abs(corr(kept[:, :-1], kept[:, 1:])), 0.01)  # Neighbouring elements.
        self.assertLess(abs(corr(kept[:-1, :-1], kept[1:, 1:])), 0.01)  # Diagonal.
        next_step = (_run(_layer(keep_prob=0.5), x, step_seed=12) != 0).astype(np.float64)
        self.assertLess(abs(corr(kept, next_step)), 0.01)  # Consecutive steps.
        shifted = (_run(_layer(keep_prob=0.5), x, example_offset=1) != 0).astype(np.float64)
        self.assertLess(abs(corr(kept, shifted)), 0.01)  # Same element, other example.

    def test_kept_values_scaled(self):
        x = _inputs([6, 50])
        y = _run(_layer(keep_prob=0.6), x)
        kept = y != 0
        np.testing.assert_allclose(y[kept], x[kept] / 0.6, rtol=1e-6)

    def test_eval_mode_and_keep_prob_one_are_identity(self):
        x = _inputs([4, 9])
        np.testing.assert_array_equal(_run(_layer(), x, training=False), x)
        np.testing.assert_array_equal(_run(_layer(keep_prob=1.0), x, training=True), x)
        with self.assertRaisesRegex(ValueError, "keep_prob"):
            _layer(keep_prob=0.0)

    def test_inside_tf_function_with_tensor_seeds(self):
        layer = _layer(dims=[2])
        x = _inputs([8, 5, 4])

        @tf.function
        def fwd(inputs, step_seed, offset):
            with fprop_context.fprop_context(training=True, step_seed=step_seed,
                                             example_offset=offset):
                return layer.FPropDefaultTheta(inputs)

        eager = _run(layer, x, step_seed=21)
        graph = fwd(tf.constant(x), tf.constant(21, tf.int64), tf.constant(0, tf.int32))
        np.testing.assert_array_equal(graph.numpy(), eager)
        parts = [fwd(tf.constant(x[i:i + 4]), tf.constant(21, tf.int64), tf.constant(i))
                 for i in (0, 4)]
        np.testing.assert_array_equal(np.concatenate(parts), eager)
        # A dynamic batch size works too.
        dyn = tf.function(fwd.python_function, input_signature=[
            tf.TensorSpec([None, 5, 4], tf.float32), tf.TensorSpec([], tf.int32),
            tf.TensorSpec([], tf.int32)])
        np.testing.assert_array_equal(dyn(x[3:], 21, 3).numpy(), eager[3:])

    def test_noise_shape_broadcast_dims(self):
        x = _inputs([6, 4, 5])
        y = _run(_layer(dims=[1]), x)
        kept = y != 0
        np.testing.assert_array_equal(kept, np.broadcast_to(kept[:, :1, :], kept.shape))
        self.assertTrue(0 < np.mean(kept) < 1)
        # Negative dims and a batch-shared mask (dim 0) that ignores example_offset.
        y = _run(_layer(dims=[0, -1]), x)
        kept = y != 0
        np.testing.assert_array_equal(kept, np.broadcast_to(kept[:1, :, :1], kept.shape))
        self.assertTrue(0 < np.mean(kept) < 1)
        shifted = _run(_layer(dims=[0, -1]), x[2:], example_offset=2)
        np.testing.assert_array_equal(shifted, y[2:])
        with self.assertRaisesRegex(ValueError, "noise_shape_broadcast_dims"):
            _run(_layer(dims=[3]), x)

    def test_gradient_is_mask_over_keep_prob(self):
        layer = _layer(keep_prob=0.7)
        x = tf.constant(_inputs([5, 8]))
        upstream = tf.constant(np.random.default_rng(1).normal(size=[5, 8]).astype(np.float32))
        with fprop_context.fprop_context(training=True, step_seed=2):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = layer.FPropDefaultTheta(x)
                loss = tf.reduce_sum(y * upstream)
        grad = tape.gradient(loss, x).numpy()
        mask = (y.numpy() != 0).astype(np.float32)
        np.testing.assert_allclose(grad, upstream.numpy() * mask / 0.7, rtol=1e-6)


class DropPathTest(tf.test.TestCase):

    def test_layer_drops_whole_examples(self):
        p = dropout.DropPathLayer.Params().Set(name="dp", keep_prob=0.5, random_seed=1)
        layer = p.Instantiate()
        self.assertNotIn("noise_shape_broadcast_dims", p)
        x = _inputs([64, 3, 3, 2])
        y = _run(layer, x)
        mask = y / x
        per_example = mask.reshape(64, -1)
        np.testing.assert_array_equal(per_example, per_example[:, :1].repeat(18, axis=1))
        self.assertTrue(set(np.unique(per_example)) <= {0.0, 2.0})
        self.assertTrue(0 < np.mean(per_example == 0) < 1)
        parts = [_run(layer, x[i:i + 16], example_offset=i) for i in range(0, 64, 16)]
        np.testing.assert_array_equal(np.concatenate(parts), y)

    def test_function_reads_context(self):
        x = _inputs([32, 4])
        self.assertIs(dropout.drop_path(x, 0.5, (1, 2)), x)  # Eval mode: identity.
        with fprop_context.fprop_context(training=True, step_seed=4, example_offset=8):
            y = dropout.drop_path(tf.constant(x), tf.constant(0.5), (1, 2)).numpy()
        kept = (y != 0).all(axis=1)
        np.testing.assert_array_equal((y != 0).any(axis=1), kept)
        np.testing.assert_allclose(y[kept], x[kept] * 2.0, rtol=1e-6)
        # The same decisions as the general op with the mask shared over dim 1.
        ref = dropout.dropout(tf.constant(x), 0.5, (1, 2), 4, 8, [1]).numpy()
        np.testing.assert_array_equal(y, ref)


class _MeanSquareLoss(base_layer.BaseLayer):
    """NestedMap(loss=mean(x^2)): the mean over its (micro-)batch, for any layout."""

    def FProp(self, theta, inputs):
        del theta
        return NestedMap(loss=tf.reduce_mean(tf.square(inputs.x)))


def _field(name, sub):
    return structural.FieldLayer.Params().Set(name=name, field="x", sub=sub)


def _batch_dim_pipeline(layers, batch_dim, num_micro_batches):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=2, partition_method="uniform",
        num_micro_batches=num_micro_batches, batch_dim=batch_dim, random_seed=5,
        remat="always").Instantiate()


class DropoutBatchDimTest(tf.test.TestCase):
    """Issue 12: with batch_dim=1 (time-major [time, batch, dim]) masks depended on T."""

    BATCH, TIME, DIM = 16, 5, 6
    NUM_MICRO = (1, 2, 4, 8, 16)

    def _x(self, batch_dim):
        x = _inputs([self.BATCH, self.TIME, self.DIM])  # Batch-major.
        return x if batch_dim == 0 else x.transpose(1, 0, 2)

    def test_masks_depend_only_on_the_example_for_any_batch_dim(self):
        drop = _field("d0", dropout.DropoutLayer.Params().Set(name="drop", keep_prob=0.5))
        ident = structural.IdentityLayer.Params().Set(name="id")
        masks = {}
        for batch_dim in (0, 1):
            x = self._x(batch_dim)
            for t in self.NUM_MICRO:
                pipe = _batch_dim_pipeline([drop, ident], batch_dim, t)
                with fprop_context.fprop_context(training=True, step_seed=9):
                    y = pipe.FProp(pipe.theta, NestedMap(x=tf.constant(x))).x.numpy()
                masks[(batch_dim, t)] = y != 0
            # The unpipelined layers on the whole batch, told where the batch axis is.
            with fprop_context.fprop_context(training=True, step_seed=9, batch_dim=batch_dim):
                ref = composite.chain_fprop(pipe.layers, pipe.theta.layers,
                                            NestedMap(x=tf.constant(x))).x.numpy()
            self.assertTrue(0.3 < np.mean(ref == 0) < 0.7)
            for t in self.NUM_MICRO:
                np.testing.assert_array_equal(ref != 0, masks[(batch_dim, t)],
                                              err_msg=f"batch_dim={batch_dim}, T={t}")
        # The same example gets the same mask whether the batch axis is 0 or 1.
        np.testing.assert_array_equal(masks[(0, 1)], masks[(1, 1)].transpose(1, 0, 2))
        # Each example's mask is that of the example alone at its position.
        for i in (0, 7, 15):
            layer = dropout.DropoutLayer.Params().Set(
                name="drop", keep_prob=0.5, random_seed=5).Instantiate()
            full = _run(layer, self._x(0))
            np.testing.assert_array_equal(full[i:i + 1],
                                          _run(layer, self._x(0)[i:i + 1], example_offset=i))
            with fprop_context.fprop_context(training=True, step_seed=11, batch_dim=1,
                                             example_offset=i):
                alone = layer.FPropDefaultTheta(tf.constant(self._x(1)[:, i:i + 1])).numpy()
            np.testing.assert_array_equal(full[i:i + 1], alone.transpose(1, 0, 2))

    def test_pipelined_gradients_equal_a_plain_tape_for_any_batch_dim(self):
        def proj(name):
            return _field(name, dense.ProjectionLayer.Params().Set(
                name="proj", input_dim=self.DIM, output_dim=self.DIM, activation="TANH"))

        layers = [proj("p0"), _field("d0", dropout.DropoutLayer.Params().Set(
            name="drop", keep_prob=0.5)), proj("p1"), _MeanSquareLoss.Params().Set(name="loss")]
        for batch_dim in (0, 1):
            batch = NestedMap(x=tf.constant(self._x(batch_dim)))
            for t in self.NUM_MICRO:
                pipe = _batch_dim_pipeline(layers, batch_dim, t)
                with fprop_context.fprop_context(training=True, step_seed=3,
                                                 batch_dim=batch_dim):
                    with tf.GradientTape() as tape:
                        want = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
                    want_grads = tape.gradient(want.loss, pipe.theta.Flatten())
                with fprop_context.fprop_context(training=True, step_seed=3):
                    out, grads = pipe.FPropAndGrads(pipe.theta, batch)
                msg = f"batch_dim={batch_dim}, T={t}"
                np.testing.assert_allclose(want.loss.numpy(), out.loss.numpy(), rtol=2e-6,
                                           err_msg=msg)
                for w, g in zip(want_grads, grads.Flatten()):
                    np.testing.assert_allclose(w.numpy(), g.numpy(), rtol=2e-5, atol=2e-7,
                                               err_msg=msg)


if __name__ == "__main__":
    tf.test.main()
