"""PipelinedModel.fit on length-bucketed batches (keras_buckets.py) against plain Keras fit.

The data: token sequences of 2 to 32 tokens batched by `tf.data.Dataset.bucket_by_sequence_length`
into 8 x 8, 4 x 16 and 2 x 32 (padded to the bucket boundary, remainders dropped). The
reference is the same Keras model, with the same initial weights, fit by Keras itself on the
same batches (plain Keras traces its step for unknown shapes and needs no buckets).
Tolerance: weights and losses (validation on the same batches included) within 1e-5 (float32
sums in another order).

Plain Keras' optimizer counts one step more per epoch than it takes on a dataset of unknown
length (its iterations variable is incremented in the call that finds the dataset exhausted),
which shifts Adam's bias correction from the second epoch on: Adam is compared over one
epoch, SGD with momentum (no step count) over two.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from lingvo_lite.keras import PipelinedModel

VOCAB, TOL = 11, 1e-5
# A gradient that is zero in exact arithmetic comes out as float32 rounding noise: a few units of
# float32's eps (1.2e-7) of the largest gradient. Real gradients here are 2e-5 of it or more.
ZERO_GRADIENT_FRACTION = 1e-6
# Such a weight moves less than this fraction of the largest move of a trained weight.
INERT_MOVE_FRACTION = 1e-2
BOUNDARIES, SIZES = [9, 17, 33], [8, 4, 2, 1]
BUCKETS = [(8, 8), (4, 16), (2, 32)]


def _dataset(pad_to_boundary: bool = True) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, VOCAB, size=int(n)) for n in rng.integers(2, 33, size=48)]
    ds = tf.data.Dataset.from_generator(
        lambda: (((s, (s * 3) % VOCAB)) for s in seqs),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)))
    return ds.bucket_by_sequence_length(
        lambda x, _: tf.shape(x)[0], BOUNDARIES, SIZES, pad_to_bucket_boundary=pad_to_boundary,
        drop_remainder=True)


def _sequential() -> keras.Sequential:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((None,), dtype="int32"),
                             keras.layers.Embedding(VOCAB, 6),
                             keras.layers.Dense(12, activation="tanh"),
                             keras.layers.Dense(VOCAB)])


def _functional() -> keras.Model:
    """Self-attention over the sequence: what each position computes depends on its length."""
    keras.utils.set_random_seed(2)
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = keras.layers.Embedding(VOCAB, 8, name="emb")(ids)
    h = keras.layers.Add(name="res")([h, keras.layers.MultiHeadAttention(2, 4, name="att")(h, h)])
    h = keras.layers.LayerNormalization(name="ln")(h)
    return keras.Model(ids, keras.layers.Dense(VOCAB, name="out")(h))


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _inert_weights(model: keras.Model) -> set[int]:
    """Indices of the weights whose gradient is zero in exact arithmetic (the attention's key
    bias: softmax ignores what it adds to every score of a row): at most ZERO_GRADIENT_FRACTION
    of the largest gradient element on every batch."""
    largest, per_weight = 0.0, np.zeros(len(model.trainable_weights))
    for x, y in _dataset().take(8):
        with tf.GradientTape() as tape:
            loss = _loss()(y, model(x))
        grads = [np.abs(tf.convert_to_tensor(g).numpy()).max()
                 for g in tape.gradient(loss, model.trainable_weights)]
        largest = max(largest, *grads)
        per_weight = np.maximum(per_weight, grads)
    trainable = {id(v): i for i, v in enumerate(model.trainable_weights)}
    floor = ZERO_GRADIENT_FRACTION * largest
    return {i for i, v in enumerate(model.weights)
            if id(v) in trainable and per_weight[trainable[id(v)]] <= floor}


class _CellTraces(keras.callbacks.Callback):
    """The pipeline's per-cell trace counts after the first step (one bucket seen)."""

    def __init__(self, pipelined: PipelinedModel) -> None:
        super().__init__()
        self.pipelined, self.first, self.steps = pipelined, None, 0

    def counts(self) -> list[int]:
        return [c.num_traces for c in self.pipelined.pipeline._executor(0)._cells]

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.first is None:
            self.first = self.counts()


class KerasBucketsTest(tf.test.TestCase):

    def _check_fit(self, make_model, optimizer, epochs, **pipeline):
        reference = make_model()
        initial = reference.get_weights()
        pipelined = PipelinedModel(make_model(), num_cells=2, num_micro_batches=2,
                                   input_buckets=BUCKETS, **pipeline)
        pipelined.compile(optimizer=optimizer(), loss=_loss())
        traces = _CellTraces(pipelined)
        history = pipelined.fit(_dataset(), epochs=epochs, verbose=0, callbacks=[traces],
                                validation_data=_dataset())
        reference.set_weights(initial)
        reference.compile(optimizer=optimizer(), loss=_loss())
        expected = reference.fit(_dataset(), epochs=epochs, verbose=0,
                                 validation_data=_dataset())
        for key in ("loss", "val_loss"):  # Evaluation runs the buckets unsplit, any shape.
            self.assertAllClose(expected.history[key], history.history[key], rtol=TOL)
        inert = _inert_weights(make_model())
        self.assertLessEqual(len(inert), 1)  # At most the attention's key bias.
        moves = [np.abs(w - w0).max() for w, w0 in zip(reference.get_weights(), initial)]
        for i, (want, got) in enumerate(zip(reference.get_weights(), pipelined.get_weights(),
                                            strict=True)):
            if i in inert:
                # Its gradient is rounding noise, which an optimizer that normalises each
                # gradient (Adam) turns into moves that no rounding bound limits: both runs
                # must only have left it (almost) where it was, against the trained moves.
                for moved in (want - initial[i], got - initial[i]):
                    self.assertLess(np.abs(moved).max(), INERT_MOVE_FRACTION * max(moves))
            else:
                self.assertAllClose(want, got, rtol=TOL, atol=TOL)
        # Every bucket occurs: one train-step trace each, and each cell traced for each
        # bucket as often as for the first, however many steps ran.
        self.assertGreater(traces.steps, 3 * len(BUCKETS))
        self.assertEqual(len(BUCKETS), pipelined.train_function.traces)
        self.assertEqual([len(BUCKETS) * n for n in traces.first], traces.counts())
        self.assertEqual(traces.steps, int(pipelined.optimizer.iterations))
        return pipelined

    def test_sequential_sgd_fit_equals_keras_one_trace_per_bucket(self):
        pipelined = self._check_fit(_sequential, lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                    2)
        copy = PipelinedModel.from_config(pipelined.get_config())
        self.assertEqual([list(b) for b in BUCKETS], copy.get_config()["input_buckets"])

    def test_functional_attention_adam_fit_equals_keras_one_trace_per_bucket(self):
        # Adam: the embedding looked up from the input runs before the pipeline
        # (front_embeddings.py), its input shaped by the step's bucket.
        self._check_fit(_functional, lambda: keras.optimizers.Adam(0.01), 1, schedule="1f1b")

    def test_a_shape_outside_the_buckets_is_refused_in_one_line(self):
        pipelined = PipelinedModel(_sequential(), num_cells=2, num_micro_batches=2,
                                   input_buckets=BUCKETS)
        pipelined.compile(optimizer="sgd", loss=_loss())
        with self.assertRaises(ValueError) as ctx:  # Padded to each batch's longest sequence.
            pipelined.fit(_dataset(pad_to_boundary=False), verbose=0)
        message = str(ctx.exception)
        self.assertNotIn("\n", message)
        self.assertRegex(message, r"^PipelinedModel.fit: a training batch of shape \[\d+, \d+\] "
                         r"is not one of the declared input_buckets \(\[8, 8\], \[4, 16\], "
                         r"\[2, 32\]\)")
        self.assertEqual(0, pipelined.train_function.traces)
        for bad, what in (([(8, None)], r"input_buckets\[0\]=\(8, None\) is not one batch"),
                          ([], "give a non-empty list")):
            with self.assertRaisesRegex(ValueError, what):
                PipelinedModel(_sequential(), num_cells=2, input_buckets=bad)
        with self.assertRaisesRegex(ValueError, "or declare the batch shapes of length buckets "
                                    r"with PipelinedModel\(..., input_buckets=\[...\]\)"):
            PipelinedModel(_sequential(), input_shape=(8,), num_cells=2).fit(_dataset())


if __name__ == "__main__":
    tf.test.main()
