"""Loss settings of a functional PipelinedModel against the plain functional Keras model.

Reductions 'sum' and 'mean_with_sample_weight', `sample_weight`, `class_weight` and
`loss_weights` (the functional loss layer uses keras_loss.micro_batch_loss, as the
layer-list PipelinedModel does): one step's loss and every gradient at K=2, T=4 against
Keras' own `compute_loss` under a tape, and weights after `fit` steps with SGD and Adam.
What cannot be exact is refused in compile in one line.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import refusal, twin
from keras_functional_test import (
    DICT_LOSS,
    dict_batch,
    masked_sequence_model,
    padded_tokens,
    skip_model,
    two_in_two_out_model,
)

from lingvo_lite.keras import PipelinedModel

TOL = 2e-5
SAMPLE_WEIGHT = np.linspace(0.25, 2.0, 8).astype("float32")


def data(n: int = 8):
    rng = np.random.default_rng(4)
    return (rng.normal(size=(n, 6)).astype("float32"),
            rng.normal(size=(n, 3)).astype("float32"))


def assert_step(model: keras.Model, loss, x, y, sample_weight=None, loss_weights=None,
                **pipeline) -> None:
    pipelined = PipelinedModel(twin(model), **pipeline)
    for m in (model, pipelined):
        m.compile(optimizer="sgd", loss=loss, loss_weights=loss_weights)
    with tf.GradientTape() as tape:
        want_loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True),
                                       sample_weight=sample_weight)
    want = tape.gradient(want_loss, model.trainable_variables)
    got_loss, got = pipelined.loss_and_gradients(x, y, sample_weight)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=TOL)
    assert len(got) == len(want)
    for v, g, w in zip(model.trainable_variables, got, want):
        np.testing.assert_allclose(g, tf.convert_to_tensor(w), atol=TOL, err_msg=v.path)


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight"])
@pytest.mark.parametrize("weighted", [False, True])
def test_reduction_step_matches_plain(reduction, weighted):
    x, y = data()
    assert_step(skip_model(), keras.losses.MeanSquaredError(reduction=reduction), x, y,
                SAMPLE_WEIGHT if weighted else None, loss_weights=[3.0], num_cells=2,
                num_micro_batches=4)


def test_masked_output_mean_with_sample_weight():
    # The micro-batches hold different numbers of real tokens and different weights:
    # Keras divides by the whole batch's weighted unmasked count.
    x = padded_tokens(8)
    y = np.arange(48).reshape(8, 6) % 5
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight")
    per_token = np.outer(SAMPLE_WEIGHT, np.linspace(1.0, 0.5, 6)).astype("float32")
    assert_step(masked_sequence_model(pooled=False), loss, x, y, per_token,
                num_cells=2, num_micro_batches=4)


def test_several_outputs_sum_and_loss_weights():
    x, y = dict_batch()
    loss = {"score": keras.losses.MeanSquaredError(reduction="sum"),
            "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                              reduction="sum")}
    assert_step(two_in_two_out_model(), loss, x, y, SAMPLE_WEIGHT,
                loss_weights={"score": 2.0, "cls": 0.5}, num_cells=2, num_micro_batches=4)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fit_with_sum_sample_and_class_weights(optimizer):
    x, _ = data(16)
    y = (np.arange(16) % 3).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model = skip_model()
    pipelined = PipelinedModel(twin(model), num_cells=2, num_micro_batches=4)
    start = model.get_weights()
    for m in (model, pipelined):
        m.compile(optimizer=keras.optimizers.get(optimizer), loss=loss, loss_weights=[0.5])
    weights = np.tile(SAMPLE_WEIGHT, 2)
    for m in (model, pipelined):
        m.fit(x, y, sample_weight=weights, batch_size=8, epochs=2, shuffle=False, verbose=0)
        m.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=8, epochs=1,
              shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOL)
    assert max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), start)) > 1e-3
    np.testing.assert_allclose(pipelined.history.history["loss"],
                               model.history.history["loss"], rtol=TOL)


def test_refusals_are_one_line():
    pipelined = PipelinedModel(skip_model(), num_cells=2)
    assert "reduction='none' returns a loss per example" in refusal(
        lambda: pipelined.compile(loss=keras.losses.MeanSquaredError(reduction="none")))
    several = PipelinedModel(two_in_two_out_model(), num_cells=2)
    loss = dict(DICT_LOSS, score=keras.losses.MeanSquaredError(
        reduction="mean_with_sample_weight"))
    assert refusal(lambda: several.compile(loss=loss)) == (
        "PipelinedModel.compile: reduction='mean_with_sample_weight' is not supported for a "
        "model with several outputs (each output divides by its own total sample weight of "
        "the whole batch); use 'sum_over_batch_size' or 'sum'.")


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_embedding_looked_up_from_an_input_trains_exactly(optimizer):
    # Keras hands a looked-up embedding's gradient to the optimizer as one row per token
    # occurrence (IndexedSlices), which Adam and RMSprop square row by row: the embedding
    # runs before the pipeline and gets that gradient from the pipeline's input gradient.
    x, y = padded_tokens(16), np.arange(16) % 5
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = masked_sequence_model(pooled=True)
    pipelined = PipelinedModel(twin(model), num_cells=2, num_micro_batches=4)
    assert [p.name for p in pipelined.pipeline.params.layers][0] == "node_0_d1"
    start = model.get_weights()
    for m in (model, pipelined):
        m.compile(optimizer=keras.optimizers.get(optimizer), loss=loss)
        m.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOL)
    assert float(np.abs(model.get_weights()[0] - start[0]).max()) > 1e-3
    np.testing.assert_allclose(pipelined.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-6)


def shared_embedding_model() -> keras.Model:
    keras.utils.set_random_seed(9)
    a = keras.Input((4,), dtype="int32", name="a")
    b = keras.Input((4,), dtype="int32", name="b")
    embed = keras.layers.Embedding(20, 6, name="shared_embed")
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(
        keras.layers.Add(name="sum")([embed(a), embed(b)]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="out")(pooled))


def test_embedding_inside_the_pipeline_sgd_exact_adam_refused():
    # Called twice, the embedding stays in the pipeline, whose gradient is the dense sum:
    # exact with SGD (linear), refused in one line with Adam.
    rng = np.random.default_rng(2)
    x = {"a": rng.integers(0, 20, (8, 4)).astype("int32"),
         "b": rng.integers(0, 20, (8, 4)).astype("int32")}
    y = np.arange(8) % 3
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    assert_step(shared_embedding_model(), loss, x, y, num_cells=2, num_micro_batches=4)
    pipelined = PipelinedModel(shared_embedding_model(), num_cells=2)
    assert refusal(lambda: pipelined.compile(optimizer="adam", loss=loss)) == (
        "PipelinedModel.compile: optimizer Adam with the trainable Embedding 'shared_embed' "
        "would train differently from plain Keras (which squares each token occurrence's "
        "gradient separately; the pipeline sums the gradient of an embedding it runs, and runs "
        "those not looked up from the model's inputs): use SGD or freeze the embedding "
        "(trainable=False).")


def classifier_with_side_output() -> keras.Model:
    keras.utils.set_random_seed(9)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="tanh", name="h")(inp)
    deep = keras.layers.Dense(8, activation="tanh", name="deep")(h)
    return keras.Model(inp, [keras.layers.Dense(3, name="logits")(deep),
                             keras.layers.Dense(2, name="side")(h)])


@pytest.mark.parametrize("loss", [
    [keras.losses.SparseCategoricalCrossentropy(from_logits=True), None],
    [None, "mse"],
])
def test_loss_list_with_none_and_one_label_array(loss):
    # As Keras takes it: the one label array goes to the one output with a loss; the other
    # output gets no gradient (zero in the pipeline, None from Keras' tape).
    x, side = data()
    y = (np.arange(8) % 3).astype("int32") if loss[0] is not None else side[:, :2]
    model = classifier_with_side_output()
    pipelined = PipelinedModel(twin(model), num_cells=2, num_micro_batches=4)
    for m in (model, pipelined):
        m.compile(optimizer="sgd", loss=loss)
    with tf.GradientTape() as tape:
        want_loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True))
    want = tape.gradient(want_loss, model.trainable_variables)
    got_loss, got = pipelined.loss_and_gradients(x, y)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=TOL)
    for v, g, w in zip(model.trainable_variables, got, want):
        np.testing.assert_allclose(g, np.zeros(v.shape) if w is None else w, atol=TOL,
                                   err_msg=v.path)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    pipelined.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOL)


def test_label_arrays_not_matching_the_losses_are_refused_in_one_line():
    x, y = data()
    pipelined = PipelinedModel(classifier_with_side_output(), num_cells=2)
    pipelined.compile(optimizer="sgd", loss=["mse", "mse"])
    assert refusal(lambda: pipelined.fit(x, y, batch_size=8, verbose=0)).endswith(
        "1 label arrays for 2 outputs of which 2 have a loss; give one label array per "
        "output (or per output with a loss, in order).")
