"""AmoebaNet's first and last layers: the stem convolution, the auxiliary head and the head.

The stem turns NestedMap(image, label) into the cells' boundary (x, label); the aux head adds
per-example aux losses to the boundary; the head computes the logits, losses and accuracies.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, fprop_context, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import dropout, losses, pooling
from tasks.image.amoebanet._common import (
    InstantiableParams,
    Params,
    bn_step,
    boundary,
    check_nhwc,
    conv_step,
    define_bn_params,
    dtype_of,
    inherit,
)
from tasks.image.amoebanet._wiring import ShapeWiring, TensorWiring

__all__ = ["STEM_TYPES", "AuxHeadLayer", "HeadLayer", "StemLayer"]

STEM_TYPES = ("imagenet", "cifar")


class StemLayer(base_layer.BaseLayer):
    """The stem convolution: NestedMap(image, label, ...) -> NestedMap(x, label, ...).

    'imagenet': 3x3 conv, stride 2, VALID, + BN (the builder follows it with two reduction
    cells at filter scalings 1/4 and 1/2). 'cifar': 3x3 conv, stride 1, VALID, + BN. No ReLU:
    every cell starts with one. The output has no prev_x: the first cell uses x in its place.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("stem_type", "imagenet", f"One of {STEM_TYPES}.")
        p.Define("input_dim", 3, "Image channels.")
        p.Define("filters", 32, "Output channels of the stem conv.")
        p.Define("image_key", "image", "Field of the input NestedMap holding the images.")
        define_bn_params(p)
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, InstantiableParams]:
        if p.stem_type not in STEM_TYPES:
            raise ValueError(f"{p.name or cls.__name__}: p.stem_type must be one of "
                             f"{STEM_TYPES}, got {p.stem_type!r}.")
        s = 2 if p.stem_type == "imagenet" else 1
        return dict([
            conv_step(p, "conv0", (3, 3), p.input_dim, p.filters, (s, s), padding="VALID"),
            bn_step(p, "conv0_bn", p.filters)])

    @staticmethod
    def _wire(wiring: TensorWiring | ShapeWiring, image: Any) -> Any:
        """The stem on the image; run by FProp on tensors and by FPropMeta on shapes."""
        return wiring.child("conv0_bn", wiring.child("conv0", image))

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        key = self.params.image_key
        inputs = boundary(self.path, inputs, key)
        out = inputs.copy()
        del out[key]
        out.x = self._wire(TensorWiring(self, theta), tf.cast(inputs[key], self.fprop_dtype))
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        shapes = boundary(p.name or cls.__name__, base_layer.to_shape(inputs), p.image_key)
        wiring = ShapeWiring(cls, p)
        out = shapes.copy()
        del out[p.image_key]
        out.x = cls._wire(wiring, tf.TensorShape(shapes[p.image_key]))
        return base_layer.fprop_meta(wiring.flops, out, wiring.num_params, dtype_of(p),
                                     **wiring.extra_param_counts(),
                                     memory=layer_memory.MemoryRecord(saved_activation_bytes=wiring.saved_bytes,
                                                                      weight_op_bytes=wiring.weight_op_bytes,
                                                                      saved_covers_input=True))


def _per_example_correct(logits: tf.Tensor, labels: tf.Tensor, k: int) -> tf.Tensor:
    """1.0 where the label is among the top-k logits (float32 [B])."""
    k = min(k, logits.shape[-1])
    return tf.cast(tf.math.in_top_k(tf.cast(labels, tf.int32), tf.cast(logits, tf.float32), k),
                   tf.float32)


class AuxHeadLayer(base_layer.BaseLayer):
    """The auxiliary classifier: adds per-example `aux_xent` and `aux_correct` [B] to the boundary.

    relu(x) -> 5x5/3 VALID avg pool -> 1x1 conv (128 * s) -> BN -> ReLU -> conv over the
    whole remaining map (768 * s) -> BN -> ReLU -> softmax cross-entropy (with label
    smoothing), s = `aux_scaling`. The HeadLayer turns `aux_xent` into the weighted aux loss;
    per-example values keep the boundary valid under micro-batch splitting.
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Channels of x.")
        p.Define("input_size", (0, 0), "Spatial size (H, W) of x; sets the kernel of the "
                 "second conv, which covers the whole pooled map.")
        p.Define("num_classes", 0, "Number of classes.")
        p.Define("label_smoothing", 0.1, "Label smoothing of the aux cross-entropy.")
        p.Define("aux_scaling", 0.4, "Width multiplier of the 128 and 768 aux convs "
                 "(0.4 in the TF TPU reference).")
        p.Define("label_key", "label", "Field of the boundary holding the int labels.")
        define_bn_params(p)
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, InstantiableParams]:
        where = p.name or cls.__name__
        h, w = tuple(p.input_size)
        if h < 5 or w < 5:
            raise ValueError(f"{where}: the aux head's 5x5 pool needs a feature map of at least "
                             f"5x5, got p.input_size={p.input_size}; use a larger image_size or "
                             "no aux head (aux_head_weight=0).")
        ph, pw = (h - 5) // 3 + 1, (w - 5) // 3 + 1
        c1, c2 = int(128 * p.aux_scaling), int(768 * p.aux_scaling)
        if c1 < 1 or p.input_dim <= 0 or p.num_classes <= 0:
            raise ValueError(f"{where}: p.input_dim, p.num_classes and int(128 * p.aux_scaling) "
                             f"must be > 0, got {p.input_dim}, {p.num_classes}, {c1}.")
        return dict([
            ("pool", inherit(p, pooling.PoolingLayer.Params().Set(
                pooling_type="AVG", window_shape=5, window_stride=3, padding="VALID"))),
            conv_step(p, "proj", (1, 1), p.input_dim, c1), bn_step(p, "bn0", c1),
            conv_step(p, "conv", (ph, pw), c1, c2, padding="VALID"), bn_step(p, "bn1", c2),
            ("softmax", inherit(p, losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=c2, num_classes=p.num_classes, label_smoothing=p.label_smoothing))),
        ])

    @staticmethod
    def _wire(wiring: TensorWiring | ShapeWiring, x: Any) -> Any:
        """x -> the features the softmax reads, [B, 1, 1, 768 * s]; run by FProp on tensors
        and by FPropMeta on shapes."""
        h = wiring.child("pool", wiring.relu(x))
        h = wiring.relu(wiring.child("bn0", wiring.child("proj", h)))
        return wiring.relu(wiring.child("bn1", wiring.child("conv", h)))

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        p = self.params
        inputs = boundary(self.path, inputs, "x", p.label_key)
        x = tf.cast(inputs.x, self.fprop_dtype)
        check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        if list(x.shape[1:3]) != list(p.input_size):
            raise ValueError(f"{self.path}: x is {x.shape[1:3]} but p.input_size="
                             f"{p.input_size}; set input_size to the feature map size.")
        h = self._wire(TensorWiring(self, theta), x)
        h = tf.reshape(h, [-1, h.shape[-1]])
        labels = inputs[p.label_key]
        result = self.softmax.FProp(theta.softmax, h, labels)
        out = inputs.copy()
        out.aux_xent = result.per_example_xent
        out.aux_correct = _per_example_correct(result.logits, labels, 1)
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        shapes = boundary(where, base_layer.to_shape(inputs), "x", p.label_key)
        x = tf.TensorShape(shapes.x)
        check_nhwc(where, x, p.input_dim, "input_dim")
        wiring = ShapeWiring(cls, p)
        features = cls._wire(wiring, x)
        batch = x[0]
        soft = cls.declare_children(p)["softmax"]
        soft_meta = soft.cls.FPropMeta(soft, features[:1].concatenate(features[-1:]))
        flops = wiring.flops + soft_meta.flops
        num_params = wiring.num_params + soft_meta.num_params
        out = shapes.copy()
        out.aux_xent = tf.TensorShape([batch])
        out.aux_correct = tf.TensorShape([batch])
        # The whole head only serves training (evaluation drops it).
        non_trainable = wiring.extra_param_counts()["non_trainable_params"]
        return base_layer.fprop_meta(
            flops, out, num_params, dtype_of(p), non_trainable_params=non_trainable,
            training_only_params=num_params - non_trainable,
            memory=layer_memory.MemoryRecord(
                weight_op_bytes=layer_memory.weight_op_bytes(wiring.metas + [soft_meta])))


class HeadLayer(base_layer.BaseLayer):
    """The classifier and loss: ReLU, global average pool, dropout, softmax cross-entropy.

    Returns NestedMap(logits [B, num_classes], per_example_xent [B], main_loss, loss,
    accuracy (top-1), top5_accuracy) and, with an aux head (aux_weight > 0), aux_loss and
    aux_accuracy. In training loss = main_loss + aux_weight * aux_loss; in evaluation
    loss = main_loss (the reference drops the aux head outside training).
    """

    @classmethod
    def Params(cls) -> InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Channels of x.")
        p.Define("num_classes", 0, "Number of classes.")
        p.Define("label_smoothing", 0.1, "Label smoothing of the cross-entropy.")
        p.Define("dropout_keep_prob", 0.5, "Keep probability of the dropout before the logits.")
        p.Define("aux_weight", 0.0, "Weight of the aux head's loss; > 0 requires `aux_xent` "
                 "in the input (an AuxHeadLayer earlier in the network).")
        p.Define("label_key", "label", "Field of the boundary holding the int labels.")
        return p

    @classmethod
    def declare_children(cls, p: Params) -> dict[str, InstantiableParams]:
        if p.aux_weight < 0:
            raise ValueError(f"{p.name or cls.__name__}: p.aux_weight must be >= 0, "
                             f"got {p.aux_weight}.")
        return {
            "pool": inherit(p, pooling.GlobalPoolingLayer.Params().Set(pooling_type="AVG")),
            "dropout": inherit(p, dropout.DropoutLayer.Params().Set(
                keep_prob=p.dropout_keep_prob)),
            "softmax": inherit(p, losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=p.input_dim, num_classes=p.num_classes,
                label_smoothing=p.label_smoothing)),
        }

    @staticmethod
    def _keys(p: Params) -> tuple[str, ...]:
        """The boundary fields the head reads."""
        return ("x", p.label_key) + (("aux_xent", "aux_correct") if p.aux_weight > 0 else ())

    @staticmethod
    def _wire(wiring: TensorWiring | ShapeWiring, x: Any) -> Any:
        """x -> the pooled features the softmax reads, [B, C]; run by FProp on tensors and
        by FPropMeta on shapes."""
        return wiring.child("dropout", wiring.child("pool", wiring.relu(x)))

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        p = self.params
        inputs = boundary(self.path, inputs, *self._keys(p))
        x = tf.cast(inputs.x, self.fprop_dtype)
        check_nhwc(self.path, x.shape, p.input_dim, "input_dim")
        h = self._wire(TensorWiring(self, theta), x)
        labels = inputs[p.label_key]
        result = self.softmax.FProp(theta.softmax, h, labels)
        out = NestedMap(
            logits=result.logits,
            per_example_xent=result.per_example_xent,
            main_loss=result.loss,
            loss=result.loss,
            accuracy=result.accuracy,
            top5_accuracy=tf.reduce_mean(_per_example_correct(result.logits, labels, 5)),
        )
        if p.aux_weight > 0:
            out.aux_loss = tf.reduce_mean(tf.cast(inputs.aux_xent, tf.float32))
            out.aux_accuracy = tf.reduce_mean(tf.cast(inputs.aux_correct, tf.float32))
            if fprop_context.current().training:
                out.loss = result.loss + p.aux_weight * out.aux_loss
        return out

    @classmethod
    def FPropMeta(cls, p: Params, inputs: Any) -> NestedMap:
        where = p.name or cls.__name__
        shapes = boundary(where, base_layer.to_shape(inputs), *cls._keys(p))
        x = tf.TensorShape(shapes.x)
        check_nhwc(where, x, p.input_dim, "input_dim")
        wiring = ShapeWiring(cls, p)
        features = cls._wire(wiring, x)
        soft = cls.declare_children(p)["softmax"]
        soft_meta = soft.cls.FPropMeta(soft, features)
        batch = x[0]
        # ReLU, pool and dropout, the softmax, and the top-5 compares.
        flops = wiring.flops + soft_meta.flops + 5 * batch * p.num_classes
        scalar = tf.TensorShape([])
        out = NestedMap(
            logits=tf.TensorShape([batch, p.num_classes]),
            per_example_xent=tf.TensorShape([batch]),
            main_loss=scalar, loss=scalar, accuracy=scalar, top5_accuracy=scalar)
        if p.aux_weight > 0:
            out.aux_loss = scalar
            out.aux_accuracy = scalar
        # The backward reads the ReLU's output (the cell output's size) and the dropout mask;
        # the pool's gradient is its input's size.
        held, freeing = wiring.backward_temporaries(features)
        return base_layer.fprop_meta(
            flops, out, soft_meta.num_params, tf.float32,
            memory=layer_memory.MemoryRecord(
                saved_activation_bytes=(wiring.saved_bytes
                                        + layer_memory.saved_activation_bytes(soft_meta)),
                weight_op_bytes=layer_memory.record_of(soft_meta).weight_op_bytes,
                backward_temporary_bytes=max(held,
                                             layer_memory.backward_temporary_bytes(soft_meta)),
                inline_backward_temporary_bytes=freeing, saved_covers_input=True))
