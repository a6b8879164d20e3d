"""Keras models as people write them, pipelined by PipelinedModel against plain Keras.

The pipeline runs the user's own layer objects (Keras stateless calls on the pipeline's
per-device variables), so a layer class needs no `build()`, no registration and no working
`get_config()`, and a preprocessing layer's state (an adapted Normalization) computes as in
plain Keras. Every check compares one step's loss and gradients, or the weights after `fit`,
with the plain model (float32 sums in another order: 2e-5, as keras_functional_test.py).
What the pipeline cannot make exact is refused in one line naming the layer.
"""

from __future__ import annotations

import doctest

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import refusal
from keras_functional_test import check_fit, check_step

from lingvo_lite.keras import PipelinedModel

VOCAB, LENGTH, DIM = 13, 6, 8


class TokenAndPositionEmbedding(keras.layers.Layer):
    """As in Keras' text-classification example: sublayers made in __init__, no build()."""

    def __init__(self, vocab: int, length: int, dim: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, dim)
        self.positions = keras.layers.Embedding(length, dim)

    def call(self, ids):
        return self.tokens(ids) + self.positions(keras.ops.arange(keras.ops.shape(ids)[-1]))


class TransformerBlock(keras.layers.Layer):
    """Attention and a feed-forward network with dropout; not registered, no build()."""

    def __init__(self, dim: int, heads: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.ffn = keras.Sequential([keras.layers.Dense(2 * dim, activation="relu"),
                                     keras.layers.Dense(dim)])
        self.norm1 = keras.layers.LayerNormalization()
        self.norm2 = keras.layers.LayerNormalization()
        self.dropout = keras.layers.Dropout(0.2)

    def call(self, x, training=False):
        x = self.norm1(x + self.dropout(self.attention(x, x), training=training))
        return self.norm2(x + self.ffn(x))


class ResidualMlp(keras.layers.Layer):
    def __init__(self, width: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(width, activation="tanh")
        self.outer = keras.layers.Dense(width)

    def call(self, x):
        return x + self.outer(self.inner(x))


def text_model() -> keras.Model:
    keras.utils.set_random_seed(31)
    ids = keras.Input((LENGTH,), dtype="int32", name="ids")
    h = TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, name="embed")(ids)
    h = TransformerBlock(DIM, 2, name="block1")(h)
    h = TransformerBlock(DIM, 2, name="block2")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, keras.layers.Dense(3, name="logits")(h))


def mlp_sequential() -> keras.Sequential:
    keras.utils.set_random_seed(32)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="lift"),
                             ResidualMlp(8, name="res1"), ResidualMlp(8, name="res2"),
                             keras.layers.Dense(3, name="out")])


def token_batch(n: int = 8):
    rng = np.random.default_rng(5)
    return (rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"),
            (np.arange(n) % 3).astype("int32"))


def feature_batch(n: int = 8, mean: float = 0.0, scale: float = 1.0):
    rng = np.random.default_rng(6)
    return (mean + scale * rng.normal(size=(n, 6))).astype("float32"), \
        rng.normal(size=(n, 3)).astype("float32")


SPARSE_XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("num_cells,num_micro_batches", [(1, 1), (2, 2), (3, 4)])
def test_own_layer_classes_step_matches_plain(num_cells, num_micro_batches):
    x, y = token_batch()
    check_step(text_model(), SPARSE_XENT, x, y, num_cells=num_cells,
               num_micro_batches=num_micro_batches)


def test_own_layer_classes_fit_matches_plain():
    x, y = token_batch(16)
    check_fit(text_model, SPARSE_XENT, x, y, "sgd", num_cells=2, num_micro_batches=2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_own_layer_classes_in_a_sequential_fit(optimizer):
    x, y = feature_batch(16)
    check_fit(mlp_sequential, "mse", x, y, optimizer, num_cells=2, num_micro_batches=2)


def adapted_model(sequential: bool) -> keras.Model:
    """An adapted Normalization in front: its mean and variance come from adapt()."""
    keras.utils.set_random_seed(33)
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(feature_batch(64, mean=5.0, scale=3.0)[0])
    layers = [norm, keras.layers.Dense(12, activation="tanh", name="h"),
              keras.layers.Dense(3, name="out")]
    if sequential:
        return keras.Sequential([keras.Input((6,)), *layers])
    inp = keras.Input((6,), name="features")
    h = inp
    for layer in layers:
        h = layer(h)
    return keras.Model(inp, h)


@pytest.mark.parametrize("sequential", [False, True])
def test_adapted_normalization_matches_plain(sequential):
    x, y = feature_batch(16, mean=5.0, scale=3.0)
    model = adapted_model(sequential)
    pipelined = PipelinedModel(adapted_model(sequential), num_cells=2, num_micro_batches=2)
    np.testing.assert_allclose(pipelined.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-5)
    check_fit(lambda: adapted_model(sequential), "mse", x, y, "adam", num_cells=2,
              num_micro_batches=2)


class Penalised(keras.layers.Layer):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        y = self.dense(x)
        self.add_loss(0.1 * keras.ops.mean(y ** 2))
        return y


class RawNoise(keras.layers.Layer):
    def call(self, x, training=False):
        return x + 0.1 * tf.random.normal(tf.shape(x)) if training else x


def _functional(middle: keras.layers.Layer) -> keras.Model:
    keras.utils.set_random_seed(34)
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(4, name="first")(inp)
    return keras.Model(inp, keras.layers.Dense(3, name="last")(middle(h)))


@pytest.mark.parametrize("middle,expected", [
    (lambda: Penalised(name="penalised"),
     "Keras layer 'penalised' (Penalised) adds a loss in its call (add_loss)"),
    (lambda: RawNoise(name="noise"),
     "Keras layer 'noise' (RawNoise) draws random numbers outside Keras' seed generators "
     "(RandomStandardNormal"),
])
def test_what_cannot_be_exact_is_refused_in_one_line(middle, expected):
    # Both model kinds are checked when the PipelinedModel is made (its layers' training
    # calls traced, nothing run); a model without input shapes when fit plans it.
    x, y = feature_batch(8)
    sequential = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), middle(),
                                   keras.layers.Dense(3)])
    for model in (_functional(middle()), sequential):
        assert refusal(lambda model=model: PipelinedModel(
            model, num_cells=2, num_micro_batches=2)).startswith(expected)
    unshaped = keras.Sequential([keras.layers.Dense(4), middle(), keras.layers.Dense(3)])
    pipelined = PipelinedModel(unshaped, num_cells=2, num_micro_batches=2)
    pipelined.compile(optimizer="sgd", loss="mse")
    assert refusal(lambda: pipelined.fit(x, y, batch_size=8, verbose=0)).startswith(expected)


class TiedHead(keras.layers.Layer):
    """Logits against the token embedding of another layer (OPT's and GPT-2's LM head): its
    only weight belongs to a sublayer of the embedding layer called earlier."""

    def __init__(self, embedding: keras.layers.Embedding, **kwargs) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def tied_lm() -> keras.Model:
    keras.utils.set_random_seed(35)
    ids = keras.Input((LENGTH,), dtype="int32", name="ids")
    embed = TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, name="embed")
    h = TransformerBlock(DIM, 2, name="block")(embed(ids))
    h = keras.layers.Dense(DIM, activation="tanh", name="hidden")(h)
    return keras.Model(ids, TiedHead(embed.tokens, name="head")(h))


@pytest.mark.parametrize("num_cells", [1, 2, 3])
def test_weight_shared_through_a_sublayer_is_one_variable(num_cells):
    # The head's weight is the token embedding inside 'embed': one variable, and its gradient
    # the sum of both uses', as plain Keras computes it.
    x, _ = token_batch()
    y = np.roll(x, -1, axis=1)
    pipelined_model = tied_lm()
    check_step(tied_lm(), SPARSE_XENT, x, y, num_cells=num_cells, num_micro_batches=2)
    pipelined = PipelinedModel(pipelined_model, num_cells=num_cells, num_micro_batches=2)
    assert len(pipelined.trainable_variables) == len(pipelined_model.trainable_variables)


def test_weight_shared_through_a_sublayer_fit_matches_plain():
    x, _ = token_batch(16)
    check_fit(tied_lm, SPARSE_XENT, x, np.roll(x, -1, axis=1), "sgd", num_cells=2,
              num_micro_batches=2)


class Widened(keras.layers.Layer):
    """An earlier layer's Dense inside, plus a weight of its own."""

    def __init__(self, inner: keras.layers.Layer, **kwargs) -> None:
        super().__init__(**kwargs)
        self.inner = inner
        self.extra = keras.layers.Dense(4)

    def call(self, x):
        return self.extra(self.inner(x))


def test_weight_shared_beside_own_weights_is_refused_in_one_line():
    inp = keras.Input((6,), name="features")
    shared = keras.layers.Dense(6, name="shared")
    model = keras.Model(inp, Widened(shared, name="widened")(shared(inp)))
    assert refusal(lambda: PipelinedModel(model, num_cells=2)) == (
        "PipelinedModel: Keras layer 'widened' uses weights of the earlier layer 'shared' "
        "beside weights of its own; the pipeline shares weights between layers whose weights "
        "are all shared (a layer called again, or a sublayer of an earlier layer called on its "
        "own).")


def test_weight_shared_in_a_layer_stack_is_refused_in_one_line():
    embed = TokenAndPositionEmbedding(VOCAB, LENGTH, DIM, name="embed")
    stack = keras.Sequential([keras.Input((LENGTH,), dtype="int32"), embed,
                              TiedHead(embed.tokens, name="head")])
    assert refusal(lambda: PipelinedModel(stack, num_cells=2)).startswith(
        "PipelinedModel: Keras layer 'head' uses weights of the earlier layer 'embed' (")


WORDS = ["red", "green", "blue", "cyan", "pink"]


def string_lookup_model() -> keras.Model:
    """Words in, a StringLookup and an Embedding in front (the usual text preprocessing)."""
    keras.utils.set_random_seed(36)
    words = keras.Input((4,), dtype="string", name="words")
    ids = keras.layers.StringLookup(vocabulary=WORDS, name="lookup")(words)
    h = keras.layers.Embedding(len(WORDS) + 1, 8, name="emb")(ids)
    h = keras.layers.Dense(8, activation="tanh", name="mix")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(words, keras.layers.Dense(3, name="out")(h))


def test_string_lookup_front_fit_matches_plain():
    # The lookup and the embedding of its ids run before the pipeline: no string enters a
    # cell, and Adam gets Keras' per-occurrence embedding gradient.
    rng = np.random.default_rng(7)
    x = tf.constant(np.array(WORDS + ["unknown"])[rng.integers(0, 6, (16, 4))])
    y = (np.arange(16) % 3).astype("int32")
    check_fit(string_lookup_model, SPARSE_XENT, x, y, "adam", num_cells=2,
              num_micro_batches=2)
    pipelined = PipelinedModel(string_lookup_model(), num_cells=2, num_micro_batches=2)
    assert "string" not in pipelined.partition_report(8)
    assert [p.name for p in pipelined.pipeline.params.layers][0] == "node_0_mix"


class BatchCentred(keras.layers.Layer):
    """Subtracts the batch mean: couples the examples of a batch (as an expert capacity
    counted over the batch does)."""

    def call(self, x):
        return x - keras.ops.mean(x, axis=0, keepdims=True)


def coupled_model() -> keras.Model:
    keras.utils.set_random_seed(37)
    inp = keras.Input((6,), name="features")
    h = BatchCentred(name="centred")(keras.layers.Dense(8, activation="tanh", name="a")(inp))
    return keras.Model(inp, keras.layers.Dense(3, name="b")(h))


def test_check_equivalence_flags_layers_that_couple_a_batch():
    from lingvo_lite.keras import equivalence

    assert doctest.testmod(equivalence).failed == 0
    x, y = feature_batch(8)
    for num_micro_batches, equivalent in ((1, True), (2, False)):
        pipelined = PipelinedModel(coupled_model(), num_cells=2,
                                   num_micro_batches=num_micro_batches)
        pipelined.compile(optimizer="sgd", loss="mse")
        before = pipelined.get_weights()
        report = pipelined.check_equivalence(x, y)
        assert report.equivalent == equivalent, str(report)
        # At T=2 the centred activations, hence every gradient, follow the micro-batch's
        # mean; nothing was trained.
        assert {path.split("/")[-2] for path, _, _ in report.differing} == (
            set() if equivalent else {"a", "b"})
        for a, b in zip(pipelined.get_weights(), before):
            np.testing.assert_array_equal(a, b)
