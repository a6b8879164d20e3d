"""Embeddings a functional model looks up from its inputs (and lookups), run before the
pipeline.

Keras hands a looked-up embedding's gradient to the optimizer as `IndexedSlices`, one row per
token occurrence, and optimizers that square the gradient (Adam, RMSprop, ...) square each
row separately; the pipeline sums every weight's gradient densely. So a trainable
`keras.layers.Embedding` (keras-hub's `ReversibleEmbedding` included) that reads only model
inputs and is called once runs here instead, on cell 0's device, before the batch is split:
its output enters the pipeline as an input, and its gradient is taken as Keras takes it, from
the pipeline's gradient of that input (the layer-list `PipelinedModel` does the same for a
leading Embedding). Any optimizer then trains it exactly. Other trainable embeddings (called
on computed tensors, or shared) stay in the pipeline, and with an optimizer other than SGD
they are refused in one line (`check_sparse_gradients`); a tied embedding also used densely
(GPT-2's `reverse=True` LM head) gets a dense gradient in Keras too and trains exactly.
Lookups from raw inputs (StringLookup, IntegerLookup, TextVectorization, Hashing, ...) run here
too, so an embedding of looked-up ids is a front embedding and no string enters a cell.

Example:
    >>> import keras
    >>> from lingvo_lite.keras.graph_trace import trace_model
    >>> ids = keras.Input((4,), dtype='int32', name='ids')
    >>> h = keras.layers.Embedding(10, 3, name='embed')(ids)
    >>> pipe_plan, front = split(trace_model(keras.Model(ids, keras.layers.Dense(2)(h))))
    >>> [n.name for n in front], pipe_plan.input_keys
    (['embed'], ['embed'])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import graph_layer, keras_layer
from lingvo_lite.keras.graph_trace import GraphNode, GraphPlan

__all__ = ["FrontEmbeddings", "check_sparse_gradients", "refuse_summed_embeddings", "split"]


# Lookups from raw inputs (strings, ids) to ids: they run with the front embeddings, on the
# host side of the pipeline, so no string tensor enters a cell.
LOOKUPS = (keras.layers.StringLookup, keras.layers.IntegerLookup, keras.layers.TextVectorization,
           keras.layers.Hashing, keras.layers.HashedCrossing, keras.layers.Discretization)


def _runs_in_front(plan: GraphPlan, i: int, front_keys: set[str]) -> bool:
    """Whether node `i` runs before the pipeline: a trainable embedding or a lookup, called
    once, reading only the model's inputs and outputs of earlier front nodes."""
    node = plan.nodes[i]
    reads = graph_layer.tensor_keys(node.call)
    if not reads or not set(reads) <= front_keys or len(node.outputs) != 1:
        return False
    if node.weights_from is not None or any(
            owner == i for other in plan.nodes for owner, _ in other.weights_from or []) or any(
            other is not node and other.layer is node.layer for other in plan.nodes):
        return False
    if isinstance(node.layer, LOOKUPS):
        return not node.layer.trainable_variables
    return (isinstance(node.layer, keras.layers.Embedding) and node.layer.trainable
            and node.call["kwargs"].get("reverse") is not True)


def split(plan: GraphPlan) -> tuple[GraphPlan, list[GraphNode]]:
    """(the plan the pipeline runs, the embedding and lookup nodes that run before it)."""
    front: list[int] = []
    front_keys = set(plan.input_keys)
    for i, node in enumerate(plan.nodes):
        if _runs_in_front(plan, i, front_keys):
            front.append(i)
            front_keys.update(node.outputs)
    if not front:
        return plan, []
    shift = {i: sum(f < i for f in front) for i in range(len(plan.nodes))}
    nodes = [dataclasses.replace(n, weights_from=None if n.weights_from is None else
                                 [(owner - shift[owner], key) for owner, key in n.weights_from])
             for i, n in enumerate(plan.nodes) if i not in front]
    read = {k for n in nodes for k in graph_layer.tensor_keys(n.call)}
    read |= set(graph_layer.tensor_keys({"outputs": _refs(plan.outputs)}))
    inputs = [k for k in plan.input_keys if k in read] + [
        plan.nodes[i].outputs[0] for i in front if plan.nodes[i].outputs[0] in read]
    return (dataclasses.replace(plan, nodes=nodes, input_keys=inputs),
            [plan.nodes[i] for i in front])


def _refs(outputs: Any) -> Any:
    if isinstance(outputs, str):
        return {graph_layer.TENSOR_REF: outputs}
    if isinstance(outputs, dict):
        return [_refs(v) for v in outputs.values()]
    return [_refs(v) for v in outputs]


class FrontEmbeddings:
    """The model's own front embedding layers, their variables moved to `device`."""

    def __init__(self, nodes: list[GraphNode], plan: GraphPlan, device: str) -> None:
        self.nodes = nodes
        self.masked = {n.outputs[0] for n in nodes if n.outputs[0] in plan.masks}
        self.layers = [node.layer for node in nodes]
        for layer in self.layers:
            keras_layer.adopt_layer_variables(layer, device)
        self.device = device

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for layer in self.layers for v in layer.trainable_variables]

    def apply(self, inputs: NestedMap, keys: list[str]) -> NestedMap:
        """The pipeline's input map (`keys`, with their masks) from the model's inputs."""
        live = NestedMap(inputs)
        with tf.device(self.device):
            for node, layer in zip(self.nodes, self.layers):
                call = graph_layer.fill_args(node.call, live)
                out = live[node.outputs[0]] = layer(*call["args"], **call["kwargs"])
                if node.outputs[0] in self.masked:
                    live[graph_layer.mask_key(node.outputs[0])] = get_keras_mask(out)
        out = NestedMap({k: live[k] for k in keys})
        out.update({graph_layer.mask_key(k): live[graph_layer.mask_key(k)]
                    for k in keys if k in self.masked})
        return out

    def gradients(self, tape: tf.GradientTape, inputs: NestedMap,
                  input_grads: NestedMap) -> dict[int, Any]:
        """id(variable.value) -> its gradient, as Keras takes it (IndexedSlices for a lookup)."""
        keys = [n.outputs[0] for n in self.nodes if n.outputs[0] in input_grads]
        variables = self.trainable_variables
        with tf.device(self.device):
            grads = tape.gradient([inputs[k] for k in keys], [v.value for v in variables],
                                  output_gradients=[input_grads[k] for k in keys])
        return {id(v.value): g for v, g in zip(variables, grads)}


def check_sparse_gradients(plan: GraphPlan, optimizer: keras.optimizers.Optimizer) -> None:
    """Refuses (one line) a non-SGD optimizer with a trainable embedding that is only looked
    up inside the pipeline (see the module doc)."""
    dense = {id(n.layer) for n in plan.nodes if n.call["kwargs"].get("reverse") is True}
    refuse_summed_embeddings(
        [n.layer for n in plan.nodes
         if isinstance(n.layer, keras.layers.Layer) and id(n.layer) not in dense],
        optimizer, "sums the gradient of an embedding it runs, and runs those not looked up "
        "from the model's inputs", "use SGD or freeze the embedding (trainable=False)")


def refuse_summed_embeddings(layers: list[keras.layers.Layer],
                             optimizer: keras.optimizers.Optimizer, how: str, fix: str) -> None:
    """Refuses (one line) a non-SGD optimizer with a trainable Embedding in (or inside) `layers`.

    Keras hands an embedding's gradient to the optimizer as IndexedSlices with one row per
    occurrence of a token, and an optimizer that squares the gradient (Adam, RMSprop, ...)
    squares each occurrence separately; the pipeline's gradient of an embedding it runs is the
    dense sum over micro-batches, which only a linear update (SGD) treats the same. `how` says
    which embeddings the pipeline sums, `fix` what the user can do.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(inner, keras.optimizers.SGD):
        return
    for layer in layers:
        for sub in layer._flatten_layers(include_self=True, recursive=True):
            if isinstance(sub, keras.layers.Embedding) and sub.trainable:
                raise ValueError(
                    f"PipelinedModel.compile: optimizer {type(inner).__name__} with the "
                    f"trainable Embedding '{sub.name}' would train differently from plain "
                    "Keras (which squares each token occurrence's gradient separately; the "
                    f"pipeline {how}): {fix}.")
