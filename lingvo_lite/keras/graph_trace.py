"""A Keras functional model's layer graph as an ordered list of nodes over named tensors.

`trace_model` walks the graph as `Functional.call` runs it (Keras' `_nodes_by_depth`,
deepest first), expanding nested functional models (a keras-hub task's backbone) into
their layers; a subclassed layer or model stays one node. Every tensor gets a readable
key (the name of the layer that makes it, `_1` for its second call, `_<i>` for its i-th
output) and a static shape: dynamic dimensions (keras-hub's `(None, None)` token ids) are
fixed by `input_shape` and Keras shape inference. Weights are shared by variable, not
by layer: a node whose layer's weights all belong to earlier nodes (the same layer called
again, or a sublayer of an earlier node's layer: an LM head calling the token embedding
inside a token-and-position embedding) takes them from those nodes
(`GraphNode.weights_from`), so each weight stays one variable with the summed gradient.

Example:
    >>> import keras
    >>> inp = keras.Input((4,), name='features')
    >>> dense = keras.layers.Dense(4, name='tied')
    >>> plan = trace_model(keras.Model(inp, dense(dense(inp))))
    >>> [(n.name, n.outputs, n.weights_from) for n in plan.nodes]
    [('tied', ['tied'], None), ('tied_1', ['tied_1'], [(0, 'kernel'), (0, 'bias')])]
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.models.functional import Functional

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import graph_layer, keras_layer

__all__ = ["GraphNode", "GraphPlan", "is_functional_model", "trace_model"]

_RESERVED = {"x", "y", "sample_weight"}


def is_functional_model(model: Any) -> bool:
    """Whether `model` is a functional Keras model (whose call is its graph).

    Example:
        >>> inp = keras.Input((2,))
        >>> is_functional_model(keras.Model(inp, keras.layers.Dense(1)(inp)))
        True
    """
    return isinstance(model, Functional) and not isinstance(model, keras.Sequential)


def _runs_its_graph(model: Functional) -> bool:
    return type(model).call is Functional.call


@dataclasses.dataclass
class GraphNode:
    """One call of a Keras layer or op in the graph."""

    name: str
    layer: Any
    call: dict  # {'args': [...], 'kwargs': {...}}, tensors as graph_layer.TENSOR_REF.
    outputs: list[str]
    # A node whose layer's weights all belong to earlier nodes: for each of its layer's
    # weights (trainable, then non-trainable), (the owning node, that node's key of it).
    weights_from: list[tuple[int, str]] | None = None


@dataclasses.dataclass
class GraphPlan:
    """A functional model's graph as pipeline layers: nodes in order and tensor specs."""

    input_keys: list[str]  # The model's flat inputs (model.inputs order) as map keys.
    nodes: list[GraphNode]
    outputs: Any  # A key, a list of keys, or {output name: key}.
    specs: dict[str, tuple[tuple[int, ...], str]]  # key -> (shape without batch, dtype).
    output_names: dict[str, str]  # Map name of a dict output -> the model's name for it.
    input_struct: Any = None
    # key -> (shape without batch, dtype) of the Keras mask a tensor carries (mask_zero=True).
    masks: dict[str, tuple[tuple[int, ...], str]] = dataclasses.field(default_factory=dict)


class _Namer:
    def __init__(self) -> None:
        self.used = set(_RESERVED)

    def __call__(self, name: str) -> str:
        key = re.sub(r"\W", "_", name) or "t"
        if key[0].isdigit():
            key = "t_" + key
        base, n = key, 1
        while key in self.used or hasattr(NestedMap, key):
            key, n = f"{base}_{n}", n + 1
        self.used.add(key)
        return key


def trace_model(model: keras.Model, input_shape: Any = None) -> GraphPlan:
    """The nodes of a functional model in topological order, nested functional models
    expanded, each tensor named by the layer that makes it.

    `input_shape`: one example's shape of the inputs whose shape has dynamic dimensions
    (keras-hub's token_ids are (None, None)): a tuple for a single input, else a dict by
    input name (or a list in input order); the pipeline needs static shapes.
    """
    if not is_functional_model(model):
        raise ValueError(f"trace_model needs a functional keras.Model, got {type(model).__name__}.")
    if not _runs_its_graph(model):
        raise ValueError(
            f"PipelinedModel: {type(model).__name__} overrides call(), so its functional graph "
            "is not what it computes; pipeline a model whose call is its graph.")
    name_of = _Namer()
    keys: dict[int, str] = {}
    specs: dict[str, tuple[tuple[int, ...], str]] = {}
    masks: dict[str, tuple[tuple[int, ...], str]] = {}

    def add(tensor: Any, name: str, shape: Any = None) -> str:
        key = name_of(name)
        keys[id(tensor)] = key
        specs[key] = (tuple(tensor.shape[1:] if shape is None else shape), str(tensor.dtype))
        mask = getattr(tensor, "_keras_mask", None)
        if mask is not None:
            masks[key] = (tuple(mask.shape[1:]), str(mask.dtype))
        return key

    input_keys = [add(t, name, shape)
                  for t, name, shape in zip(model.inputs, *_input_names_and_shapes(model,
                                                                                   input_shape))]
    nodes: list[GraphNode] = []
    owner: dict[int, tuple[int, str]] = {}  # id(variable) -> (node, its key there).
    calls: dict[int, int] = {}

    def ref(value: Any) -> Any:
        if isinstance(value, keras.KerasTensor):
            return {graph_layer.TENSOR_REF: keys[id(value)]}
        if isinstance(value, (list, tuple)):
            return [ref(v) for v in value]
        if isinstance(value, dict):
            return {k: ref(v) for k, v in value.items()}
        if isinstance(value, slice):  # x[:, 0] on a symbolic tensor (BERT's pooled token).
            return {graph_layer.SLICE_REF: [value.start, value.stop, value.step]}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
            return _constant(value)
        raise ValueError(f"PipelinedModel: a node's call argument {value!r} is not a tensor or a "
                         "plain Python value; it cannot be described in the pipeline's params.")

    def walk(graph: Functional) -> None:
        for depth in sorted(graph._nodes_by_depth, reverse=True):
            for node in graph._nodes_by_depth[depth]:
                op = node.operation
                if op is None or node.is_input:
                    continue
                if any(id(t) not in keys for t in node.input_tensors):
                    continue  # A node of another model sharing this layer.
                kwargs = dict(node.arguments.kwargs)
                # Keras records the training flag of the symbolic call; Functional.call
                # overrides it with the call's own, as each node does with the pipeline's.
                kwargs.pop("training", None)
                if is_functional_model(op) and _runs_its_graph(op):
                    expand(op, node, kwargs)
                    continue
                count = calls.get(id(op), 0)
                calls[id(op)] = count + 1
                name = op.name if count == 0 else f"{op.name}_{count}"
                outs = [add(t, name if len(node.outputs) == 1 else f"{name}_{i}")
                        for i, t in enumerate(node.outputs)]
                gn = GraphNode(name, op, {"args": ref(list(node.arguments.args)),
                                          "kwargs": ref(kwargs)}, outs)
                if isinstance(op, keras.layers.Layer) and op.variables:
                    gn.weights_from = _weights_from(op, owner, nodes, len(nodes))
                nodes.append(gn)

    def expand(sub: Functional, node: Any, kwargs: dict) -> None:
        args = list(node.arguments.args)
        if not args and "inputs" in kwargs:  # backbone(inputs=...) (keras-hub's Gemma3).
            args = [kwargs.pop("inputs")]
        outer = tree.flatten(args[0]) if args else []
        # Keras passes the masks its inputs carry itself; they travel beside their tensors.
        carried = [getattr(t, "_keras_mask", None) for t in outer]
        masks = tree.flatten(kwargs.get("mask"))
        own_masks = any(m is not None for m in masks) and not (
            len(masks) == len(carried) and all(m is c for m, c in zip(masks, carried)))
        if own_masks or len(args) != 1 or set(kwargs) - {"mask"}:
            raise ValueError(
                f"PipelinedModel: nested model '{sub.name}' is called with arguments other than "
                "its inputs (and the masks they carry); call it on its inputs alone.")
        if len(outer) != len(sub.inputs):
            raise ValueError(f"PipelinedModel: nested model '{sub.name}' takes "
                             f"{len(sub.inputs)} inputs and is called with {len(outer)}.")
        for inner, value in zip(sub.inputs, outer):
            keys[id(inner)] = keys[id(value)]
        walk(sub)
        for inner, value in zip(sub.outputs, node.outputs):
            keys[id(value)] = keys[id(inner)]

    walk(model)
    struct = model._outputs_struct
    output_names: dict[str, str] = {}
    if isinstance(struct, dict):
        outputs = {}
        for name, t in struct.items():
            safe = re.sub(r"\W", "_", name)
            output_names[safe] = name
            outputs[safe] = keys[id(t)]
    elif isinstance(struct, (list, tuple)) and len(struct) != 1:
        outputs = [keys[id(t)] for t in struct]
    else:
        outputs = keys[id(tree.flatten(struct)[0])]
    plan = GraphPlan(input_keys, nodes, outputs, specs, output_names, model._inputs_struct,
                     masks)
    if any(d is None for shape, _ in specs.values() for d in shape):
        _infer_static_specs(plan)
    return plan


# The largest tensor constant a node's call may carry in the params (Gemma's and T5's are
# scalars); a larger one belongs in a layer's weights.
MAX_CONSTANT_ELEMENTS = 4096


def _constant(value: Any) -> dict:
    """A tensor constant of a node's call (keras-hub Gemma's sqrt(hidden_dim)) as data."""
    array = np.asarray(value)
    if array.size > MAX_CONSTANT_ELEMENTS:
        raise ValueError(
            f"PipelinedModel: a node's call argument is a constant tensor of shape "
            f"{array.shape} ({array.size} elements, more than {MAX_CONSTANT_ELEMENTS}); make it a "
            "layer's weight (add_weight, trainable=False) instead.")
    return {graph_layer.CONSTANT_REF: {"value": array.tolist(),
                                       "dtype": tf.as_dtype(array.dtype).name}}


def _input_names_and_shapes(model: keras.Model, input_shape: Any
                            ) -> tuple[list[str], list[Any]]:
    struct = model._inputs_struct
    names = sorted(struct) if isinstance(struct, dict) else [t.name for t in model.inputs]
    if input_shape is None:
        shapes = [None] * len(names)
    elif isinstance(input_shape, dict):
        shapes = [input_shape.get(n) for n in names]
    elif len(model.inputs) == 1 and all(isinstance(d, int) for d in input_shape):
        shapes = [input_shape]
    else:
        shapes = list(input_shape)
    for t, name, shape in zip(model.inputs, names, shapes):
        if shape is None and any(d is None for d in t.shape[1:]):
            raise ValueError(
                f"PipelinedModel: input '{name}' has shape {tuple(t.shape)}; pass "
                f"input_shape={{'{name}': (...), ...}} (one example's static shape of every input "
                "with a dynamic dimension).")
        if shape is not None and len(shape) != len(t.shape) - 1:
            raise ValueError(f"PipelinedModel: input_shape for '{name}' is {tuple(shape)}, but "
                             f"the input has shape {tuple(t.shape)} (give it without the batch).")
    return names, [None if s is None else tuple(int(d) for d in s) for s in shapes]


def _infer_static_specs(plan: GraphPlan) -> None:
    """Every tensor's static shape, by Keras shape inference from the static inputs."""
    values = {k: keras.KerasTensor((None, *plan.specs[k][0]), dtype=plan.specs[k][1])
              for k in plan.input_keys}
    for node in plan.nodes:
        call = graph_layer.fill_args(node.call, values)
        out = node.layer.compute_output_spec(*call["args"], **call["kwargs"])
        for key, tensor in zip(node.outputs, tree.flatten(out)):
            values[key] = tensor
            plan.specs[key] = (tuple(tensor.shape[1:]), str(tensor.dtype))
            if key in plan.masks:  # A mask's shape is its tensor's leading dimensions.
                rank = len(plan.masks[key][0])
                plan.masks[key] = (plan.specs[key][0][:rank], plan.masks[key][1])
            if any(d is None for d in tensor.shape[1:]):
                raise ValueError(f"PipelinedModel: tensor '{key}' has shape {tuple(tensor.shape)} "
                                 "for static inputs; the pipeline needs static shapes.")


def _weights_from(layer: keras.layers.Layer, owner: dict[int, tuple[int, str]],
                  nodes: list[GraphNode], index: int) -> list[tuple[int, str]] | None:
    """Where the weights of `layer`, called at node `index`, come from (None: it owns them
    and is recorded in `owner` as theirs)."""
    weights = layer.trainable_variables + layer.non_trainable_variables
    earlier = [owner.get(id(v)) for v in weights]
    if all(e is None for e in earlier):
        keys = keras_layer.variable_keys(layer)
        owner.update({id(v): (index, keys[id(v)]) for v in weights})
        return None
    if any(e is None for e in earlier):
        first = nodes[next(e for e in earlier if e is not None)[0]].layer
        raise ValueError(
            f"PipelinedModel: Keras layer '{layer.name}' uses weights of the earlier layer "
            f"'{first.name}' beside weights of its own; the pipeline shares weights between "
            "layers whose weights are all shared (a layer called again, or a sublayer of an "
            "earlier layer called on its own).")
    _check_shareable(layer)
    return earlier


def _check_shareable(layer: keras.layers.Layer) -> None:
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        if isinstance(sub, keras.layers.BatchNormalization) or getattr(
                sub, "_seed_generators", None):
            raise ValueError(
                f"PipelinedModel: Keras layer '{layer.name}' is called at several places and "
                f"its layer '{sub.name}' ({type(sub).__name__}) changes state in its call; "
                "only layers whose call changes no state can be shared across calls.")
