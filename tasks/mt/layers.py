"""The Transformer's layers as pipeline layers over one boundary NestedMap.

The network is the list

    EmbeddingInputLayer, EncoderLayer x N, EncoderToDecoderLayer, DecoderLayer x N, SoftmaxLayer

(`transformer_layers`), and every layer maps a NestedMap to a NestedMap so a PipeliningLayer can
cut it anywhere. What crosses each boundary:

  after the embedding and the encoder layers:
    x [B, S, D] (encoder stream), src_paddings, y [B, T, D] (embedded decoder input),
    tgt_paddings, tgt_labels, tgt_weights
  after EncoderToDecoderLayer and the decoder layers:
    x [B, T, D] (decoder stream), encoder_output [B, S, D], src_paddings, tgt_paddings,
    tgt_labels, tgt_weights
  after SoftmaxLayer: NestedMap(loss, loss_weight, accuracy, log_pplx) (scalars)

The source and the target are both embedded in the first layer, so a shared source/target table
(`share_embeddings`) lives in one cell. The softmax keeps its own weights: tying them to the target
embedding would make the first and the last cell read one variable, which GPipe's cell-local
weights (each cell's weights on its own device, updated there) do not allow without copying the
table across devices every step.

`loss_weight` is the number of real target tokens of the (micro-)batch: the pipeline weighs each
micro-batch's mean loss by it, so the mini-batch loss and gradients are the token-level mean over
the whole batch, exactly as without pipelining, whatever the padding.

Blocks are pre-layer-norm (x + f(LN(x))), with a final layer norm on the encoder output and before
the softmax. With `fprop_dtype=tf.bfloat16` activations and matmuls run in bfloat16 while weights
stay float32; layer norms, attention softmaxes and the loss run in float32.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import attention, dropout, embedding, feedforward, losses, normalization

_TARGET_FIELDS = ("tgt_paddings", "tgt_labels", "tgt_weights")
# Packed rows (several pairs per row, ParallelTextInput.pack): each position's segment (1, 2, ...
# for the pairs, 0 for padding) and its position within the segment. The ids travel with the
# streams so attention stays within a segment; positions are only read by the embedding.
PACKED_FIELDS = ("src_segment_ids", "src_segment_pos", "tgt_segment_ids", "tgt_segment_pos")
_SEGMENT_FIELDS = ("src_segment_ids", "tgt_segment_ids")
# Per element: sin/cos table (~2 transcendental + scale) and the add; a rough count.
_POSITION_FLOPS_PER_ELEMENT = 4


def positional_encoding(length: int, dim: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """Sinusoidal position encodings [length, dim] (Vaswani et al. 2017).

    Channel 2i holds sin(pos / 10000^(2i/dim)) and channel 2i+1 cos(...) of the same frequency.
    """
    pos = tf.range(length, dtype=tf.float32)[:, tf.newaxis]
    i = tf.range(dim // 2 + dim % 2, dtype=tf.float32)[tf.newaxis, :]
    angles = pos / tf.pow(10000.0, 2.0 * i / float(dim))
    enc = tf.reshape(tf.stack([tf.sin(angles), tf.cos(angles)], axis=-1), [length, -1])
    return tf.cast(enc[:, :dim], dtype)


def _common(p: hyperparams.Params) -> dict[str, Any]:
    return dict(dtype=p.dtype, fprop_dtype=p.fprop_dtype)


def _check_map(value: Any, keys: tuple[str, ...], where: str) -> NestedMap:
    if not isinstance(value, NestedMap):
        raise ValueError(f"{where}: expects a NestedMap, got {type(value).__name__}.")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ValueError(f"{where}: the input NestedMap lacks {missing} (has {sorted(value)}); "
                         "check the layer order (embedding, encoders, encoder-to-decoder, "
                         "decoders, softmax).")
    return value


def _meta(flops: float, out: NestedMap, num_params: int, p: hyperparams.Params,
          children: list[NestedMap] | None = None, saved_extra: int = 0) -> NestedMap:
    """FPropMeta of a layer; with `children` (their metas), it keeps what they keep (plus
    `saved_extra` bytes of its own) and defers what they defer, and its gradient temporaries
    are its largest child's: it back-propagates through one child after another."""
    if children is None:
        return base_layer.fprop_meta(flops, out, num_params, p.fprop_dtype or p.dtype)
    return base_layer.fprop_meta(flops, out, num_params, p.fprop_dtype or p.dtype,
                                 memory=layer_memory.composite(children, saved_extra))


def _present(fields: tuple[str, ...], inputs: Any) -> tuple[str, ...]:
    return tuple(k for k in fields if k in inputs)


def _segments(inputs: NestedMap, query: str, key: str) -> tuple[tf.Tensor, tf.Tensor] | None:
    """(query, key) segment ids of packed rows, or None."""
    if f"{key}_segment_ids" not in inputs:
        return None
    return inputs[f"{query}_segment_ids"], inputs[f"{key}_segment_ids"]


def _shape3(shape: Any, dim: int, what: str, where: str) -> tf.TensorShape:
    shape = tf.TensorShape(shape)
    if shape.rank != 3 or not shape.is_fully_defined() or shape[-1] != dim:
        raise ValueError(f"{where}: {what} must be a fully defined [batch, time, {dim}], "
                         f"got {shape}.")
    return shape


class EmbeddingInputLayer(base_layer.BaseLayer):
    """Embeds source and target ids (+ sinusoidal positions): the network's first layer.

    In: NestedMap(src_ids, src_paddings, tgt_ids, tgt_paddings, tgt_labels, tgt_weights).
    Out: NestedMap(x=[B, S, D] source embeddings, src_paddings, y=[B, T, D] target (decoder
    input) embeddings, tgt_paddings, tgt_labels, tgt_weights). Embeddings are scaled by sqrt(D)
    and padded positions are zeroed.
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("vocab_size", 0, "Vocabulary size (source and target).")
        p.Define("model_dim", 0, "Model dimension D.")
        p.Define("share_embeddings", True,
                 "One table for source and target (needs a joint vocabulary).")
        p.Define("dropout_prob", 0.0, "Dropout on the embeddings (training only).")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        """The embedding table(s) ('emb', or 'src_emb' and 'tgt_emb'), then 'dropout'."""
        table = embedding.EmbeddingLayer.Params().Set(
            vocab_size=p.vocab_size, embedding_dim=p.model_dim, scale_sqrt_depth=True,
            **_common(p))
        names = ("emb",) if p.share_embeddings else ("src_emb", "tgt_emb")
        children: dict[str, Any] = {name: table.Copy() for name in names}
        if p.dropout_prob > 0.0:
            children["dropout"] = dropout.DropoutLayer.Params().Set(
                keep_prob=1.0 - p.dropout_prob, **_common(p))
        return children

    def _embed(self, theta: NestedMap, table: str, ids: tf.Tensor,
               paddings: tf.Tensor | None, positions: tf.Tensor | None = None) -> tf.Tensor:
        p = self.params
        name = "emb" if p.share_embeddings else table
        x = self.children[name].EmbLookup(theta[name], ids)
        table_of_positions = positional_encoding(ids.shape[1], p.model_dim, x.dtype)
        # Packed rows restart the positions at every segment.
        x += table_of_positions if positions is None else tf.gather(table_of_positions,
                                                                    positions)
        if paddings is not None:
            x *= tf.cast(1.0 - paddings, x.dtype)[:, :, tf.newaxis]
        if p.dropout_prob > 0.0:
            x = self.dropout.FProp(theta.dropout, x)
        return x

    def EmbedSource(self, theta: NestedMap, ids: tf.Tensor,
                    paddings: tf.Tensor | None = None) -> tf.Tensor:
        """[B, S] source ids -> [B, S, D] encoder input."""
        return self._embed(theta, "src_emb", ids, paddings)

    def EmbedTarget(self, theta: NestedMap, ids: tf.Tensor,
                    paddings: tf.Tensor | None = None) -> tf.Tensor:
        """[B, T] target ids (BOS first) -> [B, T, D] decoder input."""
        return self._embed(theta, "tgt_emb", ids, paddings)

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        inputs = _check_map(inputs, ("src_ids", "src_paddings", "tgt_ids") + _TARGET_FIELDS,
                            self.path)
        out = NestedMap(
            x=self._embed(theta, "src_emb", inputs.src_ids, inputs.src_paddings,
                          inputs.get("src_segment_pos")),
            src_paddings=inputs.src_paddings,
            y=self._embed(theta, "tgt_emb", inputs.tgt_ids, inputs.tgt_paddings,
                          inputs.get("tgt_segment_pos")))
        for k in _TARGET_FIELDS + _present(_SEGMENT_FIELDS, inputs):
            out[k] = inputs[k]
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        inputs = _check_map(base_layer.to_shape(inputs),
                            ("src_ids", "src_paddings", "tgt_ids") + _TARGET_FIELDS, cls.__name__)
        children = cls.declare_children(p)
        tables = [c for c in children.values() if c.cls is embedding.EmbeddingLayer]
        flops = 0.0
        out = NestedMap(src_paddings=inputs.src_paddings)
        for field, ids in (("x", inputs.src_ids), ("y", inputs.tgt_ids)):
            meta = tables[0].cls.FPropMeta(tables[0], ids)
            n = meta.out_shapes[0].num_elements()
            flops += meta.flops + _POSITION_FLOPS_PER_ELEMENT * n + n  # Positions, pad mask.
            if "dropout" in children:
                flops += 3 * n
            out[field] = meta.out_shapes[0]
        num_params = len(tables) * p.vocab_size * p.model_dim
        for k in _TARGET_FIELDS + _present(_SEGMENT_FIELDS, inputs):
            out[k] = inputs[k]
        return _meta(flops, out, num_params, p)


class _AttentionBlock(base_layer.BaseLayer):
    """x + dropout(MHA(LN(x), memory)): a pre-layer-norm attention sub-block."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("model_dim", 0, "Model dimension D.")
        p.Define("num_heads", 1, "Attention heads.")
        p.Define("atten_hidden_dim", 0, "Total depth of the heads; 0 means model_dim.")
        p.Define("causal", False, "Causal (decoder self-) attention.")
        p.Define("atten_dropout_prob", 0.0, "Dropout on attention weights.")
        p.Define("residual_dropout_prob", 0.0, "Dropout before the residual add.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        out = dict(
            ln=normalization.LayerNorm.Params().Set(input_dim=p.model_dim, **_common(p)),
            atten=attention.MultiHeadedAttention.Params().Set(
                input_dim=p.model_dim, hidden_dim=p.atten_hidden_dim, num_heads=p.num_heads,
                causal_mask=p.causal, atten_dropout_prob=p.atten_dropout_prob, **_common(p)))
        if p.residual_dropout_prob > 0.0:
            out["dropout"] = dropout.DropoutLayer.Params().Set(
                keep_prob=1.0 - p.residual_dropout_prob, **_common(p))
        return out

    def FProp(self, theta: NestedMap, x: tf.Tensor, paddings: tf.Tensor | None,
              memory: tf.Tensor | None = None,
              segment_ids: tuple[tf.Tensor, tf.Tensor] | None = None) -> tf.Tensor:
        """x [B, Tq, D] attends to itself (memory None) or to `memory` [B, Tk, D]; with
        `segment_ids` (query's, key's) only within its segment."""
        x = tf.cast(x, self.fprop_dtype)
        h = self.ln.FProp(theta.ln, x)
        kv = h if memory is None else memory
        h = self.atten.FProp(theta.atten, h, kv, kv, paddings, segment_ids)
        if "dropout" in self.children:
            h = self.dropout.FProp(theta.dropout, h)
        return x + h

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, x: Any, memory: Any = None,
                  segment_ids: bool = False) -> NestedMap:
        x = tf.TensorShape(x)
        kv = x if memory is None else tf.TensorShape(memory)
        children = cls.declare_children(p)
        ln = children["ln"].cls.FPropMeta(children["ln"], x)
        # The decoder's causal self-attention runs without paddings (DecoderLayer.FProp).
        att = children["atten"].cls.FPropMeta(children["atten"], x, kv, kv,
                                              None if p.causal else kv[:2], segment_ids)
        metas = [ln, att]
        if "dropout" in children:
            metas.append(children["dropout"].cls.FPropMeta(children["dropout"], x))
        n = x.num_elements()
        flops = ln.flops + att.flops + n + (3 * n if "dropout" in children else 0)
        # The residual add keeps nothing: what the block keeps is its children's.
        return _meta(flops, x, ln.num_params + att.num_params, p, metas)


def _block_params(p: hyperparams.Params, causal: bool) -> hyperparams.Params:
    return _AttentionBlock.Params().Set(
        model_dim=p.model_dim, num_heads=p.num_heads, atten_hidden_dim=p.atten_hidden_dim,
        causal=causal, atten_dropout_prob=p.atten_dropout_prob,
        residual_dropout_prob=p.residual_dropout_prob, **_common(p))


def _ffn_params(p: hyperparams.Params) -> hyperparams.Params:
    return feedforward.FeedForwardLayer.Params().Set(
        input_dim=p.model_dim, hidden_dim=p.hidden_dim, activation="RELU",
        relu_dropout_prob=p.relu_dropout_prob, residual_dropout_prob=p.residual_dropout_prob,
        pre_layer_norm=True, add_residual=True, **_common(p))


class _TransformerLayer(base_layer.BaseLayer):
    """Params shared by the encoder and decoder layers."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("model_dim", 0, "Model dimension D.")
        p.Define("hidden_dim", 0, "Feed-forward hidden dimension (the paper's H).")
        p.Define("num_heads", 1, "Attention heads (the paper's A).")
        p.Define("atten_hidden_dim", 0, "Total depth of the attention heads; 0 means model_dim.")
        p.Define("atten_dropout_prob", 0.0, "Dropout on attention weights.")
        p.Define("relu_dropout_prob", 0.0, "Dropout after the feed-forward activation.")
        p.Define("residual_dropout_prob", 0.0, "Dropout before each residual add.")
        return p


def _check_dims(p: hyperparams.Params, where: str) -> None:
    if p.model_dim <= 0 or p.hidden_dim <= 0:
        raise ValueError(f"{where}: p.model_dim and p.hidden_dim must be > 0, got "
                         f"{p.model_dim} and {p.hidden_dim}.")


class EncoderLayer(_TransformerLayer):
    """One Transformer encoder layer on `x`: self-attention (masked by src_paddings), then FFN."""

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        _check_dims(p, p.name or cls.__name__)
        return {"self_atten": _block_params(p, causal=False), "ffn": _ffn_params(p)}

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        inputs = _check_map(inputs, ("x", "src_paddings"), self.path)
        x = self.self_atten.FProp(theta.self_atten, inputs.x, inputs.src_paddings,
                                  segment_ids=_segments(inputs, "src", "src"))
        out = inputs.copy()
        out.x = self.ffn.FProp(theta.ffn, x)
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        inputs = _check_map(base_layer.to_shape(inputs), ("x", "src_paddings"), cls.__name__)
        children = cls.declare_children(p)
        x = _shape3(inputs.x, p.model_dim, "x", cls.__name__)
        packed = "src_segment_ids" in inputs
        metas = [c.cls.FPropMeta(c, x, segment_ids=packed) if name == "self_atten"
                 else c.cls.FPropMeta(c, x) for name, c in children.items()]
        return _meta(sum(m.flops for m in metas), inputs.copy(),
                     sum(m.num_params for m in metas), p, metas)


class EncoderToDecoderLayer(base_layer.BaseLayer):
    """Final encoder layer norm; hands the decoder stream over.

    Out: NestedMap(x=y (the decoder input), encoder_output=LN(x), src_paddings, tgt_paddings,
    tgt_labels, tgt_weights). Padded encoder positions are zeroed (they are masked anyway).
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("model_dim", 0, "Model dimension D.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        return {"ln": normalization.LayerNorm.Params().Set(input_dim=p.model_dim,
                                                           **_common(p))}

    def EncoderOutput(self, theta: NestedMap, x: tf.Tensor,
                      src_paddings: tf.Tensor) -> tf.Tensor:
        out = self.ln.FProp(theta.ln, x)
        return out * tf.cast(1.0 - src_paddings, out.dtype)[:, :, tf.newaxis]

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        inputs = _check_map(inputs, ("x", "src_paddings", "y") + _TARGET_FIELDS, self.path)
        out = NestedMap(x=tf.cast(inputs.y, self.fprop_dtype),
                        encoder_output=self.EncoderOutput(theta, inputs.x, inputs.src_paddings),
                        src_paddings=inputs.src_paddings)
        for k in _TARGET_FIELDS + _present(_SEGMENT_FIELDS, inputs):
            out[k] = inputs[k]
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        inputs = _check_map(base_layer.to_shape(inputs), ("x", "src_paddings", "y")
                            + _TARGET_FIELDS, cls.__name__)
        x = _shape3(inputs.x, p.model_dim, "x", cls.__name__)
        ln_p = cls.declare_children(p)["ln"]
        ln = ln_p.cls.FPropMeta(ln_p, x)
        out = NestedMap(x=inputs.y, encoder_output=x, src_paddings=inputs.src_paddings)
        for k in _TARGET_FIELDS + _present(_SEGMENT_FIELDS, inputs):
            out[k] = inputs[k]
        # Zeroing the padded positions keeps the layer norm's output and the [B, S, 1] mask.
        mask = base_layer.activation_bytes(x[:2].concatenate([1]), p.fprop_dtype or p.dtype)
        return _meta(ln.flops + x.num_elements(), out, ln.num_params, p, [ln],
                     saved_extra=base_layer.activation_bytes(x, p.fprop_dtype or p.dtype) + mask)


class DecoderLayer(_TransformerLayer):
    """One decoder layer on `x`: causal self-attention, attention to encoder_output, FFN."""

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        _check_dims(p, p.name or cls.__name__)
        return {"self_atten": _block_params(p, causal=True),
                "cross_atten": _block_params(p, causal=False), "ffn": _ffn_params(p)}

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        inputs = _check_map(inputs, ("x", "tgt_paddings", "encoder_output", "src_paddings"),
                            self.path)
        # Causality alone hides future (and trailing padded) target positions from real ones.
        x = self.self_atten.FProp(theta.self_atten, inputs.x, None,
                                  segment_ids=_segments(inputs, "tgt", "tgt"))
        x = self.cross_atten.FProp(theta.cross_atten, x, inputs.src_paddings,
                                   memory=tf.cast(inputs.encoder_output, self.fprop_dtype),
                                   segment_ids=_segments(inputs, "tgt", "src"))
        out = inputs.copy()
        out.x = self.ffn.FProp(theta.ffn, x)
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        inputs = _check_map(base_layer.to_shape(inputs),
                            ("x", "tgt_paddings", "encoder_output", "src_paddings"), cls.__name__)
        children = cls.declare_children(p)
        x = _shape3(inputs.x, p.model_dim, "x", cls.__name__)
        enc = _shape3(inputs.encoder_output, p.model_dim, "encoder_output", cls.__name__)
        packed = dict(segment_ids="src_segment_ids" in inputs)
        metas = [c.cls.FPropMeta(c, *shapes, **kw) for c, shapes, kw in (
            (children["self_atten"], (x,), packed), (children["cross_atten"], (x, enc), packed),
            (children["ffn"], (x,), {}))]
        # Plus encoder_output, which the cross-attention's key and value projections read.
        return _meta(sum(m.flops for m in metas), inputs.copy(),
                     sum(m.num_params for m in metas), p, metas,
                     saved_extra=base_layer.activation_bytes(enc, p.fprop_dtype or p.dtype))


class SoftmaxLayer(base_layer.BaseLayer):
    """Final layer norm, logits and the label-smoothed token loss: the network's last layer.

    Out: NestedMap(loss = smoothed cross-entropy per real target token, loss_weight = number of
    real target tokens, log_pplx = unsmoothed cross-entropy per token, accuracy = token top-1).
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("model_dim", 0, "Model dimension D.")
        p.Define("vocab_size", 0, "Vocabulary size.")
        p.Define("label_smoothing", 0.1, "Uniform label smoothing of the targets.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        return dict(
            ln=normalization.LayerNorm.Params().Set(input_dim=p.model_dim, **_common(p)),
            softmax=losses.SoftmaxCrossEntropyLayer.Params().Set(
                input_dim=p.model_dim, num_classes=p.vocab_size,
                label_smoothing=p.label_smoothing, **_common(p)))

    def Logits(self, theta: NestedMap, x: tf.Tensor) -> tf.Tensor:
        """Decoder output [B, T, D] -> float32 logits [B, T, vocab_size]."""
        return self.softmax.Logits(theta.softmax, self.ln.FProp(theta.ln, x))

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        inputs = _check_map(inputs, ("x", "tgt_labels", "tgt_weights"), self.path)
        p = self.params
        logits = self.Logits(theta, inputs.x)
        weights = tf.cast(inputs.tgt_weights, tf.float32)
        labels = tf.cast(inputs.tgt_labels, tf.int32)
        num_tokens = tf.reduce_sum(weights)
        xent = losses.xent_with_label_smoothing(logits, labels, p.label_smoothing)
        # A metric: no gradient, so its backward keeps nothing.
        nll = losses.xent_with_label_smoothing(tf.stop_gradient(logits), labels)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels),
                          tf.float32)

        def mean(v: tf.Tensor) -> tf.Tensor:
            return tf.math.divide_no_nan(tf.reduce_sum(weights * v), num_tokens)

        return NestedMap(loss=mean(xent), loss_weight=num_tokens, log_pplx=mean(nll),
                         accuracy=mean(correct))

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: Any) -> NestedMap:
        inputs = _check_map(base_layer.to_shape(inputs), ("x", "tgt_labels", "tgt_weights"),
                            cls.__name__)
        x = _shape3(inputs.x, p.model_dim, "x", cls.__name__)
        children = cls.declare_children(p)
        ln = children["ln"].cls.FPropMeta(children["ln"], x)
        sm = children["softmax"].cls.FPropMeta(children["softmax"], x)
        # Plus the unsmoothed NLL and accuracy: ~3 flops per logit.
        flops = ln.flops + sm.flops + 3 * x[:2].num_elements() * p.vocab_size
        scalar = tf.TensorShape([])
        out = NestedMap(loss=scalar, loss_weight=scalar, log_pplx=scalar, accuracy=scalar)
        # Kept for the loss's backward: the layer norm's tensors and output (the logits'
        # input), the fused cross-entropy's gradient softmax - targets (float32 [B, T, vocab]),
        # the token weights and the per-token losses they weigh (float32 [B, T]).
        tokens = x[:2].num_elements()
        saved = (layer_memory.saved_activation_bytes(ln)
                 + base_layer.activation_bytes(x, p.fprop_dtype or p.dtype)
                 + (tokens * p.vocab_size + 2 * tokens) * tf.float32.size)
        # Its forward's peak beyond that: the logits and the smoothed targets alive while the
        # fused kernel writes its gradient (and the logits while the NLL metric's kernel
        # writes one it drops).
        temporaries = 2 * tokens * p.vocab_size * tf.float32.size
        return base_layer.fprop_meta(flops, out, ln.num_params + sm.num_params, tf.float32,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=saved,
                                         weight_op_bytes=layer_memory.weight_op_bytes([ln, sm]),
                                         backward_temporary_bytes=temporaries))


def transformer_layers(vocab_size: int, model_dim: int, hidden_dim: int, num_heads: int,
                       num_encoder_layers: int, num_decoder_layers: int,
                       atten_hidden_dim: int = 0, share_embeddings: bool = True,
                       label_smoothing: float = 0.1, dropout_prob: float = 0.0,
                       fprop_dtype: tf.DType | None = None) -> list[hyperparams.Params]:
    """The layer params of an encoder-decoder Transformer, in pipeline order.

    Args:
      vocab_size: joint vocabulary size.
      model_dim: D. hidden_dim: feed-forward width (H). num_heads: A.
      num_encoder_layers, num_decoder_layers: layers of each stack.
      atten_hidden_dim: total attention depth; 0 = model_dim.
      share_embeddings: one table for source and target embeddings.
      label_smoothing: of the loss.
      dropout_prob: residual, attention, relu and embedding dropout.
      fprop_dtype: activation dtype (tf.bfloat16 for mixed precision); None = float32.
    """
    if num_encoder_layers < 1 or num_decoder_layers < 1:
        raise ValueError(f"transformer_layers: num_encoder_layers and num_decoder_layers must be "
                         f">= 1, got {num_encoder_layers} and {num_decoder_layers}.")
    if model_dim % 2:
        raise ValueError(f"transformer_layers: model_dim must be even (sinusoidal positions), "
                         f"got {model_dim}.")
    common = dict(fprop_dtype=fprop_dtype)
    layer_kw = dict(model_dim=model_dim, hidden_dim=hidden_dim, num_heads=num_heads,
                    atten_hidden_dim=atten_hidden_dim, atten_dropout_prob=dropout_prob,
                    relu_dropout_prob=dropout_prob, residual_dropout_prob=dropout_prob, **common)
    layers = [EmbeddingInputLayer.Params().Set(
        name="embed", vocab_size=vocab_size, model_dim=model_dim,
        share_embeddings=share_embeddings, dropout_prob=dropout_prob, **common)]
    layers += [EncoderLayer.Params().Set(name=f"enc_{i}", **layer_kw)
               for i in range(num_encoder_layers)]
    layers.append(EncoderToDecoderLayer.Params().Set(name="enc_to_dec", model_dim=model_dim,
                                                     **common))
    layers += [DecoderLayer.Params().Set(name=f"dec_{i}", **layer_kw)
               for i in range(num_decoder_layers)]
    layers.append(SoftmaxLayer.Params().Set(name="softmax", model_dim=model_dim,
                                            vocab_size=vocab_size,
                                            label_smoothing=label_smoothing, **common))
    return layers


def input_shapes(batch_size: int, max_source_length: int, max_target_length: int,
                 packed: bool = False) -> NestedMap:
    """Shapes of one mini-batch of `ParallelTextInput` (for FPropMeta and partitioning); with
    `packed`, also its PACKED_FIELDS."""
    src = tf.TensorShape([batch_size, max_source_length])
    tgt = tf.TensorShape([batch_size, max_target_length])
    out = NestedMap(src_ids=src, src_paddings=src, tgt_ids=tgt, tgt_paddings=tgt,
                    tgt_labels=tgt, tgt_weights=tgt)
    if packed:
        for k in PACKED_FIELDS:
            out[k] = src if k.startswith("src") else tgt
    return out


def count_params(model_dim: int, hidden_dim: int, atten_hidden_dim: int, vocab_size: int,
                 num_layers: int, share_embeddings: bool) -> int:
    """Closed-form parameter count of `transformer_layers` with L encoder and L decoder layers."""
    a = atten_hidden_dim or model_dim
    atten = 4 * model_dim * a + 3 * a + model_dim + 2 * model_dim  # Projections, biases, LN.
    ffn = 2 * model_dim * hidden_dim + hidden_dim + model_dim + 2 * model_dim
    tables = (1 if share_embeddings else 2) * vocab_size * model_dim
    softmax = model_dim * vocab_size + vocab_size + 2 * model_dim
    return (num_layers * (atten + ffn) + num_layers * (2 * atten + ffn) + tables
            + 2 * model_dim + softmax)


__all__ = ["PACKED_FIELDS", "EmbeddingInputLayer", "EncoderLayer", "EncoderToDecoderLayer",
    "DecoderLayer", "SoftmaxLayer", "transformer_layers", "positional_encoding", "input_shapes",
    "count_params"]
