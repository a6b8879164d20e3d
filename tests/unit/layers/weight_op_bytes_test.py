"""FPropMeta's `weight_op_bytes` against the records a deferred backward actually keeps.

Zero-bubble's B (and `weight_gradients='batched'`) keeps, for every op that applies a weight
through `layers.weight_ops`, the op's input and output gradient until W; the memory model
counts a layer's declared `weight_op_bytes` for them. Here each layer runs under
`weight_ops.deferring` and a tape, its backward fills the stash, and the bytes of the distinct
tensors the records hold are compared with the declaration (exactly: both are sizes of the
same tensors).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import attention, conv, dense, feedforward, losses, weight_ops


def _recorded_bytes(layer, inputs: list[tf.Tensor]) -> int:
    """Bytes of the distinct tensors in the records of one deferred forward and backward."""
    theta = layer.theta.Transform(tf.convert_to_tensor)
    weights = theta.Flatten()
    with tf.GradientTape() as tape:
        leaves = NestedMap(inputs=list(inputs)).Flatten()
        tape.watch([x for x in leaves if x.dtype.is_floating] + weights)
        with weight_ops.deferring(weights) as stash:
            with fprop_context.fprop_context(training=True):
                out = layer.FProp(theta, *inputs)
    ys = [y for y in NestedMap(out=out).Flatten() if y.dtype.is_floating]
    tape.gradient(ys, weights, output_gradients=[tf.ones_like(y) for y in ys])
    assert stash.records, "the layer applied no weight through weight_ops"
    distinct = {id(t): t for r in stash.records for t in (r.x, r.dy)}
    return sum(t.shape.num_elements() * t.dtype.size for t in distinct.values())


def _normal(*shape: int) -> tf.Tensor:
    return tf.constant(np.random.default_rng(len(shape)).standard_normal(shape), tf.float32)


CASES = {
    "projection_3d": (dense.ProjectionLayer.Params().Set(input_dim=6, output_dim=5),
                      [(4, 3, 6)]),
    "conv_strided_valid": (conv.Conv2DLayer.Params().Set(
        filter_shape=(3, 3, 2, 4), filter_stride=(2, 2), padding="VALID"), [(2, 9, 9, 2)]),
    "conv_same": (conv.Conv2DLayer.Params().Set(filter_shape=(1, 1, 3, 5)), [(2, 4, 4, 3)]),
    "depthwise": (conv.DepthwiseConv2DLayer.Params().Set(filter_shape=(3, 3, 2, 2)),
                  [(2, 6, 6, 2)]),
    "separable": (conv.SeparableConv2DLayer.Params().Set(
        input_dim=2, output_dim=4, kernel_size=3, stride=2), [(2, 7, 7, 2)]),
    "feedforward": (feedforward.FeedForwardLayer.Params().Set(input_dim=8, hidden_dim=16),
                    [(3, 5, 8)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_declared_bytes_are_the_records(name):
    params, shapes = CASES[name]
    params = params.Copy().Set(name=name)
    layer = params.Instantiate()
    meta = params.cls.FPropMeta(params, *[tf.TensorShape(s) for s in shapes])
    assert _recorded_bytes(layer, [_normal(*s) for s in shapes]) == meta.memory.weight_op_bytes


def test_self_attention_declares_its_records():
    # Query, key and value are one tensor: its record is held once.
    p = attention.MultiHeadedAttention.Params().Set(name="att", input_dim=8, num_heads=2)
    x = _normal(2, 5, 8)
    meta = p.cls.FPropMeta(p, x.shape, x.shape, x.shape)
    assert _recorded_bytes(p.Instantiate(), [x, x, x]) == meta.memory.weight_op_bytes


def test_softmax_loss_declares_its_records():
    p = losses.SoftmaxCrossEntropyLayer.Params().Set(name="xent", input_dim=8, num_classes=5)
    x, ids = _normal(6, 8), tf.constant([0, 1, 2, 3, 4, 0])
    meta = p.cls.FPropMeta(p, x.shape, ids.shape)
    assert _recorded_bytes(p.Instantiate(), [x, ids]) == meta.memory.weight_op_bytes


def test_amoebanet_stem_and_cells_declare_their_records():
    # The layers' own wiring sums their convolutions' records; a strided reduction cell and
    # the CIFAR stem included.
    from tasks.image import amoebanet

    net = amoebanet.AmoebaNetParams().Set(
        variant="D", num_normal_cells=1, filters=4, image_size=8, num_channels=3,
        num_classes=10, stem_type="cifar", stem_filters=4, drop_path_keep_prob=1.0,
        dropout_keep_prob=1.0, aux_head_weight=0.0)
    params = amoebanet.amoebanet_layers(net)
    shapes = amoebanet.input_shapes(net, 2)
    x = NestedMap(image=_normal(2, 8, 8, 3), label=tf.constant([1, 2]))
    checked = 0
    for p in params[:-1]:  # The head's loss is checked above.
        meta = p.cls.FPropMeta(p, shapes)
        layer = p.Copy().Instantiate()
        got = _recorded_bytes(layer, [x])
        assert got == meta.memory.weight_op_bytes, p.name
        with fprop_context.fprop_context(training=True):
            x = layer.FProp(layer.theta, x)
        shapes = meta.out_shapes[0]
        checked += 1
    assert checked >= 4


def test_transformer_layers_declare_their_records():
    # Encoder, encoder-to-decoder, decoder and softmax layers sum their children's records
    # (the decoder's cross-attention holds encoder_output and the query separately).
    from tasks.mt import layers as mt

    b, s, t, vocab = 2, 6, 5, 11
    x = NestedMap(src_ids=tf.constant(np.arange(b * s).reshape(b, s) % vocab, tf.int32),
                  src_paddings=tf.zeros([b, s]),
                  tgt_ids=tf.constant(np.arange(b * t).reshape(b, t) % vocab, tf.int32),
                  tgt_paddings=tf.zeros([b, t]),
                  tgt_labels=tf.constant(np.arange(b * t).reshape(b, t) % vocab, tf.int32),
                  tgt_weights=tf.ones([b, t]))
    shapes = x.Transform(lambda v: v.shape)
    checked = 0
    for p in mt.transformer_layers(vocab, 8, 16, 2, 1, 1):
        meta = p.cls.FPropMeta(p, shapes)
        layer = p.Instantiate()
        if meta.get("memory") and meta.memory.weight_op_bytes:
            assert _recorded_bytes(layer, [x]) == meta.memory.weight_op_bytes, p.name
            checked += 1
        with fprop_context.fprop_context(training=True):
            x = layer.FProp(layer.theta, x)
        shapes = meta.out_shapes[0] if isinstance(meta.out_shapes, tuple) else meta.out_shapes
    assert checked == 3  # Encoder, decoder, softmax (the embedding and the layer norm: 0).
