"""Pipeline layers that run one node of a Keras functional graph on a map of live tensors.

`lingvo_lite.keras.functional` turns a functional Keras model into a list of these:
each layer reads the tensors its node was called with from the boundary NestedMap
(every tensor still needed downstream, keyed by a readable name), calls the Keras
layer or op with the node's own arguments (`training`, `reverse=True`, `padding_mask=`
...), adds its outputs and drops the tensors no later node reads. So the pipeline's
partitioner may cut between any two nodes, and whatever is live at a cut (skip
connections, masks, several inputs) crosses it in the map.

- `GraphNodeLayer`: a node whose Keras layer owns its weights here (a `KerasLayer`:
  weights on the cell's device, dropout and batch norm exact under micro-batching).
  When later nodes use some of its weights (the layer called again, or one of its
  sublayers called on its own: shared or tied weights), it also puts those weights'
  values in the map (`exports`), so they travel to the cells of the later calls; their
  gradients flow back through the cuts into the one variable.
- `SharedNodeLayer`: a node whose layer's weights all come from the map (`imports`), or a
  Keras op without weights (`keras.ops.add` on symbolic tensors).
- `GraphOutputLayer`: the model's outputs (a tensor, a list or a NestedMap) as `x`,
  beside the labels `y` and `sample_weight`, for `GraphLossLayer` (graph_loss.py): the
  compiled loss (one per output, summed, as `Model.compile` does).

Example (a skip connection: 'x' is read again by the Add node, so it stays in the map):
    >>> import keras
    >>> import tensorflow as tf
    >>> from lingvo_lite.keras import functional
    >>> inp = keras.Input((3,), name='x')
    >>> out = keras.layers.Add(name='add')([inp, keras.layers.Dense(3, name='dense')(inp)])
    >>> plan = functional.trace_model(keras.Model(inp, out))
    >>> [(n.name, n.outputs) for n in plan.nodes]
    [('dense', ['dense']), ('add', ['add'])]
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src import tree
from keras.src.backend.common.masking import set_keras_mask

from lingvo_lite.core import base_layer, fprop_context, hyperparams, layer_memory
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import keras_flops, keras_layer
from lingvo_lite.keras.graph_loss import GraphLossLayer

__all__ = ["CONSTANT_REF", "GraphLossLayer", "GraphNodeLayer", "GraphOutputLayer",
           "SharedNodeLayer", "SLICE_REF", "TENSOR_REF", "check_node_call", "mask_key"]

# How a node's call arguments refer to a tensor of the map: {"__tensor__": key}, how they
# hold a Python slice: {"__slice__": [start, stop, step]}, and a tensor constant:
# {"__constant__": {"value": nested lists, "dtype": name}}.
TENSOR_REF = "__tensor__"
SLICE_REF = "__slice__"
CONSTANT_REF = "__constant__"


def mask_key(key: str) -> str:
    """The map key of the Keras mask that the tensor `key` carries (Embedding(mask_zero))."""
    return key + "__mask"


def fill_args(template: Any, live: NestedMap) -> Any:
    """The node's call arguments with each tensor reference replaced by its value."""
    if isinstance(template, dict):
        if set(template) == {TENSOR_REF}:
            return live[template[TENSOR_REF]]
        if set(template) == {SLICE_REF}:
            return slice(*template[SLICE_REF])
        if set(template) == {CONSTANT_REF}:
            return tf.constant(template[CONSTANT_REF]["value"], template[CONSTANT_REF]["dtype"])
        return {k: fill_args(v, live) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(fill_args(v, live) for v in template)
    return template


def tensor_keys(template: Any) -> list[str]:
    """Keys of the map tensors a call template reads, in order."""
    if isinstance(template, dict):
        if set(template) == {TENSOR_REF}:
            return [template[TENSOR_REF]]
        return [k for v in template.values() for k in tensor_keys(v)]
    if isinstance(template, (list, tuple)):
        return [k for v in template for k in tensor_keys(v)]
    return []


def _node_params(p: hyperparams.InstantiableParams) -> hyperparams.InstantiableParams:
    p.Define("call", None, "The node's call: {'args': [...], 'kwargs': {...}}, tensors as "
             "{'__tensor__': key} references to the map.")
    p.Define("outputs", [], "Map keys of the node's outputs (its flattened outputs).")
    p.Define("specs", {}, "{key: [shape without batch, dtype]} of the tensors the node reads "
             "and writes (building, costing).")
    p.Define("drop", [], "Map keys no later layer reads: removed after this node (with their "
             "masks).")
    p.Define("masks_in", [], "Keys of inputs that carry a Keras mask (from the map).")
    p.Define("masks_out", [], "Keys of outputs whose Keras mask goes into the map.")
    return p


def _call_node(layer: Any, p: hyperparams.Params, live: NestedMap, trainable: list[Any],
               non_trainable: list[Any], training: bool) -> tuple[list[Any], list[bool]]:
    """Flat outputs of the node's call on `live` with the given weight values, and which
    non-trainable weights the call changed."""
    for key in p.masks_in:  # Masks cross cuts beside their tensors, as map entries.
        set_keras_mask(live[key], live[mask_key(key)])
    call = fill_args(p.call, live)
    args, kwargs = list(call["args"]), dict(call["kwargs"])
    if not isinstance(layer, keras.layers.Layer):
        return tree.flatten(layer(*args, **kwargs)), []
    if "training" in getattr(layer, "_call_context_args", ()):
        kwargs["training"] = training
    mapping = (list(zip(layer.trainable_variables, trainable))
               + list(zip(layer.non_trainable_variables, non_trainable)))
    with keras_backend.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        before = [scope.get_current_value(v) for v in layer.non_trainable_variables]
        outputs = layer(*args, **kwargs)
        after = [scope.get_current_value(v) for v in layer.non_trainable_variables]
        if scope.losses:
            raise ValueError(keras_layer.added_loss_error(layer))
    return tree.flatten(outputs), [a is not b for a, b in zip(after, before)]


def check_node_call(p: hyperparams.Params, specs: dict[str, Any]) -> None:
    """Traces the node's training call once (nothing runs), so that a layer which adds a
    loss (add_loss) or draws random numbers outside Keras' seed generators is refused in
    one line when the model is planned, not at its first step.

    `specs`: {key: (shape without batch, dtype)} of what the node reads, masks included.
    """
    layer = keras_layer.live_layer_of(p)
    if not isinstance(layer, keras.layers.Layer):
        return
    keys = list(specs)

    def training_call(*tensors: tf.Tensor) -> None:
        live = NestedMap(dict(zip(keys, tensors)))
        with keras_layer.refusing_raw_random(layer):
            _call_node(layer, p, live, [v.value for v in layer.trainable_variables],
                       [v.value for v in layer.non_trainable_variables], training=True)

    tensor_specs = [tf.TensorSpec([None, *shape], dtype) for shape, dtype in specs.values()]
    tf.function(training_call, autograph=False).get_concrete_function(*tensor_specs)


def _next_map(live: NestedMap, p: hyperparams.Params, outputs: list[Any],
              extra: dict[str, Any] | None = None) -> NestedMap:
    if len(outputs) != len(p.outputs):
        raise ValueError(f"Keras node returned {len(outputs)} tensors, its graph {len(p.outputs)}.")
    drop = set(p.drop) | {mask_key(k) for k in p.drop}
    out = NestedMap({k: v for k, v in live.items() if k not in drop})
    for key, value in zip(p.outputs, outputs):
        if key not in drop:
            out[key] = value
            if key in p.masks_out:
                out[mask_key(key)] = keras_backend.get_keras_mask(value)
    out.update(extra or {})
    return out


def _batch_of(p: hyperparams.Params, inputs: NestedMap) -> Any:
    """The batch size of the tensors a node reads (the map also holds shared weights, whose
    first dimension is not the batch)."""
    reads = tensor_keys(p.call)
    if reads:
        return inputs[reads[0]][0]
    return next(iter(inputs.values()))[0] if inputs else 1


def _shape_meta(p: hyperparams.Params, inputs: NestedMap, extra: dict[str, Any]) -> NestedMap:
    batch = _batch_of(p, inputs)
    drop = set(p.drop) | {mask_key(k) for k in p.drop}
    out = NestedMap({k: v for k, v in inputs.items() if k not in drop})
    for key in p.outputs:
        if key not in drop:
            out[key] = tf.TensorShape([batch, *p.specs[key][0]])
            if key in p.masks_out:
                out[mask_key(key)] = tf.TensorShape([batch, *p.specs[mask_key(key)][0]])
    out.update(extra)
    return out


@functools.lru_cache(maxsize=1024)
def _config_node_cost(p_json: str, batch: int) -> tuple[float, int, int]:
    """`_node_cost` of a node rebuilt from its JSON (built in a graph: nothing allocated)."""
    d = json.loads(p_json)
    with tf.Graph().as_default():
        return _node_cost(_build(d["keras_layer"], d["call"], d["specs"]), d, batch)


def _node_cost(layer: Any, d: dict, batch: int) -> tuple[float, int, int]:
    """(flops, params, non-trainable params) of one node's layer on a batch."""
    if not isinstance(layer, keras.layers.Layer):
        flops = float(sum(math.prod([batch, *d["specs"][k][0]]) for k in d["outputs"]))
        return flops, 0, 0
    in_keys = tensor_keys(d["call"])
    shapes = [[batch, *d["specs"][k][0]] for k in in_keys]
    out_shape = [batch, *d["specs"][d["outputs"][0]][0]]
    flops = None
    if d["call"]["kwargs"].get("reverse") is True and isinstance(
            layer, keras.layers.Embedding):
        # A tied embedding used as the output projection (GPT-2's LM head): a matmul.
        flops = 2.0 * math.prod(out_shape) * shapes[0][-1]
    elif len(in_keys) == 1 and d["specs"][in_keys[0]][1].startswith("float"):
        flops, _ = keras_flops.layer_flops(layer, shapes, out_shape)
    else:
        flops = keras_flops.formula_flops(layer, shapes, out_shape)
        if flops is None:
            flops = _measured_flops(layer, d["call"], d["specs"], batch)
    params = sum(math.prod(v.shape) for v in layer.weights)
    non_trainable = sum(math.prod(v.shape) for v in layer.non_trainable_weights)
    return float(flops), int(params), int(non_trainable)


def _measured_flops(layer: Any, call: Any, specs: dict, batch: int) -> float:
    keys = list(dict.fromkeys(tensor_keys(call)))
    tensor_specs = [tf.TensorSpec([batch, *specs[k][0]], specs[k][1]) for k in keys]

    def run(*xs: tf.Tensor) -> Any:
        filled = fill_args(call, dict(zip(keys, xs)))
        return layer(*filled["args"], **filled["kwargs"])

    try:
        graph = tf.function(run, autograph=False).get_concrete_function(*tensor_specs).graph
        options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
        options["output"] = "none"
        flops = float(tf.compat.v1.profiler.profile(graph, options=options).total_float_ops)
    except (ValueError, TypeError, NotImplementedError):
        flops = 0.0
    return flops or float(sum(math.prod(s.shape) for s in tensor_specs))


def _node_layer(p: hyperparams.Params) -> Any:
    """The node's Keras layer (or op): the user's object, else rebuilt in a graph (only its
    structure is used: shapes, weight keys)."""
    live = keras_layer.live_layer_of(p)
    if live is not None:
        return live
    with tf.Graph().as_default():
        return _build(p.keras_layer, p.call, p.specs)


def _build(config: Any, call: Any, specs: dict) -> Any:
    """A fresh Keras layer (or op) from its config, built for the node's input specs."""
    layer = keras_layer.deserialize(config)
    if isinstance(layer, keras.layers.Layer) and not layer.built:
        symbolic = {k: keras.KerasTensor([None, *s], d) for k, (s, d) in specs.items()}
        filled = fill_args(call, symbolic)
        layer(*filled["args"], **filled["kwargs"])
    return layer


def _cost_meta(p: hyperparams.Params, inputs: NestedMap, extra: dict[str, Any],
               own_weights: bool) -> NestedMap:
    out = _shape_meta(p, inputs, extra)
    batch = int(_batch_of(p, inputs))
    d = dict(keras_layer=p.keras_layer, call=p.call, specs=p.specs, outputs=p.outputs)
    live = keras_layer.live_layer_of(p)
    if live is not None:
        flops, params, non_trainable = _node_cost(live, d, batch)
    else:
        flops, params, non_trainable = _config_node_cost(
            json.dumps(d, sort_keys=True, default=str), batch)
    if not own_weights:
        params = non_trainable = 0
    return base_layer.fprop_meta(flops, out, params, p.fprop_dtype or p.dtype,
                                 non_trainable_params=non_trainable,
                                 memory=layer_memory.MemoryRecord(weight_op_bytes=0))


class GraphNodeLayer(keras_layer.KerasLayer):
    """A functional-graph node whose Keras layer's weights live here; see the module doc."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = _node_params(super().Params())
        p.Define("exports", {},
                 "{weight key: map key}: weights later nodes use (the layer or a sublayer "
                 "called again), whose values this node adds to the map.")
        return p

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        p = self.params
        ctx = fprop_context.current()
        trainable = [theta[k] for k in self._trainable_keys]
        non_trainable = [theta[k] for k in self._non_trainable_keys]
        with keras_layer.Recording(keras_layer.Recorder(ctx)) as rec, \
                keras_layer.refusing_raw_random(self._layer,
                                                check=ctx.training and self._check_random()):
            outputs, changed = _call_node(self._layer, p, inputs, trainable, non_trainable,
                                          ctx.training)
        for key, was_changed in zip(self._non_trainable_keys, changed):
            if was_changed and key not in self._handled:
                raise ValueError(keras_layer.state_error(self._layer, key))
        if ctx.training and ctx.updates is not None and (self._batch_norms or self._random):
            moments = NestedMap({f"bn_{j}": rec.moments[id(bn)]
                                 for j, (bn, _, _) in enumerate(self._batch_norms)
                                 if id(bn) in rec.moments})
            ctx.updates.add(self, NestedMap(moments=moments, draws=tf.constant(1.0)))
        # An identity read on this cell's device: later cells receive the value, and its
        # gradient from every later call comes back through the cuts to this variable.
        extra = {map_key: tf.identity(theta[key]) for key, map_key in p.exports.items()}
        return _next_map(inputs, p, outputs, extra)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: NestedMap) -> NestedMap:
        extra = {}
        if p.exports:
            layer = _node_layer(p)
            keys = keras_layer.variable_keys(layer)
            shapes = {keys[id(v)]: tf.TensorShape(v.shape)
                      for v in layer.trainable_variables + layer.non_trainable_variables}
            extra = {map_key: shapes[key] for key, map_key in p.exports.items()}
        return _cost_meta(p, inputs, extra, own_weights=True)


class SharedNodeLayer(base_layer.BaseLayer):
    """A node that calls a Keras layer with weights from the map (a later call of a shared
    layer), or a Keras op without weights; see the module doc."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = _node_params(super().Params())
        p.Define("keras_layer", None, "The Keras layer's (or op's) serialized config.")
        p.Define("live_layer", None, "The user's Keras layer (or op) object (a LiveLayer), "
                 "run as it is unless keras_layer is overridden.")
        p.Define("imports", [],
                 "Map keys of the layer's weights (trainable, then non-trainable), exported "
                 "by the earlier nodes that own them.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        p = self.params
        layer = _node_layer(p)  # Its weights come from the map.
        object.__setattr__(self, "_layer", layer)
        self._weight_keys: tuple[list[str], list[str]] = ([], [])
        if isinstance(layer, keras.layers.Layer):
            count, total = len(layer.trainable_variables), len(layer.variables)
            if total != len(p.imports):
                raise ValueError(f"{self.path}: Keras layer '{layer.name}' has {total} "
                                 f"variables, p.imports {len(p.imports)}.")
            self._weight_keys = (list(p.imports[:count]), list(p.imports[count:]))

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        del theta  # No weights of its own.
        trainable = [inputs[k] for k in self._weight_keys[0]]
        non_trainable = [inputs[k] for k in self._weight_keys[1]]
        outputs, _ = _call_node(self._layer, self.params, inputs, trainable, non_trainable,
                                fprop_context.current().training)
        return _next_map(inputs, self.params, outputs)

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: NestedMap) -> NestedMap:
        return _cost_meta(p, inputs, {}, own_weights=False)


def pack_outputs(structure: Any, live: Any) -> Any:
    """The model's outputs from the map: a key -> its tensor; a list -> a list; a dict of
    {name: key} -> a NestedMap by name."""
    if isinstance(structure, str):
        return live[structure]
    if isinstance(structure, dict):
        return NestedMap({name: pack_outputs(key, live) for name, key in structure.items()})
    return [pack_outputs(key, live) for key in structure]


class GraphOutputLayer(base_layer.BaseLayer):
    """The map's model outputs as NestedMap(x=outputs[, y, sample_weight])."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("outputs", None, "Output key, list of keys, or {output name: key}.")
        p.Define("output_mask", None, "Map key of the one output's Keras mask, if it has one.")
        return p

    def FProp(self, theta: NestedMap, inputs: NestedMap) -> NestedMap:
        del theta
        out = NestedMap(x=pack_outputs(self.params.outputs, inputs))
        if self.params.output_mask:
            out.x_mask = inputs[self.params.output_mask]
        for key in ("y", "sample_weight", "loss_scale", "num_micro_batches"):
            if inputs.get(key) is not None:
                out[key] = inputs[key]
        return out

    @classmethod
    def FPropMeta(cls, p: hyperparams.Params, inputs: NestedMap) -> NestedMap:
        out = NestedMap(x=pack_outputs(p.outputs, inputs))
        if p.output_mask:
            out.x_mask = inputs[p.output_mask]
        return base_layer.fprop_meta(0.0, out, 0, p.dtype)
