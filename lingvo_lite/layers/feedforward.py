"""The Transformer feed-forward block.

    y = x + dropout(W2 · dropout(act(W1 · LN(x) + b1)) + b2)

with the layer norm optional (`pre_layer_norm`) and the residual optional
(`add_residual`), as Lingvo's TransformerFeedForwardLayer.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, hyperparams, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, dense, dropout, normalization


class FeedForwardLayer(base_layer.BaseLayer):
    """[B, ..., input_dim] -> [B, ..., input_dim] position-wise two-layer MLP with residual.

    Children: `layer_norm` (if `pre_layer_norm`), `fflayer_1` (input_dim ->
    hidden_dim, `activation`), `relu_dropout` (if `relu_dropout_prob` > 0),
    `fflayer_2` (hidden_dim -> input_dim), `residual_dropout` (if
    `residual_dropout_prob` > 0).
    """

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_dim", 0, "Depth of the input and of the output.")
        p.Define("hidden_dim", 0, "Depth of the hidden layer (typically 4 * input_dim).")
        p.Define("activation", "RELU", "Activation after the first projection.")
        p.Define("relu_dropout_prob", 0.0, "Dropout probability after the activation.")
        p.Define("residual_dropout_prob", 0.0,
                 "Dropout probability on the block's output before the residual add.")
        p.Define("add_residual", True, "Add the (un-normalised) input to the output.")
        p.Define("pre_layer_norm", True, "Layer-normalise the input before the projections.")
        p.Define("ln_tpl", normalization.LayerNorm.Params(), "Layer norm template.")
        return p

    @classmethod
    def declare_children(cls, p: hyperparams.Params) -> dict[str, Any]:
        """Params of the children, in application order (only those that exist)."""
        if p.input_dim <= 0 or p.hidden_dim <= 0:
            raise ValueError(f"FeedForwardLayer '{p.name}': p.input_dim and p.hidden_dim must "
                             f"be > 0, got {p.input_dim} and {p.hidden_dim}.")
        for name in ("relu_dropout_prob", "residual_dropout_prob"):
            if not 0.0 <= getattr(p, name) < 1.0:
                raise ValueError(f"FeedForwardLayer '{p.name}': p.{name} must be in [0, 1), "
                                 f"got {getattr(p, name)}.")
        children = NestedMap()
        common = dict(dtype=p.dtype, fprop_dtype=p.fprop_dtype)
        if p.pre_layer_norm:
            children.layer_norm = p.ln_tpl.Copy().Set(input_dim=p.input_dim, **common)
        children.fflayer_1 = dense.ProjectionLayer.Params().Set(
            input_dim=p.input_dim, output_dim=p.hidden_dim, activation=p.activation,
            params_init=p.params_init, **common)
        if p.relu_dropout_prob > 0.0:
            children.relu_dropout = dropout.DropoutLayer.Params().Set(
                keep_prob=1.0 - p.relu_dropout_prob, **common)
        children.fflayer_2 = dense.ProjectionLayer.Params().Set(
            input_dim=p.hidden_dim, output_dim=p.input_dim, activation="NONE",
            params_init=p.params_init, **common)
        if p.residual_dropout_prob > 0.0:
            children.residual_dropout = dropout.DropoutLayer.Params().Set(
                keep_prob=1.0 - p.residual_dropout_prob, **common)
        return children

    def FProp(self, theta: NestedMap, inputs: tf.Tensor) -> tf.Tensor:
        """Applies the block to `inputs` [B, ..., input_dim]; same shape out, fprop dtype."""
        p = self.params
        inputs = tf.convert_to_tensor(inputs)
        normalization.check_input_shape(f"{type(self).__name__} '{self.path}'", inputs.shape, 2,
                                        p.input_dim, "input_dim")
        x = tf.cast(inputs, self.fprop_dtype)
        h = composite.chain_fprop(list(self.children.values()),
                                  [theta[name] for name in self.children], x)
        if p.add_residual:
            h += x
        return h

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs_shape: Any) -> NestedMap:
        shape = normalization.check_input_shape(cls.__name__, base_layer.to_shape(inputs_shape),
                                                2, p.input_dim, "input_dim")
        children = cls.declare_children(p)
        metas = composite.chain_meta(list(children.values()), shape)
        by_name = dict(zip(children.keys(), metas))
        flops = sum(m.flops for m in metas)
        num_params = sum(m.num_params for m in metas)
        dtype = p.fprop_dtype or p.dtype
        # What the backward reads: the layer norm's own tensors and its output (the first
        # projection's input; without a layer norm that input is the previous layer's output,
        # counted there), the hidden activation, and with relu dropout its mask and output
        # (the second projection's input). The second projection's output and the residual
        # sum are read by nothing.
        saved = 0
        if "layer_norm" in by_name:
            saved += (layer_memory.saved_activation_bytes(by_name["layer_norm"])
                      + base_layer.activation_bytes(shape, dtype))
        hidden = by_name["fflayer_1"]
        saved += layer_memory.saved_activation_bytes(hidden)
        if "relu_dropout" in by_name:
            saved += (layer_memory.saved_activation_bytes(by_name["relu_dropout"])
                      + hidden.out_bytes)
        if "residual_dropout" in by_name:
            saved += layer_memory.saved_activation_bytes(by_name["residual_dropout"])
        if p.add_residual:
            flops += shape.num_elements()
        return base_layer.fprop_meta(flops, shape, num_params, dtype,
                                     memory=layer_memory.MemoryRecord(
                                         saved_activation_bytes=saved,
                                         weight_op_bytes=layer_memory.weight_op_bytes(metas),
                                         saved_covers_input="layer_norm" in by_name))


__all__ = ["FeedForwardLayer"]
