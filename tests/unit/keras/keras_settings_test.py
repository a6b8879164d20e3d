"""Every compile/fit setting of PipelinedModel: trained exactly like plain Keras, or refused.

The reference is always the plain `keras.Sequential` with the same layers and initial
weights: one step's loss and gradients from Keras' own `compute_loss` under a tape, and
weights after a few plain `fit` steps (SGD and Adam). The pipeline runs K=2 cells and
T=4 micro-batches (T=2 where the micro-batches must differ in their masked counts).
Refusals are checked to be one-line ValueErrors raised before any step runs.

Tolerances: float32 rows 2e-5 (measured differences were 1.2e-7 or less: sums in another
order); mixed_float16 5e-4 and mixed_bfloat16 1e-2 (measured up to 8.6e-5 and 2.0e-3: one
rounding of the half-precision activations summed per micro-batch).
"""

from __future__ import annotations

import copy
import os
import tempfile

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import PipelinedModel, pipeline_params
from lingvo_lite.keras.keras_loss import KerasLossLayer, serialize_loss

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

N, D, CLASSES = 8, 5, 3
TOL = 2e-5


def _dense_stack(**dense_kwargs) -> list[keras.layers.Layer]:
    return [keras.layers.Dense(8, activation="tanh", **dense_kwargs),
            keras.layers.Dense(CLASSES)]


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = (np.arange(N) % CLASSES).astype(np.int32)
    sample_weight = np.linspace(0.25, 2.0, N).astype(np.float32)
    return x, y, sample_weight


class _NoXlaKernel(keras.layers.Layer):
    """Adds a Python function's zeros: an op XLA cannot compile."""

    def call(self, x):
        zeros = tf.numpy_function(lambda a: a * 0, [x], tf.float32)
        return x + tf.ensure_shape(zeros, x.shape)


def _pair(make_layers, input_shape=(D,), num_micro_batches=4, num_cells=2, **settings
          ) -> tuple[keras.Sequential, PipelinedModel]:
    """The plain Sequential and a PipelinedModel with the same initial weights."""
    keras.utils.set_random_seed(11)
    plain = keras.Sequential([keras.Input(input_shape), *make_layers()])
    pipelined = PipelinedModel(plain, num_cells=num_cells, num_micro_batches=num_micro_batches,
                               partition_method="uniform", **settings)
    keras.utils.set_random_seed(11)
    plain = keras.Sequential([keras.Input(input_shape), *make_layers()])
    return plain, pipelined


def _sparse_xent(**kwargs) -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)


def _plain_loss_and_gradients(plain: keras.Model, x, y, sample_weight=None):
    with tf.GradientTape() as tape:
        y_pred = plain(x, training=True)
        loss = plain.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
    grads = tape.gradient(loss, plain.trainable_variables)
    return loss, [tf.convert_to_tensor(g) for g in grads]  # Embedding's: IndexedSlices.


def _max_diff(a: list, b: list) -> float:
    return max(float(np.max(np.abs(np.asarray(u, np.float64) - np.asarray(v, np.float64))))
               for u, v in zip(a, b))


class SettingsTest(tf.test.TestCase):

    def assert_same_step(self, plain, pipelined, x, y, sample_weight=None, tol=TOL):
        """One step's loss and every gradient agree with plain Keras' on the same weights."""
        ref_loss, ref_grads = _plain_loss_and_gradients(plain, x, y, sample_weight)
        loss, grads = pipelined.loss_and_gradients(x, y, sample_weight)
        self.assertAllClose(float(ref_loss), float(loss), rtol=tol, atol=tol)
        self.assertLen(grads, len(ref_grads))
        for g, r in zip(grads, ref_grads):
            self.assertAllClose(r, tf.convert_to_tensor(g), rtol=tol, atol=tol)

    def assert_same_fit(self, make_layers, compile_kwargs, fit_kwargs=None, data=None,
                        optimizers=("sgd", "adam"), tol=TOL, **pair_kwargs) -> float:
        """Weights after 3 plain fit steps equal the pipelined ones; returns the max diff."""
        x, y, _ = data or _data()
        worst = 0.0
        for optimizer in optimizers:
            plain, pipelined = _pair(make_layers, **pair_kwargs)
            initial = plain.get_weights()
            for model in (plain, pipelined):
                opt = keras.optimizers.get({"sgd": "SGD", "adam": "Adam"}[optimizer])
                opt.learning_rate = 0.1 if optimizer == "sgd" else 0.01
                model.compile(optimizer=opt, **copy.deepcopy(compile_kwargs))  # Own metrics.
                model.fit(x, y, epochs=3, shuffle=False, verbose=0,
                          **{"batch_size": N, **(fit_kwargs or {})})
            with self.subTest(optimizer=optimizer):
                self.assertGreater(_max_diff(plain.get_weights(), initial), 1e-3)  # It trained.
                for a, b in zip(pipelined.get_weights(), plain.get_weights()):
                    self.assertAllClose(b, a, rtol=tol, atol=tol)
                for key in plain.history.history:
                    self.assertAllClose(plain.history.history[key],
                                        pipelined.history.history[key], rtol=tol, atol=tol)
            worst = max(worst, _max_diff(pipelined.get_weights(), plain.get_weights()))
        return worst

    def assert_one_line_refusal(self, pattern: str, fn) -> None:
        with self.assertRaisesRegex(ValueError, pattern) as caught:
            fn()
        message = str(caught.exception)
        self.assertNotIn("\n", message)
        self.assertIsNone(caught.exception.__cause__)

    # -- loss settings -------------------------------------------------------------

    def test_reduction_sum(self):
        x, y, w = _data()
        plain, pipelined = _pair(_dense_stack)
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent(reduction="sum"))
        self.assert_same_step(plain, pipelined, x, y)
        self.assert_same_step(plain, pipelined, x, y, w)
        self.assert_same_fit(_dense_stack, dict(loss=_sparse_xent(reduction="sum")))

    def test_reduction_mean_with_sample_weight(self):
        x, y, w = _data()
        loss = _sparse_xent(reduction="mean_with_sample_weight")
        plain, pipelined = _pair(_dense_stack)
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=loss)
        self.assert_same_step(plain, pipelined, x, y, w)
        self.assert_same_step(plain, pipelined, x, y)
        self.assert_same_fit(_dense_stack, dict(loss=loss), dict(sample_weight=w))

    def test_default_reduction_with_sample_and_class_weights(self):
        x, y, w = _data()
        plain, pipelined = _pair(_dense_stack)
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent())
        self.assert_same_step(plain, pipelined, x, y, w)
        self.assert_same_fit(_dense_stack, dict(loss=_sparse_xent()), dict(sample_weight=w),
                             optimizers=("adam",))
        self.assert_same_fit(_dense_stack, dict(loss=_sparse_xent()),
                             dict(class_weight={0: 0.5, 1: 2.0, 2: 1.0}), optimizers=("sgd",))

    def test_loss_weights_are_honoured(self):
        x, y, w = _data()
        for loss_weights in ([3.0], 3.0):
            with self.subTest(loss_weights=loss_weights):
                plain, pipelined = _pair(_dense_stack)
                for model in (plain, pipelined):
                    model.compile(optimizer="sgd", loss=_sparse_xent(), loss_weights=loss_weights)
                self.assert_same_step(plain, pipelined, x, y, w)
        self.assert_same_fit(_dense_stack, dict(loss="mse", loss_weights=[3.0]),
                             data=(x, np.eye(CLASSES, dtype=np.float32)[y], None),
                             optimizers=("adam",))

    def test_several_losses_are_refused_in_one_line(self):
        _, pipelined = _pair(_dense_stack)
        self.assert_one_line_refusal(
            "loss has 2 entries, but a pipelined layer stack has one output",
            lambda: pipelined.compile(loss=[_sparse_xent(), "mse"]))
        self.assert_one_line_refusal(
            "loss_weights has 2 entries",
            lambda: pipelined.compile(loss=_sparse_xent(), loss_weights=[1.0, 2.0]))
        self.assert_one_line_refusal(
            "reduction='none'.*use one of 'sum_over_batch_size'",
            lambda: pipelined.compile(loss=_sparse_xent(reduction="none")))

    def test_trainer_task_refuses_reduction_sum(self):
        # A trainer.py task's loss layer is not told the number of micro-batches.
        self.assert_one_line_refusal(
            "reduction='sum' is not supported in a trainer.py task",
            lambda: pipeline_params(_dense_stack(), (D,), num_cells=2,
                                    loss=_sparse_xent(reduction="sum")))

    def test_a_misspelt_setting_is_refused_in_one_line_with_the_fix(self):
        # One record of settings for the layer stack, the functional model and the task.
        inputs = keras.Input((D,))
        functional = keras.Model(inputs, keras.layers.Dense(3)(inputs))
        for build in (lambda: PipelinedModel(_dense_stack(), (D,), num_cell=2),
                      lambda: PipelinedModel(functional, num_cell=2),
                      lambda: pipeline_params(_dense_stack(), (D,), num_cell=2)):
            self.assert_one_line_refusal(
                r"unknown pipeline setting num_cell=2 \(did you mean num_cells\?\)", build)

    def test_metrics_and_steps_per_execution(self):
        # Two steps of 4 examples per execution; the history holds every metric.
        self.assert_same_fit(
            _dense_stack, dict(loss=_sparse_xent(), steps_per_execution=2,
                               metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(
                                   from_logits=True)], weighted_metrics=["accuracy"]),
            dict(sample_weight=_data()[2], batch_size=N // 2), optimizers=("adam",),
            num_micro_batches=2)

    def test_jit_compile_compiles_each_cell_with_xla(self):
        # Plain Keras compiles its step with XLA too; each cell's functions are compiled
        # for its device (the step that places them is not).
        self.assert_same_fit(_dense_stack, dict(loss=_sparse_xent(), jit_compile=True))
        _, pipelined = _pair(lambda: [keras.layers.Dense(4), _NoXlaKernel(name="no_xla")])
        pipelined.compile(optimizer="sgd", loss="mse", jit_compile=True)
        self.assertTrue(pipelined.cells_jit_compile)
        x, _, _ = _data()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "PyFunc"):
            pipelined.fit(x, np.zeros((N, 4), "float32"), batch_size=N, verbose=0)

    def test_jit_compile_auto_and_refusals(self):
        _, pipelined = _pair(_dense_stack)
        pipelined.compile(optimizer="sgd", loss="mse", jit_compile="auto")
        self.assertFalse(pipelined.cells_jit_compile)  # As Keras resolves it on a CPU.
        _, noisy = _pair(lambda: [keras.layers.Dense(8), keras.layers.GaussianNoise(0.1, name="n"),
                                  keras.layers.Dense(CLASSES)])
        self.assert_one_line_refusal(
            "jit_compile=True with Keras layer 'n' \\(GaussianNoise\\), which draws normal noise",
            lambda: noisy.compile(loss="mse", jit_compile=True))

    def test_jit_compile_with_dropout_draws_what_plain_keras_draws_under_xla(self):
        # XLA's uniform draw differs from TensorFlow's kernel's: every micro-batch draws its
        # rows of XLA's whole-batch mask, also in forwards run uncompiled (except_last's last).
        def dropped():
            return [keras.layers.Dense(16, activation="tanh"),
                    keras.layers.Dropout(0.3), keras.layers.Dense(16, activation="tanh"),
                    keras.layers.Dropout(0.5),
                    keras.layers.Dense(CLASSES)]
        compiled = dict(loss=_sparse_xent(), jit_compile=True)
        for cells, micro_batches, remat in ((1, 1, "except_last"), (2, 4, "except_last"),
                                            (2, 2, "never"), (3, 4, "always")):
            with self.subTest(cells=cells, micro_batches=micro_batches, remat=remat):
                self.assert_same_fit(dropped, compiled, num_cells=cells,
                                     num_micro_batches=micro_batches, remat=remat)

    # -- mixed precision ---------------------------------------------------------------

    def test_mixed_precision_policies(self):
        x, y, w = _data()

        def layers():  # Dropout draws its mask in the compute dtype, as in Keras.
            return [keras.layers.Dense(8, activation="tanh"), keras.layers.Dropout(0.3, seed=3),
                    keras.layers.Dense(CLASSES)]

        try:
            keras.mixed_precision.set_global_policy("mixed_float16")
            plain, pipelined = _pair(layers)
            self.assertEqual(pipelined.plain.layers[0].compute_dtype, "float16")
            for model in (plain, pipelined):
                model.compile(optimizer="sgd", loss=_sparse_xent())
            # Both wrap the optimizer in a LossScaleOptimizer; the step's gradients are
            # taken on the scaled loss and unscaled.
            self.assertIsInstance(pipelined.optimizer, keras.optimizers.LossScaleOptimizer)
            self.assert_same_step(plain, pipelined, x, y, w, tol=5e-4)
            self.assert_same_fit(layers, dict(loss=_sparse_xent()), tol=5e-4,
                                 optimizers=("sgd",))
            keras.mixed_precision.set_global_policy("mixed_bfloat16")
            plain, pipelined = _pair(layers)
            for model in (plain, pipelined):
                model.compile(optimizer="sgd", loss=_sparse_xent())
            predictions = pipelined.predict(x, verbose=0)
            self.assertEqual(predictions.dtype, np.dtype(tf.bfloat16.as_numpy_dtype))
            self.assert_same_step(plain, pipelined, x, y, w, tol=1e-2)
            self.assert_same_fit(layers, dict(loss=_sparse_xent()), tol=1e-2,
                                 optimizers=("adam",))
        finally:
            keras.mixed_precision.set_global_policy("float32")

    # -- layers --------------------------------------------------------------------

    def test_regularizers_and_constraints(self):
        def layers():
            return [keras.layers.Dense(8, activation="tanh",
                                       kernel_regularizer=keras.regularizers.L2(0.1),
                                       kernel_constraint=keras.constraints.MaxNorm(0.3)),
                    keras.layers.Dense(CLASSES, bias_constraint=keras.constraints.NonNeg())]

        x, y, w = _data()
        plain, pipelined = _pair(layers)
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent())
        self.assert_same_step(plain, pipelined, x, y, w)
        self.assert_same_fit(layers, dict(loss=_sparse_xent()), optimizers=("adam",))

    def test_zero_dropout_and_default_attention(self):
        def layers():
            return [keras.layers.Dense(8), keras.layers.Dropout(0.0),
                    SelfAttention(), keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(CLASSES)]

        x = np.random.default_rng(1).normal(size=(N, 3, D)).astype(np.float32)
        y = _data()[1]
        plain, pipelined = _pair(layers, input_shape=(3, D))
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent())
        self.assert_same_step(plain, pipelined, x, y)
        # SGD: the attention's key bias has an analytically zero gradient, whose rounding
        # noise Adam would normalise to full-size steps in both models.
        self.assert_same_fit(layers, dict(loss=_sparse_xent()), data=(x, y, None),
                             input_shape=(3, D), optimizers=("sgd",))

    def test_add_loss_is_refused_in_one_line(self):
        self.assert_one_line_refusal(
            "'penalised' \\(AddsLoss\\) adds a loss in its call \\(add_loss\\)",
            lambda: PipelinedModel([keras.layers.Dense(4), AddsLoss(name="penalised")],
                                   input_shape=(D,), num_cells=2))

    def test_load_weights_of_another_model_is_one_line(self):
        path = os.path.join(tempfile.mkdtemp(), "other.weights.h5")
        other = keras.Sequential([keras.Input((D,)), *_dense_stack(),
                                  keras.layers.Dense(2)])
        other.save_weights(path)
        _, pipelined = _pair(_dense_stack)
        self.assert_one_line_refusal("does not hold this model's weights",
                                     lambda: pipelined.load_weights(path))
        different_last = keras.Sequential([keras.Input((D,)), keras.layers.Dense(8),
                                           keras.layers.Dense(CLASSES + 1)])
        different_last.save_weights(path)
        self.assert_one_line_refusal("does not hold this model's weights",
                                     lambda: pipelined.load_weights(path))

    # -- masks -----------------------------------------------------------------------

    def test_masks_travel_across_cells(self):
        vocab, length = 7, 6
        rng = np.random.default_rng(2)
        tokens = rng.integers(1, vocab, size=(N, length)).astype(np.int32)
        for i in range(N):  # Padding differs per example, hence per micro-batch.
            tokens[i, length - i % length:] = 0
        y = _data()[1]

        def pooled():
            return [keras.layers.Embedding(vocab, 4, mask_zero=True),
                    keras.layers.Dense(6, activation="tanh"),
                    keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(CLASSES)]

        plain, pipelined = _pair(pooled, input_shape=(length,), num_cells=3)
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent())
        self.assert_same_step(plain, pipelined, tokens, y)
        self.assertAllClose(plain.predict(tokens, verbose=0),
                            pipelined.predict(tokens, verbose=0), rtol=TOL, atol=TOL)
        # Adam too: the leading Embedding's gradient reaches it as Keras' IndexedSlices.
        self.assert_same_fit(pooled, dict(loss=_sparse_xent()), data=(tokens, y, None),
                             input_shape=(length,), num_cells=3)
        inner = PipelinedModel([keras.layers.Identity(), keras.layers.Embedding(vocab, 4),
                                keras.layers.GlobalAveragePooling1D()],
                               input_shape=(length,), num_cells=2)
        self.assert_one_line_refusal(
            "optimizer Adam with the trainable Embedding 'embedding.*' would train differently",
            lambda: inner.compile(optimizer="adam", loss=_sparse_xent()))

        def recurrent():  # LSTMs skip the masked steps.
            return [keras.layers.Embedding(vocab, 4, mask_zero=True),
                    keras.layers.LSTM(5, return_sequences=True), keras.layers.LSTM(5),
                    keras.layers.Dense(CLASSES)]

        plain, pipelined = _pair(recurrent, input_shape=(length,))
        for model in (plain, pipelined):
            model.compile(optimizer="sgd", loss=_sparse_xent())
        self.assert_same_step(plain, pipelined, tokens, y)
        self.assert_one_line_refusal(
            "'lstm_cell' \\(LSTMCell\\) draws random numbers \\(dropout=0.2, "
            "recurrent_dropout=0.0\\).*set both to 0",
            lambda: PipelinedModel([keras.layers.LSTM(5, dropout=0.2)], input_shape=(3, D)))

        def per_token():  # The loss itself is masked: Keras divides by the unmasked count.
            return [keras.layers.Embedding(vocab, 4, mask_zero=True),
                    keras.layers.Dense(CLASSES)]

        labels = rng.integers(0, CLASSES, size=(N, length)).astype(np.int32)
        for reduction in ("sum_over_batch_size", "mean_with_sample_weight", "sum"):
            with self.subTest(reduction=reduction):
                plain, pipelined = _pair(per_token, input_shape=(length,), num_micro_batches=2)
                for model in (plain, pipelined):
                    model.compile(optimizer="sgd", loss=_sparse_xent(reduction=reduction))
                self.assert_same_step(plain, pipelined, tokens, labels)
                token_weights = rng.uniform(0.5, 2.0, size=(N, length)).astype(np.float32)
                self.assert_same_step(plain, pipelined, tokens, labels, token_weights)


class KerasLossLayerTest(tf.test.TestCase):

    def test_micro_batches_combine_to_keras_loss_and_masked_accuracy(self):
        rng = np.random.default_rng(4)
        logits = tf.constant(rng.normal(size=(4, 5, CLASSES)), tf.float32)
        labels = tf.constant(rng.integers(0, CLASSES, size=(4, 5)), tf.int32)
        mask = tf.constant(rng.uniform(size=(4, 5)) > 0.4)
        weights = tf.constant(rng.uniform(0.5, 2.0, size=(4, 5)), tf.float32)
        for reduction in ("sum_over_batch_size", "mean_with_sample_weight", "sum"):
            for sample_weight in (None, weights):
                layer = KerasLossLayer.Params().Set(
                    name="loss", loss=serialize_loss(_sparse_xent(reduction=reduction)),
                    sparse_accuracy=True).Instantiate()
                halves = []
                for part in (slice(0, 2), slice(2, 4)):
                    inputs = NestedMap(x=logits[part], x_mask=mask[part], y=labels[part],
                                       num_micro_batches=tf.constant(2.0))
                    if sample_weight is not None:
                        inputs.sample_weight = sample_weight[part]
                    halves.append(layer.FProp(layer.theta, inputs))
                # The pipeline's combination: mean over micro-batches, weighted by
                # loss_weight when the layer returns one.
                w = [h.get("loss_weight", tf.constant(1.0)) for h in halves]
                combined = (w[0] * halves[0].loss + w[1] * halves[1].loss) / (w[0] + w[1])
                masked = tf.identity(logits)
                masked._keras_mask = mask
                expected = _sparse_xent(reduction=reduction)(labels, masked, sample_weight)
                with self.subTest(reduction=reduction, weighted=sample_weight is not None):
                    self.assertAllClose(expected, combined, rtol=1e-6, atol=1e-6)
                    correct = np.argmax(logits, -1) == labels.numpy()
                    accuracy = (w[0] * halves[0].accuracy + w[1] * halves[1].accuracy) / (
                        w[0] + w[1])
                    if "loss_weight" in halves[0] and sample_weight is None:
                        self.assertAllClose(correct[mask.numpy()].mean(), accuracy)


@keras.saving.register_keras_serializable(package="keras_settings_test")
class SelfAttention(keras.layers.Layer):
    """MultiHeadAttention with its default dropout=0.0, attending over its own input."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)

    def call(self, x):
        return self.attention(x, x)


@keras.saving.register_keras_serializable(package="keras_settings_test")
class AddsLoss(keras.layers.Layer):
    """Adds the mean square of its input to the loss."""

    def call(self, x):
        self.add_loss(tf.reduce_mean(tf.square(x)))
        return x


if __name__ == "__main__":
    tf.test.main()
