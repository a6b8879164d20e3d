"""LayerNorm, MultiHeadedAttention, FeedForwardLayer and SoftmaxCrossEntropyLayer vs numpy."""

import numpy as np
import tensorflow as tf

from lingvo_lite.core.fprop_context import fprop_context
from lingvo_lite.layers import attention, feedforward, losses, normalization


def _randomize(layer, seed):
    """Gives every variable random values (biases and scales included) and returns them."""
    rng = np.random.default_rng(seed)
    values = {}
    for v in layer.variables:
        value = rng.normal(scale=0.5, size=v.shape).astype(np.float32)
        v.assign(value)
        values[v.name.split(":")[0]] = value
    return values


def _var(layer, path):
    """numpy value of the variable at dotted `path` (e.g. 'fflayer_1.w')."""
    node = layer.vars
    for key in path.split("."):
        node = node[key]
    return node.numpy()


def _num_vars(layer):
    return sum(int(np.prod(v.shape)) for v in layer.variables)


def _np_layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _np_log_softmax(logits):
    m = logits.max(-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


class LayerNormTest(tf.test.TestCase):

    def test_matches_numpy(self):
        rng = np.random.default_rng(0)
        for shape in ([3, 8], [2, 5, 8], [1, 1, 8]):
            p = normalization.LayerNorm.Params().Set(name="ln", input_dim=8, epsilon=1e-6)
            layer = p.Instantiate()
            _randomize(layer, 1)
            x = (rng.normal(size=shape) * 2.0 + 3.0).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x))
            expected = _np_layer_norm(x.astype(np.float64), _var(layer, "scale"),
                                      _var(layer, "bias"), 1e-6)
            self.assertAllClose(expected, y.numpy(), rtol=1e-5, atol=1e-5)
            meta = normalization.LayerNorm.FPropMeta(p, tf.TensorShape(shape))
            self.assertEqual(meta.out_shapes, (tf.TensorShape(y.shape),))
            self.assertEqual(meta.num_params, _num_vars(layer))

    def test_bfloat16_output(self):
        p = normalization.LayerNorm.Params().Set(name="ln", input_dim=4, fprop_dtype=tf.bfloat16)
        y = p.Instantiate().FPropDefaultTheta(tf.constant([[1.0, 2.0, 3.0, 4.0]]))
        self.assertEqual(y.dtype, tf.bfloat16)
        x = np.array([1.0, 2.0, 3.0, 4.0])
        self.assertAllClose((x - 2.5) / np.sqrt(1.25 + 1e-6), y.numpy()[0].astype(np.float32),
                            atol=2e-2)

    def test_wrong_depth_raises(self):
        p = normalization.LayerNorm.Params().Set(name="ln", input_dim=4)
        with self.assertRaisesRegex(ValueError, "input_dim"):
            p.Instantiate().FPropDefaultTheta(tf.zeros([2, 3]))


def _np_attention(layer, q_in, k_in, v_in, num_heads, paddings=None, causal=False):
    """Independent reference: per-head loops in float64 numpy. Returns (out, probs)."""
    w = {name: _var(layer, name).astype(np.float64)
         for name in ("w_query", "w_key", "w_value", "w_post")}
    b = {name: _var(layer, name).astype(np.float64)
         for name in ("b_query", "b_key", "b_value", "b_post")}
    B, Tq, _ = q_in.shape
    Tk = k_in.shape[1]
    H = w["w_query"].shape[1]
    dh = H // num_heads
    q = q_in @ w["w_query"] + b["b_query"]
    k = k_in @ w["w_key"] + b["b_key"]
    v = v_in @ w["w_value"] + b["b_value"]
    probs = np.zeros([B, num_heads, Tq, Tk])
    context = np.zeros([B, Tq, H])
    for bi in range(B):
        for n in range(num_heads):
            sl = slice(n * dh, (n + 1) * dh)
            for t in range(Tq):
                scores = np.array([q[bi, t, sl] @ k[bi, s, sl] / np.sqrt(dh) for s in range(Tk)])
                allowed = np.ones(Tk, bool)
                if paddings is not None:
                    allowed &= paddings[bi] == 0
                if causal:
                    allowed &= np.arange(Tk) <= t
                e = np.where(allowed, np.exp(scores - scores[allowed].max()), 0.0)
                probs[bi, n, t] = e / e.sum()
                context[bi, t, sl] = probs[bi, n, t] @ v[bi, :, sl]
    out = context @ w["w_post"] + b["b_post"]
    return out, probs


class AttentionTest(tf.test.TestCase):

    def _layer(self, input_dim=8, hidden_dim=12, num_heads=3, **kw):
        p = attention.MultiHeadedAttention.Params().Set(
            name="att", input_dim=input_dim, hidden_dim=hidden_dim, num_heads=num_heads, **kw)
        layer = p.Instantiate()
        _randomize(layer, 3)
        return p, layer

    def test_cross_attention_matches_numpy(self):
        rng = np.random.default_rng(0)
        _, layer = self._layer()
        q = rng.normal(size=[2, 3, 8]).astype(np.float32)
        kv = rng.normal(size=[2, 5, 8]).astype(np.float32)
        out, probs = layer.FPropWithProbs(layer.theta, tf.constant(q), tf.constant(kv),
                                          tf.constant(kv))
        ref_out, ref_probs = _np_attention(layer, q, kv, kv, 3)
        self.assertAllClose(ref_probs, probs.numpy(), rtol=1e-5, atol=1e-5)
        self.assertAllClose(ref_out, out.numpy(), rtol=1e-4, atol=1e-4)
        self.assertAllClose(out, layer.FPropDefaultTheta(q, kv, kv))

    def test_paddings(self):
        rng = np.random.default_rng(1)
        _, layer = self._layer()
        q = rng.normal(size=[3, 4, 8]).astype(np.float32)
        k = rng.normal(size=[3, 6, 8]).astype(np.float32)
        v = rng.normal(size=[3, 6, 8]).astype(np.float32)
        paddings = np.zeros([3, 6], np.float32)
        paddings[0, 4:] = 1.0
        paddings[1, 1:] = 1.0
        out, probs = layer.FPropWithProbs(layer.theta, q, k, v, tf.constant(paddings))
        probs = probs.numpy()
        self.assertAllEqual(np.zeros_like(probs[0, :, :, 4:]), probs[0, :, :, 4:])
        self.assertAllEqual(np.zeros_like(probs[1, :, :, 1:]), probs[1, :, :, 1:])
        self.assertAllClose(np.ones([3, 3, 4]), probs.sum(-1), atol=1e-6)
        ref_out, ref_probs = _np_attention(layer, q, k, v, 3, paddings=paddings)
        self.assertAllClose(ref_probs, probs, rtol=1e-5, atol=1e-5)
        self.assertAllClose(ref_out, out.numpy(), rtol=1e-4, atol=1e-4)
        # Values at padded positions do not influence the output.
        v2 = v.copy()
        v2[0, 4:] = 100.0
        self.assertAllClose(out, layer.FPropDefaultTheta(q, k, v2, paddings), atol=1e-4)

    def test_causal_mask(self):
        rng = np.random.default_rng(2)
        _, layer = self._layer(causal_mask=True)
        x = rng.normal(size=[2, 5, 8]).astype(np.float32)
        paddings = np.zeros([2, 5], np.float32)
        paddings[1, 3:] = 1.0
        for pad in (None, paddings):
            out, probs = layer.FPropWithProbs(layer.theta, x, x, x, pad)
            probs = probs.numpy()
            future = np.triu(np.ones([5, 5], bool), k=1)  # [query, key]: key > query.
            self.assertAllEqual(np.zeros(future.sum() * 2 * 3), probs[:, :, future].ravel())
            ref_out, ref_probs = _np_attention(layer, x, x, x, 3, paddings=pad, causal=True)
            self.assertAllClose(ref_probs, probs, rtol=1e-5, atol=1e-5)
            self.assertAllClose(ref_out, out.numpy(), rtol=1e-4, atol=1e-4)
        # Changing the last position leaves earlier outputs unchanged.
        x2 = x.copy()
        x2[:, -1] += 3.0
        out2 = layer.FPropDefaultTheta(x2, x2, x2).numpy()
        self.assertAllClose(layer.FPropDefaultTheta(x, x, x).numpy()[:, :-1], out2[:, :-1],
                            atol=1e-5)

    def test_causal_needs_equal_lengths(self):
        p, layer = self._layer(causal_mask=True)
        with self.assertRaisesRegex(ValueError, "causal_mask"):
            layer.FPropDefaultTheta(tf.zeros([1, 2, 8]), tf.zeros([1, 3, 8]), tf.zeros([1, 3, 8]))
        with self.assertRaisesRegex(ValueError, "causal_mask"):
            attention.MultiHeadedAttention.FPropMeta(p, [1, 2, 8], [1, 3, 8], [1, 3, 8])

    def test_num_heads_must_divide_hidden_dim(self):
        p = attention.MultiHeadedAttention.Params().Set(name="att", input_dim=8, num_heads=3)
        with self.assertRaisesRegex(ValueError, "num_heads=3 does not divide p.hidden_dim=8"):
            p.Instantiate()
        with self.assertRaisesRegex(ValueError, "num_heads"):
            attention.MultiHeadedAttention.FPropMeta(p, [1, 2, 8], [1, 2, 8], [1, 2, 8])

    def test_meta_shapes_params_and_flops(self):
        for use_bias in (True, False):
            p, layer = self._layer(use_bias=use_bias)
            self.assertEqual(attention.MultiHeadedAttention.FPropMeta(
                p, [1, 1, 8], [1, 1, 8], [1, 1, 8]).num_params, _num_vars(layer))
            for B, Tq, Tk in ((1, 1, 1), (3, 5, 7), (2, 4, 4)):
                out = layer.FPropDefaultTheta(tf.zeros([B, Tq, 8]), tf.zeros([B, Tk, 8]),
                                              tf.zeros([B, Tk, 8]), tf.zeros([B, Tk]))
                meta = attention.MultiHeadedAttention.FPropMeta(
                    p, [B, Tq, 8], [B, Tk, 8], [B, Tk, 8], [B, Tk])
                self.assertEqual(meta.out_shapes, (tf.TensorShape(out.shape),))
        # Flops grow with the sequence lengths: the score and weighted-sum matmuls alone are
        # 2 * B * N * Tq * Tk * dh * 2.
        p, _ = self._layer(use_bias=False)

        def flops(Tq, Tk):
            return attention.MultiHeadedAttention.FPropMeta(
                p, [2, Tq, 8], [2, Tk, 8], [2, Tk, 8]).flops

        projections = 2 * 2 * 8 * 12 * (1 + 2 + 1)  # Q, K, V and output at Tq = Tk = 1.
        scores = 2 * 2 * 3 * 4  # 2 * B * N * dh * 2 per (query, key) pair.
        self.assertGreaterEqual(flops(1, 1), projections + scores)
        self.assertGreater(flops(4, 4), flops(2, 2))
        self.assertGreaterEqual(flops(1, 9) - flops(1, 1), 8 * (scores + 2 * 2 * 8 * 12 * 2))

    def test_bfloat16(self):
        rng = np.random.default_rng(4)
        _, layer32 = self._layer()
        p16, _ = self._layer(fprop_dtype=tf.bfloat16)
        layer16 = p16.Instantiate()
        for v16, v32 in zip(layer16.variables, layer32.variables):
            v16.assign(v32)
        x = rng.normal(size=[2, 4, 8]).astype(np.float32)
        out16, probs16 = layer16.FPropWithProbs(layer16.theta, x, x, x)
        out32 = layer32.FPropDefaultTheta(x, x, x)
        self.assertEqual(out16.dtype, tf.bfloat16)
        self.assertEqual(probs16.dtype, tf.float32)
        self.assertAllClose(out32, tf.cast(out16, tf.float32), atol=0.15, rtol=0.05)

    def test_attention_dropout(self):
        rng = np.random.default_rng(5)
        _, plain = self._layer()
        p, layer = self._layer(atten_dropout_prob=0.5)
        for v, w in zip(layer.variables, plain.variables):
            v.assign(w)
        self.assertEqual(attention.MultiHeadedAttention.FPropMeta(
            p, [1, 1, 8], [1, 1, 8], [1, 1, 8]).num_params, _num_vars(layer))
        x = rng.normal(size=[2, 4, 8]).astype(np.float32)
        expected = plain.FPropDefaultTheta(x, x, x)
        self.assertAllClose(expected, layer.FPropDefaultTheta(x, x, x))  # Eval: no dropout.
        with fprop_context(training=True, step_seed=3):
            a = layer.FPropDefaultTheta(x, x, x)
            b = layer.FPropDefaultTheta(x, x, x)
        self.assertAllClose(a, b)  # Same seed, same masks.
        self.assertGreater(np.abs(a.numpy() - expected.numpy()).max(), 1e-3)


def _np_ffn(layer, x, pre_layer_norm, add_residual, activation=lambda h: np.maximum(h, 0.0)):
    h = x
    if pre_layer_norm:
        h = _np_layer_norm(h, _var(layer, "layer_norm.scale"), _var(layer, "layer_norm.bias"),
                           1e-6)
    h = activation(h @ _var(layer, "fflayer_1.w") + _var(layer, "fflayer_1.b"))
    h = h @ _var(layer, "fflayer_2.w") + _var(layer, "fflayer_2.b")
    return h + x if add_residual else h


class FeedForwardTest(tf.test.TestCase):

    def test_matches_numpy(self):
        rng = np.random.default_rng(0)
        for pre_ln, residual in ((True, True), (False, False), (True, False)):
            p = feedforward.FeedForwardLayer.Params().Set(
                name="ffn", input_dim=6, hidden_dim=10, pre_layer_norm=pre_ln,
                add_residual=residual)
            layer = p.Instantiate()
            _randomize(layer, 7)
            for shape in ([1, 6], [3, 6], [2, 5, 6]):
                x = rng.normal(size=shape).astype(np.float32)
                y = layer.FPropDefaultTheta(tf.constant(x))
                self.assertAllClose(_np_ffn(layer, x.astype(np.float64), pre_ln, residual),
                                    y.numpy(), rtol=1e-4, atol=1e-4)
                meta = feedforward.FeedForwardLayer.FPropMeta(p, shape)
                self.assertEqual(meta.out_shapes, (tf.TensorShape(y.shape),))
                self.assertEqual(meta.num_params, _num_vars(layer))
                self.assertGreaterEqual(meta.flops, 2 * 2 * np.prod(shape[:-1]) * 6 * 10)

    def test_activation_and_dropout(self):
        rng = np.random.default_rng(1)
        p = feedforward.FeedForwardLayer.Params().Set(
            name="ffn", input_dim=4, hidden_dim=8, activation="TANH", relu_dropout_prob=0.3,
            residual_dropout_prob=0.2)
        layer = p.Instantiate()
        _randomize(layer, 2)
        self.assertEqual(feedforward.FeedForwardLayer.FPropMeta(p, [2, 3, 4]).num_params,
                         _num_vars(layer))
        x = rng.normal(size=[2, 3, 4]).astype(np.float32)
        expected = _np_ffn(layer, x.astype(np.float64), True, True, activation=np.tanh)
        self.assertAllClose(expected, layer.FPropDefaultTheta(x).numpy(), rtol=1e-4, atol=1e-4)
        with fprop_context(training=True, step_seed=1):
            train_out = layer.FPropDefaultTheta(x).numpy()
        self.assertGreater(np.abs(train_out - expected).max(), 1e-3)

    def test_wrong_depth_raises(self):
        p = feedforward.FeedForwardLayer.Params().Set(name="ffn", input_dim=4, hidden_dim=8)
        with self.assertRaisesRegex(ValueError, "input_dim"):
            p.Instantiate().FPropDefaultTheta(tf.zeros([2, 5]))


class SoftmaxCrossEntropyTest(tf.test.TestCase):

    def _np_metrics(self, layer, x, labels, weights, ls):
        logits = x.astype(np.float64) @ _var(layer, "weight") + _var(layer, "bias")
        log_probs = _np_log_softmax(logits)
        num_classes = logits.shape[-1]
        onehot = np.eye(num_classes)[labels]
        target = (1 - ls) * onehot + ls / num_classes
        xent = -(target * log_probs).sum(-1)
        correct = (logits.argmax(-1) == labels).astype(np.float64)
        return dict(logits=logits, log_probs=log_probs, per_example_xent=xent,
                    loss=(weights * xent).sum() / weights.sum(), num_examples=weights.sum(),
                    accuracy=(weights * correct).sum() / weights.sum())

    def test_matches_numpy(self):
        rng = np.random.default_rng(0)
        for ls in (0.0, 0.1):
            p = losses.SoftmaxCrossEntropyLayer.Params().Set(
                name="sm", input_dim=6, num_classes=5, label_smoothing=ls)
            layer = p.Instantiate()
            _randomize(layer, 1)
            for shape in ([4], [2, 3]):
                x = rng.normal(size=shape + [6]).astype(np.float32)
                labels = rng.integers(0, 5, size=shape)
                weights = rng.integers(0, 2, size=shape).astype(np.float32)
                weights.flat[0] = 1.0
                out = layer.FPropDefaultTheta(x, tf.constant(labels), tf.constant(weights))
                ref = self._np_metrics(layer, x, labels, weights, ls)
                for key, value in ref.items():
                    self.assertAllClose(value, out[key].numpy(), rtol=1e-5, atol=1e-5, msg=key)
                    self.assertEqual(out[key].dtype, tf.float32)
                meta = losses.SoftmaxCrossEntropyLayer.FPropMeta(p, shape + [6], shape, shape)
                self.assertEqual(meta.out_shapes[0].Transform(tf.TensorShape),
                                 out.Transform(lambda t: tf.TensorShape(t.shape)))
                self.assertEqual(meta.num_params, _num_vars(layer))
                # Without weights every example counts once.
                out = layer.FPropDefaultTheta(x, labels)
                ref = self._np_metrics(layer, x, labels, np.ones(shape), ls)
                self.assertAllClose(ref["loss"], out.loss.numpy(), rtol=1e-5)
                self.assertAllClose(np.prod(shape), out.num_examples.numpy())

    def test_xent_function(self):
        rng = np.random.default_rng(2)
        logits = rng.normal(size=[3, 4, 7]).astype(np.float32) * 3.0
        labels = rng.integers(0, 7, size=[3, 4])
        # No smoothing: TF's own sparse cross-entropy.
        self.assertAllClose(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits),
            losses.xent_with_label_smoothing(logits, labels, 0.0), rtol=1e-5, atol=1e-5)
        # Smoothing: -sum_c target_c * log p_c with target = 0.8 * onehot + 0.2 / 7.
        log_p = _np_log_softmax(logits.astype(np.float64))
        target = 0.8 * np.eye(7)[labels] + 0.2 / 7
        self.assertAllClose(-(target * log_p).sum(-1),
                            losses.xent_with_label_smoothing(logits, labels, 0.2),
                            rtol=1e-5, atol=1e-5)
        # The same as (1 - ls) * NLL + ls * mean over classes of -log p.
        nll = -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]
        self.assertAllClose(0.8 * nll + 0.2 * -log_p.mean(-1),
                            losses.xent_with_label_smoothing(logits, labels, 0.2),
                            rtol=1e-5, atol=1e-5)

    def test_xent_gradient(self):
        # d/dlogits of sum(w * xent) is w * (softmax(logits) - target), with and without
        # smoothing; the fused kernel's gradient against numpy, for 2-D and 3-D logits.
        rng = np.random.default_rng(3)
        for shape, ls in (([5], 0.0), ([3, 4], 0.0), ([3, 4], 0.1)):
            logits = (rng.normal(size=[*shape, 7]) * 3.0).astype(np.float32)
            labels = rng.integers(0, 7, size=shape)
            w = rng.uniform(size=shape).astype(np.float32)
            x = tf.constant(logits)
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(w * losses.xent_with_label_smoothing(x, labels, ls))
            p = np.exp(_np_log_softmax(logits.astype(np.float64)))
            target = (1 - ls) * np.eye(7)[labels] + ls / 7
            with self.subTest(shape=shape, label_smoothing=ls):
                self.assertAllClose(w[..., None] * (p - target), tape.gradient(loss, x),
                                    rtol=1e-5, atol=1e-6)

    def test_bfloat16_softmax_in_float32(self):
        p = losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="sm", input_dim=4, num_classes=3, fprop_dtype=tf.bfloat16, has_bias=False)
        layer = p.Instantiate()
        self.assertEqual(losses.SoftmaxCrossEntropyLayer.FPropMeta(p, [2, 4]).num_params,
                         _num_vars(layer))
        out = layer.FPropDefaultTheta(tf.ones([2, 4]), tf.constant([0, 2]))
        self.assertEqual(out.log_probs.dtype, tf.float32)
        self.assertAllClose(np.ones(2), np.exp(out.log_probs.numpy()).sum(-1), atol=1e-6)

    def test_bad_inputs_raise(self):
        p = losses.SoftmaxCrossEntropyLayer.Params().Set(name="sm", input_dim=4, num_classes=3)
        layer = p.Instantiate()
        with self.assertRaisesRegex(ValueError, "input_dim"):
            layer.FPropDefaultTheta(tf.zeros([2, 5]), tf.constant([0, 1]))
        with self.assertRaisesRegex(ValueError, "class_ids"):
            layer.FPropDefaultTheta(tf.zeros([2, 4]), tf.constant([0, 1, 2]))
        with self.assertRaisesRegex(ValueError, "label_smoothing"):
            p.Copy().Set(label_smoothing=1.0).Instantiate()


if __name__ == "__main__":
    tf.test.main()
