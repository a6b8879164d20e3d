"""Functional Keras models pipelined by PipelinedModel, against the plain model.

Every check compares with the same functional model run by Keras with the same weights:
one step's loss and every gradient, and the weights after a few `fit` steps (SGD, Adam).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import refusal, twin

from lingvo_lite.keras import PipelinedModel
from lingvo_lite.keras.graph_layer import GraphNodeLayer, SharedNodeLayer

GRAD_TOL = 2e-5
WEIGHT_TOL = 2e-5


def skip_model() -> keras.Model:
    """Seven nodes; the input and an early activation are read again at the end."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((6,), name="features")
    h1 = keras.layers.Dense(12, activation="tanh", name="h1")(inp)
    h2 = keras.layers.Dense(12, activation="tanh", name="h2")(h1)
    h3 = keras.layers.Dense(12, activation="tanh", name="h3")(h2)
    h4 = keras.layers.Dense(12, activation="tanh", name="h4")(h3)
    added = keras.layers.Add(name="skip_add")([h1, h4])
    joined = keras.layers.Concatenate(name="skip_cat")([inp, added])
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(joined))


def two_in_two_out_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    a = keras.Input((5,), name="a")
    b = keras.Input((4,), name="b")
    ha = keras.layers.Dense(8, activation="relu", name="ha")(a)
    hb = keras.layers.Dense(8, activation="tanh", name="hb")(b)
    joint = keras.layers.Dense(8, activation="tanh", name="joint")(
        keras.layers.Concatenate(name="cat")([ha, hb]))
    deep = keras.layers.Dense(8, activation="tanh", name="deep")(joint)
    score = keras.layers.Dense(1, name="score")(keras.layers.Add(name="res")([deep, hb]))
    cls = keras.layers.Dense(3, name="cls")(deep)
    return keras.Model({"a": a, "b": b}, {"score": score, "cls": cls})


def tied_model() -> keras.Model:
    """One Dense called by the first node and the last (its kernel in the first cell)."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((8,), name="x_in")
    tied = keras.layers.Dense(8, activation="tanh", name="tied")
    h = tied(inp)
    for i in range(3):
        h = keras.layers.Dense(8, activation="tanh", name=f"mid{i}")(h)
    return keras.Model(inp, tied(h))


def task_with_backbone() -> keras.Model:
    """A task model wrapping a functional backbone (expanded into its layers)."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((6,), name="backbone_in")
    h = keras.layers.Dense(10, activation="tanh", name="b1")(inp)
    h = keras.layers.Dense(10, activation="tanh", name="b2")(h)
    backbone = keras.Model(inp, keras.layers.Add(name="b_skip")([h, keras.layers.Dense(
        10, name="b3")(h)]), name="backbone")
    task_in = keras.Input((6,), name="task_in")
    features = backbone(task_in)
    return keras.Model(task_in, keras.layers.Dense(4, name="head")(features))


def batch(n: int = 8, seed: int = 0, dims: int = 6, out: int = 3):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, dims)).astype("float32"),
            rng.normal(size=(n, out)).astype("float32"))


def dict_batch(n: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(n, 5)).astype("float32"),
         "b": rng.normal(size=(n, 4)).astype("float32")}
    y = {"score": rng.normal(size=(n, 1)).astype("float32"),
         "cls": rng.integers(0, 3, size=n).astype("int32")}
    return x, y


DICT_LOSS = {"score": "mse",
             "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


def plain_loss_and_grads(model: keras.Model, x, y):
    with tf.GradientTape() as tape:
        pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=pred)
    return loss, tape.gradient(loss, model.trainable_variables)


def plain_step_keeping_state(model: keras.Model, x, y):
    """`plain_loss_and_grads`, then the model's variables as they were: the pipeline trains
    the model's own variables, so the plain step's side effects (dropout seeds, batch-norm
    statistics) must not reach the pipelined step it is compared with."""
    before = [v.numpy() for v in model.variables]
    result = plain_loss_and_grads(model, x, y)
    for v, value in zip(model.variables, before, strict=True):
        v.assign(value)
    return result


def check_step(model: keras.Model, loss, x, y, loss_weights=None, **pipeline) -> float:
    """Asserts the pipelined loss and gradients equal the plain model's; the max diff."""
    pipelined = PipelinedModel(model, **pipeline)
    pipelined.compile(optimizer="sgd", loss=loss, loss_weights=loss_weights)
    model.compile(optimizer="sgd", loss=loss, loss_weights=loss_weights)
    want_loss, want = plain_step_keeping_state(model, x, y)
    got_loss, got = pipelined.loss_and_gradients(x, y)
    assert abs(float(got_loss) - float(want_loss)) < 1e-5
    assert len(got) == len(want) == len(model.trainable_variables)
    worst = 0.0
    for v, g, w in zip(model.trainable_variables, got, want):
        w = tf.convert_to_tensor(w)  # An embedding's gradient is IndexedSlices.
        diff = float(np.abs(np.asarray(g) - np.asarray(w)).max())
        assert diff < GRAD_TOL, (v.path, diff)
        worst = max(worst, diff)
    return worst


def check_fit(make_model, loss, x, y, optimizer: str, **pipeline) -> float:
    model = make_model()  # The reference: its own variables (the pipeline trains its model's).
    pipelined = PipelinedModel(make_model(), **pipeline)
    pipelined.compile(optimizer=keras.optimizers.get(optimizer), loss=loss)
    model.compile(optimizer=keras.optimizers.get(optimizer), loss=loss)
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    worst = max(float(np.abs(a - b).max())
                for a, b in zip(pipelined.get_weights(), model.get_weights()))
    assert worst < WEIGHT_TOL, worst
    assert any(float(np.abs(a - b).max()) > 1e-3  # The weights did move.
               for a, b in zip(pipelined.get_weights(), make_model().get_weights()))
    return worst


@pytest.mark.parametrize("num_cells", [1, 2, 4])
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_skip_connections_step_matches_plain(num_cells, num_micro_batches):
    x, y = batch()
    check_step(skip_model(), "mse", x, y, num_cells=num_cells,
               num_micro_batches=num_micro_batches)


@pytest.mark.parametrize("schedule,remat,serial_devices", [
    ("1f1b", "always", False), ("gpipe", "never", False), ("1f1b", "except_last", True),
    ("zero_bubble", "except_last", False)])
def test_skip_connections_schedules_and_remat(schedule, remat, serial_devices):
    x, y = batch()
    check_step(skip_model(), "mse", x, y, num_cells=4, num_micro_batches=4,
               schedule=schedule, remat=remat, serial_devices=serial_devices)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_skip_connections_fit_matches_plain(optimizer):
    x, y = batch(16)
    check_fit(skip_model, "mse", x, y, optimizer, num_cells=4, num_micro_batches=2)


def test_cut_report_names_the_skip_tensors_and_bytes():
    pipelined = PipelinedModel(skip_model(), num_cells=4, num_micro_batches=2)
    report = pipelined.partition_report(batch_size=8)
    # The model's input is read by the last Concatenate: it crosses every cut.
    assert report.count("features ") == 3, report
    # 4 examples x 6 float32 per micro-batch.
    assert "[4, 6]" in report and " 96" in report, report
    assert "h1 " in report  # The Add's skip operand crosses the middle cut(s).


def test_several_inputs_and_outputs_as_dicts():
    x, y = dict_batch()
    check_step(two_in_two_out_model(), DICT_LOSS, x, y, num_cells=2, num_micro_batches=2)
    check_step(two_in_two_out_model(), DICT_LOSS, x, y, num_cells=2, num_micro_batches=2,
               loss_weights={"score": 3.0, "cls": 0.5})
    check_step(skip_model(), "mse", *batch(), num_cells=2, num_micro_batches=2,
               loss_weights=[2.5])
    with pytest.raises(ValueError, match=r"^PipelinedModel.compile: loss names outputs "
                                         r"\['scor'\]; the model's outputs are "
                                         r"\['cls', 'score'\]\.$"):
        PipelinedModel(two_in_two_out_model()).compile(loss={"scor": "mse", "cls": "mse"})
    model = two_in_two_out_model()
    pipelined = PipelinedModel(model, num_cells=3, num_micro_batches=4)
    got, want = pipelined.predict(x, verbose=0), model.predict(x, verbose=0)
    assert set(got) == {"score", "cls"}
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_several_inputs_and_outputs_fit(optimizer):
    x, y = dict_batch(16)
    check_fit(two_in_two_out_model, DICT_LOSS, x, y, optimizer, num_cells=2,
              num_micro_batches=2)


def test_tied_weight_in_first_and_last_cell():
    x, y = batch(dims=8, out=8)
    model = tied_model()
    pipelined = PipelinedModel(model, num_cells=3, num_micro_batches=2)
    pipe = pipelined.pipeline
    first, last = pipe.layers[0], pipe.layers[len(pipe.layers) - 3]
    assert isinstance(first, GraphNodeLayer) and isinstance(last, SharedNodeLayer)
    assert pipe.partition.cell_of_layer(0) == 0
    assert pipe.partition.cell_of_layer(len(pipe.layers) - 3) == 2
    # One variable per weight, on the first cell's device.
    assert len(pipe.theta.Flatten()) == len(model.trainable_variables)
    assert all(v.device.endswith("CPU:0") for v in first.vars.Flatten())
    assert "w_tied__kernel" in pipelined.partition_report(8)
    for remat in ("always", "never"):
        check_step(tied_model(), "mse", x, y, num_cells=3, num_micro_batches=2, remat=remat)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_tied_weight_fit(optimizer):
    x, y = batch(16, dims=8, out=8)
    check_fit(tied_model, "mse", x, y, optimizer, num_cells=3, num_micro_batches=4,
              schedule="1f1b")


def test_nested_functional_backbone_is_expanded():
    x, y = batch(out=4)
    pipelined = PipelinedModel(task_with_backbone(), num_cells=2, num_micro_batches=2)
    names = [p.name for p in pipelined.pipeline.params.layers]
    assert names[:4] == ["node_0_b1", "node_1_b2", "node_2_b3", "node_3_b_skip"], names
    check_step(task_with_backbone(), "mse", x, y, num_cells=2, num_micro_batches=4)
    x16, y16 = batch(16, out=4)
    check_fit(task_with_backbone, "mse", x16, y16, "adam", num_cells=2, num_micro_batches=2)


def test_weights_in_the_original_layout(tmp_path):
    model = task_with_backbone()
    pipelined = PipelinedModel(model, num_cells=2, num_micro_batches=2)
    x, y = batch(16, out=4)
    pipelined.compile(optimizer="adam", loss="mse")
    pipelined.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "w.weights.h5")
    pipelined.save_weights(path)
    fresh = task_with_backbone()
    fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), pipelined.get_weights()):
        np.testing.assert_array_equal(a, b)
    other = task_with_backbone()  # Untrained: other weights than the pipeline's now.
    pipelined.set_weights(other.get_weights())
    np.testing.assert_allclose(pipelined.predict(x, verbose=0), other.predict(x, verbose=0),
                               atol=1e-6)


def masked_sequence_model(pooled: bool) -> keras.Model:
    """Embedding(mask_zero=True): the mask rides with the activations across the cuts, into a
    masked pooling (pooled) or the per-token loss (not pooled)."""
    keras.utils.set_random_seed(8)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 8, mask_zero=True, name="embed")(tokens)
    h = keras.layers.Dense(8, activation="tanh", name="d1")(h)
    h = keras.layers.Dense(8, activation="tanh", name="d2")(h)
    if pooled:
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(5, name="out")(h))


def padded_tokens(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 20, (n, 6)).astype("int32")
    for i in range(n):  # Lengths 1..6: micro-batches hold different numbers of real tokens.
        tokens[i, 1 + (i * 5) % 6:] = 0
    return tokens


@pytest.mark.parametrize("pooled", [True, False])
def test_keras_masks_cross_cuts(pooled):
    x = padded_tokens(8)
    labels = np.arange(8 * (1 if pooled else 6)).reshape(8, -1) % 5
    y = labels[:, 0] if pooled else labels
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    worst = check_step(masked_sequence_model(pooled), loss, x, y, num_cells=3,
                       num_micro_batches=4)
    assert worst < GRAD_TOL
    model = masked_sequence_model(pooled)
    pipelined = PipelinedModel(model, num_cells=3, num_micro_batches=2)
    report = pipelined.partition_report(8)
    assert "__mask " in report and "bool" in report, report  # The mask crosses the cuts.
    got = pipelined.predict(x, verbose=0)
    np.testing.assert_allclose(got, model.predict(x, verbose=0), atol=1e-6)


class _CallOverridden(keras.Model):
    def call(self, inputs):
        return super().call(inputs) * 2.0


def test_refusals_are_one_line():
    inp = keras.Input((4,))
    shared_dropout = keras.layers.Dropout(0.5, name="drop")
    h = shared_dropout(keras.layers.Dense(4)(inp))
    assert refusal(lambda: PipelinedModel(keras.Model(inp, shared_dropout(h)), num_cells=2)) == (
        "PipelinedModel: Keras layer 'drop' is called at several places and its layer 'drop' "
        "(Dropout) changes state in its call; only layers whose call changes no state can be "
        "shared across calls.")
    assert refusal(lambda: PipelinedModel(skip_model(), input_shape=(6, 2))).startswith(
        "PipelinedModel: input_shape for 'features' is (6, 2), but the input has shape (None, 6)")
    dynamic = keras.Input((None,), dtype="int32", name="ids")
    unshaped = PipelinedModel(keras.Model(dynamic, keras.layers.Embedding(10, 2)(dynamic)))
    assert refusal(lambda: unshaped.partition_report()) == (
        "PipelinedModel: the input shapes are not known yet: they come from the first batch "
        "that fit, evaluate, predict or loss_and_gradients sees; pass input_shape=... to plan "
        "the pipeline before.")
    assert refusal(lambda: unshaped.predict(iter([np.ones((2, 3), "int32")]))).startswith(
        "PipelinedModel: the input shapes are taken from the first batch of arrays or of a "
        "tf.data.Dataset; with list_iterator input pass input_shape=...")
    inp = keras.Input((4,))
    overridden = _CallOverridden(inp, keras.layers.Dense(2)(inp))
    assert "_CallOverridden overrides call()" in refusal(lambda: PipelinedModel(overridden))
    pipelined = PipelinedModel(skip_model(), num_cells=2)
    assert "reduction='none' returns a loss per example" in refusal(
        lambda: pipelined.compile(loss=keras.losses.MeanSquaredError(reduction="none")))


def dropout_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(12, activation="relu", name="h")(inp)
    dropped = keras.layers.Dropout(0.5, name="drop")(h)
    h2 = keras.layers.Dense(12, activation="relu", name="h2")(dropped)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(
        keras.layers.Add(name="res")([h2, dropped])))


def batch_norm_model() -> keras.Model:
    keras.utils.set_random_seed(6)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(12, name="h")(inp)
    normed = keras.layers.BatchNormalization(name="bn")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(
        keras.layers.Concatenate(name="cat")([normed, inp])))


def test_dropout_node_draws_keras_masks_for_every_split():
    x, y = batch()
    for num_micro_batches in (1, 4):
        check_step(dropout_model(), "mse", x, y, num_cells=2,
                   num_micro_batches=num_micro_batches)


def test_batch_norm_node_fit_at_one_micro_batch():
    x, y = batch(16)
    check_fit(batch_norm_model, "mse", x, y, "adam", num_cells=2, num_micro_batches=1)


def test_unread_second_output_of_a_node():
    keras.utils.set_random_seed(9)
    seq = keras.Input((4, 8), name="seq")
    attended, _ = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, name="mha")(
        seq, seq, return_attention_scores=True)  # The scores: an output no node reads.
    h = keras.layers.Dense(8, activation="tanh", name="h")(attended)
    model = keras.Model(seq, keras.layers.Add(name="res")([seq, h]))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4, 8)).astype("float32")
    check_step(model, "mse", x, rng.normal(size=(8, 4, 8)).astype("float32"), num_cells=2,
               num_micro_batches=2)


# Half the spacing of 1.0 in each compute dtype: the relative error of one rounding.
UNIT_ROUNDOFF = {"mixed_float16": 2.0**-11, "mixed_bfloat16": 2.0**-8}
# skip_model's longest path: four hidden Dense layers, the logits and the loss.
SKIP_MODEL_DEPTH = 6


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_fit_matches_plain(policy):
    # float16: the loss scale of Keras' LossScaleOptimizer scales each micro-batch's loss;
    # bfloat16: layers autocast as in Keras. The pipeline's cells may run other kernels than
    # the plain graph (oneDNN fuses across what is a cell boundary here), so each activation
    # may round differently: with SGD a weight's move is lr times the sum of its gradients,
    # and the two moves agree to one rounding per level of the network, relative to the
    # largest move. (Adam divides each gradient by its own scale, so the rounding noise of a
    # gradient that is near zero becomes a move of size lr: no rounding bound holds for it.)
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = batch(16)
        model = skip_model()
        initial = model.get_weights()
        pipelined = PipelinedModel(skip_model(), num_cells=2, num_micro_batches=1)
        pipelined.compile(optimizer="sgd", loss="mse")
        model.compile(optimizer="sgd", loss="mse")
        pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        largest_move = max(float(np.abs(w - w0).max())
                           for w, w0 in zip(model.get_weights(), initial))
        assert largest_move > 1e-3  # The weights did move.
        tolerance = SKIP_MODEL_DEPTH * UNIT_ROUNDOFF[policy] * largest_move
        for got, want in zip(pipelined.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, atol=tolerance, rtol=0)
        # Two micro-batches: each weight gradient is the sum of two half-batch products
        # computed in the low precision: one rounding more than the network's depth.
        model = skip_model()
        pipelined = PipelinedModel(model, num_cells=2, num_micro_batches=2)
        pipelined.compile(optimizer="sgd", loss="mse")
        model.compile(optimizer="sgd", loss="mse")
        _, want = plain_step_keeping_state(model, x[:8], y[:8])
        _, got = pipelined.loss_and_gradients(x[:8], y[:8])
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       atol=(SKIP_MODEL_DEPTH + 1) * UNIT_ROUNDOFF[policy]
                                       * float(np.abs(np.asarray(w)).max()) + 1e-6)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_cost_shapes_keep_the_batch_after_a_shared_weight():
    # The tied weight travels in the map (first dimension 8, not the batch): later nodes'
    # shapes and costs still take the batch from the tensors they read.
    from lingvo_lite.layers.composite import chain_meta

    pipelined = PipelinedModel(tied_model(), num_cells=2, cost_batch_size=5)
    p = pipelined.pipeline.params
    metas = chain_meta(p.layers, p.input_shapes)
    middle = metas[1].out_shapes[0]
    assert list(middle["w_tied__kernel"]) == [8, 8] and list(middle["mid0"]) == [5, 8], middle
    assert list(metas[len(p.layers) - 3].out_shapes[0]["tied_1"]) == [5, 8]


def encoder_decoder_on_a_masked_output() -> keras.Model:
    """A nested decoder model called on an encoder output that carries a Keras mask (Keras
    passes the mask itself): padded steps are skipped by the decoder's LSTM."""
    keras.utils.set_random_seed(41)
    ids = keras.Input((6,), dtype="int32", name="ids")
    h = keras.layers.Embedding(13, 8, mask_zero=True, name="emb")(ids)
    h = keras.layers.Dense(8, activation="tanh", name="enc")(h)
    decoder_in = keras.Input((6, 8), name="decoder_in")
    summary = keras.layers.LSTM(8, name="lstm")(decoder_in)
    decoder = keras.Model(decoder_in, keras.layers.Dense(3, name="out")(summary),
                          name="decoder")
    return keras.Model(ids, decoder(h))


@pytest.mark.parametrize("num_cells,num_micro_batches", [(2, 2), (3, 4)])
def test_nested_decoder_on_a_masked_encoder_output(num_cells, num_micro_batches):
    x = np.random.default_rng(8).integers(1, 13, (8, 6)).astype("int32")
    x[::2, 3:] = 0  # Padded examples: the mask changes what the LSTM returns.
    y = (np.arange(8) % 3).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    check_step(encoder_decoder_on_a_masked_output(), loss, x, y, num_cells=num_cells,
               num_micro_batches=num_micro_batches)


def dynamic_length_model() -> keras.Model:
    """Token ids of any length (keras.Input((None,))), as every language model declares."""
    keras.utils.set_random_seed(42)
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = keras.layers.Embedding(13, 8, name="emb")(ids)
    h = keras.layers.Dense(8, activation="tanh", name="mix")(h)
    return keras.Model(ids, keras.layers.Dense(13, name="logits")(h))


@pytest.mark.parametrize("as_dataset", [False, True])
def test_shapes_from_the_first_batch_without_input_shape(as_dataset):
    # As Keras builds a model on first use: no input_shape, the pipeline planned for the
    # first batch fit sees (arrays or a tf.data.Dataset), compile given before that.
    x = np.random.default_rng(9).integers(0, 13, (16, 5)).astype("int32")
    y = np.roll(x, 1, axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = dynamic_length_model()
    pipelined = PipelinedModel(dynamic_length_model(), num_cells=2, num_micro_batches=2)
    for m in (model, pipelined):
        m.compile(optimizer="adam", loss=loss)
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
            if as_dataset else x)
    pipelined.fit(data, None if as_dataset else y, batch_size=None if as_dataset else 8,
                  epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert "cut 0 -> 1" in pipelined.partition_report(8)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=WEIGHT_TOL)


def test_layer_stack_without_input_shape():
    x, y = batch(16, out=2)
    make = lambda: keras.Sequential([keras.layers.Dense(8, activation="tanh", name="a"),  # noqa: E731
                                     keras.layers.Dense(2, name="b")])
    keras.utils.set_random_seed(43)
    model = make()
    model.build((None, 6))
    pipelined_layers = make()
    pipelined_layers.build((None, 6))
    pipelined_layers.set_weights(model.get_weights())
    pipelined = PipelinedModel(pipelined_layers.layers, num_cells=2, num_micro_batches=2)
    for m in (model, pipelined):
        m.compile(optimizer="sgd", loss="mse")
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=WEIGHT_TOL)


def test_jit_compile_fit_matches_plain_keras_compiled():
    x, y = batch(16)
    model = skip_model()
    pipelined = PipelinedModel(twin(model), num_cells=2, num_micro_batches=2)
    for m in (model, pipelined):
        m.compile(optimizer="sgd", loss="mse", jit_compile=True)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert pipelined.cells_jit_compile and model.jit_compile
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=WEIGHT_TOL)


def test_jit_compile_with_dropout_on_a_branch_matches_plain_keras_compiled():
    # Under XLA each micro-batch draws its rows of XLA's whole-batch mask.
    keras.utils.set_random_seed(45)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(12, activation="tanh", name="a")(inp)
    left = keras.layers.Dropout(0.4, name="drop")(keras.layers.Dense(12, name="l")(h))
    model = keras.Model(inp, keras.layers.Dense(3, name="out")(keras.layers.Add()([h, left])))
    x, y = batch(16)
    pipelined = PipelinedModel(twin(model), num_cells=2, num_micro_batches=4)
    initial = model.get_weights()
    for m in (model, pipelined):
        m.compile(optimizer="sgd", loss="mse", jit_compile=True)
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(model.get_weights(), initial)) > 1e-3
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=WEIGHT_TOL)


def scaled_by_a_constant_model() -> keras.Model:
    """A tensor constant as a call argument (keras-hub Gemma's sqrt(hidden_dim))."""
    keras.utils.set_random_seed(44)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="tanh", name="a")(inp)
    h = keras.ops.multiply(h, tf.constant([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]))
    return keras.Model(inp, keras.layers.Dense(3, name="b")(h))


def test_tensor_constant_as_a_call_argument():
    x, y = batch()
    check_step(scaled_by_a_constant_model(), "mse", x, y, num_cells=2, num_micro_batches=2)
    big = keras.Input((5000,), name="wide")
    model = keras.Model(big, keras.ops.add(big, tf.zeros([5000])))
    assert refusal(lambda: PipelinedModel(model)).startswith(
        "PipelinedModel: a node's call argument is a constant tensor of shape (5000,)")
