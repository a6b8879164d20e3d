"""KerasLayer: FPropMeta against hand formulas, exact random slices, pooled batch norm."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from lingvo_lite.core import fprop_context, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import keras_flops, keras_layer


@keras.saving.register_keras_serializable(package="keras_layer_test")
class Square(keras.layers.Layer):
    """x * x + x: no hand formula, so its flops are measured."""

    def call(self, x):
        return x * x + x


def _params(layer: keras.layers.Layer, input_shape: list[int]) -> hyperparams.Params:
    return keras_layer.KerasLayer.Params().Set(
        name="k", keras_layer=keras_layer.serialize(layer), input_shape=input_shape)


def _flops(layer: keras.layers.Layer, *shapes: tuple) -> tuple[float, str]:
    if not layer.built:
        layer.build(*shapes)
    out = tf.nest.flatten(layer.compute_output_spec(*[keras.KerasTensor(s) for s in shapes]))
    return keras_flops.layer_flops(layer, list(shapes), list(out[0].shape))


class FlopsTest(tf.test.TestCase):

    def test_common_layers_equal_hand_formulas(self):
        L = keras.layers  # noqa: N806
        cases = [
            # (layer, input shapes, hand count: 2 per multiply-add, + bias, + activation)
            (L.Dense(10), [(4, 3)], 2 * 4 * 3 * 10 + 4 * 10),
            (L.Dense(10, activation="relu"), [(4, 3)], 2 * 4 * 3 * 10 + 4 * 10 + 4 * 10),
            (L.EinsumDense("abc,cde->abde", output_shape=(3, 5, 6), bias_axes="de"), [(2, 3, 4)],
             2 * 2 * 3 * 4 * 5 * 6 + 2 * 3 * 5 * 6),
            (L.Conv2D(8, 3), [(2, 10, 10, 3)], 2 * 2 * 8 * 8 * 8 * 9 * 3 + 2 * 8 * 8 * 8),
            (L.Conv1D(4, 3, padding="same"), [(2, 7, 5)], 2 * 2 * 7 * 4 * 3 * 5 + 2 * 7 * 4),
            (L.Conv3D(2, 2, use_bias=False), [(1, 3, 3, 3, 2)], 2 * 8 * 2 * 8 * 2),
            (L.Conv2DTranspose(4, 3, strides=2), [(1, 5, 5, 2)],
             2 * 25 * 2 * 9 * 4 + 11 * 11 * 4),
            (L.DepthwiseConv2D(3, depth_multiplier=2), [(2, 6, 6, 3)],
             2 * 2 * 16 * 6 * 9 + 2 * 16 * 6),
            (L.SeparableConv2D(5, 3), [(2, 6, 6, 3)],
             2 * 2 * 16 * (3 * 9 + 3 * 5) + 2 * 16 * 5),
            (L.MultiHeadAttention(num_heads=2, key_dim=4), [(2, 5, 8), (2, 5, 8)],
             2 * 2 * 5 * 8 * 2 * 4 * 3          # query, key and value projections
             + 2 * 2 * 2 * 5 * 5 * 4 * 2        # scores and weighted sum
             + 2 * 2 * 5 * 2 * 4 * 8            # output projection
             + 2 * 5 * 8 * 3 + 2 * 5 * 8        # biases
             + 5 * 2 * 2 * 5 * 5),              # softmax
            (L.Embedding(100, 8), [(4, 7)], 4 * 7 * 8),
            (L.BatchNormalization(), [(4, 10)], 8 * 40),
            (L.LayerNormalization(), [(4, 10)], 8 * 40),
            (L.MaxPooling2D(2), [(2, 8, 8, 3)], 2 * 4 * 4 * 3 * 4),
            (L.AveragePooling1D(3), [(2, 9, 3)], 2 * 3 * 3 * 3),
            (L.GlobalAveragePooling2D(), [(2, 8, 8, 3)], 2 * 8 * 8 * 3),
            (L.Activation("relu"), [(4, 10)], 40),
            (L.Activation("tanh"), [(4, 10)], 4 * 40),
            (L.Softmax(), [(4, 10)], 5 * 40),
            (L.Dropout(0.5), [(4, 10)], 3 * 40),
            (L.Flatten(), [(4, 2, 5)], 0),
        ]
        for layer, shapes, expected in cases:
            with self.subTest(layer=type(layer).__name__):
                flops, method = _flops(layer, *shapes)
                self.assertEqual(method, "formula")
                self.assertEqual(flops, expected)

    def test_other_layers_are_measured_or_estimated_never_zero(self):

        class Copy(keras.layers.Layer):
            def call(self, x):
                return tf.identity(x)

        flops, method = _flops(Square(), (4, 5))
        self.assertEqual((flops, method), (2 * 20, "measured"))  # A multiply and an add each.
        flops, method = _flops(Copy(), (4, 5))
        self.assertEqual((flops, method), (20, "estimated"))
        meta = keras_layer.KerasLayer.FPropMeta(_params(Square(), [5]), tf.TensorShape([4, 5]))
        self.assertEqual(meta.flops, 2 * 20)

    def test_fprop_meta_allocates_nothing(self):
        # 10^10 weights (40 GB) described from shapes alone.
        big = _params(keras.layers.Dense(100_000), [100_000])
        meta = keras_layer.KerasLayer.FPropMeta(big, tf.TensorShape([8, 100_000]))
        self.assertEqual(meta.num_params, 100_000 * 100_000 + 100_000)
        self.assertEqual(meta.flops, 2 * 8 * 100_000 * 100_000 + 8 * 100_000)

    def test_fprop_meta_of_a_nested_sequential_is_the_sum_of_its_layers(self):
        sub = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5),
                                keras.layers.Dense(3, activation="relu")])
        meta = keras_layer.KerasLayer.FPropMeta(_params(sub, [6]), tf.TensorShape([4, 6]))
        self.assertEqual(meta.flops, (2 * 4 * 6 * 5 + 4 * 5) + (2 * 4 * 5 * 3 + 4 * 3 + 4 * 3))
        self.assertEqual(meta.num_params, 6 * 5 + 5 + 5 * 3 + 3)
        self.assertEqual(meta.out_shapes[0], tf.TensorShape([4, 3]))

    def test_fprop_meta_params_and_shapes(self):
        conv = _params(keras.layers.Conv2D(8, 3, padding="same"), [10, 10, 3])
        meta = keras_layer.KerasLayer.FPropMeta(conv, NestedMap(
            x=tf.TensorShape([2, 10, 10, 3]), y=tf.TensorShape([2])))
        self.assertEqual(meta.num_params, 3 * 3 * 3 * 8 + 8)
        self.assertEqual(meta.out_shapes[0].x, tf.TensorShape([2, 10, 10, 8]))
        self.assertEqual(meta.out_shapes[0].y, tf.TensorShape([2]))
        bn = _params(keras.layers.BatchNormalization(), [7])
        meta = keras_layer.KerasLayer.FPropMeta(bn, tf.TensorShape([2, 7]))
        self.assertEqual((meta.num_params, meta.non_trainable_params), (4 * 7, 2 * 7))


class KerasLayerTest(tf.test.TestCase):

    def test_params_text_round_trip_and_override(self):
        p = _params(keras.layers.Dropout(0.3, noise_shape=(None, 1)), [5])
        q = keras_layer.KerasLayer.Params()
        line = [t for t in p.ToText().splitlines() if t.startswith("keras_layer")]
        q.FromText("\n".join(line))
        self.assertEqual(q.keras_layer, p.keras_layer)
        q.FromText("keras_layer[config][rate] : 0.5")
        self.assertEqual(q.Set(name="d", input_shape=[5]).Instantiate().keras_layer.rate, 0.5)

    def test_initial_weights_follow_random_seed_and_path(self):
        def kernel(seed, name="k"):
            p = _params(keras.layers.Dense(3), [2]).Set(name=name, random_seed=seed)
            return p.Instantiate().keras_layer.kernel.numpy()

        self.assertAllEqual(kernel(3), kernel(3))
        self.assertNotAllClose(kernel(3), kernel(4))
        self.assertNotAllClose(kernel(3), kernel(3, name="other"))

    def test_fprop_equals_the_keras_layer_and_nested_model(self):
        x = tf.random.stateless_normal([4, 6], seed=[1, 2])
        sub = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                                keras.layers.Dense(3)])
        layer = _params(sub, [6]).Instantiate()
        layer.keras_layer.set_weights(sub.get_weights())
        self.assertAllClose(layer.FProp(layer.theta, x), sub(x), rtol=0, atol=0)
        out = layer.FProp(layer.theta, NestedMap(x=x, y=tf.zeros([4])))
        self.assertAllClose(out.x, sub(x), rtol=0, atol=0)
        self.assertIn("y", out)

    def test_random_layers_draw_the_full_batch_rows_for_every_split(self):
        x = tf.random.stateless_uniform([12, 5, 3], seed=[3, 4], minval=0.5, maxval=1.5)
        L = keras.layers  # noqa: N806
        for make in (lambda: L.Dropout(0.4, seed=5), lambda: L.Dropout(0.4, (1, None, 1), 5),
                     lambda: L.SpatialDropout1D(0.5, seed=5), lambda: L.GaussianNoise(0.3, 5),
                     lambda: L.GaussianDropout(0.3, seed=5)):
            reference = make()
            state = reference.seed_generator.state.numpy()
            full = reference(x, training=True).numpy()  # Keras' own draw for all 12 examples.
            layer = _params(make(), [5, 3]).Instantiate()
            layer.keras_layer.seed_generator.state.assign(state)
            for split in ((0, 12), (0, 4, 8, 12), (0, 1, 5, 6, 12)):
                with self.subTest(layer=type(reference).__name__, split=split):
                    parts = []
                    for a, b in zip(split[:-1], split[1:]):
                        with fprop_context.fprop_context(training=True, example_offset=a):
                            parts.append(layer.FProp(layer.theta, x[a:b]).numpy())
                    np.testing.assert_array_equal(np.concatenate(parts), full)
            # The state advances only through ApplyUpdates, once per mini-batch.
            np.testing.assert_array_equal(layer.keras_layer.seed_generator.state.numpy(), state)

    def test_dropout_nested_in_a_sub_model_draws_the_full_batch_rows(self):
        x = tf.random.stateless_uniform([8, 6], seed=[5, 6], minval=0.5, maxval=1.5)

        def sub():
            return keras.Sequential([keras.Input((6,)), keras.layers.Dropout(0.5, seed=3)])

        reference = sub()
        state = reference.layers[0].seed_generator.state.numpy()
        full = reference(x, training=True).numpy()
        layer = _params(sub(), [6]).Instantiate()
        layer.keras_layer.layers[0].seed_generator.state.assign(state)
        parts = []
        for a in (0, 2, 4, 6):
            with fprop_context.fprop_context(training=True, example_offset=a):
                parts.append(layer.FProp(layer.theta, x[a:a + 2]).numpy())
        np.testing.assert_array_equal(np.concatenate(parts), full)

    def test_batch_norm_statistics_pool_once_per_mini_batch(self):
        x = np.random.default_rng(0).normal(2.0, 3.0, size=(8, 4)).astype(np.float32)
        layer = _params(keras.layers.BatchNormalization(momentum=0.7), [4]).Instantiate()
        collector = fprop_context.UpdateCollector()
        parts = []
        for a in (0, 2, 4, 6):
            with fprop_context.fprop_context(training=True, example_offset=a, updates=collector):
                parts.append(layer.FProp(layer.theta, x[a:a + 2]).numpy())
        for a, part in zip((0, 2, 4, 6), parts):  # Each micro-batch: its own moments.
            chunk = x[a:a + 2]
            expected = (chunk - chunk.mean(0)) / np.sqrt(chunk.var(0) + 1e-3)
            np.testing.assert_allclose(part, expected, rtol=1e-4, atol=1e-4)
        collector.apply()
        bn = layer.keras_layer
        np.testing.assert_allclose(bn.moving_mean.numpy(), 0.3 * x.mean(0), rtol=1e-5)
        np.testing.assert_allclose(bn.moving_variance.numpy(), 0.7 + 0.3 * x.var(0), rtol=1e-5)


if __name__ == "__main__":
    tf.test.main()
