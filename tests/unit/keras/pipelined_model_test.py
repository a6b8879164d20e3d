"""PipelinedModel against the same unpipelined Keras model: fit steps, weights, callbacks.

References, computed without lingvo-lite:
- T = 1: the plain `keras.Sequential.fit`, with the same initial weights, dropout seed
  states and optimizer.
- T = 4: GPipe's semantics written with Keras' own ops: each micro-batch of 2 examples
  goes through the Sequential's layers with batch norm on its own moments, every
  dropout mask is the matching rows of `tf.nn.experimental.stateless_dropout` drawn
  for the whole batch from the layer's seed state (what Keras draws), the loss is the
  mean over micro-batches, and the moving statistics are updated once with numpy's
  mean and population variance of the whole batch's batch-norm inputs.
Tolerance: weights after 1 and 10 SGD-with-momentum steps agree to rtol = atol = 1e-5
(float32 sums in a different order; at K=2, T=1 they were bitwise equal).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.keras import PipelinedModel, keras_layer

N, D, CLASSES = 8, 6, 4
RATE, MOMENTUM, SEED = 0.25, 0.8, 7
TOL = 1e-5


def _sequential() -> keras.Sequential:
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((D,)),
        keras.layers.Dense(12, activation="relu"),
        keras.layers.BatchNormalization(momentum=MOMENTUM),
        keras.layers.Dropout(RATE, seed=SEED),
        keras.layers.Dense(12, activation="tanh"),
        keras.layers.Dense(CLASSES),
    ])


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.normal(size=(N, D)).astype(np.float32), (np.arange(N) % CLASSES).astype(np.int32)


def _gpipe_reference(num_micro: int) -> list[list[np.ndarray]]:
    model = _sequential()
    x, y = _data()
    if num_micro == 1:
        model.compile(optimizer=_optimizer(), loss=_loss())
        after = []
        for epochs in (1, 9):
            model.fit(x, y, batch_size=N, epochs=epochs, shuffle=False, verbose=0)
            after.append(model.get_weights())
        return after
    loss_fn, opt = _loss(), _optimizer()
    m = N // num_micro
    dense0, bn, drop, dense1, dense2 = model.layers
    after = []
    for step in range(10):
        seed = tf.cast(tf.math.floormod(drop.seed_generator.state.value, tf.int32.max - 1),
                       tf.int32)
        mask = tf.nn.experimental.stateless_dropout(tf.ones([N, 12]), RATE, seed=seed)
        moving = [bn.moving_mean.numpy(), bn.moving_variance.numpy()]
        bn_inputs = []
        with tf.GradientTape() as tape:
            losses = []
            for t in range(num_micro):
                h = dense0(x[t * m:(t + 1) * m])
                bn_inputs.append(h.numpy())
                h = bn(h, training=True)  # Normalised with this micro-batch's moments.
                h = h * mask[t * m:(t + 1) * m]
                losses.append(loss_fn(y[t * m:(t + 1) * m], dense2(dense1(h))))
            loss = tf.add_n(losses) / num_micro
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        pooled = np.concatenate(bn_inputs).astype(np.float64)
        for var, old, stat in ((bn.moving_mean, moving[0], pooled.mean(0)),
                               (bn.moving_variance, moving[1], pooled.var(0))):
            var.assign((old * MOMENTUM + stat * (1 - MOMENTUM)).astype(np.float32))
        drop.seed_generator.state.assign(drop.seed_generator.state.value + [0, 1])
        if step in (0, 9):
            after.append(model.get_weights())
    return after


def _pipelined(num_cells: int, num_micro: int, remat: str, schedule: str = "gpipe",
               serial_devices: bool = False) -> PipelinedModel:
    model = PipelinedModel(_sequential(), num_cells=num_cells, num_micro_batches=num_micro,
                           remat=remat, schedule=schedule, partition_method="uniform",
                           serial_devices=serial_devices)
    model.compile(optimizer=_optimizer(), loss=_loss(), metrics=["accuracy"])
    return model


def _assert_weights_close(test: tf.test.TestCase, actual: list, expected: list) -> None:
    test.assertEqual(len(actual), len(expected))
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=TOL, atol=TOL)


class KerasModelTest(tf.test.TestCase):

    def test_fit_matches_unpipelined_for_every_k_t_remat(self):
        x, y = _data()
        # Every (K, remat) pair and every (K, T) pair once: remat and T act independently.
        remats = {1: ("always", "never", "always"), 4: ("never", "always", "never")}
        for num_micro in (1, 4):
            expected = _gpipe_reference(num_micro)
            runs = [(k, remats[num_micro][k - 1], "gpipe", False) for k in (1, 2, 3)]
            if num_micro == 4:
                runs += [(2, "except_last", "1f1b", False), (2, "except_last", "gpipe", True)]
            for num_cells, remat, schedule, serial in runs:
                with self.subTest(K=num_cells, T=num_micro, remat=remat, schedule=schedule,
                                  serial_devices=serial):
                    model = _pipelined(num_cells, num_micro, remat, schedule, serial)
                    pipe = model.pipeline
                    self.assertEqual(pipe.num_cells, num_cells)
                    for k in range(num_cells):  # Weights live on their cell's device.
                        for v in pipe.cell_variables(k):
                            self.assertTrue(v.device.endswith(pipe.devices[k].lstrip("/")),
                                            (v.device, pipe.devices[k]))
                    model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
                    _assert_weights_close(self, model.get_weights(), expected[0])
                    model.fit(x, y, batch_size=N, epochs=9, shuffle=False, verbose=0)
                    _assert_weights_close(self, model.get_weights(), expected[1])
                    state = model.plain.layers[2].seed_generator.state.numpy()
                    np.testing.assert_array_equal(state, [SEED, 10])

    def test_without_batch_statistics_t4_equals_plain_fit_with_sample_weights(self):
        x, y = _data()
        weights = np.linspace(0.5, 2.0, N).astype(np.float32)

        def sequential():
            keras.utils.set_random_seed(2)
            return keras.Sequential([
                keras.Input((D,)),
                keras.layers.Dense(12, activation="relu",
                                   kernel_regularizer=keras.regularizers.L2(0.05)),
                keras.layers.Dropout(RATE, seed=SEED),
                keras.layers.Dense(CLASSES, bias_regularizer=keras.regularizers.L1(0.05))])

        plain = sequential()
        model = PipelinedModel(sequential(), num_cells=2, num_micro_batches=4, remat="always")
        for m in (plain, model):
            m.compile(optimizer=_optimizer(), loss=_loss())
            history = m.fit(x, y, sample_weight=weights, batch_size=N, epochs=3, shuffle=False,
                            verbose=0)
            losses = history.history["loss"]
        _assert_weights_close(self, model.get_weights(), plain.get_weights())
        self.assertAllClose(losses, plain.history.history["loss"], rtol=TOL, atol=TOL)

    def test_saved_weights_load_into_the_plain_sequential(self):
        x, y = _data()
        model = _pipelined(2, 4, "except_last")
        model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=N // 2, epochs=1, shuffle=False, verbose=0)  # Retraced.
        path = os.path.join(tempfile.mkdtemp(), "pipelined.weights.h5")
        model.save_weights(path)
        plain = _sequential()
        plain.load_weights(path)
        expected = plain.predict(x, verbose=0)
        for batch_size in (N, 3):  # predict's batches have a dynamic size: run unsplit.
            np.testing.assert_allclose(model.predict(x, batch_size=batch_size, verbose=0),
                                       expected, rtol=1e-6, atol=1e-6)
        # A static batch runs pipelined: 4 micro-batches through the 2 cells.
        np.testing.assert_allclose(model(x), expected, rtol=1e-6, atol=1e-6)
        whole = os.path.join(os.path.dirname(path), "pipelined.keras")
        model.save(whole)
        loaded = PipelinedModel.load_model(whole, num_cells=2)
        self.assertEqual(loaded.pipeline.num_cells, 2)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-6, atol=1e-6)
        plain_weights = [w + 1.0 for w in plain.get_weights()]
        model.set_weights(plain_weights)
        _assert_weights_close(self, model.get_weights(), plain_weights)

    def test_callbacks_fire_and_write(self):
        x, y = _data()
        model = _pipelined(2, 2, "except_last")
        logdir = tempfile.mkdtemp()
        stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=1e3,
                                                restore_best_weights=True)
        callbacks = [
            keras.callbacks.TensorBoard(log_dir=os.path.join(logdir, "tb")),
            keras.callbacks.ModelCheckpoint(os.path.join(logdir, "ckpt_{epoch}.weights.h5"),
                                            save_weights_only=True),
            stopper,
        ]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            history = model.fit(x, y, batch_size=4, epochs=20, validation_data=(x, y),
                                callbacks=callbacks, shuffle=False, verbose=1)
        # min_delta is never reached: training stops after patience + 1 = 2 epochs, and
        # the weights of epoch 1 (the best) are restored.
        self.assertEqual(len(history.history["loss"]), 2)
        self.assertEqual(stopper.stopped_epoch, 1)
        self.assertIn("loss:", out.getvalue())
        self.assertIn("accuracy:", out.getvalue())
        self.assertEqual(sorted(os.path.basename(p) for p in glob.glob(
            os.path.join(logdir, "ckpt_*"))), ["ckpt_1.weights.h5", "ckpt_2.weights.h5"])
        epoch = []
        for name in ("ckpt_1.weights.h5", "ckpt_2.weights.h5"):
            plain = _sequential()
            plain.load_weights(os.path.join(logdir, name))
            epoch.append(plain.get_weights())
        self.assertGreater(np.abs(epoch[0][0] - epoch[1][0]).max(), 1e-4)
        _assert_weights_close(self, model.get_weights(), epoch[0])
        tags = set()
        for path in glob.glob(os.path.join(logdir, "tb", "train", "events.*")):
            for event in tf.compat.v1.train.summary_iterator(path):
                tags.update(v.tag for v in event.summary.value)
        self.assertTrue({"epoch_loss", "epoch_accuracy"} <= tags, tags)

    def test_unequal_batches_are_a_clear_error(self):
        x, y = _data()
        model = _pipelined(2, 2, "always")
        with self.assertRaisesRegex(ValueError, "batch_size=3.*divides"):
            model.fit(x, y, batch_size=3, verbose=0)
        with self.assertRaisesRegex(ValueError, "batch_size=1: num_micro_batches=2 does not "
                                                "divide the mini-batch size 1"):
            model.fit(x, y, batch_size=1, verbose=0)


@keras.saving.register_keras_serializable(package="keras_model_test")
class CallCounter(keras.layers.Layer):
    """Counts its calls in a non-trainable weight: state micro-batching cannot reproduce."""

    def build(self, input_shape: tuple) -> None:
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        self.count.assign(self.count + 1.0)
        return inputs


class UnsupportedLayersTest(tf.test.TestCase):

    def test_stateful_layer_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "'counter' \\(CallCounter\\) changes its "
                                                "non-trainable weight 'counter/"):
            PipelinedModel([keras.layers.Dense(4), CallCounter(name="counter")],
                           input_shape=(D,), num_cells=2)
        # A KerasLayer made directly (no pipeline_params) refuses it when it runs.
        layer = keras_layer.KerasLayer.Params().Set(
            name="k", keras_layer=keras_layer.serialize(CallCounter(name="counter")),
            input_shape=[D]).Instantiate()
        with self.assertRaisesRegex(ValueError, "'counter'.*non-trainable weight"), \
                fprop_context.fprop_context(training=True):
            layer.FProp(layer.theta, tf.zeros([2, D]))

    def test_unmapped_random_layer_and_renorm_are_refused(self):
        with self.assertRaisesRegex(ValueError, "'noise' \\(AlphaDropout\\) draws random"):
            PipelinedModel([keras.layers.AlphaDropout(0.1, name="noise")], input_shape=(D,))
        with self.assertRaisesRegex(ValueError, "'bn' .*renormalisation"):
            PipelinedModel([keras.layers.BatchNormalization(renorm=True, name="bn")],
                           input_shape=(D,))
        with self.assertRaisesRegex(ValueError, "'act' has activity_regularizer"):
            PipelinedModel([keras.layers.Dense(3, activity_regularizer="l2", name="act")],
                           input_shape=(D,))


if __name__ == "__main__":
    tf.test.main()
