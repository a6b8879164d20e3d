"""Tests of tasks/image/amoebanet/: cost model vs real layers, numerics, structure, sizes."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from lingvo_lite.analysis import model_analysis
from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.tasks import pipelined_task
from tasks.image import amoebanet as an

EPS = 1e-3  # The default batch_norm_epsilon.


# ---- independent reference computations ---------------------------------------------------------


def np_conv(x: np.ndarray, w: np.ndarray, stride=(1, 1), padding="SAME") -> np.ndarray:
    """Brute-force NHWC convolution with TF's SAME/VALID padding (no dilation)."""
    b, h, wd, _ = x.shape
    kh, kw, _, cout = w.shape
    sh, sw = stride
    if padding == "SAME":
        oh, ow = -(-h // sh), -(-wd // sw)
        ph = max((oh - 1) * sh + kh - h, 0)
        pw = max((ow - 1) * sw + kw - wd, 0)
        x = np.pad(x, [(0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)])
    else:
        oh, ow = (h - kh) // sh + 1, (wd - kw) // sw + 1
    out = np.zeros([b, oh, ow, cout])
    for i in range(oh):
        for j in range(ow):
            patch = x[:, i * sh:i * sh + kh, j * sw:j * sw + kw, :]
            out[:, i, j, :] = np.einsum("bhwc,hwco->bo", patch, w)
    return out


def np_bn_train(x: np.ndarray, bn_vars: NestedMap) -> np.ndarray:
    mean = x.mean(axis=tuple(range(x.ndim - 1)))
    var = x.var(axis=tuple(range(x.ndim - 1)))
    return (x - mean) / np.sqrt(var + EPS) * bn_vars.gamma.numpy() + bn_vars.beta.numpy()


def np_bn_eval(x: np.ndarray, bn_vars: NestedMap) -> np.ndarray:
    return ((x - bn_vars.moving_mean.numpy()) / np.sqrt(bn_vars.moving_variance.numpy() + EPS)
            * bn_vars.gamma.numpy() + bn_vars.beta.numpy())


def np_max_pool_same(x: np.ndarray, k: int, s: int) -> np.ndarray:
    b, h, w, c = x.shape
    oh, ow = -(-h // s), -(-w // s)
    ph, pw = max((oh - 1) * s + k - h, 0), max((ow - 1) * s + k - w, 0)
    xp = np.pad(x, [(0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)],
                constant_values=-np.inf)
    out = np.zeros([b, oh, ow, c])
    for i in range(oh):
        for j in range(ow):
            out[:, i, j, :] = xp[:, i * s:i * s + k, j * s:j * s + k, :].max(axis=(1, 2))
    return out


def np_xent(logits: np.ndarray, labels: np.ndarray, ls: float) -> np.ndarray:
    z = logits - logits.max(-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    k = logits.shape[-1]
    targets = (1 - ls) * np.eye(k)[labels] + ls / k
    return -(targets * log_probs).sum(-1)


relu = lambda v: np.maximum(v, 0.0)  # noqa: E731


def _rand(shape, seed=0) -> tf.Tensor:
    return tf.random.stateless_normal(shape, seed=[seed, 7])


def _num_vars(layer) -> int:
    return sum(int(np.prod(v.shape)) for v in layer.vars.Flatten())


def _shapes(x):
    if isinstance(x, NestedMap):
        return x.Transform(lambda t: tf.TensorShape(t.shape))
    return tf.TensorShape(x.shape)


def _tiny_net(**kw) -> object:
    p = an.AmoebaNetParams().Set(num_normal_cells=1, filters=8, image_size=16, num_classes=10,
                                 stem_type="cifar", stem_filters=6)
    return p.Set(**kw)


def _net_inputs(p, batch: int, seed: int = 1) -> NestedMap:
    image = tf.random.stateless_uniform([batch, p.image_size, p.image_size, p.num_channels],
                                        seed=[seed, 2])
    label = tf.constant(np.arange(batch) % p.num_classes, tf.int32)
    return NestedMap(image=image, label=label)


def _cell_params(variant: str, cell_type: str, **kw):
    spec = an.CELL_SPECS[variant][cell_type]
    p = an.AmoebaNetCell.Params().Set(
        name="cell", cell_type=cell_type, operations=list(spec.operations),
        hiddenstate_indices=list(spec.hiddenstate_indices),
        used_hiddenstates=list(spec.used_hiddenstates), filters=4, input_dim=6,
        prev_input_dim=5, prev_stride=1)
    return p.Set(**kw)


class AmoebaNetLayersTest(tf.test.TestCase):

    def _check_meta(self, params, inputs, training=True):
        """FPropMeta shapes == FProp shapes, num_params == variables; returns (layer, output)."""
        layer = params.Instantiate()
        with fprop_context.fprop_context(training=training, step_seed=5):
            out = layer.FProp(layer.theta, inputs)
        in_shapes = _shapes(inputs)
        meta = params.cls.FPropMeta(params, in_shapes)
        self.assertEqual(meta.out_shapes[0], _shapes(out), params.name)
        self.assertEqual(meta.num_params, _num_vars(layer), params.name)
        self.assertGreater(meta.flops, 0)
        return layer, out

    # ---- operations ------------------------------------------------------------------------------

    def test_operation_meta_matches_fprop(self):
        ops = ["none", "1x1", "3x3", "1x3_3x1", "1x7_7x1", "max_pool_2x2", "max_pool_3x3",
               "avg_pool_3x3", "separable_3x3_2", "dil_2_separable_5x5_2", "dilated_3x3_rate_2"]
        for op in ops:
            for shape, stride, cin, f in [((1, 7, 5, 6), 1, 6, 8), ((2, 8, 8, 8), 2, 8, 8),
                                          ((3, 5, 9, 3), 2, 3, 2)]:
                if op.startswith("dilated") and stride == 2:
                    continue
                with self.subTest(op=op, shape=shape, stride=stride):
                    p = an.AmoebaOpLayer.Params().Set(
                        name="op", operation=op, input_dim=cin, filters=f, stride=stride,
                        drop_path_keep_prob=0.7)
                    self._check_meta(p, _rand(shape))

    def test_operation_children(self):
        def names(op, **kw):
            p = an.AmoebaOpLayer.Params().Set(name="op", operation=op, input_dim=8, filters=8,
                                              **kw)
            return sorted(p.Instantiate().children.keys())

        self.assertEqual(names("none"), [])  # Identity: no weights, no drop-path.
        self.assertEqual(names("none", stride=2), ["bn_1", "conv_1x1"])
        self.assertEqual(names("max_pool_3x3", drop_path_keep_prob=0.5), ["drop_path", "pool"])
        self.assertEqual(names("1x7_7x1"), ["bn", "bn_1x7_7x1", "conv_1x7", "conv_7x1",
                                            "post_1x1", "post_bn", "pre_1x1", "pre_bn"])
        self.assertEqual(names("separable_3x3_2"), ["bn_sep_1", "bn_sep_2", "sep_1", "sep_2"])
        # Below 4 filters the bottleneck would be empty: the reference skips it.
        p = an.AmoebaOpLayer.Params().Set(name="op", operation="3x3", input_dim=3, filters=3)
        self.assertEqual(sorted(p.Instantiate().children.keys()), ["bn", "conv_3x3"])

    def test_1x1_op_matches_numpy(self):
        p = an.AmoebaOpLayer.Params().Set(name="op", operation="1x1", input_dim=5, filters=4,
                                          stride=2)
        layer = p.Instantiate()
        x = _rand([3, 7, 5, 5], seed=2)
        with fprop_context.fprop_context(training=True):
            got = layer.FProp(layer.theta, x).numpy()
        xn = relu(x.numpy())[:, ::2, ::2, :]
        want = np_bn_train(np.einsum("bhwc,co->bhwo", xn, layer.conv_1x1.vars.w.numpy()[0, 0]),
                           layer.bn_1.vars)
        self.assertAllClose(got, want, atol=1e-4)

    def test_1x7_7x1_op_matches_numpy(self):
        p = an.AmoebaOpLayer.Params().Set(name="op", operation="1x7_7x1", input_dim=6,
                                          filters=8, stride=2)
        layer = p.Instantiate()
        x = _rand([2, 9, 6, 6], seed=3)
        got = layer.FProp(layer.theta, x).numpy()  # Eval mode: moving statistics.
        v = layer.vars
        h = np_bn_eval(np_conv(relu(x.numpy()), v.pre_1x1.w.numpy()), v.pre_bn)
        h = np_bn_eval(np_conv(relu(h), v.conv_1x7.w.numpy(), (1, 2)), v.bn_1x7_7x1)
        h = np_bn_eval(np_conv(relu(h), v.conv_7x1.w.numpy(), (2, 1)), v.bn)
        want = np_bn_eval(np_conv(relu(h), v.post_1x1.w.numpy()), v.post_bn)
        self.assertEqual(got.shape, (2, 5, 3, 8))
        self.assertAllClose(got, want, atol=1e-4)

    def test_max_pool_op_with_channel_change_matches_numpy(self):
        p = an.AmoebaOpLayer.Params().Set(name="op", operation="max_pool_3x3", input_dim=3,
                                          filters=4, stride=2)
        layer = p.Instantiate()
        x = _rand([2, 7, 6, 3], seed=4)
        with fprop_context.fprop_context(training=True):
            got = layer.FProp(layer.theta, x).numpy()
        pooled = np_max_pool_same(x.numpy(), 3, 2)  # No ReLU before a pool.
        want = np_bn_train(np_conv(pooled, layer.vars.conv_1x1.w.numpy()), layer.vars.bn_1)
        self.assertAllClose(got, want, atol=1e-4)

    def test_factorized_reduction_matches_numpy(self):
        for stride, shape in [(2, (3, 7, 5, 4)), (2, (1, 6, 6, 4)), (1, (2, 5, 5, 4))]:
            with self.subTest(stride=stride, shape=shape):
                p = an.FactorizedReductionLayer.Params().Set(
                    name="fr", input_dim=4, output_dim=6, stride=stride, pre_relu=True)
                layer, got = self._check_meta(p, _rand(shape, seed=5))
                x = relu(_rand(shape, seed=5).numpy())
                v = layer.vars
                if stride == 1:
                    want = np_bn_train(np_conv(x, v.path_conv.w.numpy()), v.path_bn)
                else:
                    p1 = np_conv(x[:, ::2, ::2, :], v.path1_conv.w.numpy())
                    shifted = np.pad(x, [(0, 0), (0, 1), (0, 1), (0, 0)])[:, 1:, 1:, :]
                    p2 = np_conv(shifted[:, ::2, ::2, :], v.path2_conv.w.numpy())
                    want = np_bn_train(np.concatenate([p1, p2], -1), v.final_path_bn)
                self.assertAllClose(got.numpy(), want, atol=1e-4)

    def test_factorized_reduction_gradient_temporaries_by_hand(self):
        # x [2, 8, 8, 4] float32: 2,048 B; ReLU output r the same; the strided slices p1, p2
        # 512 B each, the 1x1 convs' outputs 256 B each, their concat cc (BN's input) 512 B.
        # Backward in reverse: BN (2 x 512 default), concat, conv2, slice 2 (its gradient is
        # r-sized), the shift, conv1, slice 1; r is read by slice 1 and the shift, so its two
        # 2,048 B gradients and their sum are held at once: 3 x 2,048 = 6,144 B. Freeing the
        # saved activations as it goes, it has released cc, p2 and p1 by then: 6,144 - 1,536.
        p = an.FactorizedReductionLayer.Params().Set(name="fr", input_dim=4, output_dim=4,
                                                     stride=2, pre_relu=True)
        meta = p.cls.FPropMeta(p, tf.TensorShape([2, 8, 8, 4]))
        self.assertEqual(meta.memory.backward_temporary_bytes, 6144)
        self.assertEqual(meta.memory.inline_backward_temporary_bytes, 6144 - 1536)

    # ---- cells -----------------------------------------------------------------------------------

    def test_cells_meta_matches_fprop(self):
        label = tf.constant([0, 1], tf.int32)
        cases = [  # (x shape, prev shape or None, prev_stride)
            ((2, 7, 7, 6), (2, 7, 7, 5), 1),    # prev: 1x1 to match channels.
            ((2, 7, 7, 6), (2, 13, 13, 5), 2),  # prev: factorized reduction (odd sizes).
            ((2, 6, 6, 6), None, 1),            # First cell: no prev_x.
            ((2, 5, 5, 6), (2, 5, 5, 4), 1),    # prev already has `filters` channels.
        ]
        for variant in ("D", "B"):
            for cell_type in ("normal", "reduction"):
                for x_shape, prev_shape, prev_stride in cases:
                    with self.subTest(variant=variant, cell=cell_type, x=x_shape, prev=prev_shape):
                        inputs = NestedMap(x=_rand(x_shape, 1), label=label)
                        prev_dim = 0
                        if prev_shape:
                            inputs.prev_x = _rand(prev_shape, 2)
                            prev_dim = prev_shape[-1]
                        p = _cell_params(variant, cell_type, prev_input_dim=prev_dim,
                                         prev_stride=prev_stride, drop_path_keep_prob=0.6,
                                         total_num_cells=4, cell_index=2)
                        _, out = self._check_meta(p, inputs)
                        self.assertAllEqual(out.label, label)  # Passthrough.
                        self.assertIs(out.prev_x, inputs.x)
        # Batch 1.
        p = _cell_params("D", "reduction", prev_input_dim=5, prev_stride=2)
        self._check_meta(p, NestedMap(x=_rand((1, 5, 3, 6)), prev_x=_rand((1, 10, 6, 5))))

    def test_cell_wiring_matches_numpy(self):
        # Identity ops make the combination/concat wiring checkable by hand:
        # h2 = h0 + h1, h3 = h2 + h0; output = concat(h2, h3) (states 0, 1 are used).
        p = an.AmoebaNetCell.Params().Set(
            name="cell", operations=["none"] * 4, hiddenstate_indices=[0, 1, 2, 0],
            used_hiddenstates=[1, 1, 0, 0], filters=4, input_dim=3, prev_input_dim=4)
        layer, out = self._check_meta(
            p, NestedMap(x=_rand([2, 5, 5, 3], 1), prev_x=_rand([2, 5, 5, 4], 2)))
        x, prev = _rand([2, 5, 5, 3], 1).numpy(), _rand([2, 5, 5, 4], 2).numpy()
        w = layer.base.vars.conv_1x1.w.numpy()[0, 0]
        h0 = np_bn_train(np.einsum("bhwc,co->bhwo", relu(x), w), layer.base.vars.bn_1)
        h2 = h0 + prev
        h3 = h2 + h0
        self.assertAllClose(out.x.numpy(), np.concatenate([h2, h3], -1), atol=1e-4)

    def test_normal_and_reduction_cell_structure(self):
        f = 4
        x = NestedMap(x=_rand([2, 7, 7, 6]), prev_x=_rand([2, 7, 7, 5]))
        expected = {  # (variant, type): (output channels, output H/W)
            ("D", "normal"): (4 * f, 7), ("D", "reduction"): (3 * f, 4),
            ("B", "normal"): (4 * f, 7), ("B", "reduction"): (2 * f, 4),
        }
        for (variant, cell_type), (channels, size) in expected.items():
            with self.subTest(variant=variant, cell=cell_type):
                layer = _cell_params(variant, cell_type).Instantiate()
                self.assertEqual(layer.num_operations, 10)  # 5 combinations of 2 branches.
                self.assertLen(layer.ops, 10)
                spec = an.CELL_SPECS[variant][cell_type]
                self.assertEqual(len(spec.used_hiddenstates), 2 + 5)
                out = layer.FProp(layer.theta, x)
                self.assertEqual(out.x.shape, (2, size, size, channels))
                # Ops on the cell inputs (states 0, 1) carry the cell's stride, others don't.
                stride = 2 if cell_type == "reduction" else 1
                for op, idx in zip(layer.ops, spec.hiddenstate_indices):
                    self.assertEqual(op.params.stride, stride if idx < 2 else 1)

    def test_network_filters_double_and_spatial_halves(self):
        for stem in ("cifar", "imagenet"):
            p = _tiny_net(num_normal_cells=2, stem_type=stem, image_size=72, aux_head_weight=0)
            lps = an.amoebanet_layers(p)
            metas = an.layer_metas(lps, an.input_shapes(p, 2))
            cells = [(lp, m.out_shapes[0].x) for lp, m in zip(lps, metas)
                     if lp.cls is an.AmoebaNetCell]
            num_stem = 2 if stem == "imagenet" else 0
            self.assertLen(cells, num_stem + 3 * 2 + 2)
            stack, prev_size = 0, None
            for lp, shape in cells[num_stem:]:
                if lp.cell_type == "reduction":
                    stack += 1
                    self.assertEqual(shape[1], -(-prev_size // 2))  # Spatial halves.
                    self.assertEqual(shape[3], 3 * 8 * 2 ** stack)  # D reduction: 3 states.
                else:
                    self.assertEqual(shape[3], 4 * 8 * 2 ** stack)  # D normal: 4 states.
                self.assertEqual(lp.filters, 8 * 2 ** stack)  # F doubles at each reduction.
                prev_size = shape[1]
            self.assertEqual(stack, 2)
            if stem == "imagenet":  # Stem cells at filter scalings 1/4 and 1/2, stride 2.
                self.assertEqual([lp.filters for lp, _ in cells[:2]], [2, 4])
                self.assertEqual([s[1] for _, s in cells[:2]], [18, 9])  # 72 -> 35 -> 18 -> 9.

    def test_drop_path_only_in_training(self):
        inputs = NestedMap(x=_rand([8, 5, 5, 6]), prev_x=_rand([8, 5, 5, 5]))
        common = dict(total_num_cells=3, cell_index=2)
        cell = _cell_params("D", "normal", drop_path_keep_prob=0.5, **common).Instantiate()
        plain = _cell_params("D", "normal", drop_path_keep_prob=1.0, **common).Instantiate()
        for a, b in zip(cell.base.vars.Flatten(), plain.base.vars.Flatten()):
            self.assertAllEqual(a, b)  # Same path and seed: same weights.
        with fprop_context.fprop_context(training=False):
            self.assertAllClose(cell.FProp(cell.theta, inputs).x,
                                plain.FProp(plain.theta, inputs).x)
        with fprop_context.fprop_context(training=True, step_seed=1):
            self.assertNotAllClose(cell.FProp(cell.theta, inputs).x,
                                   plain.FProp(plain.theta, inputs).x)
        # One op: each example is either dropped (0) or scaled by 1 / keep.
        op_p = an.AmoebaOpLayer.Params().Set(name="op", operation="1x1", input_dim=6, filters=4)
        dropped = op_p.Copy().Set(drop_path_keep_prob=0.5).Instantiate()
        kept = op_p.Instantiate()
        with fprop_context.fprop_context(training=True, step_seed=3):
            y, ref = dropped.FProp(dropped.theta, inputs.x), kept.FProp(kept.theta, inputs.x)
        ratios = []
        for i in range(8):
            if np.all(y[i].numpy() == 0):
                ratios.append(0.0)
            else:
                self.assertAllClose(y[i], 2.0 * ref[i], atol=1e-5)
                ratios.append(2.0)
        self.assertIn(0.0, ratios)
        self.assertIn(2.0, ratios)

    def test_drop_path_schedule_is_linear_over_depth(self):
        p = _tiny_net(num_normal_cells=1, drop_path_keep_prob=0.6, aux_head_weight=0)
        cells = [lp for lp in an.amoebanet_layers(p) if lp.cls is an.AmoebaNetCell]
        total = len(cells)  # cifar: 3 normal + 2 reduction cells.
        self.assertEqual(total, 5)
        for k, lp in enumerate(cells):
            self.assertEqual((lp.cell_index, lp.total_num_cells), (k, total))
            layer = lp.Instantiate()
            for op in layer.ops:
                if op.params.operation == "none":
                    self.assertNotIn("drop_path", op.children)
                else:
                    self.assertAlmostEqual(op.drop_path.params.keep_prob,
                                           1.0 - (k + 1) / total * 0.4)

    # ---- stem and heads --------------------------------------------------------------------------

    def test_stem_matches_numpy(self):
        for stem_type, shape, out_hw in [("imagenet", (2, 9, 9, 3), 4), ("cifar", (1, 7, 6, 3), 5)]:
            with self.subTest(stem_type=stem_type):
                p = an.StemLayer.Params().Set(name="stem", stem_type=stem_type, filters=4)
                inputs = NestedMap(image=_rand(shape, 3), label=tf.zeros([shape[0]], tf.int32))
                layer, out = self._check_meta(p, inputs)
                self.assertEqual(sorted(out.keys()), ["label", "x"])
                s = 2 if stem_type == "imagenet" else 1
                want = np_bn_train(np_conv(inputs.image.numpy(), layer.vars.conv0.w.numpy(),
                                           (s, s), "VALID"), layer.vars.conv0_bn)
                self.assertEqual(out.x.shape[1], out_hw)
                self.assertAllClose(out.x.numpy(), want, atol=1e-4)

    def test_aux_head_matches_tf_ops(self):
        p = an.AuxHeadLayer.Params().Set(name="aux", input_dim=6, input_size=(8, 11),
                                         num_classes=5, label_smoothing=0.1, aux_scaling=0.1)
        labels = tf.constant([0, 3, 4], tf.int32)
        inputs = NestedMap(x=_rand([3, 8, 11, 6], 4), prev_x=_rand([3, 8, 11, 2]), label=labels)
        layer, out = self._check_meta(p, inputs)
        v = layer.vars
        h = tf.nn.avg_pool2d(tf.nn.relu(inputs.x), 5, 3, "VALID").numpy()  # -> [3, 2, 3, 6]
        h = relu(np_bn_train(np_conv(h, v.proj.w.numpy()), v.bn0))
        self.assertEqual(v.conv.w.shape, (2, 3, 12, 76))  # Kernel covers the pooled map.
        h = relu(np_bn_train(np_conv(h, v.conv.w.numpy(), padding="VALID"), v.bn1))
        logits = h.reshape(3, -1) @ v.softmax.weight.numpy() + v.softmax.bias.numpy()
        self.assertAllClose(out.aux_xent, np_xent(logits, labels.numpy(), 0.1), atol=1e-4)
        self.assertAllClose(out.aux_correct, (logits.argmax(-1) == labels.numpy()) * 1.0)
        self.assertIs(out.x, inputs.x)

    def test_head_matches_numpy(self):
        labels = np.array([0, 6, 2, 1])
        x = _rand([4, 3, 5, 8], 6)
        aux_xent = tf.constant([1.0, 2.0, 3.0, 6.0])
        inputs = NestedMap(x=x, prev_x=_rand([4, 6, 10, 2]), label=tf.constant(labels),
                           aux_xent=aux_xent, aux_correct=tf.constant([1.0, 0.0, 0.0, 0.0]))
        p = an.HeadLayer.Params().Set(name="head", input_dim=8, num_classes=7,
                                      label_smoothing=0.2, dropout_keep_prob=1.0, aux_weight=0.4)
        layer, out = self._check_meta(p, inputs, training=True)
        v = layer.softmax.vars
        logits = relu(x.numpy()).mean(axis=(1, 2)) @ v.weight.numpy() + v.bias.numpy()
        xent = np_xent(logits, labels, 0.2)
        self.assertAllClose(out.logits, logits, atol=1e-5)
        self.assertAllClose(out.main_loss, xent.mean(), atol=1e-5)
        self.assertAllClose(out.loss, xent.mean() + 0.4 * 3.0, atol=1e-5)  # mean aux_xent = 3.
        self.assertAllClose(out.aux_accuracy, 0.25)
        self.assertAllClose(out.accuracy, np.mean(logits.argmax(-1) == labels))
        top5 = np.argsort(-logits, axis=-1)[:, :5]
        self.assertAllClose(out.top5_accuracy, np.mean([labels[i] in top5[i] for i in range(4)]))
        with fprop_context.fprop_context(training=False):
            eval_out = layer.FProp(layer.theta, inputs)
        self.assertAllClose(eval_out.loss, xent.mean(), atol=1e-5)  # No aux term in eval.

    def test_head_dropout_only_in_training(self):
        p = an.HeadLayer.Params().Set(name="head", input_dim=8, num_classes=7,
                                      dropout_keep_prob=0.5)
        layer = p.Instantiate()
        inputs = NestedMap(x=_rand([4, 3, 3, 8]), label=tf.constant([0, 1, 2, 3]))
        with fprop_context.fprop_context(training=False):
            a = layer.FProp(layer.theta, inputs).logits
            b = layer.FProp(layer.theta, inputs).logits
        with fprop_context.fprop_context(training=True, step_seed=2):
            c = layer.FProp(layer.theta, inputs).logits
        self.assertAllClose(a, b)
        self.assertNotAllClose(a, c)

    # ---- the network -----------------------------------------------------------------------------

    def test_inspect_model_counts_trainable_and_non_trainable_separately(self):
        # Issue 12: the printed total mixed in batch-norm moving statistics and the aux head.
        p = _tiny_net(variant="D")
        lps = an.amoebanet_layers(p)
        trainable = non_trainable = aux = 0
        for lp in lps:
            layer = lp.Instantiate()
            for v in layer.vars.Flatten():
                n = int(np.prod(v.shape))
                if v.trainable:
                    trainable += n
                    aux += n if isinstance(layer, an.AuxHeadLayer) else 0
                else:
                    non_trainable += n
        self.assertGreater(non_trainable, 0)
        self.assertGreater(aux, 0)
        task = pipelined_task.PipelinedTask.Params().Set(
            network=pipelining_layer.PipeliningLayer.Params().Set(
                name="net", layers=lps, num_cells=2, input_shapes=an.input_shapes(p, 3)))
        text = model_analysis.describe_model("tiny", task)
        fmt = model_analysis.format_count
        self.assertIn(f"Total parameters in PipeliningLayers: {fmt(trainable + non_trainable)}",
                      text)
        self.assertIn(f"  trainable: {fmt(trainable)}\n", text)
        self.assertIn(f"  non-trainable (e.g. batch-norm moving statistics): "
                      f"{fmt(non_trainable)}\n", text)
        self.assertIn(f"used only in training (auxiliary heads): {fmt(aux)}; trainable without "
                      f"them: {fmt(trainable - aux)}", text)

    def test_tiny_networks_forward(self):
        configs = [
            _tiny_net(variant="D"),
            _tiny_net(variant="B", image_size=17),
            _tiny_net(variant="D", stem_type="imagenet", image_size=72, filters=8),
        ]
        for p in configs:
            with self.subTest(variant=p.variant, stem=p.stem_type):
                lps = an.amoebanet_layers(p)
                metas = an.layer_metas(lps, an.input_shapes(p, 3))
                x = _net_inputs(p, 3)
                total_vars = 0
                with fprop_context.fprop_context(training=True, step_seed=1):
                    for lp, meta in zip(lps, metas):
                        layer = lp.Instantiate()
                        x = layer.FProp(layer.theta, x)
                        self.assertEqual(_shapes(x), meta.out_shapes[0], lp.name)
                        self.assertEqual(_num_vars(layer), meta.num_params, lp.name)
                        total_vars += _num_vars(layer)
                self.assertEqual(an.num_params(lps, an.input_shapes(p, 3)), total_vars)
                self.assertTrue(np.isfinite(x.loss.numpy()))
                self.assertTrue(np.isfinite(x.aux_loss.numpy()))
                self.assertAllClose(x.loss, x.main_loss + 0.4 * x.aux_loss)
                self.assertEqual(x.logits.shape, (3, 10))
                self.assertIn("aux_head", [lp.name for lp in lps])

    def test_paper_parameter_counts(self):
        # GPipe (Huang et al. 2019) Table 1 at 224x224, 1000 classes: AmoebaNet-D (L, D) with
        # L = 18, 18, 18, 36, 72 normal cells in all (6, 6, 6, 12, 24 per stack) and
        # 82M, 318M, 542M, 1.05B, 1.8B parameters; section 4.1: AmoebaNet-B (18, 512) at
        # 480x480, 557M. Ours (BN moving statistics and aux head included):
        # 81.9M, 318.6M, 541.4M, 1054.9M, 1844.9M, 559.6M, i.e. -0.1% .. +2.5%.
        configs = [("D", 6, 208, 224, 82e6), ("D", 6, 416, 224, 318e6),
                   ("D", 6, 544, 224, 542e6), ("D", 12, 544, 224, 1.05e9),
                   ("D", 24, 512, 224, 1.8e9), ("B", 6, 512, 480, 557e6)]

        def no_variables(*args, **kwargs):
            raise AssertionError("num_params must not create variables")

        with tf.variable_creator_scope(no_variables):
            for variant, per_stack, filters, size, published in configs:
                p = an.AmoebaNetParams().Set(variant=variant, num_normal_cells=per_stack,
                                             filters=filters, image_size=size)
                count = an.num_params(an.amoebanet_layers(p), an.input_shapes(p, 1))
                with self.subTest(variant=variant, per_stack=per_stack, filters=filters):
                    self.assertLess(abs(count - published) / published, 0.10)
                    self.assertLess(abs(count - published) / published, 0.03)  # Actual margin.

    def test_flops_reflect_filter_doubling(self):
        p = an.AmoebaNetParams().Set(num_normal_cells=6, filters=208)
        lps = an.amoebanet_layers(p)
        metas = an.layer_metas(lps, an.input_shapes(p, 1))
        normal = [m.flops for lp, m in zip(lps, metas)
                  if lp.cls is an.AmoebaNetCell and lp.cell_type == "normal"]
        # F doubles while H, W halve: a normal cell's flops stay within ~10% across stacks
        # (1x1 convs: 4x per pixel, 1/4 the pixels). Cells 0 and 1 of a stack read inputs
        # of other shapes (after a reduction), so compare the steady cell 2 of each stack.
        self.assertLen(normal, 18)
        for stack in range(3):
            self.assertAlmostEqual(normal[stack * 6 + 2] / normal[8], 1.0, delta=0.1)
            self.assertLess(normal[stack * 6], normal[stack * 6 + 2])
        # Parameters grow 4x per stack.
        params = [m.num_params for lp, m in zip(lps, metas)
                  if lp.cls is an.AmoebaNetCell and lp.cell_type == "normal"]
        self.assertAlmostEqual(params[14] / params[8], 4.0, delta=0.05)
        self.assertAlmostEqual(params[8] / params[2], 4.0, delta=0.05)
        # A reduction cell costs more than a normal cell at its input resolution.
        reductions = [m.flops for lp, m in zip(lps, metas)
                      if lp.name.startswith("reduction_cell")]
        self.assertGreater(min(reductions), 1.2 * max(normal))
        total = an.total_flops(lps, an.input_shapes(p, 1))
        self.assertTrue(math.isfinite(total) and total > 1e10)

    def test_pipeline_matches_sequential(self):
        p = _tiny_net(drop_path_keep_prob=0.7, dropout_keep_prob=0.5)
        lps = an.amoebanet_layers(p)
        aux_index = [lp.name for lp in lps].index("aux_head")
        pp = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=lps, num_cells=2, partition_method="explicit",
            split_points=[aux_index + 1], input_shapes=an.input_shapes(p, 4),
            num_micro_batches=1, placement="cpu")
        pipe = pp.Instantiate()
        inputs = _net_inputs(p, 4)
        with fprop_context.fprop_context(training=True, step_seed=4):
            out, grads = pipe.FPropAndGrads(pipe.theta, inputs)
            with tf.GradientTape() as tape:
                x = inputs
                for layer in pipe.layers:
                    x = layer.FProp(layer.theta, x)
            trainable = [v for v in pipe.vars.Flatten() if v.trainable]
            ref = tape.gradient(x.loss, trainable)
        self.assertAllClose(out.loss, x.loss)
        got = [g for g, v in zip(grads.Flatten(), pipe.vars.Flatten()) if v.trainable]
        for g, r in zip(got, ref):
            self.assertAllClose(g, r, atol=1e-5)
        # The aux loss crosses the cell boundary: the aux head (cell 0) gets its gradient.
        aux_grads = [g for g in grads.layers[aux_index].Flatten() if g is not None]
        self.assertGreater(sum(float(tf.reduce_sum(tf.abs(g))) for g in aux_grads), 0.0)

    def test_bad_params_raise(self):
        with self.assertRaisesRegex(ValueError, "variant"):
            an.amoebanet_layers(_tiny_net(variant="Z"))
        with self.assertRaisesRegex(ValueError, "filters"):
            an.amoebanet_layers(_tiny_net(filters=7))
        with self.assertRaisesRegex(ValueError, "5x5"):
            an.amoebanet_layers(_tiny_net(image_size=8))
        with self.assertRaisesRegex(ValueError, "Unknown AmoebaNet operation"):
            an.parse_operation("conv_9x9")
        with self.assertRaisesRegex(ValueError, "stride"):
            _cell_params("D", "normal", stride=2).Instantiate()
        with self.assertRaisesRegex(ValueError, "prev_x"):
            layer = _cell_params("D", "normal").Instantiate()
            layer.FProp(layer.theta, NestedMap(x=_rand([1, 4, 4, 6])))


if __name__ == "__main__":
    tf.test.main()
