"""The Transformer's pipeline layers: cost model, causality, pipelining equivalence, bfloat16.

Equivalence: the reference is the unpipelined model (every layer's FProp chained on the whole
batch, one GradientTape); its loss is the mean smoothed cross-entropy over all real target tokens.
The pipeline splits the batch into T micro-batches whose real-token counts differ (the padding is
random), so a pipeline that averaged micro-batch means without the `loss_weight` weighting would
be off by far more than the float32 tolerance rtol=2e-5, atol=2e-7 (the same as
pipeline_test.py: only the summation order differs).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import pipelining_layer
from tasks.mt import layers

VOCAB, D, H, HEADS = 23, 8, 16, 2
B, S, T = 8, 5, 6
RTOL, ATOL = 2e-5, 2e-7


def make_batch(seed: int = 0, batch: int = B) -> NestedMap:
    """Random ids with random lengths (>= 1 real token), padded like ParallelTextInput."""
    rng = np.random.default_rng(seed)
    src_len = rng.integers(1, S + 1, size=batch)
    tgt_len = rng.integers(1, T + 1, size=batch)
    src_pad = (np.arange(S)[None] >= src_len[:, None]).astype(np.float32)
    tgt_pad = (np.arange(T)[None] >= tgt_len[:, None]).astype(np.float32)
    src_ids = rng.integers(4, VOCAB, size=(batch, S)) * (1 - src_pad)
    tgt_labels = rng.integers(4, VOCAB, size=(batch, T)) * (1 - tgt_pad)
    tgt_ids = np.concatenate([np.full((batch, 1), 2), tgt_labels[:, :-1]], 1) * (1 - tgt_pad)
    return NestedMap(
        src_ids=tf.constant(src_ids, tf.int32), src_paddings=tf.constant(src_pad),
        tgt_ids=tf.constant(tgt_ids, tf.int32), tgt_labels=tf.constant(tgt_labels, tf.int32),
        tgt_paddings=tf.constant(tgt_pad), tgt_weights=tf.constant(1.0 - tgt_pad))


def layer_params(num_layers: int = 2, **kw) -> list:
    return layers.transformer_layers(VOCAB, D, H, HEADS, num_layers, num_layers, **kw)


def make_pipeline(num_cells=1, num_micro_batches=1, num_layers=2, **kw):
    p = pipelining_layer.PipeliningLayer.Params().Set(
        name="net", layers=layer_params(num_layers, **kw), num_cells=num_cells,
        num_micro_batches=num_micro_batches, remat="always",
        input_shapes=layers.input_shapes(B, S, T), random_seed=5)
    return p.Instantiate()


def reference_loss_and_grads(pipe, batch):
    theta = pipe.theta
    with tf.device("/device:CPU:0"), fprop_context.fprop_context(training=True, step_seed=1):
        with tf.GradientTape() as tape:
            out = composite.chain_fprop(pipe.layers, theta.layers, batch)
        grads = tape.gradient(out.loss, theta.Flatten())
    # Embedding lookups give IndexedSlices; the pipeline sums them densely.
    return out, [None if g is None else tf.convert_to_tensor(g) for g in grads]


def numpy_smoothed_xent(logits: np.ndarray, labels: np.ndarray, weights: np.ndarray,
                        ls: float) -> float:
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    target = np.eye(logits.shape[-1])[labels] * (1 - ls) + ls / logits.shape[-1]
    xent = -(target * logp).sum(-1)
    return float((xent * weights).sum() / weights.sum())


class MetaTest(tf.test.TestCase):

    def test_fprop_meta_matches_fprop_for_every_layer(self):
        pipe = make_pipeline()
        metas = pipelining_layer.PipeliningLayer.LayerMetas(pipe.params)
        x = make_batch()
        for layer, th, meta in zip(pipe.layers, pipe.theta.layers, metas):
            x = layer.FProp(th, x)
            actual = x.Transform(lambda t: t.shape.as_list())
            expected = meta.out_shapes[0].Transform(lambda s: tf.TensorShape(s).as_list())
            self.assertEqual(dict(actual.FlattenItems()), dict(expected.FlattenItems()),
                             layer.path)
            self.assertEqual(meta.num_params,
                             sum(int(np.prod(v.shape)) for v in layer.vars.Flatten()),
                             layer.path)
        self.assertEqual(sum(m.num_params for m in metas),
                         layers.count_params(D, H, 0, VOCAB, 2, share_embeddings=True))

    def test_attention_flops_grow_quadratically_with_length(self):
        p = layer_params()[1]  # An encoder layer.

        def flops(length):
            shapes = NestedMap(x=tf.TensorShape([B, length, D]),
                               src_paddings=tf.TensorShape([B, length]))
            return layers.EncoderLayer.FPropMeta(p, shapes).flops

        # Linear terms cancel in f(2L) - 2 f(L); the scores and weighted sum (2 * 2 * dh flops
        # per head, query and key) and the masked softmax (6 per score) are quadratic.
        length = 7
        quadratic = B * HEADS * (4 * (D // HEADS) + 6)
        self.assertEqual(flops(2 * length) - 2 * flops(length), 2 * quadratic * length ** 2)

    def test_separate_embeddings_have_two_tables(self):
        shared = layers.EmbeddingInputLayer.FPropMeta(
            layer_params()[0], layers.input_shapes(B, S, T)).num_params
        separate = layers.EmbeddingInputLayer.FPropMeta(
            layer_params(share_embeddings=False)[0], layers.input_shapes(B, S, T)).num_params
        self.assertEqual((shared, separate), (VOCAB * D, 2 * VOCAB * D))


class CausalityAndLossTest(tf.test.TestCase):

    def test_future_target_token_does_not_change_earlier_logits(self):
        pipe = make_pipeline()
        batch = make_batch(1)
        ids = batch.tgt_ids.numpy()
        changed = ids.copy()
        j = 3
        changed[:, j] = (changed[:, j] + 5) % VOCAB

        def logits(tgt_ids):
            x = batch.copy()
            x.tgt_ids = tf.constant(tgt_ids)
            x.tgt_paddings = tf.zeros_like(batch.tgt_paddings)  # Every position real.
            for layer, th in zip(pipe.layers[:-1], pipe.theta.layers[:-1]):
                x = layer.FProp(th, x)
            return pipe.layers[-1].Logits(pipe.theta.layers[-1], x.x).numpy()

        a, b = logits(ids), logits(changed)
        self.assertAllEqual(a[:, :j], b[:, :j])
        self.assertGreater(np.abs(a[:, j:] - b[:, j:]).min(axis=-1).min(), 0.0)

    def test_loss_is_token_mean_of_smoothed_xent(self):
        pipe = make_pipeline()
        batch = make_batch(2)
        x = batch
        for layer, th in zip(pipe.layers[:-1], pipe.theta.layers[:-1]):
            x = layer.FProp(th, x)
        out = pipe.layers[-1].FProp(pipe.theta.layers[-1], x)
        logits = pipe.layers[-1].Logits(pipe.theta.layers[-1], x.x).numpy()
        w = batch.tgt_weights.numpy()
        self.assertAllClose(out.loss, numpy_smoothed_xent(logits, batch.tgt_labels.numpy(), w,
                                                          0.1), rtol=1e-5)
        self.assertAllClose(out.log_pplx, numpy_smoothed_xent(
            logits, batch.tgt_labels.numpy(), w, 0.0), rtol=1e-5)
        self.assertEqual(float(out.loss_weight), w.sum())


class PipelineEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batch = make_batch(3)
        tokens = cls.batch.tgt_weights.numpy().reshape(4, -1).sum(-1)
        assert len(set(tokens)) > 1, "micro-batches must differ in real tokens"
        cls.ref_out, cls.ref_grads = reference_loss_and_grads(make_pipeline(), cls.batch)

    @parameterized.parameters((1, 4), (2, 2), (2, 8), (4, 4))
    def test_pipeline_matches_unpipelined(self, num_cells, num_micro_batches):
        pipe = make_pipeline(num_cells, num_micro_batches)
        self.assertEqual(pipe.num_cells, num_cells)

        # Eager: the same values as the traced step (control dependencies only order work),
        # without tracing a graph per configuration.
        with fprop_context.fprop_context(training=True, step_seed=1):
            out, grads = pipe.FPropAndGrads(pipe.theta, self.batch)
        grads = grads.Flatten()
        self.assertAllClose(out.loss, self.ref_out.loss, rtol=RTOL, atol=ATOL)
        self.assertAllClose(out.accuracy, self.ref_out.accuracy, rtol=RTOL, atol=ATOL)
        self.assertEqual(float(out.loss_weight), float(self.ref_out.loss_weight))
        for g, r in zip(grads, self.ref_grads):
            if r is None:
                self.assertIsNone(g)
            else:
                self.assertAllClose(g, r, rtol=RTOL, atol=ATOL)


class MixedPrecisionTest(tf.test.TestCase):

    def test_bfloat16_loss_close_to_float32(self):
        """Same float32 weights; bfloat16 activations. Tolerance: 1% relative.

        bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2% per value); the loss
        (computed in float32 from bfloat16 logits) measured 0.06-0.09% off on three seeds, so
        1% leaves a 10x margin and is still far below the gap to a different model.
        """
        batch = make_batch(4)
        f32 = make_pipeline(num_cells=2, num_micro_batches=2)
        bf16 = make_pipeline(num_cells=2, num_micro_batches=2, fprop_dtype=tf.bfloat16)
        for a, b in zip(f32.vars.Flatten(), bf16.vars.Flatten()):
            self.assertEqual(b.dtype, tf.float32)
            self.assertAllEqual(a, b)
        loss32 = f32.FProp(f32.theta, batch).loss
        out16 = bf16.FProp(bf16.theta, batch)
        self.assertEqual(out16.loss.dtype, tf.float32)
        self.assertAllClose(out16.loss, loss32, rtol=1e-2)
        with fprop_context.fprop_context(training=True, step_seed=1):
            _, grads = bf16.FPropAndGrads(bf16.theta, batch)
        for g in grads.Flatten():
            if g is not None:
                self.assertEqual(g.dtype, tf.float32)
                self.assertTrue(np.all(np.isfinite(g.numpy())))
