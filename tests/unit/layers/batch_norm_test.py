"""BatchNormLayer: batch/moving statistics and exact pooling of micro-batch statistics."""

import numpy as np
import tensorflow as tf

from lingvo_lite.core.fprop_context import UpdateCollector, fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import normalization


def _np_normalize(x, mean, variance, gamma, beta, epsilon):
    return (x - mean) / np.sqrt(variance + epsilon) * gamma + beta


def _np_moments(x):
    axes = tuple(range(x.ndim - 1))
    return x.mean(axis=axes), x.var(axis=axes)


class BatchNormTest(tf.test.TestCase):

    def _layer(self, dim, **kw):
        p = normalization.BatchNormLayer.Params().Set(name="bn", dim=dim, **kw)
        layer = p.Instantiate()
        rng = np.random.default_rng(7)
        # Non-trivial weights and moving statistics, so every term of the formula matters.
        layer.vars.gamma.assign(rng.uniform(0.5, 2.0, dim).astype(np.float32))
        layer.vars.beta.assign(rng.normal(size=dim).astype(np.float32))
        layer.vars.moving_mean.assign(rng.normal(size=dim).astype(np.float32))
        layer.vars.moving_variance.assign(rng.uniform(0.5, 3.0, dim).astype(np.float32))
        return layer

    def _weights(self, layer):
        return {k: v.numpy() for k, v in layer.vars.items()}

    def test_train_mode_uses_batch_statistics(self):
        rng = np.random.default_rng(0)
        for shape in ([6, 5], [3, 4, 5, 7]):
            dim = shape[-1]
            layer = self._layer(dim, epsilon=1e-3)
            w = self._weights(layer)
            x = (rng.normal(size=shape) * 3.0 + 1.5).astype(np.float32)
            with fprop_context(training=True):
                y = layer.FPropDefaultTheta(tf.constant(x)).numpy()
            mean, var = _np_moments(x.astype(np.float64))
            expected = _np_normalize(x, mean, var, w["gamma"], w["beta"], 1e-3)
            self.assertAllClose(expected, y, rtol=1e-4, atol=1e-4)
            # Without a collector nothing is recorded and the moving stats are untouched.
            self.assertAllEqual(w["moving_mean"], layer.vars.moving_mean.numpy())

    def test_eval_mode_uses_moving_averages(self):
        rng = np.random.default_rng(1)
        for shape in ([4, 3], [2, 3, 3, 3]):
            layer = self._layer(shape[-1], epsilon=1e-3)
            w = self._weights(layer)
            x = rng.normal(size=shape).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x)).numpy()  # Default context: eval.
            expected = _np_normalize(x, w["moving_mean"], w["moving_variance"], w["gamma"],
                                     w["beta"], 1e-3)
            self.assertAllClose(expected, y, rtol=1e-5, atol=1e-5)

    def test_use_moving_avg_in_training(self):
        rng = np.random.default_rng(2)
        layer = self._layer(4, use_moving_avg_in_training=True)
        w = self._weights(layer)
        x = rng.normal(size=[5, 4]).astype(np.float32)
        collector = UpdateCollector()
        with fprop_context(training=True, updates=collector):
            y = layer.FPropDefaultTheta(tf.constant(x)).numpy()
        expected = _np_normalize(x, w["moving_mean"], w["moving_variance"], w["gamma"],
                                 w["beta"], 1e-3)
        self.assertAllClose(expected, y, rtol=1e-5, atol=1e-5)
        self.assertLen(collector, 1)  # The moving averages are still updated.

    def test_micro_batches_pool_to_whole_batch_statistics(self):
        rng = np.random.default_rng(3)
        decay = 0.9
        for shape, sizes in (([10, 6], [1, 4, 5]), ([7, 3, 2, 4], [3, 2, 2])):
            dim = shape[-1]
            layer = self._layer(dim, decay=decay, epsilon=1e-3)
            w = self._weights(layer)
            # Micro-batches with clearly different means make a mean-of-variances wrong.
            x = rng.normal(size=shape).astype(np.float32)
            x += np.arange(shape[0], dtype=np.float32).reshape([-1] + [1] * (len(shape) - 1))
            parts = np.split(x, np.cumsum(sizes)[:-1])
            collector = UpdateCollector()
            with fprop_context(training=True, updates=collector):
                outputs = [layer.FPropDefaultTheta(tf.constant(part)).numpy() for part in parts]
            # Each micro-batch is normalised with its own statistics (GPipe's per-micro-batch BN).
            for part, out in zip(parts, outputs):
                mean, var = _np_moments(part.astype(np.float64))
                self.assertAllClose(
                    _np_normalize(part, mean, var, w["gamma"], w["beta"], 1e-3), out,
                    rtol=1e-4, atol=1e-4)
            self.assertLen(collector, 1)
            self.assertLen(collector.items()[0][1], len(sizes))
            collector.apply()
            mean, var = _np_moments(x.astype(np.float64))
            self.assertAllClose(decay * w["moving_mean"] + (1 - decay) * mean,
                                layer.vars.moving_mean.numpy(), rtol=1e-6, atol=1e-6)
            self.assertAllClose(decay * w["moving_variance"] + (1 - decay) * var,
                                layer.vars.moving_variance.numpy(), rtol=1e-6, atol=1e-6)

    def test_pool_moments_matches_numpy(self):
        rng = np.random.default_rng(4)
        x = rng.normal(size=[12, 3]).astype(np.float64) * 2.0
        x[:4] += 5.0
        stats = []
        for part in (x[:4], x[4:5], x[5:]):
            stats.append(NestedMap(count=float(part.shape[0]), mean=part.mean(0).astype(np.float32),
                                   variance=part.var(0).astype(np.float32)))
        mean, var = normalization.pool_moments(stats)
        self.assertAllClose(x.mean(0), mean.numpy(), rtol=1e-5, atol=1e-5)
        self.assertAllClose(x.var(0), var.numpy(), rtol=1e-5, atol=1e-5)

    def test_apply_updates_in_tf_function(self):
        rng = np.random.default_rng(5)
        layer = self._layer(3, decay=0.5)
        w = self._weights(layer)
        x = rng.normal(size=[8, 3]).astype(np.float32)

        @tf.function
        def step(a, b):
            collector = UpdateCollector()
            with fprop_context(training=True, updates=collector):
                layer.FPropDefaultTheta(a)
                layer.FPropDefaultTheta(b)
            collector.apply()

        step(tf.constant(x[:3]), tf.constant(x[3:]))
        mean, var = _np_moments(x.astype(np.float64))
        self.assertAllClose(0.5 * w["moving_mean"] + 0.5 * mean,
                            layer.vars.moving_mean.numpy(), rtol=1e-6, atol=1e-6)
        self.assertAllClose(0.5 * w["moving_variance"] + 0.5 * var,
                            layer.vars.moving_variance.numpy(), rtol=1e-6, atol=1e-6)

    def test_fprop_meta_and_num_params(self):
        for shape in ([1, 5], [3, 5], [1, 3, 3, 5], [2, 7, 1, 5]):
            p = normalization.BatchNormLayer.Params().Set(name="bn", dim=5)
            layer = p.Instantiate()
            meta = normalization.BatchNormLayer.FPropMeta(p, tf.TensorShape(shape))
            with fprop_context(training=True):
                y = layer.FPropDefaultTheta(tf.zeros(shape))
            self.assertEqual(tuple(meta.out_shapes), (tf.TensorShape(y.shape),))
            self.assertEqual(meta.num_params, sum(int(np.prod(v.shape)) for v in layer.variables))
            self.assertEqual(meta.num_params, 20)
            self.assertGreater(meta.flops, 0)

    def test_bad_dim_raises(self):
        p = normalization.BatchNormLayer.Params().Set(name="bn", dim=4)
        layer = p.Instantiate()
        with self.assertRaisesRegex(ValueError, "p.dim"):
            layer.FPropDefaultTheta(tf.zeros([2, 3]))
        with self.assertRaisesRegex(ValueError, "p.dim"):
            normalization.BatchNormLayer.FPropMeta(p, tf.TensorShape([2, 3]))


if __name__ == "__main__":
    tf.test.main()
