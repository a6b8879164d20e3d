"""Packed translation rows (tasks/mt/packing.py, ParallelTextInput.pack) against the same pairs
unpacked.

The Transformer's loss on rows packing several pairs (segment ids keep attention within a
pair, positions restart per pair) equals its loss on the same pairs one per row, and so do the
gradients of every weight; through the pipeline (K=2, T=2) as well. The reference is the
unpacked batch through the same layers, which never see segment fields. The input's packed rows
hold exactly the pairs of the unpacked stream, in order.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import tensorflow as tf
from mt_bucket_data import _params, data_dir  # noqa: F401  (the corpus fixture)

from lingvo_lite.analysis import memory_model
from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.training import options, runner
from tasks.mt import layers, packing

VOCAB, S, T = 17, 12, 12
TOL = 2e-5


def _pairs() -> dict[str, np.ndarray]:
    """Ten pairs of 2 to 6 source and target tokens, padded to S / T, one per row."""
    rng = np.random.default_rng(1)
    src_len, tgt_len = rng.integers(2, 7, size=10), rng.integers(2, 7, size=10)
    arrays = {k: np.zeros((10, S), np.int32) for k in ("src_ids", "tgt_ids", "tgt_labels")}
    for i, (s, t) in enumerate(zip(src_len, tgt_len)):
        arrays["src_ids"][i, :s] = rng.integers(3, VOCAB, size=s)
        arrays["tgt_ids"][i, :t] = rng.integers(3, VOCAB, size=t)
        arrays["tgt_labels"][i, :t] = rng.integers(3, VOCAB, size=t)
    arrays["src_paddings"] = (np.arange(S) >= src_len[:, None]).astype(np.float32)
    arrays["tgt_paddings"] = (np.arange(T) >= tgt_len[:, None]).astype(np.float32)
    arrays["tgt_weights"] = 1.0 - arrays["tgt_paddings"]
    return arrays


def _layer_params():
    return layers.transformer_layers(VOCAB, model_dim=8, hidden_dim=16, num_heads=2,
                                     num_encoder_layers=2, num_decoder_layers=2)


class _Plain:
    """The pipeline's layers and weights, run as one chain on one device (no pipeline)."""

    def __init__(self, pipe):
        self.layers, self.theta = pipe.layers, pipe.theta


def _loss_and_grads(model, batch):
    with fprop_context.fprop_context(training=True, step_seed=1, example_offset=0):
        if isinstance(model, pipelining_layer.PipeliningLayer):
            out, grads = model.FPropAndGrads(model.theta, batch)
            return out.loss, grads.Flatten()
        with tf.GradientTape() as tape:
            out = composite.chain_fprop(model.layers, model.theta.layers, batch)
        return out.loss, tape.gradient(out.loss, model.theta.Flatten())


def _tensors(arrays):
    return NestedMap({k: tf.constant(v) for k, v in arrays.items()})


def test_packed_rows_give_the_loss_and_gradients_of_the_pairs_unpacked():
    unpacked = _pairs()
    packed = packing.pack(unpacked, S, T)
    rows = packed["src_ids"].shape[0]
    assert rows == 4 and packed["src_segment_ids"].max() >= 3  # Several pairs per row.
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=_layer_params(), num_cells=2, num_micro_batches=2, random_seed=2,
        input_shapes=layers.input_shapes(rows, S, T, packed=True)).Instantiate()
    with tf.device("/device:CPU:0"):
        ref_loss, ref_grads = _loss_and_grads(_Plain(pipe), _tensors(unpacked))
        plain_loss, plain_grads = _loss_and_grads(_Plain(pipe), _tensors(packed))
    pipe_loss, pipe_grads = _loss_and_grads(pipe, _tensors(packed))
    assert np.isfinite(float(ref_loss)) and float(ref_loss) > 1.0
    for loss, grads, what in ((plain_loss, plain_grads, "plain"),
                              (pipe_loss, pipe_grads, "pipeline")):
        np.testing.assert_allclose(float(ref_loss), float(loss), rtol=TOL, err_msg=what)
        assert len(grads) == len(ref_grads)
        for g_ref, g in zip(ref_grads, grads):
            np.testing.assert_allclose(tf.convert_to_tensor(g_ref).numpy(),
                                       tf.convert_to_tensor(g).numpy(), rtol=TOL, atol=TOL,
                                       err_msg=what)


def test_input_packs_the_pairs_of_the_stream_in_order(data_dir):  # noqa: F811
    def pairs(batches, packed):
        out = []
        for b in batches:
            for i in range(b["src_ids"].shape[0]):
                if not packed:
                    out.append((tuple(b["src_ids"][i][b["src_paddings"][i] == 0].numpy()),
                                tuple(b["tgt_labels"][i][b["tgt_paddings"][i] == 0].numpy())))
                    continue
                seg_s, seg_t = b["src_segment_ids"][i].numpy(), b["tgt_segment_ids"][i].numpy()
                for j in range(1, seg_s.max() + 1):
                    pos_s = b["src_segment_pos"][i].numpy()[seg_s == j]
                    pos_t = b["tgt_segment_pos"][i].numpy()[seg_t == j]
                    assert list(pos_s) == list(range(len(pos_s)))  # Restart per pair.
                    assert list(pos_t) == list(range(len(pos_t)))
                    out.append((tuple(b["src_ids"][i].numpy()[seg_s == j]),
                                tuple(b["tgt_labels"][i].numpy()[seg_t == j])))
        return out

    plain = list(_params(data_dir, batch_size=4, drop_remainder=False).Instantiate().dataset())
    packed = list(_params(data_dir, batch_size=4, drop_remainder=False,
                          pack=True).Instantiate().dataset())
    assert pairs(plain, False) == pairs(packed, True)
    padding = [np.mean([float(np.mean(b["src_paddings"])) for b in bs]) for bs in (plain, packed)]
    # On this corpus: 100 batches padded 60% -> 56 batches padded 27%.
    assert len(packed) < 0.6 * len(plain) and padding[1] < padding[0] / 2, (len(packed), padding)
    for b in packed:
        # Padding is segment 0, and the same positions as the paddings say.
        np.testing.assert_array_equal(b["src_segment_ids"].numpy() == 0,
                                      b["src_paddings"].numpy() == 1)
        np.testing.assert_array_equal(b["tgt_segment_ids"].numpy() == 0,
                                      b["tgt_paddings"].numpy() == 1)
    with pytest.raises(ValueError, match="pack=True with bucket_lengths"):
        _params(data_dir, pack=True, bucket_lengths=[50], bucket_batch_sizes=[4]).Instantiate()


def test_registered_packed_model_is_inspected_with_its_segment_fields():
    out = io.StringIO()
    assert runner.main(options.RunOptions(model="mt.TransformerSmallPacked",
                                          mode="inspect_model"), out=out) == 0
    text = out.getvalue()
    assert "src_segment_pos: [32, 16]" in text and "tgt_segment_ids: [32, 18]" in text
    # The encoder self-attention keeps its [B, 1, S, S] boolean segment mask instead of the
    # paddings' [B, 1, 1, S]: 4 * 12 * 12 - 4 * 12 bytes more per encoder layer.
    kept = [memory_model.layer_memory(pipelining_layer.PipeliningLayer.LayerMetas(
        pipelining_layer.PipeliningLayer.Params().Set(
            name="p", layers=_layer_params(), input_shapes=layers.input_shapes(4, S, T, packed))),
        4)[1].saved_bytes for packed in (True, False)]
    assert kept[0] - kept[1] == 4 * S * S - 4 * S
