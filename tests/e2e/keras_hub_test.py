"""keras-hub GPT2CausalLM (built from a config: random weights, nothing downloaded) pipelined
by PipelinedModel, against the plain keras-hub model with the same weights (dropout 0.1:
every micro-batch split draws Keras' masks). BERT and a vision model: keras_hub_models_test.py.

Needs the `keras-hub` extra (`pip install -e .[keras-hub]`); the import guard below only
keeps the rest of the suite running where it is missing.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from keras_steps import LOSS, assert_step_matches  # noqa: E402

from lingvo_lite.keras import PipelinedModel  # noqa: E402
from lingvo_lite.keras.graph_layer import GraphNodeLayer, SharedNodeLayer  # noqa: E402

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

VOCAB, SEQ = 64, 8
SHAPES = {"token_ids": (SEQ,), "padding_mask": (SEQ,)}
def gpt2_causal_lm() -> keras.Model:
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def token_batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.ones((n, SEQ), "int32")
    mask[::2, 6:] = 0  # Padded examples: the padding mask matters.
    x = {"token_ids": rng.integers(1, VOCAB, (n, SEQ)).astype("int32") * mask,
         "padding_mask": mask}
    return x, rng.integers(0, VOCAB, (n, SEQ)).astype("int32")


@pytest.mark.parametrize("num_cells,num_micro_batches,schedule,remat", [
    (1, 1, "gpipe", "except_last"),
    (2, 4, "gpipe", "never"),
    (4, 2, "1f1b", "always"),
])
def test_gpt2_causal_lm_step_matches_plain(num_cells, num_micro_batches, schedule, remat):
    model = gpt2_causal_lm()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(gpt2_causal_lm(), input_shape=SHAPES, num_cells=num_cells,
                               num_micro_batches=num_micro_batches, schedule=schedule,
                               remat=remat)
    pipe = pipelined.pipeline
    # The token embedding is applied in cell 0 and, reversed, as the LM head in a later
    # cell: one variable, in cell 0, its weights sent down the pipeline.
    embedding = next(i for i, p in enumerate(pipe.params.layers)
                     if p.name.endswith("token_embedding"))
    head = next(i for i, p in enumerate(pipe.params.layers)
                if p.name.endswith("token_embedding_1"))
    assert isinstance(pipe.layers[embedding], GraphNodeLayer)
    assert isinstance(pipe.layers[head], SharedNodeLayer)
    assert pipe.partition.cell_of_layer(embedding) == 0
    if num_cells > 1:
        assert pipe.partition.cell_of_layer(head) > 0
        assert "w_token_embedding__embeddings" in pipelined.partition_report(8)
    x, y = token_batch(8)
    assert_step_matches(model, pipelined, x, y)
    np.testing.assert_allclose(pipelined.predict(x, verbose=0), model.predict(x, verbose=0),
                               atol=1e-5)


def test_gpt2_causal_lm_fit_matches_plain():
    # Adam, the optimizer these models train with (plain SGD: keras_hub_vision_test.py).
    model = gpt2_causal_lm()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(gpt2_causal_lm(), input_shape=SHAPES, num_cells=2,
                               num_micro_batches=2, schedule="1f1b", remat="always")
    model.compile(optimizer="adam", loss=LOSS)
    pipelined.compile(optimizer="adam", loss=LOSS)
    x, y = token_batch(16, seed=1)
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    start = gpt2_causal_lm().get_weights()
    moved = 0.0
    for a, b, w0 in zip(pipelined.get_weights(), model.get_weights(), start):
        np.testing.assert_allclose(a, b, atol=2e-5)
        moved = max(moved, float(np.abs(a - w0).max()))
    assert moved > 1e-3
