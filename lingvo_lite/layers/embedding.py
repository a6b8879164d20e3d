"""Token embeddings, with the transposed table as a (shared) softmax projection."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import weight_ops

__all__ = ["EmbeddingLayer"]


class EmbeddingLayer(base_layer.BaseLayer):
    """Looks up ids [B, ...] in a table `emb` [vocab_size, embedding_dim] -> [B, ..., dim].

    `scale_sqrt_depth` multiplies the looked-up vectors by sqrt(embedding_dim),
    as the Transformer does. `Logits(theta, x)` computes x @ emb^T so the same
    table can serve as the softmax weights. The default initialiser (when
    `params_init` is None) is N(0, 1 / embedding_dim).
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("vocab_size", 0, "Number of rows of the table (valid ids: 0..vocab_size-1).")
        p.Define("embedding_dim", 0, "Size of each embedding vector.")
        p.Define("scale_sqrt_depth", False, "Multiply lookups by sqrt(embedding_dim).")
        p.params_init = None
        return p

    @classmethod
    def _validate(cls, p: hyperparams.Params, where: str) -> None:
        for name in ("vocab_size", "embedding_dim"):
            value = getattr(p, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}: p.{name} must be a positive int, got {value!r}.")

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        self._validate(p, self.path)
        init = p.params_init or weight_params.WeightInit.Gaussian(1.0 / math.sqrt(p.embedding_dim))
        self.CreateVariable("emb", weight_params.WeightParams(
            shape=(p.vocab_size, p.embedding_dim), init=init))

    def EmbLookup(self, theta: NestedMap, ids: tf.Tensor) -> tf.Tensor:
        """Embeddings of integer `ids` [B, ...] -> [B, ..., embedding_dim].

        Out-of-range ids fail a tf.debugging check (TF's CPU gather would also
        fail, but accelerators silently return zeros).
        """
        p = self.params
        theta = self.CastTheta(theta)
        ids = tf.convert_to_tensor(ids)
        if not ids.dtype.is_integer:
            raise ValueError(f"{self.path}: ids must be an integer tensor, got {ids.dtype}.")
        checks = [
            tf.debugging.assert_non_negative(
                ids, message=f"{self.path}: ids must be >= 0."),
            tf.debugging.assert_less(
                ids, tf.cast(p.vocab_size, ids.dtype),
                message=f"{self.path}: ids must be < p.vocab_size={p.vocab_size}."),
        ]
        with tf.control_dependencies(checks):
            out = tf.gather(theta.emb, ids)
        if p.scale_sqrt_depth:
            out = out * tf.cast(math.sqrt(p.embedding_dim), out.dtype)
        return out

    def FProp(self, theta: NestedMap, ids: tf.Tensor) -> tf.Tensor:
        return self.EmbLookup(theta, ids)

    def Logits(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
        """x [..., embedding_dim] @ emb^T -> [..., vocab_size] (shared softmax weights)."""
        p = self.params
        theta = self.CastTheta(theta)
        x = tf.convert_to_tensor(x)
        if x.shape.rank is not None and x.shape[-1] is not None and x.shape[-1] != p.embedding_dim:
            raise ValueError(f"{self.path}: Logits needs x[..., p.embedding_dim="
                             f"{p.embedding_dim}], got shape {x.shape}.")
        x = tf.cast(x, self.fprop_dtype)
        flat = tf.reshape(x, [-1, p.embedding_dim])
        logits = weight_ops.matmul(flat, theta.emb, transpose_b=True)
        out = tf.reshape(logits, tf.concat([tf.shape(x)[:-1], [p.vocab_size]], axis=0))
        out.set_shape(x.shape[:-1].concatenate([p.vocab_size]))
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, ids: Any) -> NestedMap:
        where = p.name or cls.__name__
        cls._validate(p, where)
        shape = base_layer.to_shape(ids)
        if not shape.is_fully_defined():
            raise ValueError(f"{where}: FPropMeta needs a fully-defined ids shape, got {shape}.")
        out_shape = shape.concatenate([p.embedding_dim])
        # A gather does no arithmetic; scaling costs one multiply per output element.
        flops = out_shape.num_elements() if p.scale_sqrt_depth else 0
        # A lookup: its gradient is in B.
        return base_layer.fprop_meta(flops, out_shape, p.vocab_size * p.embedding_dim,
                                     p.fprop_dtype or p.dtype,
                                     memory=layer_memory.MemoryRecord(weight_op_bytes=0))
