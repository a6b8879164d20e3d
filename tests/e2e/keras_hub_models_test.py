"""keras-hub BertTextClassifier (three inputs: token ids, segment ids, padding mask), built
from a config, pipelined by PipelinedModel against the plain keras-hub model with the same
weights. GPT-2 (tied embedding): keras_hub_test.py; a ResNet: keras_hub_vision_test.py.

Needs the `keras-hub` extra; the import guard only keeps the rest of the suite running
where it is missing.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from keras_steps import LOSS, assert_step_matches  # noqa: E402

from lingvo_lite.keras import PipelinedModel  # noqa: E402

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

SEQ = 8
BERT_SHAPES = {"token_ids": (SEQ,), "segment_ids": (SEQ,), "padding_mask": (SEQ,)}


def bert_classifier() -> keras.Model:
    keras.utils.set_random_seed(11)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=SEQ)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                               preprocessor=None)


def bert_batch(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = np.ones((n, SEQ), "int32")
    mask[::2, 5:] = 0
    segments = np.zeros((n, SEQ), "int32")
    segments[:, 4:] = 1
    x = {"token_ids": rng.integers(1, 64, (n, SEQ)).astype("int32") * mask,
         "segment_ids": segments * mask, "padding_mask": mask}
    return x, rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("num_cells,num_micro_batches", [(1, 2), (2, 1), (4, 4)])
def test_bert_classifier_step_matches_plain(num_cells, num_micro_batches):
    model = bert_classifier()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(bert_classifier(), input_shape=BERT_SHAPES, num_cells=num_cells,
                               num_micro_batches=num_micro_batches)
    x, y = bert_batch(8)
    assert_step_matches(model, pipelined, x, y)
    if num_cells == 4:  # The padding mask crosses the cuts to the later encoder layers.
        assert "padding_mask" in pipelined.partition_report(8).split("cut 1 -> 2")[1]


def test_bert_classifier_fit_matches_plain():
    # Adam, the optimizer these models train with (plain SGD: keras_hub_vision_test.py).
    # Keras gives the token and segment embeddings' gradients to the optimizer as one
    # row per token occurrence (squared row by row); they run before the pipeline
    # (front_embeddings.py) and get that gradient from the pipeline's input gradient.
    model = bert_classifier()  # The plain reference; the pipeline trains its own twin.
    pipelined = PipelinedModel(bert_classifier(), input_shape=BERT_SHAPES, num_cells=2,
                               num_micro_batches=2, schedule="1f1b")
    assert "node_0_token_embedding" not in [p.name for p in pipelined.pipeline.params.layers]
    model.compile(optimizer="adam", loss=LOSS)
    pipelined.compile(optimizer="adam", loss=LOSS)
    x, y = bert_batch(16, seed=1)
    pipelined.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(pipelined.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-5)
