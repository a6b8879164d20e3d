"""The Transformer layers' saved-activation counts (FPropMeta) against TensorFlow's gradient graph.

The memory model reads, per layer, `saved_activation_bytes`: what the layer's backward keeps
from its forward. Here the same number comes from the graph: the layer's forward and its
gradient are traced, and every forward tensor with a batch dimension that an op of the gradient
takes as input is summed once (a reshape or identity is its source's buffer; ops that read
only a shape are skipped; boolean masks count 1 byte per element). The declarations are
exact, with and without dropout.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import attention, dropout, feedforward, normalization
from tasks.mt import layers as mt

SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"})
VIEW_OPS = frozenset({"Reshape", "Identity", "ExpandDims", "Squeeze"})
B, S, T, D, H, V = 4, 12, 10, 32, 64, 50


def _read_by_gradient(layer, inputs) -> int:
    """Bytes of the forward tensors with a leading batch dimension (B, or B x length for
    flattened ones) that the gradient of the layer's float outputs (its `loss` if it has one)
    reads, each buffer once."""
    is_map = isinstance(inputs, NestedMap)
    leaves = inputs.Flatten() if is_map else [inputs]
    gradient_starts = []

    @tf.function(autograph=False)
    def step(*args):
        x = inputs.Pack(list(args)) if is_map else args[0]
        floats = [a for a in args if a.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(floats)
            with tf.name_scope("fwd"), fprop_context.fprop_context(training=True, step_seed=3):
                y = layer.FProp(layer.theta, x)
            if isinstance(y, NestedMap) and "loss" in y:
                loss = y.loss
            else:
                outs = y.Flatten() if isinstance(y, NestedMap) else [y]
                loss = tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32)) for v in outs
                                 if v.dtype.is_floating])
        gradient_starts.append(len(tf.compat.v1.get_default_graph().get_operations()))
        weights = [v for v in layer.vars.Flatten() if v.trainable]
        return tape.gradient(loss, floats + weights)

    graph = step.get_concrete_function(*leaves).graph
    placeholders = graph.inputs[:len(leaves)]
    read: dict[int, tf.Tensor] = {}
    for op in graph.get_operations()[gradient_starts[0]:]:
        if op.type in SHAPE_OPS:
            continue
        for t in op.inputs:
            while t.op.type in VIEW_OPS:
                t = t.op.inputs[0]
            forward = t.op.name.startswith("fwd/") or any(t is p for p in placeholders)
            batch_dims = (B, B * S, B * T) if (t.shape.rank or 0) >= 2 else (B * S, B * T)
            if (forward and (t.dtype.is_floating or t.dtype == tf.bool) and t.shape.rank
                    and t.shape[0] in batch_dims):
                read[id(t)] = t
    return sum(t.shape.num_elements() * t.dtype.size for t in read.values())


def _sample(shapes: NestedMap) -> NestedMap:
    rng = np.random.default_rng(0)
    out = NestedMap()
    for k, s in shapes.items():
        dims = tf.TensorShape(s).as_list()
        if k.endswith("ids") or k.endswith("labels"):
            out[k] = tf.constant(rng.integers(1, V, dims), tf.int32)
        elif k.endswith("paddings"):
            pad = np.zeros(dims, np.float32)
            pad[:, -2:] = 1.0
            out[k] = tf.constant(pad)
        elif k.endswith("weights"):
            out[k] = tf.ones(dims)
        else:
            out[k] = tf.constant(rng.normal(size=dims), tf.float32)
    return out


class TransformerSavedBytesTest(tf.test.TestCase):

    def _check(self, p, x, *meta_args):
        meta = p.cls.FPropMeta(p, *(meta_args or (x.shape,)))
        self.assertEqual(layer_memory.saved_activation_bytes(meta),
                         _read_by_gradient(p.Instantiate(), x))

    def test_dropout_keeps_its_boolean_mask_only(self):
        # A select on the mask: neither a float mask nor the input is kept.
        for dims in (None, [1]):
            with self.subTest(noise_shape_broadcast_dims=dims):
                p = dropout.DropoutLayer.Params().Set(name="drop", keep_prob=0.7,
                                                      noise_shape_broadcast_dims=dims)
                x = tf.random.normal([B, S, D])
                self._check(p, x)
                mask = B * D if dims else B * S * D
                self.assertEqual(layer_memory.saved_activation_bytes(
                    p.cls.FPropMeta(p, x.shape)), mask * tf.bool.size)

    def test_layer_norm(self):
        for dtype in (None, tf.bfloat16):
            with self.subTest(fprop_dtype=dtype):
                p = normalization.LayerNorm.Params().Set(name="ln", input_dim=D,
                                                         fprop_dtype=dtype)
                self._check(p, tf.random.normal([B, S, D]))

    def test_feed_forward(self):
        for pre_layer_norm in (True, False):
            with self.subTest(pre_layer_norm=pre_layer_norm):
                p = feedforward.FeedForwardLayer.Params().Set(
                    name="ffn", input_dim=D, hidden_dim=H, pre_layer_norm=pre_layer_norm)
                x = tf.random.normal([B, S, D])
                if pre_layer_norm:
                    self._check(p, x)
                else:  # Its input is the previous layer's output, counted there.
                    meta = p.cls.FPropMeta(p, x.shape)
                    self.assertEqual(layer_memory.saved_activation_bytes(meta),
                                     _read_by_gradient(p.Instantiate(), x)
                                     - base_layer.activation_bytes(x.shape))

    def test_self_attention(self):
        p = attention.MultiHeadedAttention.Params().Set(name="att", input_dim=D, num_heads=4)
        layer = p.Instantiate()

        class SelfAttention:  # FProp(theta, x) with query = key = value.
            theta, vars = layer.theta, layer.vars

            @staticmethod
            def FProp(theta, x):
                return layer.FProp(theta, x, x, x)

        x = tf.random.normal([B, S, D])
        meta = p.cls.FPropMeta(p, x.shape, x.shape, x.shape)
        self.assertEqual(layer_memory.saved_activation_bytes(meta),
                         _read_by_gradient(SelfAttention, x))

    def test_transformer_layers(self):
        for dropout_prob in (0.0, 0.1):
            shapes = NestedMap(
                src_ids=tf.TensorShape([B, S]), src_paddings=tf.TensorShape([B, S]),
                tgt_ids=tf.TensorShape([B, T]), tgt_paddings=tf.TensorShape([B, T]),
                tgt_labels=tf.TensorShape([B, T]), tgt_weights=tf.TensorShape([B, T]))
            x = _sample(shapes)
            for p in mt.transformer_layers(V, D, H, 4, 1, 1, dropout_prob=dropout_prob):
                layer = p.Instantiate()
                meta = p.cls.FPropMeta(p, shapes)
                if p.cls is not mt.EmbeddingInputLayer:  # It declares no estimate.
                    with self.subTest(layer=p.name, dropout_prob=dropout_prob):
                        self.assertEqual(layer_memory.saved_activation_bytes(meta),
                                         _read_by_gradient(layer, x))
                with fprop_context.fprop_context(training=True, step_seed=3):
                    x = layer.FProp(layer.theta, x)
                shapes = meta.out_shapes
                shapes = shapes[0] if isinstance(shapes, tuple) else shapes


if __name__ == "__main__":
    tf.test.main()
