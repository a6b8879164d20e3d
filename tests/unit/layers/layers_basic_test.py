"""Tests of the basic layers: shapes and costs from FPropMeta, numerics against numpy."""

from __future__ import annotations

import itertools
import math

import numpy as np
import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import (
    activations,
    conv,
    dense,
    dropout,
    embedding,
    pooling,
    structural,
)

_ERF = np.vectorize(math.erf)

_NP_ACTIVATIONS = {
    "NONE": lambda x: x,
    "RELU": lambda x: np.maximum(x, 0.0),
    "RELU6": lambda x: np.clip(x, 0.0, 6.0),
    "GELU": lambda x: 0.5 * x * (1.0 + _ERF(x / np.sqrt(2.0))),
    "SWISH": lambda x: x / (1.0 + np.exp(-x)),
    "SIGMOID": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "TANH": np.tanh,
}


def _num_var_elements(layer) -> int:
    return sum(int(np.prod(v.shape)) for v in tf.nest.flatten(layer.vars))


def _np_same_pads(size: int, k: int, s: int, d: int) -> tuple[int, int, int]:
    """(out, pad_before, pad_after) for TF SAME padding, written out independently."""
    eff = (k - 1) * d + 1
    out = (size + s - 1) // s
    total = max(0, (out - 1) * s + eff - size)
    return out, total // 2, total - total // 2


def _np_windows(x, kernel, stride, dilation, padding, fill):
    """Yields (i, j, window [B, kh, kw, C], valid mask [kh, kw]) with explicit padding."""
    b, h, w, c = x.shape
    kh, kw = kernel
    (sh, sw), (dh, dw) = stride, dilation
    if padding == "SAME":
        oh, pt, pb = _np_same_pads(h, kh, sh, dh)
        ow, pl, pr = _np_same_pads(w, kw, sw, dw)
    else:
        oh = (h - (kh - 1) * dh - 1) // sh + 1
        ow = (w - (kw - 1) * dw - 1) // sw + 1
        pt = pb = pl = pr = 0
    xp = np.full((b, h + pt + pb, w + pl + pr, c), fill, dtype=np.float64)
    xp[:, pt:pt + h, pl:pl + w, :] = x
    valid = np.zeros(xp.shape[1:3], bool)
    valid[pt:pt + h, pl:pl + w] = True
    for i in range(oh):
        for j in range(ow):
            rows = [i * sh + a * dh for a in range(kh)]
            cols = [j * sw + a * dw for a in range(kw)]
            yield i, j, oh, ow, xp[:, rows][:, :, cols], valid[rows][:, cols]


def np_conv2d(x, w, stride, dilation, padding, depthwise=False):
    out = None
    for i, j, oh, ow, win, _ in _np_windows(x, w.shape[:2], stride, dilation, padding, 0.0):
        if depthwise:  # out channel c * m_count + m.
            val = np.einsum("bhwc,hwcm->bcm", win, w).reshape(x.shape[0], -1)
        else:
            val = np.einsum("bhwc,hwco->bo", win, w)
        if out is None:
            out = np.zeros((x.shape[0], oh, ow, val.shape[-1]))
        out[:, i, j, :] = val
    return out


def np_pool(x, window, stride, padding, pooling_type):
    fill = -np.inf if pooling_type == "MAX" else 0.0
    out = None
    for i, j, oh, ow, win, valid in _np_windows(x, window, stride, (1, 1), padding, fill):
        if pooling_type == "MAX":
            val = win.max(axis=(1, 2))
        else:
            val = win.sum(axis=(1, 2)) / valid.sum()
        if out is None:
            out = np.zeros((x.shape[0], oh, ow, x.shape[-1]))
        out[:, i, j, :] = val
    return out


class ActivationsTest(tf.test.TestCase):

    def test_all_against_numpy(self):
        x = np.linspace(-8.0, 8.0, 101)
        for name, ref in _NP_ACTIVATIONS.items():
            got = activations.get_activation(name)(tf.constant(x, tf.float64)).numpy()
            self.assertAllClose(got, ref(x), atol=1e-6, msg=name)
            self.assertGreaterEqual(activations.activation_flops_per_element(name), 0)
        self.assertEqual(activations.activation_flops_per_element("NONE"), 0)

    def test_unknown_name_lists_valid_names(self):
        with self.assertRaisesRegex(ValueError, "RELU6.*TANH"):
            activations.get_activation("LEAKY")
        with self.assertRaisesRegex(ValueError, "activation"):
            activations.activation_flops_per_element("relu")


class ProjectionLayerTest(tf.test.TestCase):

    def _check(self, cls, in_shape, has_bias, activation):
        p = cls.Params().Set(name="proj", input_dim=in_shape[-1], output_dim=5,
                             has_bias=has_bias, activation=activation, random_seed=3)
        layer = p.Instantiate()
        rng = np.random.default_rng(len(in_shape))
        x = rng.normal(size=in_shape).astype(np.float32)
        if has_bias:  # Non-zero bias so that it is actually tested.
            layer.b.assign(rng.normal(size=[5]).astype(np.float32))
        y = layer.FPropDefaultTheta(tf.constant(x))
        w = layer.w.numpy().astype(np.float64)
        ref = x.astype(np.float64) @ w + (layer.b.numpy() if has_bias else 0.0)
        self.assertAllClose(y, _NP_ACTIVATIONS[activation](ref), rtol=1e-5, atol=1e-5)
        meta = cls.FPropMeta(p, tf.TensorShape(in_shape))
        self.assertEqual(meta.out_shapes, (y.shape,))
        self.assertEqual(meta.num_params, _num_var_elements(layer))
        rows = int(np.prod(in_shape[:-1]))
        self.assertGreaterEqual(meta.flops, 2 * rows * in_shape[-1] * 5)
        self.assertEqual(meta.out_bytes, 4 * int(np.prod(y.shape)))

    def test_shapes_params_numerics(self):
        for shape, has_bias, act in [([1, 3], True, "NONE"), ([4, 7], False, "TANH"),
                                     ([2, 3, 6], True, "GELU"), ([1, 2, 3, 4], True, "RELU")]:
            self._check(dense.ProjectionLayer, shape, has_bias, act)

    def test_fc_layer_defaults_to_relu(self):
        self.assertEqual(dense.FCLayer.Params().activation, "RELU")
        self.assertEqual(dense.ProjectionLayer.Params().activation, "NONE")
        self._check(dense.FCLayer, [3, 4], True, "RELU")

    def test_flops_formula(self):
        p = dense.ProjectionLayer.Params().Set(name="p", input_dim=8, output_dim=3)
        meta = dense.ProjectionLayer.FPropMeta(p, tf.TensorShape([2, 5, 8]))
        self.assertEqual(meta.flops, 2 * 10 * 8 * 3 + 10 * 3)  # MACs + bias adds.

    def test_input_dim_mismatch_names_param(self):
        p = dense.ProjectionLayer.Params().Set(name="p", input_dim=4, output_dim=3)
        layer = p.Instantiate()
        with self.assertRaisesRegex(ValueError, r"input_dim.*\(2, 5\)|input_dim.*\[2, 5\]"):
            layer.FPropDefaultTheta(tf.zeros([2, 5]))
        with self.assertRaisesRegex(ValueError, "input_dim"):
            dense.ProjectionLayer.FPropMeta(p, tf.TensorShape([2, 5]))
        with self.assertRaisesRegex(ValueError, "rank >= 2"):
            layer.FPropDefaultTheta(tf.zeros([4]))
        with self.assertRaisesRegex(ValueError, "output_dim"):
            dense.ProjectionLayer.Params().Set(name="p", input_dim=4).Instantiate()

    def test_dynamic_batch_in_tf_function(self):
        p = dense.ProjectionLayer.Params().Set(name="p", input_dim=4, output_dim=3)
        layer = p.Instantiate()
        fn = tf.function(layer.FPropDefaultTheta,
                         input_signature=[tf.TensorSpec([None, None, 4], tf.float32)])
        x = np.random.default_rng(2).normal(size=[3, 2, 4]).astype(np.float32)
        y = fn(x)
        self.assertAllClose(y, x @ layer.w.numpy() + layer.b.numpy(), rtol=1e-5, atol=1e-6)
        self.assertEqual(fn.get_concrete_function().output_shapes.as_list(), [None, None, 3])

    def test_mixed_precision(self):
        p = dense.ProjectionLayer.Params().Set(name="p", input_dim=4, output_dim=3,
                                               fprop_dtype=tf.bfloat16)
        layer = p.Instantiate()
        x = np.ones([2, 4], np.float32)
        y = layer.FPropDefaultTheta(tf.constant(x))
        self.assertEqual(y.dtype, tf.bfloat16)
        self.assertEqual(layer.w.dtype, tf.float32)
        self.assertAllClose(tf.cast(y, tf.float32), x @ layer.w.numpy(), rtol=2e-2, atol=2e-2)


_CONV_CASES = [
    # (input shape, stride, dilation, padding)
    ([1, 7, 7, 3], (1, 1), (1, 1), "SAME"),
    ([1, 7, 7, 3], (2, 2), (1, 1), "VALID"),
    ([2, 8, 9, 3], (2, 2), (1, 1), "SAME"),
    ([2, 8, 9, 3], (1, 1), (2, 2), "VALID"),
    ([3, 5, 6, 3], (2, 1), (1, 1), "SAME"),
    ([2, 9, 7, 3], (1, 1), (2, 1), "SAME"),
    ([1, 9, 11, 3], (2, 2), (2, 2), "SAME"),
    ([2, 10, 9, 3], (2, 2), (2, 2), "VALID"),
    ([1, 3, 2, 3], (1, 1), (1, 1), "VALID"),  # Output 1x1 (kernel 3x2).
]


class ConvLayersTest(tf.test.TestCase):

    def test_conv2d(self):
        rng = np.random.default_rng(0)
        for in_shape, stride, dilation, padding in _CONV_CASES:
            for has_bias, act in [(False, "NONE"), (True, "RELU")]:
                p = conv.Conv2DLayer.Params().Set(
                    name="conv", filter_shape=(3, 2, 3, 4), filter_stride=stride,
                    dilation_rate=dilation, padding=padding, has_bias=has_bias, activation=act)
                layer = p.Instantiate()
                if has_bias:
                    layer.b.assign(rng.normal(size=[4]).astype(np.float32))
                x = rng.normal(size=in_shape).astype(np.float32)
                y = layer.FPropDefaultTheta(tf.constant(x))
                ref = np_conv2d(x.astype(np.float64), layer.w.numpy().astype(np.float64),
                                stride, dilation, padding)
                if has_bias:
                    ref = ref + layer.b.numpy()
                msg = f"{in_shape} {stride} {dilation} {padding}"
                self.assertEqual(tuple(y.shape), ref.shape, msg=msg)
                self.assertAllClose(y, _NP_ACTIVATIONS[act](ref), atol=1e-4, msg=msg)
                meta = conv.Conv2DLayer.FPropMeta(p, tf.TensorShape(in_shape))
                self.assertEqual(meta.out_shapes, (y.shape,), msg=msg)
                self.assertEqual(meta.num_params, _num_var_elements(layer))
                b, oh, ow, co = y.shape
                macs_flops = 2 * b * oh * ow * 3 * 2 * 3 * 4
                extra = b * oh * ow * co * (int(has_bias) + (1 if act == "RELU" else 0))
                self.assertEqual(meta.flops, macs_flops + extra, msg=msg)

    def test_depthwise_conv2d(self):
        rng = np.random.default_rng(1)
        for in_shape, stride, dilation, padding in _CONV_CASES:
            p = conv.DepthwiseConv2DLayer.Params().Set(
                name="dw", filter_shape=(3, 2, 3, 2), filter_stride=stride,
                dilation_rate=dilation, padding=padding, has_bias=True)
            layer = p.Instantiate()
            layer.b.assign(rng.normal(size=[6]).astype(np.float32))
            x = rng.normal(size=in_shape).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x))
            ref = np_conv2d(x.astype(np.float64), layer.w.numpy().astype(np.float64),
                            stride, dilation, padding, depthwise=True) + layer.b.numpy()
            msg = f"{in_shape} {stride} {dilation} {padding}"
            self.assertEqual(tuple(y.shape), ref.shape, msg=msg)
            self.assertAllClose(y, ref, atol=1e-4, msg=msg)
            meta = conv.DepthwiseConv2DLayer.FPropMeta(p, tf.TensorShape(in_shape))
            self.assertEqual(meta.out_shapes, (y.shape,), msg=msg)
            self.assertEqual(meta.num_params, _num_var_elements(layer))
            b, oh, ow, co = y.shape
            self.assertEqual(meta.flops, 2 * b * oh * ow * 3 * 2 * 3 * 2 + b * oh * ow * co)

    def test_separable_conv2d(self):
        rng = np.random.default_rng(2)
        for (in_shape, stride, dilation, padding), mult in itertools.product(
                _CONV_CASES[:5], (1, 2)):
            p = conv.SeparableConv2DLayer.Params().Set(
                name="sep", kernel_size=3, input_dim=3, output_dim=5, stride=stride,
                dilation_rate=dilation, padding=padding, depth_multiplier=mult,
                activation="RELU6", has_bias=True)
            layer = p.Instantiate()
            layer.pointwise.b.assign(rng.normal(size=[5]).astype(np.float32))
            x = rng.normal(size=in_shape).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x))
            mid = np_conv2d(x.astype(np.float64), layer.depthwise.w.numpy().astype(np.float64),
                            stride, dilation, padding, depthwise=True)
            pw = layer.pointwise.w.numpy().astype(np.float64)[0, 0]
            ref = np.clip(mid @ pw + layer.pointwise.b.numpy(), 0.0, 6.0)
            msg = f"{in_shape} {stride} {padding} mult={mult}"
            self.assertAllClose(y, ref, atol=1e-4, msg=msg)
            meta = conv.SeparableConv2DLayer.FPropMeta(p, tf.TensorShape(in_shape))
            self.assertEqual(meta.out_shapes, (y.shape,), msg=msg)
            self.assertEqual(meta.num_params, _num_var_elements(layer))
            self.assertEqual(meta.num_params, 3 * 3 * 3 * mult + 3 * mult * 5 + 5)
            b, oh, ow, _ = y.shape
            dw_flops = 2 * b * oh * ow * 9 * 3 * mult
            pw_flops = 2 * b * oh * ow * 3 * mult * 5 + b * oh * ow * 5 * (1 + 2)
            self.assertEqual(meta.flops, dw_flops + pw_flops, msg=msg)

    def test_mixed_precision(self):
        x = np.random.default_rng(9).normal(size=[2, 7, 7, 3]).astype(np.float32)
        for p in [conv.Conv2DLayer.Params().Set(filter_shape=(3, 3, 3, 4)),
                  conv.DepthwiseConv2DLayer.Params().Set(filter_shape=(3, 3, 3, 2)),
                  conv.SeparableConv2DLayer.Params().Set(input_dim=3, output_dim=4)]:
            full = p.Copy().Set(name="c", random_seed=1).Instantiate()
            half = p.Copy().Set(name="c", random_seed=1, fprop_dtype=tf.bfloat16).Instantiate()
            y_half = half.FPropDefaultTheta(tf.constant(x))
            self.assertEqual(y_half.dtype, tf.bfloat16)
            self.assertAllClose(tf.cast(y_half, tf.float32), full.FPropDefaultTheta(x),
                                rtol=0.05, atol=0.1)

    def test_he_normal_default_init(self):
        p = conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 16, 32))
        w = p.Instantiate().w.numpy()
        self.assertAllClose(w.std(), math.sqrt(2.0 / (3 * 3 * 16)), rtol=0.05)
        self.assertAllClose(w.mean(), 0.0, atol=0.01)

    def test_errors_name_params(self):
        p = conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 4, 8))
        layer = p.Instantiate()
        with self.assertRaisesRegex(ValueError, r"filter_shape\[2\]=4"):
            layer.FPropDefaultTheta(tf.zeros([1, 5, 5, 3]))
        with self.assertRaisesRegex(ValueError, r"filter_shape\[2\]=4"):
            conv.Conv2DLayer.FPropMeta(p, tf.TensorShape([1, 5, 5, 3]))
        with self.assertRaisesRegex(ValueError, "rank 4"):
            layer.FPropDefaultTheta(tf.zeros([5, 5, 4]))
        with self.assertRaisesRegex(ValueError, "VALID"):
            conv.Conv2DLayer.FPropMeta(p.Copy().Set(padding="VALID"),
                                       tf.TensorShape([1, 2, 5, 4]))
        with self.assertRaisesRegex(ValueError, "padding"):
            conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 4, 8),
                                          padding="FULL").Instantiate()
        with self.assertRaisesRegex(ValueError, "filter_shape"):
            conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 4)).Instantiate()
        with self.assertRaisesRegex(ValueError, "filter_stride"):
            conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 4, 8),
                                          filter_stride=(0, 1)).Instantiate()
        sep = conv.SeparableConv2DLayer.Params().Set(name="s", input_dim=4, output_dim=8)
        with self.assertRaisesRegex(ValueError, "input_dim=4"):
            sep.Instantiate().FPropDefaultTheta(tf.zeros([1, 5, 5, 3]))
        with self.assertRaisesRegex(ValueError, "activation"):
            conv.Conv2DLayer.Params().Set(name="c", filter_shape=(3, 3, 4, 8),
                                          activation="ELU").Instantiate()


class PoolingLayerTest(tf.test.TestCase):

    def test_pooling(self):
        rng = np.random.default_rng(3)
        cases = [([1, 7, 7, 2], (3, 3), (2, 2), "SAME"), ([2, 7, 8, 3], (3, 3), (2, 2), "VALID"),
                 ([2, 5, 6, 1], (2, 2), (2, 2), "SAME"), ([1, 6, 5, 2], (3, 2), (1, 2), "SAME"),
                 ([3, 4, 4, 2], (4, 4), (1, 1), "VALID")]
        for (in_shape, window, stride, padding), ptype in itertools.product(cases,
                                                                           ("AVG", "MAX")):
            p = pooling.PoolingLayer.Params().Set(name="pool", pooling_type=ptype,
                                                  window_shape=window, window_stride=stride,
                                                  padding=padding)
            layer = p.Instantiate()
            x = rng.normal(size=in_shape).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x))
            ref = np_pool(x.astype(np.float64), window, stride, padding, ptype)
            msg = f"{in_shape} {window} {stride} {padding} {ptype}"
            self.assertEqual(tuple(y.shape), ref.shape, msg=msg)
            self.assertAllClose(y, ref, atol=1e-5, msg=msg)
            meta = pooling.PoolingLayer.FPropMeta(p, tf.TensorShape(in_shape))
            self.assertEqual(meta.out_shapes, (y.shape,), msg=msg)
            self.assertEqual(meta.num_params, 0)
            self.assertEqual(_num_var_elements(layer), 0)
            self.assertGreater(meta.flops, 0)

    def test_global_pooling(self):
        rng = np.random.default_rng(4)
        for in_shape, ptype in itertools.product(([1, 3, 5, 2], [4, 7, 7, 3]), ("AVG", "MAX")):
            p = pooling.GlobalPoolingLayer.Params().Set(name="gp", pooling_type=ptype)
            layer = p.Instantiate()
            x = rng.normal(size=in_shape).astype(np.float32)
            y = layer.FPropDefaultTheta(tf.constant(x))
            ref = x.mean(axis=(1, 2)) if ptype == "AVG" else x.max(axis=(1, 2))
            self.assertAllClose(y, ref, atol=1e-6)
            meta = pooling.GlobalPoolingLayer.FPropMeta(p, tf.TensorShape(in_shape))
            self.assertEqual(meta.out_shapes, (y.shape,))
            self.assertEqual(meta.num_params, _num_var_elements(layer))
        self.assertEqual(pooling.GlobalPoolingLayer.Params().pooling_type, "AVG")

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "pooling_type"):
            pooling.PoolingLayer.Params().Set(name="p", pooling_type="MIN").Instantiate()
        p = pooling.PoolingLayer.Params().Set(name="p")
        with self.assertRaisesRegex(ValueError, "rank 4"):
            p.Instantiate().FPropDefaultTheta(tf.zeros([2, 3]))
        with self.assertRaisesRegex(ValueError, "window_shape"):
            pooling.PoolingLayer.Params().Set(name="p", window_shape=(2, 2, 2)).Instantiate()


class DropoutLayerMetaTest(tf.test.TestCase):

    def test_meta_and_eval_identity(self):
        for cls in (dropout.DropoutLayer, dropout.DropPathLayer):
            for shape in ([1, 3], [2, 5, 7], [3, 4, 4, 2]):
                p = cls.Params().Set(name="drop", keep_prob=0.8)
                layer = p.Instantiate()
                x = np.random.default_rng(5).normal(size=shape).astype(np.float32)
                y = layer.FPropDefaultTheta(tf.constant(x))
                self.assertAllEqual(y, x)
                with fprop_context.fprop_context(training=True, step_seed=1):
                    y = layer.FPropDefaultTheta(tf.constant(x))
                meta = cls.FPropMeta(p, tf.TensorShape(shape))
                self.assertEqual(meta.out_shapes, (y.shape,))
                self.assertEqual(meta.num_params, _num_var_elements(layer))


class EmbeddingLayerTest(tf.test.TestCase):

    def test_lookup_logits_meta(self):
        for ids_shape, scale in [([1], False), ([3, 5], True), ([2, 3, 4], False)]:
            p = embedding.EmbeddingLayer.Params().Set(name="emb", vocab_size=11,
                                                      embedding_dim=6, scale_sqrt_depth=scale)
            layer = p.Instantiate()
            ids = np.random.default_rng(6).integers(0, 11, size=ids_shape).astype(np.int32)
            y = layer.FPropDefaultTheta(tf.constant(ids))
            table = layer.emb.numpy()
            ref = table[ids] * (math.sqrt(6) if scale else 1.0)
            self.assertAllClose(y, ref, rtol=1e-6)
            self.assertAllClose(layer.EmbLookup(layer.theta, ids), ref, rtol=1e-6)
            meta = embedding.EmbeddingLayer.FPropMeta(p, tf.TensorShape(ids_shape))
            self.assertEqual(meta.out_shapes, (y.shape,))
            self.assertEqual(meta.num_params, _num_var_elements(layer))
            self.assertEqual(meta.num_params, 66)
            x = np.random.default_rng(7).normal(size=ids_shape + [6]).astype(np.float32)
            logits = layer.Logits(layer.theta, tf.constant(x))
            self.assertAllClose(logits, x @ table.T, rtol=1e-5, atol=1e-5)

    def test_default_init_scale(self):
        p = embedding.EmbeddingLayer.Params().Set(name="emb", vocab_size=500, embedding_dim=64)
        table = p.Instantiate().emb.numpy()
        self.assertAllClose(table.std(), 1.0 / 8.0, rtol=0.05)

    def test_errors(self):
        p = embedding.EmbeddingLayer.Params().Set(name="emb", vocab_size=5, embedding_dim=3)
        layer = p.Instantiate()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, "vocab_size=5"):
            layer.FPropDefaultTheta(tf.constant([[1, 5]]))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, ">= 0"):
            layer.FPropDefaultTheta(tf.constant([[-1, 2]]))
        with self.assertRaisesRegex(ValueError, "integer"):
            layer.FPropDefaultTheta(tf.constant([[1.0]]))
        with self.assertRaisesRegex(ValueError, "embedding_dim"):
            layer.Logits(layer.theta, tf.zeros([2, 4]))
        with self.assertRaisesRegex(ValueError, "vocab_size"):
            embedding.EmbeddingLayer.Params().Set(name="e", embedding_dim=3).Instantiate()


class StructuralLayersTest(tf.test.TestCase):

    def test_field_layer(self):
        sub = dense.ProjectionLayer.Params().Set(input_dim=3, output_dim=2)
        for out_field in (None, "h"):
            p = structural.FieldLayer.Params().Set(name="f", field="x", sub=sub,
                                                   output_field=out_field)
            layer = p.Instantiate()
            rng = np.random.default_rng(8)
            for batch in (1, 4):
                x = rng.normal(size=[batch, 3]).astype(np.float32)
                paddings = np.zeros([batch, 1], np.float32)
                inputs = NestedMap(x=tf.constant(x), paddings=tf.constant(paddings))
                out = layer.FPropDefaultTheta(inputs)
                ref = x @ layer.sub.w.numpy() + layer.sub.b.numpy()
                self.assertAllClose(out.Get(out_field or "x"), ref, rtol=1e-5)
                self.assertAllEqual(out.paddings, paddings)
                if out_field:
                    self.assertAllEqual(out.x, x)
                self.assertAllEqual(inputs.x, x)  # Input map untouched.
                shapes = NestedMap(x=tf.TensorShape([batch, 3]),
                                   paddings=tf.TensorShape([batch, 1]))
                meta = structural.FieldLayer.FPropMeta(p, shapes)
                real = out.Transform(lambda t: t.shape)
                self.assertEqual(meta.out_shapes, (real,))
                self.assertEqual(meta.num_params, _num_var_elements(layer))
                self.assertEqual(meta.num_params, 8)
                self.assertEqual(meta.flops, 2 * batch * 3 * 2 + batch * 2)

    def test_field_layer_dotted_path_and_errors(self):
        sub = dense.ProjectionLayer.Params().Set(input_dim=3, output_dim=2)
        p = structural.FieldLayer.Params().Set(name="f", field="enc.x", sub=sub)
        layer = p.Instantiate()
        out = layer.FPropDefaultTheta(NestedMap(enc=NestedMap(x=tf.ones([2, 3]))))
        self.assertEqual(out.enc.x.shape, (2, 2))
        bad = structural.FieldLayer.Params().Set(name="f", field="y", sub=sub).Instantiate()
        with self.assertRaisesRegex(ValueError, "field='y'"):
            bad.FPropDefaultTheta(NestedMap(x=tf.ones([2, 3])))
        with self.assertRaisesRegex(ValueError, "NestedMap"):
            bad.FPropDefaultTheta(tf.ones([2, 3]))
        with self.assertRaisesRegex(ValueError, "p.sub"):
            structural.FieldLayer.Params().Set(name="f", field="x").Instantiate()

    def test_identity_layer(self):
        p = structural.IdentityLayer.Params().Set(name="id")
        layer = p.Instantiate()
        x = tf.constant([[1.0, 2.0]])
        self.assertIs(layer.FPropDefaultTheta(x), x)
        nm = NestedMap(a=tf.zeros([1, 3]), b=tf.zeros([1, 5, 2]))
        self.assertIs(layer.FPropDefaultTheta(nm), nm)
        meta = structural.IdentityLayer.FPropMeta(p, structural.shapes_of(nm))
        self.assertEqual(meta.out_shapes, (NestedMap(a=tf.TensorShape([1, 3]),
                                                     b=tf.TensorShape([1, 5, 2])),))
        self.assertEqual((meta.flops, meta.num_params), (0.0, 0))
        self.assertEqual(meta.out_bytes, 4 * (3 + 10))


if __name__ == "__main__":
    tf.test.main()
