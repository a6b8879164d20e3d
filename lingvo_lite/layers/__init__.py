"""The layers: each a `BaseLayer` with `Params()`, `FProp(theta, ...)` and `FPropMeta`.

>>> from lingvo_lite import layers
>>> p = layers.ProjectionLayer.Params().Set(name="proj", input_dim=4, output_dim=3)
>>> meta = layers.ProjectionLayer.FPropMeta(p, [8, 4])    # Costs from shapes alone.
>>> meta.out_shapes, int(meta.flops)                      # 2*8*4*3 matmul + 8*3 bias
((TensorShape([8, 3]),), 216)

Imported on first use; the modules (`layers.dense`, `layers.structural`, ...) can be imported
directly too.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "ProjectionLayer": "lingvo_lite.layers.dense",
    "FCLayer": "lingvo_lite.layers.dense",
    "Conv2DLayer": "lingvo_lite.layers.conv",
    "DepthwiseConv2DLayer": "lingvo_lite.layers.conv",
    "SeparableConv2DLayer": "lingvo_lite.layers.conv",
    "PoolingLayer": "lingvo_lite.layers.pooling",
    "GlobalPoolingLayer": "lingvo_lite.layers.pooling",
    "BatchNormLayer": "lingvo_lite.layers.normalization",
    "LayerNorm": "lingvo_lite.layers.normalization",
    "DropoutLayer": "lingvo_lite.layers.dropout",
    "DropPathLayer": "lingvo_lite.layers.dropout",
    "EmbeddingLayer": "lingvo_lite.layers.embedding",
    "MultiHeadedAttention": "lingvo_lite.layers.attention",
    "FeedForwardLayer": "lingvo_lite.layers.feedforward",
    "SoftmaxCrossEntropyLayer": "lingvo_lite.layers.losses",
    "SequentialLayer": "lingvo_lite.layers.composite",
    "RepeatLayer": "lingvo_lite.layers.composite",
    "FieldLayer": "lingvo_lite.layers.structural",
    "FieldsLayer": "lingvo_lite.layers.structural",
    "IdentityLayer": "lingvo_lite.layers.structural",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
