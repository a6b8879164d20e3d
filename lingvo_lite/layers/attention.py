"""Multi-headed scaled dot-product attention (Transformer encoder/decoder attention).

Queries, keys and values are projected to `num_heads` heads of depth
`hidden_dim / num_heads`; each head computes softmax(q k^T / sqrt(dh)) v over
the key positions that are not padded (and, with `causal_mask`, not in the
future; with segment ids, in the query's segment: several sequences packed in one
row do not see each other); the heads are concatenated and projected back to `input_dim`. The
softmax always runs in float32, also when activations are bfloat16.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory, weight_params
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import dropout, weight_ops

__all__ = ["MultiHeadedAttention"]

# Rough cost of the masked softmax per score: mask, max, subtract, exp, sum, divide.
_SOFTMAX_FLOPS_PER_SCORE = 6
# Logit given to masked positions: exp() of it underflows to exactly 0 in float32.
_LARGE_NEGATIVE = -1e9


def _hidden_dim(p: hyperparams.Params) -> int:
    return p.hidden_dim or p.input_dim


def _check_params(name: str, p: hyperparams.Params) -> None:
    if p.input_dim <= 0:
        raise ValueError(f"{name}: p.input_dim must be > 0, got {p.input_dim}.")
    hidden = _hidden_dim(p)
    if p.num_heads <= 0:
        raise ValueError(f"{name}: p.num_heads must be > 0, got {p.num_heads}.")
    if hidden % p.num_heads != 0:
        raise ValueError(
            f"{name}: p.num_heads={p.num_heads} does not divide p.hidden_dim={hidden} "
            f"(hidden_dim defaults to input_dim); choose num_heads dividing it or set "
            f"p.hidden_dim to a multiple of num_heads."
        )
    if not 0.0 <= p.atten_dropout_prob < 1.0:
        raise ValueError(f"{name}: p.atten_dropout_prob must be in [0, 1), "
                         f"got {p.atten_dropout_prob}.")


def _check_shapes(name: str, p: hyperparams.Params, query: tf.TensorShape,
                  key: tf.TensorShape, value: tf.TensorShape,
                  paddings: tf.TensorShape | None) -> None:
    for arg, shape in (("query_vec", query), ("key_vec", key), ("value_vec", value)):
        if shape.rank != 3:
            raise ValueError(f"{name}: {arg} must be [batch, time, input_dim], got {shape}.")
        if shape[-1] is not None and shape[-1] != p.input_dim:
            raise ValueError(f"{name}: {arg} has depth {shape[-1]} but p.input_dim is "
                             f"{p.input_dim}; set p.input_dim={shape[-1]}.")
    if not key[:2].is_compatible_with(value[:2]):
        raise ValueError(f"{name}: key_vec {key} and value_vec {value} must share "
                         "[batch, time].")
    if not query[:1].is_compatible_with(key[:1]):
        raise ValueError(f"{name}: query_vec {query} and key_vec {key} must share the batch.")
    if paddings is not None and not paddings.is_compatible_with(key[:2]):
        raise ValueError(f"{name}: paddings {paddings} must be [batch, key_time] = {key[:2]}.")
    if p.causal_mask and not query[1:2].is_compatible_with(key[1:2]):
        raise ValueError(f"{name}: p.causal_mask needs as many queries as keys (self-attention), "
                         f"got query_vec {query} and key_vec {key}.")


class MultiHeadedAttention(base_layer.BaseLayer):
    """Multi-headed attention: [B, Tq, D] queries attend over [B, Tk, D] keys/values."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Depth D of the query, key and value vectors and of the output.")
        p.Define("hidden_dim", 0, "Total depth of the projected heads; 0 means input_dim.")
        p.Define("num_heads", 1, "Number of heads; must divide hidden_dim.")
        p.Define("atten_dropout_prob", 0.0, "Dropout probability on the attention weights "
                 "(training only).")
        p.Define("use_bias", True, "Add biases to the query/key/value and output projections.")
        p.Define("causal_mask", False, "Decoder self-attention: query i attends keys <= i only "
                 "(needs as many queries as keys).")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        _check_params(self.path, p)
        hidden = _hidden_dim(p)
        for name in ("query", "key", "value"):
            self.CreateVariable(f"w_{name}",
                                weight_params.WeightParams(shape=(p.input_dim, hidden)))
        self.CreateVariable("w_post", weight_params.WeightParams(shape=(hidden, p.input_dim)))
        if p.use_bias:
            zeros = weight_params.WeightInit.Constant(0.0)
            for name in ("query", "key", "value"):
                self.CreateVariable(f"b_{name}",
                                    weight_params.WeightParams(shape=(hidden,), init=zeros))
            self.CreateVariable("b_post", weight_params.WeightParams(shape=(p.input_dim,),
                                                                     init=zeros))
        if p.atten_dropout_prob > 0.0:
            self.CreateChild("atten_dropout", dropout.DropoutLayer.Params().Set(
                keep_prob=1.0 - p.atten_dropout_prob))

    def _project(self, theta: NestedMap, name: str, x: tf.Tensor) -> tf.Tensor:
        """[B, T, D] -> [B, T, N, dh]."""
        p = self.params
        y = weight_ops.einsum("btd,dh->bth", x, theta[f"w_{name}"])
        if p.use_bias:
            y = tf.nn.bias_add(y, theta[f"b_{name}"])  # Keeps no activation for backward.
        dh = _hidden_dim(p) // p.num_heads
        return tf.reshape(y, tf.concat([tf.shape(y)[:2], [p.num_heads, dh]], axis=0))

    def FPropWithProbs(
        self,
        theta: NestedMap,
        query_vec: tf.Tensor,
        key_vec: tf.Tensor,
        value_vec: tf.Tensor,
        paddings: tf.Tensor | None = None,
        segment_ids: tuple[tf.Tensor, tf.Tensor] | None = None,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Like FProp, also returning the attention probabilities.

        Returns:
          (output [B, Tq, input_dim] in the fprop dtype,
           probs [B, num_heads, Tq, Tk] float32, before attention dropout; masked
           (padded or future) keys get probability exactly 0).
        """
        p = self.params
        query_vec, key_vec, value_vec = (tf.convert_to_tensor(t) for t in (query_vec, key_vec,
                                                                           value_vec))
        if paddings is not None:
            paddings = tf.convert_to_tensor(paddings)
        _check_shapes(self.path, p, query_vec.shape, key_vec.shape, value_vec.shape,
                      None if paddings is None else paddings.shape)
        theta = self.CastTheta(theta)
        dtype = self.fprop_dtype
        query_vec, key_vec, value_vec = (tf.cast(t, dtype) for t in (query_vec, key_vec,
                                                                     value_vec))
        dh = _hidden_dim(p) // p.num_heads
        q = self._project(theta, "query", query_vec) * tf.cast(dh ** -0.5, dtype)
        k = self._project(theta, "key", key_vec)
        v = self._project(theta, "value", value_vec)

        logits = tf.cast(tf.einsum("btnh,bsnh->bnts", q, k), tf.float32)  # [B, N, Tq, Tk]
        valid = None  # bool, broadcastable to logits; True where the key may be attended.
        if paddings is not None:
            valid = tf.cast(paddings, tf.float32)[:, tf.newaxis, tf.newaxis, :] < 0.5
        if segment_ids is not None:  # Packed rows: a query sees only its own segment's keys.
            q_seg, k_seg = segment_ids
            same = tf.equal(q_seg[:, tf.newaxis, :, tf.newaxis],
                            k_seg[:, tf.newaxis, tf.newaxis, :])
            valid = same if valid is None else tf.logical_and(valid, same)
        if p.causal_mask:
            t = tf.shape(logits)[-1]
            causal = tf.linalg.band_part(tf.ones([t, t], tf.bool), -1, 0)  # key <= query
            valid = causal if valid is None else tf.logical_and(valid, causal)
        if valid is not None:
            logits = tf.where(valid, logits, _LARGE_NEGATIVE)
        probs = tf.nn.softmax(logits, axis=-1)

        weights = probs
        if p.atten_dropout_prob > 0.0:
            weights = self.atten_dropout.FProp(theta.atten_dropout, weights)
        context = tf.einsum("bnts,bsnh->btnh", tf.cast(weights, dtype), v)
        context = tf.reshape(context, tf.concat([tf.shape(context)[:2], [_hidden_dim(p)]], 0))
        out = weight_ops.einsum("bth,hd->btd", context, theta.w_post)
        if p.use_bias:
            out = tf.nn.bias_add(out, theta.b_post)
        return out, probs

    def FProp(
        self,
        theta: NestedMap,
        query_vec: tf.Tensor,
        key_vec: tf.Tensor,
        value_vec: tf.Tensor,
        paddings: tf.Tensor | None = None,
        segment_ids: tuple[tf.Tensor, tf.Tensor] | None = None,
    ) -> tf.Tensor:
        """Attends `query_vec` [B, Tq, D] over `key_vec`/`value_vec` [B, Tk, D].

        Args:
          theta: this layer's weights.
          query_vec: [B, Tq, input_dim].
          key_vec: [B, Tk, input_dim].
          value_vec: [B, Tk, input_dim].
          paddings: [B, Tk], 1.0 at padded key positions (never attended), or None.
          segment_ids: (query [B, Tq], key [B, Tk]) int segment ids of packed rows: a query
            attends only keys of its segment. None: one sequence per row.

        Returns:
          [B, Tq, input_dim] in the fprop dtype.
        """
        return self.FPropWithProbs(theta, query_vec, key_vec, value_vec, paddings,
                                   segment_ids)[0]

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, query_shape: Any, key_shape: Any,
                  value_shape: Any, paddings_shape: Any = None,
                  segment_ids: bool = False) -> NestedMap:
        """`segment_ids`: the call passes segment ids (packed rows)."""
        _check_params(cls.__name__, p)
        query = base_layer.to_shape(query_shape)
        key = base_layer.to_shape(key_shape)
        value = base_layer.to_shape(value_shape)
        paddings = None if paddings_shape is None else base_layer.to_shape(paddings_shape)
        _check_shapes(cls.__name__, p, query, key, value, paddings)
        if not (query.is_fully_defined() and key.is_fully_defined()):
            raise ValueError(f"{cls.__name__}.FPropMeta needs fully defined shapes, got "
                             f"query {query}, key {key}.")
        B, Tq, D = query.as_list()
        Tk = key[1]
        H = _hidden_dim(p)
        N = p.num_heads
        dh = H // N
        flops = 2 * B * Tq * D * H + 2 * 2 * B * Tk * D * H  # Q, K and V projections.
        flops += 2 * B * N * Tq * Tk * dh * 2  # Scores and the weighted sum of values.
        flops += _SOFTMAX_FLOPS_PER_SCORE * B * N * Tq * Tk
        flops += 2 * B * Tq * H * D  # Output projection.
        num_params = 4 * D * H
        if p.use_bias:
            flops += B * Tq * H + 2 * B * Tk * H + B * Tq * D
            num_params += 3 * H + D
        dtype = p.fprop_dtype or p.dtype
        # Kept for the backward: the query input (the Q projection's weight gradient reads
        # it), the Q, K, V projections, the context and the float32 softmax probabilities;
        # with attention dropout also its boolean mask and the dropped probabilities.
        probs = B * N * Tq * Tk
        saved = B * Tq * D + B * Tq * H + 2 * B * Tk * H + B * Tq * H
        kept_masks = probs * (tf.bool.size + tf.float32.size) if p.atten_dropout_prob > 0.0 else 0
        # The masking select keeps its boolean condition: [B, 1, 1, Tk] from the paddings, or
        # [B, 1, Tq, Tk] with the causal mask too (the causal mask alone has no batch).
        if segment_ids:  # The condition is [B, 1, Tq, Tk] with segments.
            kept_masks += B * Tq * Tk * tf.bool.size
        elif paddings is not None:
            kept_masks += B * Tk * (Tq if p.causal_mask else 1) * tf.bool.size
        # A deferred weight gradient holds each projection's input and output gradient, and
        # the output projection's input (the context) and output gradient. Inputs of one shape
        # are taken as one tensor, held once: self-attention passes one tensor as query, key
        # and value, cross-attention one memory as key and value.
        inputs = B * Tq * D + (B * Tk * D if key != query else 0)
        inputs += B * Tk * D if value != query and value != key else 0
        weight_ops = inputs + (B * Tq * H + 2 * B * Tk * H) + (B * Tq * H + B * Tq * D)
        size = tf.as_dtype(dtype).size
        # Back-propagating through the softmax, the probabilities' gradient and its product
        # with the probabilities are alive together (two float32 probability tensors); by then
        # the backward has freed the context and V (and with dropout its mask and the dropped
        # probabilities). At least the gradients flowing in and out (2 x the output).
        freed = (B * Tq * H + B * Tk * H) * size
        if p.atten_dropout_prob > 0.0:
            freed += probs * (tf.bool.size + tf.float32.size)
        temporaries = max(2 * probs * tf.float32.size - freed, 2 * B * Tq * D * size)
        return base_layer.fprop_meta(flops=flops, out_shapes=tf.TensorShape([B, Tq, D]),
                                     num_params=num_params, dtype=dtype,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=(saved * size
                                                                 + probs * tf.float32.size
                                                                 + kept_masks),
                                         weight_op_bytes=weight_ops * size,
                                         backward_temporary_bytes=temporaries,
                                         saved_covers_input=True))
