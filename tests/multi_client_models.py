"""Test model for the multi-client tests: TinyMlpNoisy plus batch norm, logging what it reads.

`TinyMlpBnNoisy`: fc0 -> batch norm -> dropout -> fc1 -> softmax, on NoisyInput (seeded noise
per example) with a global batch of 12 (splits over 2 or 3 tasks, R x T micro-batches). Its
input carries each example's id; when READ_LOG_ENV names a directory, preprocessing an example
appends its id to `<dir>/<pid>.txt`, so a test can tell which examples each process read.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import normalization, structural
from lingvo_lite.tasks import model_registry

try:  # Under pytest, tests/ is on sys.path; trainer.py imports this module as tests.*.
    import reliability_models
    import testdata_models
except ModuleNotFoundError:
    from tests import reliability_models, testdata_models

READ_LOG_ENV = "MULTI_CLIENT_READ_LOG"
BATCH_SIZE = 12


def _log_ids(ids: np.ndarray) -> np.ndarray:
    with open(os.path.join(os.environ[READ_LOG_ENV], f"{os.getpid()}.txt"), "a") as f:
        f.write("".join(f"{int(i)}\n" for i in np.reshape(ids, [-1])))
    return ids


class LoggedNoisyInput(reliability_models.NoisyInput):
    """NoisyInput whose examples carry their id (logged when preprocessed, see above)."""

    def _build_examples(self) -> tf.data.Dataset:
        x, labels = testdata_models.synthetic_examples(self.params.split, self.params.num_examples)
        ids = np.arange(self.params.num_examples, dtype=np.int64)
        return tf.data.Dataset.from_tensor_slices({"x": x, "labels": labels, "id": ids})

    def dataset(self) -> tf.data.Dataset:
        ds = super().dataset()
        if os.environ.get(READ_LOG_ENV):  # The log is no input state: positions still save.
            options = tf.data.Options()
            options.experimental_external_state_policy = (
                tf.data.experimental.ExternalStatePolicy.IGNORE)
            ds = ds.with_options(options)
        return ds

    def _preprocess(self, example: NestedMap, seed: tf.Tensor) -> NestedMap:
        out = super()._preprocess(example, seed)
        out.id = example.id
        if os.environ.get(READ_LOG_ENV):
            out.id = tf.reshape(tf.numpy_function(_log_ids, [example.id], tf.int64), [])
        return out


@model_registry.register
class TinyMlpBnNoisy(reliability_models.TinyMlpNoisy):
    """TinyMlpNoisy with batch norm after fc0 and a global batch of 12 (see above)."""

    def Train(self) -> hyperparams.Params:
        return LoggedNoisyInput.Params().Set(name="train", split="train", num_examples=1024,
                                             batch_size=BATCH_SIZE)

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        fc0, *rest = p.network.layers
        bn = structural.FieldLayer.Params().Set(
            name="bn", field="x", sub=normalization.BatchNormLayer.Params().Set(
                name="bn", dim=testdata_models.HIDDEN_DIM, decay=0.9))
        p.network.layers = [fc0, bn, *rest]
        p.network.input_shapes = NestedMap(
            x=tf.TensorShape([BATCH_SIZE, testdata_models.INPUT_DIM]),
            labels=tf.TensorShape([BATCH_SIZE]))
        return p


# Keras (tests/e2e/multi_client_test.py): a Sequential with dropout, fitted on fixed data.


def keras_sequential():
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(12, activation="relu"),
        keras.layers.Dropout(0.25, seed=7), keras.layers.Dense(12, activation="tanh"),
        keras.layers.Dense(4)])


def keras_fit(model) -> None:
    import keras

    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 6)).astype(np.float32)
    y = (np.arange(24) % 4).astype(np.int32)
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
