"""Keras functional models on the pipeline, cut automatically between graph nodes.

`PipelinedModel(model, num_cells=K, ...)` with a functional `keras.Model` (a keras-hub
task model wrapping a functional backbone included) lands here. `trace_model` walks its
layer graph in topological order (Keras' `_nodes_by_depth`, as `Functional.call` runs
it), expanding nested functional models into their layers (a subclassed layer stays
one opaque layer); each node becomes one pipeline layer (graph_layer.py), so the
partitioner places the K-1 cuts by cost, and every tensor live across a cut (skip
connections, padding masks, several inputs) crosses it in the boundary NestedMap.

A weight used at several nodes (a layer called again, or a sublayer called on its own:
GPT-2's token embedding reused as the output projection, OPT's inside its token-and-position
embedding) keeps one variable, on the device of its first use; that node also sends the
weight's value down the pipeline in the map, and each later use reads it there, so the
gradient contributions of every use flow back through the cuts and are summed into the
one variable by the same backward that carries activations.
A trainable embedding looked up from the model's inputs (BERT's token and segment
embeddings) runs before the pipeline instead (front_embeddings.py), so that Adam and
other optimizers get Keras' per-occurrence gradient and train it exactly.

Each node runs the model's own layer object (no config round trip: layer classes need no
`build()`, registration or working `get_config()`), and the model's variables read and write
the pipeline's: training trains the model itself (`self.plain` is the user's model).

`FunctionalPipelinedModel` trains it with `compile`/`fit` (several inputs and outputs as
the model declares them: dicts or lists; one loss per output; Keras masks carried beside
their tensors; mixed precision), `predict` returns the model's outputs, and
`get_weights`/`set_weights`/`save_weights` use the original model's layout.
`partition_report()` adds the tensors each cut carries and their bytes per micro-batch to
the partition table.

Example (2 logical CPUs stand in for 2 accelerators; configure them before any TF op):
    >>> import keras
    >>> from lingvo_lite.core import devices
    >>> from lingvo_lite.keras import PipelinedModel
    >>> _ = devices.configure_logical_cpus(2)
    >>> inp = keras.Input((8,), name='features')
    >>> h = keras.layers.Dense(16, activation='relu', name='hidden')(inp)
    >>> skip = keras.layers.Concatenate(name='skip')([inp, keras.layers.Dense(16, name='deep')(h)])
    >>> model = keras.Model(inp, keras.layers.Dense(3, name='logits')(skip))
    >>> pipelined = PipelinedModel(model, num_cells=2, num_micro_batches=2)
    >>> pipelined.compile(optimizer='sgd', loss='mse')
    >>> 'features' in pipelined.partition_report()   # the skip input crosses the cut
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.backend.common.masking import set_keras_mask

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import (
    front_embeddings,
    graph_layer,
    keras_buckets,
    keras_layer,
    weight_penalties,
)
from lingvo_lite.keras.graph_trace import GraphPlan, is_functional_model, trace_model
from lingvo_lite.keras.pipeline_settings import PipelineSettings
from lingvo_lite.keras.pipelined_model import PipelinedModel, register_model_kind
from lingvo_lite.keras.untracked import Untracked
from lingvo_lite.pipeline import pipelining_layer

__all__ = ["FunctionalPipelinedModel", "GraphPlan", "cut_report", "functional_pipeline_params",
           "is_functional_model", "trace_model"]


def _weight_map_key(plan: GraphPlan, node: int, key: str) -> str:
    """The map key under which node `node` exports its weight `key` to later nodes."""
    return f"w_{plan.nodes[node].name}__{key}"


def _exports(plan: GraphPlan) -> dict[int, list[str]]:
    """The weight keys each node exports (read by later nodes that share them), in order."""
    exports: dict[int, list[str]] = {}
    for node in plan.nodes:
        for owner, key in node.weights_from or []:
            if key not in exports.setdefault(owner, []):
                exports[owner].append(key)
    return exports


def _last_uses(plan: GraphPlan) -> dict[str, int]:
    """The index of the last pipeline layer reading each map key (len(nodes): the outputs)."""
    last = {key: -1 for key in plan.specs}
    for i, node in enumerate(plan.nodes):
        for key in graph_layer.tensor_keys(node.call):
            last[key] = i
        for owner, key in node.weights_from or []:
            last[_weight_map_key(plan, owner, key)] = i
    for key in tree.flatten(plan.outputs):
        last[key] = len(plan.nodes)
    return last


def layer_params(plan: GraphPlan, live: bool = False) -> list[Any]:
    """The pipeline layers of `plan`: one per node, then the outputs, then the loss.

    `live`: each node runs the user's layer object (PipelinedModel); otherwise it is rebuilt
    from its config where the layer is instantiated (a registered task's Params).
    """
    exports = _exports(plan)
    last = _last_uses(plan)
    drops: dict[int, list[str]] = {}
    for key, i in last.items():
        if i < len(plan.nodes):
            drops.setdefault(max(i, 0), []).append(key)
    produced_at = {key: i for i, n in enumerate(plan.nodes) for key in n.outputs}
    for key, i in last.items():  # Outputs nobody reads leave at once.
        if i < produced_at.get(key, -1):
            drops.setdefault(produced_at[key], []).append(key)
    params = []
    for i, node in enumerate(plan.nodes):
        reads = graph_layer.tensor_keys(node.call)
        specs = {k: [list(plan.specs[k][0]), plan.specs[k][1]] for k in reads + node.outputs}
        specs.update({graph_layer.mask_key(k): [list(plan.masks[k][0]), plan.masks[k][1]]
                      for k in node.outputs if k in plan.masks})
        if live:
            handle = keras_layer.LiveLayer(node.layer)
            layer = dict(keras_layer=handle.description, live_layer=handle)
        else:
            layer = dict(keras_layer=keras_layer.serialize(node.layer))
        if node.weights_from is None and isinstance(node.layer, keras.layers.Layer):
            weight_penalties.check_regularizers(node.layer, allow_weight_regularizers=True)
            keras_layer.check_supported(node.layer)
            p = graph_layer.GraphNodeLayer.Params().Set(
                exports={key: _weight_map_key(plan, i, key) for key in exports.get(i, [])},
                input_shape=list(plan.specs[reads[0]][0]) if reads else [1], **layer)
        else:
            p = graph_layer.SharedNodeLayer.Params().Set(
                imports=[_weight_map_key(plan, owner, key)
                         for owner, key in node.weights_from or []], **layer)
        masks_in = [k for k in dict.fromkeys(reads) if k in plan.masks]
        params.append(p.Set(name=f"node_{i}_{node.name}", call=node.call, outputs=node.outputs,
                            specs=specs, drop=sorted(set(drops.get(i, []))),
                            masks_in=masks_in,
                            masks_out=[k for k in node.outputs if k in plan.masks]))
        if live and node.weights_from is None:
            read_specs = {k: plan.specs[k] for k in dict.fromkeys(reads)}
            read_specs.update({graph_layer.mask_key(k): plan.masks[k] for k in masks_in})
            graph_layer.check_node_call(p, read_specs)
    masked = [k for k in tree.flatten(plan.outputs) if k in plan.masks]
    if masked and not isinstance(plan.outputs, str):
        raise ValueError(f"PipelinedModel: outputs {masked} carry Keras masks; masked outputs "
                         "are supported for a model with one output only.")
    params.append(graph_layer.GraphOutputLayer.Params().Set(
        name="outputs", outputs=plan.outputs,
        output_mask=graph_layer.mask_key(plan.outputs) if masked else None))
    params.append(graph_layer.GraphLossLayer.Params().Set(name="loss"))
    return params


def functional_pipeline_params(model: keras.Model, num_cells: int = 1,
                               cost_batch_size: int = 1, name: str = "keras_pipeline",
                               plan: GraphPlan | None = None, live: bool = False,
                               **pipeline: Any) -> Any:
    """PipeliningLayer params of a functional model's nodes, its outputs and a loss layer.

    `live`: the nodes run the model's own layer objects (see `layer_params`).
    `pipeline`: the other `PipeliningLayer.Params()` fields (num_micro_batches, remat,
    schedule, placement, partition_method, split_points, serial_devices, ...).
    """
    if plan is None:
        plan = trace_model(model)
    with tf.Graph().as_default():
        layers = layer_params(plan, live=live)
    shapes = NestedMap({k: tf.TensorShape([cost_batch_size, *plan.specs[k][0]])
                        for k in plan.input_keys})
    shapes.update({graph_layer.mask_key(k): tf.TensorShape([cost_batch_size, *plan.masks[k][0]])
                   for k in plan.input_keys if k in plan.masks})  # A front embedding's mask.
    return pipelining_layer.PipeliningLayer.Params().Set(
        name=name, layers=layers, num_cells=num_cells, input_shapes=shapes, **pipeline)


def cut_report(pipeline: pipelining_layer.PipeliningLayer, plan: GraphPlan,
               micro_batch_size: int) -> str:
    """The tensors each cut carries (one micro-batch of `micro_batch_size` examples)."""
    ranges = pipeline.partition.cell_layer_ranges
    live: dict[str, tuple[Any, ...]] = {k: plan.specs[k] for k in plan.input_keys}
    live.update({graph_layer.mask_key(k): plan.masks[k] for k in plan.input_keys
                 if k in plan.masks})
    lines = [f"Tensors crossing each cut (bytes per micro-batch of {micro_batch_size}; the "
             "labels y and any sample_weight travel too):"]
    for i, layer in enumerate(pipeline.layers[:-2]):
        p, name = layer.params, pipeline.params.layers[i].name
        live.update({k: plan.specs[k] for k in p.outputs})
        live.update({graph_layer.mask_key(k): plan.masks[k] for k in p.masks_out})
        if isinstance(layer, graph_layer.GraphNodeLayer):
            for key, map_key in p.exports.items():
                v = layer.theta[key]
                live[map_key] = (None, list(v.shape), v.dtype.name)
        for k in p.drop:
            live.pop(k, None)
            live.pop(graph_layer.mask_key(k), None)
        for k in range(len(ranges) - 1):
            if ranges[k][1] - 1 != i:
                continue
            lines.append(f" cut {k} -> {k + 1} (after {name}):")
            total = 0
            for key in sorted(live):
                spec = live[key]
                if spec[0] is None:  # A shared layer's weight: no batch dimension.
                    shape, dtype, what = spec[1], spec[2], "weight"
                else:
                    shape, dtype, what = [micro_batch_size, *spec[0]], spec[1], "tensor"
                size = math.prod(shape) * tf.as_dtype(dtype).size
                total += size
                lines.append(f"   {key:32s} {what:6s} {str(shape):20s} {dtype:8s} {size:>10,d}")
            lines.append(f"   {'total':32s} {'':6s} {'':20s} {'':8s} {total:>10,d}")
    return "\n".join(lines)


@register_model_kind(is_functional_model)
@keras.saving.register_keras_serializable(package="lingvo_lite")
class FunctionalPipelinedModel(PipelinedModel):
    """`PipelinedModel` of a functional Keras model (see the module doc); made by
    `PipelinedModel(model, ...)`. `plain` is the user's model, whose variables now read and
    write the pipeline's (each on its cell's device)."""

    def __init__(self, layers: keras.Model, input_shape: Any = None, *,
                 cost_batch_size: int = 1, input_buckets: Sequence[Any] | None = None,
                 name: str | None = None, **settings: Any) -> None:
        keras.Model.__init__(self, name=name)
        model = layers
        settings = PipelineSettings.of(settings).as_dict()
        self._config = dict(input_shape=input_shape, cost_batch_size=cost_batch_size,
                            input_buckets=input_buckets, **settings)
        # Buckets: built, traced for costs and planned for the largest (keras_buckets.py).
        names = keras_buckets.functional_input_names(model)
        declared = input_buckets and keras_buckets.normalize(input_buckets, names)
        if declared:
            input_shape = input_shape or keras_buckets.example_shapes(
                keras_buckets.largest(declared))
            cost_batch_size = next(iter(keras_buckets.largest(declared).values()))[0]
        self.plain = model
        self._hidden = Untracked(batch_size=None, compiled=None, deferred=None, buckets=declared,
                               input_names=names)
        # Shapes from the first batch only where the model's inputs leave some unknown;
        # () builds now for the model's own static shapes.
        dynamic = any(d is None for t in model.inputs for d in t.shape[1:])
        self._build_when_shaped(
            input_shape if input_shape is not None or dynamic else (),
            lambda shape: self._build(model, shape or None, cost_batch_size, settings))

    def _build(self, model: keras.Model, input_shape: Any, cost_batch_size: int,
               settings: dict[str, Any]) -> None:
        """Traces, plans and places the pipeline for inputs of `input_shape` (None: the
        model's own static shapes)."""
        declared = self._hidden.buckets
        plan = trace_model(model, input_shape)
        # Embeddings looked up from the inputs run before the pipeline (front_embeddings.py).
        pipe_plan, front_nodes = front_embeddings.split(plan)
        if declared:
            settings = dict(settings, input_buckets=keras_buckets.functional_pipeline_buckets(
                declared, dict(zip(self._hidden.input_names, plan.input_keys)), front_nodes,
                pipe_plan.input_keys))
        params = functional_pipeline_params(model, cost_batch_size=cost_batch_size,
                                            plan=pipe_plan, live=True, **settings)
        # Each node runs the model's own layer object; its variables now read and write the
        # pipeline's (each on its cell's device): training trains `model` itself.
        pipeline = params.Instantiate()
        front = (front_embeddings.FrontEmbeddings(front_nodes, plan, pipeline.devices[0])
                 if front_nodes else None)
        _check_every_variable_owned(model, pipeline, front)
        self._hidden.__dict__.update(pipeline=pipeline, plan=plan, pipe_plan=pipe_plan,
                                     front=front)
        position = {id(leaf): i for i, leaf in enumerate(pipeline.theta.Flatten())}
        # Index into the pipeline's gradients, or None for a front embedding's variables.
        self._hidden.grad_index = [position.get(id(v.value))
                                   for v in model.trainable_variables]

    def _example_shapes(self, x: Any) -> list[tuple[int, ...]]:
        return [tuple(tf.TensorShape(np.shape(t))[1:])
                for t in self.plain._standardize_inputs(x)]

    def partition_report(self, batch_size: int | None = None) -> str:
        """The partition table and the tensors each cut carries per micro-batch."""
        pipe = self.pipeline
        batch = batch_size or self._hidden.batch_size or self._config["cost_batch_size"]
        try:
            micro = batch // pipe.num_micro_batches_for(batch)
        except ValueError:
            micro = batch
        return pipe.partition.report() + "\n" + cut_report(pipe, self._hidden.pipe_plan, micro)

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                jit_compile: Any = "auto", **kwargs: Any) -> None:
        """`keras.Model.compile`: one loss, or one per output (a list or a dict by name), and
        `loss_weights` in the same forms; every reduction but 'none' (and, for several
        outputs, 'mean_with_sample_weight')."""
        optimizer = keras.optimizers.get(optimizer)
        self._remember_compile(optimizer, loss, loss_weights, jit_compile,
                               kwargs.get("metrics"), kwargs.get("weighted_metrics"))
        keras.Model.compile(self, optimizer=optimizer, loss=loss, jit_compile=False, **kwargs)

    def _compile_losses(self, optimizer: Any, loss: Any, loss_weights: Any) -> None:
        front_embeddings.check_sparse_gradients(self._hidden.pipe_plan, optimizer)
        self.pipeline.layers[-1].set_loss(
            self._by_map_name(loss, "loss"), self._by_map_name(loss_weights, "loss_weights"),
            several_outputs=not isinstance(self._hidden.plan.outputs, str))

    # -- inputs and outputs in the model's structures --------------------------

    def _by_map_name(self, setting: Any, what: str) -> Any:
        """A compile setting given by output name, keyed by the map's output names."""
        names = self._hidden.plan.output_names
        if not isinstance(setting, dict) or not names:
            return setting
        unknown = sorted(set(setting) - set(names.values()))
        if unknown:
            raise ValueError(f"PipelinedModel.compile: {what} names outputs {unknown}; the "
                             f"model's outputs are {sorted(names.values())}.")
        return {safe: setting.get(name) for safe, name in names.items()}

    def _input_map(self, x: Any) -> NestedMap:
        flat = self.plain._standardize_inputs(x)
        return NestedMap({k: self._static_batch(tf.convert_to_tensor(t))
                          for k, t in zip(self._hidden.plan.input_keys, flat)})

    def _to_map(self, value: Any) -> Any:
        """Labels or sample weights in the map's output structure."""
        plan = self._hidden.plan
        if isinstance(plan.outputs, dict) and isinstance(value, dict):
            return NestedMap({safe: self._static_batch(tf.convert_to_tensor(value[name]))
                              for safe, name in plan.output_names.items()})
        if isinstance(plan.outputs, list) and isinstance(value, (list, tuple)):
            return [self._static_batch(tf.convert_to_tensor(v)) for v in value]
        return self._static_batch(tf.convert_to_tensor(value))

    def _to_keras(self, predictions: Any, mask: Any = None) -> Any:
        plan = self._hidden.plan
        if mask is not None:  # Keras metrics and the caller see the output's mask.
            predictions = tf.identity(predictions)
            set_keras_mask(predictions, mask)
        if isinstance(plan.outputs, dict):
            return {plan.output_names[k]: v for k, v in predictions.items()}
        return predictions

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if tf.executing_eagerly():
            self._build_for_data(inputs)
        pipe = self.pipeline
        x = self._pipe_inputs(self._input_map(inputs))
        collector = fprop_context.UpdateCollector() if training else None
        with fprop_context.fprop_context(training=bool(training), updates=collector):
            batch = x.Flatten()[0].shape[0]
            if batch is not None and batch % pipe.num_micro_batches_for(batch) == 0:
                out = pipe.FProp(pipe.theta, x)
            else:
                out = self._unsplit_forward(x)
        if collector is not None:
            collector.apply()
        return self._to_keras(out.predictions, out.get("predictions_mask"))

    def _pipe_inputs(self, inputs: NestedMap) -> NestedMap:
        """The pipeline's input map: the model's inputs, front embeddings applied."""
        front = self._hidden.front
        return inputs if front is None else front.apply(inputs, self._hidden.pipe_plan.input_keys)

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, gradients, predictions, collector = self._pipelined_step(x, y, sample_weight)
        self.optimizer.apply_gradients(zip(gradients, self.plain.trainable_variables))
        collector.apply()
        batch = tf.shape(tree.flatten(x)[0])[0]
        self._loss_tracker.update_state(loss, sample_weight=batch)
        return self.compute_metrics(x, y, predictions, sample_weight=sample_weight)

    def loss_and_gradients(self, x: Any, y: Any, sample_weight: Any = None
                           ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """One pipelined step's loss and the gradients of `plain.trainable_variables` (in
        that order, which is the original model's); nothing is applied."""
        def step(x: Any, y: Any, sample_weight: Any) -> tuple[Any, list[Any]]:
            loss, gradients, _, _ = self._pipelined_step(x, y, sample_weight)
            scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
            return loss, [g / tf.cast(scale, g.dtype) for g in gradients]

        self._build_for_data(x)
        # Traced, as fit runs it (serial_devices=True can hang eagerly at K >= 3).
        return tf.function(step, autograph=False)(x, y, sample_weight)

    def _pipelined_step(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, ...]:
        """(loss, gradients, predictions, side updates to apply) of one training batch."""
        front = self._hidden.front
        with tf.GradientTape(watch_accessed_variables=False) as front_tape:
            if front is not None:
                front_tape.watch([v.value for v in front.trainable_variables])
            model_inputs = self._input_map(x)
            inputs = self._pipe_inputs(model_inputs)
        inputs.y = self._to_map(y)
        if sample_weight is not None:
            inputs.sample_weight = self._to_map(sample_weight)
        # Mixed-precision loss scaling (LossScaleOptimizer; 1 otherwise): as Keras scales the
        # loss before its backward, the loss layer scales each micro-batch's loss, and
        # apply_gradients unscales the gradients.
        inputs.loss_scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        pipe = self.pipeline
        batch = model_inputs[self._hidden.plan.input_keys[0]].shape[0]
        inputs.num_micro_batches = tf.constant(float(pipe.num_micro_batches_for(batch)))
        collector = fprop_context.UpdateCollector()
        with fprop_context.fprop_context(training=True, updates=collector):
            if front is None:
                out, grads = pipe.FPropAndGrads(pipe.theta, inputs)
            else:
                out, grads, input_grads = pipe.FPropAndGrads(pipe.theta, inputs,
                                                             return_input_grads=True)
                front_grads = front.gradients(front_tape, inputs, input_grads)
        flat = grads.Flatten()
        gradients = [flat[i] if i is not None else front_grads[id(v.value)]
                     for i, v in zip(self._hidden.grad_index, self.plain.trainable_variables)]
        loss = out.loss / inputs.loss_scale
        loss = weight_penalties.add_weight_penalties(self.plain.trainable_variables, gradients,
                                                     loss, inputs.loss_scale)
        return (loss, gradients, self._to_keras(out.predictions, out.get("predictions_mask")),
                collector)

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self.plain.compute_output_shape(input_shape)

    def get_config(self) -> dict[str, Any]:
        return dict(self._config, layers=keras.saving.serialize_keras_object(self.plain),
                    name=self.name)

    @classmethod
    def from_config(cls, config: dict[str, Any],
                    custom_objects: Any = None) -> FunctionalPipelinedModel:
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("layers"))
        return cls(model, **config)


def _check_every_variable_owned(model: keras.Model, pipeline: Any, front: Any) -> None:
    """Refuses (one line) a model with variables that no pipelined layer trains."""
    owned = {id(v) for layer in pipeline.layers if isinstance(layer, graph_layer.GraphNodeLayer)
             for v in layer.keras_layer.variables}
    if front is not None:
        owned |= {id(v) for layer in front.layers for v in layer.variables}
    missing = [v.path for v in model.variables if id(v) not in owned]
    if missing:
        raise ValueError(f"PipelinedModel: variables {missing[:3]} of the model are used by no "
                         "pipelined layer.")
