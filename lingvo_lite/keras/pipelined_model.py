"""PipelinedModel: a keras.Model that trains a Keras layer stack as a GPipe pipeline.

Give it the layers of a `keras.Sequential` (or the Sequential itself) and the
pipeline's K, T, re-materialisation, schedule and placement; `compile`, `fit`,
`evaluate`, `predict` and Keras callbacks work as for the Sequential. Each Keras layer
becomes a `KerasLayer` that runs the user's own layer object (its weights on its cell's
device, which the layer's variables then read and write) and the compiled loss a
`KerasLossLayer` at the end of a `PipeliningLayer`; `train_step` runs
`PipeliningLayer.FPropAndGrads` and hands the gradients to the Keras optimizer.

What matches the unpipelined Sequential (tests/unit/keras/pipelined_model_test.py):
- the loss, the gradients and so the weights after `fit` steps, for every K, T, remat
  and schedule, dropout included (each example gets the mask the whole batch would),
  weight regularizers' penalties included (activity regularizers are refused);
- with BatchNormalization, T = 1 matches exactly; for T > 1 each micro-batch is
  normalised with its own moments (GPipe) and the moving statistics are updated once
  per mini-batch from the exactly pooled moments;
- every loss reduction but 'none' ('sum_over_batch_size', 'mean',
  'mean_with_sample_weight', 'sum'), sample_weight and class_weight, `loss_weights`
  for the one output, metrics and weighted_metrics, `steps_per_execution`, weight
  regularizers and constraints (tests/unit/keras/keras_settings_test.py);
- mixed precision: each layer runs under its dtype policy as in Keras (inputs cast,
  weights autocast); under 'mixed_float16' the loss is scaled before the pipelined
  backward and the LossScaleOptimizer unscales the gradients, as Keras does;
- Keras masks (Embedding(mask_zero=True), Masking) travel with their tensors through
  the layers and across cells, and a masked loss divides by the mini-batch's unmasked
  count;
- `get_weights`/`set_weights`/`save_weights`/`load_weights` use the Sequential's
  layout: weights saved from one load into the other. `save('m.keras')` and
  `keras.models.load_model('m.keras')` round-trip the whole model (config, weights,
  compile settings).

Refused up front with a one-line ValueError naming the setting and what to do instead:
`jit_compile=True` with a GaussianNoise or GaussianDropout layer; several losses or loss
weights (a layer stack has one output); a loss with reduction='none'; layers that call
`add_loss` or have activity regularizers; an optimizer other than SGD with a trainable
Embedding after the first layer (Keras squares each token occurrence's sparse gradient
separately, the pipeline's gradient of a pipelined layer is a dense sum; a leading
Embedding runs before the pipeline, on cell 0's device, and gets Keras' sparse gradient
from the pipeline's input gradient); a `.weights.h5` file of another model in
`load_weights`.

Training needs equal batches (the pipeline splits a static mini-batch into T
micro-batches): `fit` on arrays needs a batch_size dividing the number of training
examples, and a tf.data.Dataset must be batched with drop_remainder=True. Batches of a
few shapes (length buckets from `bucket_by_sequence_length`) train with
`input_buckets=[(16, 8), (8, 16), ...]`: one trace per bucket, any other shape refused
(keras_buckets.py). Evaluation and prediction take any batch.

Example (2 logical CPUs stand in for 2 accelerators; configure them before any TF op):
    >>> from lingvo_lite.core import devices
    >>> _ = devices.configure_logical_cpus(2)
    >>> model = PipelinedModel(
    ...     [keras.layers.Dense(32, activation='relu'), keras.layers.Dropout(0.1),
    ...      keras.layers.Dense(10)],
    ...     input_shape=(64,), num_cells=2, num_micro_batches=4)
    >>> model.compile(optimizer='adam', metrics=['accuracy'],
    ...               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    >>> history = model.fit(x, y, batch_size=32, epochs=2)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import h5py
import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import process_group
from lingvo_lite.keras import (
    front_embeddings,
    keras_buckets,
    keras_layer,
    keras_loss,
    multi_worker,
    weight_penalties,
)
from lingvo_lite.keras.pipeline_settings import PipelineSettings
from lingvo_lite.keras.untracked import Untracked
from lingvo_lite.pipeline import buckets as pipeline_buckets
from lingvo_lite.pipeline import pipelining_layer

__all__ = ["pipeline_params", "PipelinedModel"]


# Other kinds of model PipelinedModel takes, registered by the modules that pipeline them
# (functional.py: a functional keras.Model), which `lingvo_lite.keras` imports: (does it take
# `layers`, the subclass that does).
_MODEL_KINDS: list[tuple[Callable[[Any], bool], type]] = []


def register_model_kind(takes: Callable[[Any], bool]) -> Callable[[type], type]:
    """Class decorator: `PipelinedModel(layers)` builds the decorated subclass when
    `takes(layers)`."""
    def register(cls: type) -> type:
        _MODEL_KINDS.append((takes, cls))
        return cls
    return register


def _keras_layer_params(layers: Any, input_shape: Sequence[int],
                        allow_weight_regularizers: bool = False) -> list[Any]:
    """KerasLayer params of each layer, with the input shape Keras infers for it."""
    layer_params = []
    spec = keras.KerasTensor((None, *input_shape))
    for i, layer in enumerate(keras_layer.iter_keras_layers(layers)):
        weight_penalties.check_regularizers(layer, allow_weight_regularizers)
        keras_layer.check_supported(layer)
        config = keras_layer.serialize(layer)
        shape = list(spec.shape[1:])
        probe = keras_layer.deserialize(config)
        if not probe.built:
            probe.build(spec.shape)
        keras_layer.check_call_state(probe, shape)
        spec = probe.compute_output_spec(spec)
        layer_params.append(keras_layer.KerasLayer.Params().Set(
            name=f"keras_{i}_{layer.name}", keras_layer=config, input_shape=shape))
    return layer_params


def _live_layer_params(layers: Any, input_shape: Sequence[int]) -> list[Any]:
    """KerasLayer params that run the user's own layer objects, each built (by a symbolic
    call, as Keras builds a model's layers) for the shape Keras infers for its input."""
    layer_params = []
    spec = keras.KerasTensor((None, *input_shape))
    owner: dict[int, keras.layers.Layer] = {}
    for i, layer in enumerate(keras_layer.iter_keras_layers(layers)):
        weight_penalties.check_regularizers(layer, allow_weight_regularizers=True)
        keras_layer.check_supported(layer)
        _refuse_shared_weights(layer, owner)
        shape, dtype = list(spec.shape[1:]), spec.dtype
        spec = layer.compute_output_spec(spec) if layer.built else layer(spec)
        # Nothing runs: the call is traced only (in a function, which can capture the
        # layer's eager constants, e.g. an adapted Normalization's mean).
        tf.function(lambda layer=layer, shape=shape, dtype=dtype: keras_layer.check_call_state(
            layer, shape, dtype), autograph=False).get_concrete_function()
        layer_params.append(keras_layer.KerasLayer.LiveParams(
            layer, name=f"keras_{i}_{layer.name}", input_shape=shape))
    return layer_params


def _refuse_shared_weights(layer: keras.layers.Layer,
                           owner: dict[int, keras.layers.Layer]) -> None:
    """Refuses a layer of a stack that uses an earlier layer's weights (each layer of a stack
    holds its own copies); records its weights in `owner`."""
    for v in layer.variables:
        first = owner.setdefault(id(v), layer)
        if first is not layer:
            raise ValueError(
                f"PipelinedModel: Keras layer '{layer.name}' uses weights of the earlier layer "
                f"'{first.name}' ({v.path}); in a layer stack each layer holds its own: build "
                "the model functionally (keras.Model(inputs, outputs)), where shared weights "
                "are one variable.")


def pipeline_params(layers: Any, input_shape: Sequence[int], *, loss: Any = None,
                    cost_batch_size: int = 1, name: str = "keras_pipeline",
                    allow_weight_regularizers: bool = False,
                    input_buckets: Sequence[Any] | None = None, live: bool = False,
                    **settings: Any) -> Any:
    """PipeliningLayer params for Keras layers followed by a KerasLossLayer.

    `settings`: the pipeline's settings by name (`PipelineSettings`: num_cells,
    num_micro_batches, remat, schedule, ...).

    `layers`: a list of Keras layers, a `keras.Sequential`, or a function returning
    either; a function is called inside a `tf.Graph`, so no TensorFlow op runs (a
    registered model's `Task()` should pass one: trainer.py configures the devices
    after reading the params, and creating Keras weights eagerly would start TF first).
    `input_shape` is one example's shape; `cost_batch_size` the batch the cost model
    (partitioning, inspect_model) assumes. `loss`: any form `compile(loss=...)` takes,
    or None to set it later (`KerasLossLayer.set_loss`). Weight regularizers
    (kernel_regularizer, ...) are refused unless `allow_weight_regularizers` (PipelinedModel
    adds their penalty itself; a trainer.py task would silently drop it); activity
    regularizers are always refused. `input_buckets`: PipeliningLayer.input_buckets (the
    pipeline input's mini-batch shapes, NestedMaps with `x`); costs are then planned for
    the largest. `live`: the layers run as the user's objects (PipelinedModel; their
    variables then read and write the pipeline's), else they are rebuilt from their configs.

    Example:
        >>> p = pipeline_params([keras.layers.Dense(8), keras.layers.Dense(2)], (4,),
        ...                     num_cells=2, loss='mse')
        >>> len(p.layers)
        3
    """
    # Probe layers are built in a graph: no TensorFlow op runs, so a registered model's
    # Task() can call this before trainer.py configures the devices.
    if live:
        layer_params = _live_layer_params(layers, input_shape)
    else:
        with tf.Graph().as_default():
            if callable(layers) and not isinstance(layers, keras.layers.Layer):
                layers = layers()
            layer_params = _keras_layer_params(layers, input_shape, allow_weight_regularizers)
    if loss is not None:
        check_task_loss(loss, "pipeline_params")
    layer_params.append(keras_loss.KerasLossLayer.Params().Set(
        name="loss", loss=None if loss is None else keras_loss.serialize_loss(loss)))
    return pipelining_layer.PipeliningLayer.Params().Set(
        name=name, layers=layer_params, input_buckets=input_buckets,
        **PipelineSettings.of(settings).as_dict(),
        input_shapes=(NestedMap(x=tf.TensorShape([cost_batch_size, *input_shape]))
                      if not input_buckets else pipeline_buckets.largest(input_buckets)))


def check_task_loss(loss: Any, where: str) -> None:
    """Refuses (one line) a loss a trainer.py task cannot train as Keras would."""
    reduction = keras_loss.reduction_of(keras_loss.make_loss(loss))
    if reduction not in keras_loss.SUPPORTED_REDUCTIONS or reduction == "sum":
        raise ValueError(
            f"{where}: the loss's reduction={reduction!r} is not supported in a "
            "trainer.py task (reduction='sum' needs the number of micro-batches, which "
            "PipelinedModel passes); use 'sum_over_batch_size' or "
            "'mean_with_sample_weight'.")


@keras.saving.register_keras_serializable(package="lingvo_lite")
class PipelinedModel(keras.Model):
    """A Keras model whose `fit` runs a GPipe pipeline; see the module doc.

    Args:
      layers: a list of Keras layers, or a `keras.Sequential` (its layers are used, and
        own layer objects run, and their variables, dropout seed states included, then
        read and write the pipeline's: training trains them).
      input_shape: one example's shape; taken from the Sequential's input if omitted.
      **settings: the pipeline's settings by name (`PipelineSettings`: num_cells,
        num_micro_batches, micro_batch_size, remat, schedule, placement, partition_method,
        split_points, serial_devices), as in `PipeliningLayer.Params()`; keyword only.
      cost_batch_size: batch size the cost model assumes when partitioning.
      input_buckets: training batches of varying shape (length buckets): the input batch
        shapes, batch first, e.g. [(16, 8), (8, 16), (4, 32)]; each is traced once and
        any other shape refused (keras_buckets.py). The layers are built and the partition
        planned for the largest; `input_shape` defaults to its example shape.
    """

    def __new__(cls, layers: Any = None, *args: Any, **kwargs: Any) -> PipelinedModel:
        if cls is PipelinedModel:
            cls = next((kind for takes, kind in _MODEL_KINDS if takes(layers)), cls)
        return super().__new__(cls, layers, *args, **kwargs)

    def __init__(self, layers: Any, input_shape: Sequence[int] | None = None, *,
                 cost_batch_size: int = 1, input_buckets: Sequence[Any] | None = None,
                 name: str | None = None, **settings: Any) -> None:
        super().__init__(name=name)
        settings = PipelineSettings.of(settings).as_dict()
        sources = list(keras_layer.iter_keras_layers(layers))
        if not sources:
            raise ValueError("PipelinedModel: `layers` is empty; give the Keras layers to "
                             "pipeline.")
        declared = None if input_buckets is None else keras_buckets.normalize(input_buckets,
                                                                              ["x"])
        if input_shape is None and declared:
            input_shape = keras_buckets.example_shapes(keras_buckets.largest(declared))["x"]
        if input_shape is None:
            input_shape = _input_shape_of(layers)
        self._config = dict(
            input_shape=None, cost_batch_size=cost_batch_size,
            input_buckets=declared and [list(b["x"]) for b in declared], **settings)
        self._hidden = Untracked(batch_size=None, compiled=None, deferred=None, sources=sources)
        self._build_when_shaped(input_shape, lambda shape: self._build(sources, declared, shape))

    def _build(self, sources: list[keras.layers.Layer], declared: Any,
               input_shape: Sequence[int]) -> None:
        """Plans and places the pipeline for examples of `input_shape`."""
        input_shape = tuple(int(d) for d in input_shape)
        self._config["input_shape"] = list(input_shape)
        settings = {k: v for k, v in self._config.items()
                    if k not in ("input_shape", "input_buckets")}
        # A leading trainable Embedding runs before the pipeline, on cell 0's device: its
        # gradient is then taken as Keras takes it (one row per token occurrence, from the
        # pipeline's input gradient), which optimizers that square gradients need.
        front_source = None
        if len(sources) > 1 and isinstance(sources[0], keras.layers.Embedding) and \
                sources[0].trainable:
            front_source, sources = sources[0], sources[1:]
        pipe_input_shape = input_shape
        if front_source is not None:
            if not front_source.built:
                front_source.build((None, *input_shape))
            pipe_input_shape = tuple(front_source.compute_output_shape((None, *input_shape))[1:])
        pipe_buckets = None if not declared else keras_buckets.pipeline_buckets_of(
            declared, {"x": "x"},
            None if front_source is None else lambda _, s: front_source.compute_output_shape(s))
        params = pipeline_params(sources, pipe_input_shape, allow_weight_regularizers=True,
                                 input_buckets=pipe_buckets, live=True, **settings)
        # Each pipelined layer runs the user's own layer object, whose variables now read and
        # write the pipeline's (each on its cell's device): training trains them.
        pipeline = params.Instantiate()
        wrapped = [layer.keras_layer for layer in pipeline.layers[:-1]]
        front = front_source
        if front is not None:
            keras_layer.adopt_layer_variables(front, pipeline.devices[0])
            wrapped.insert(0, front)
        # The user's layer objects (hence variables) in a plain Sequential: Keras tracks and
        # saves the weights through it, in the Sequential's layout.
        self.plain = keras.Sequential(
            [keras.Input(keras_buckets.plain_shape(declared, "x", input_shape)), *wrapped],
            name="layers")
        self._hidden.__dict__.update(pipeline=pipeline, front=front, buckets=declared,
                                     input_names=["x"])
        flat = pipeline.theta.Flatten()
        position = {id(leaf): i for i, leaf in enumerate(flat)}
        # Index into the pipeline's gradients, or None for the front layer's variables.
        self._hidden.grad_index = [position.get(id(v.value))
                                   for v in self.plain.trainable_variables]

    # -- shapes from the data ----------------------------------------------------

    def _build_when_shaped(self, input_shape: Any, build: Any) -> None:
        """Builds now for `input_shape`, or (None) at the first batch the model sees, as
        Keras builds a model on first use."""
        if input_shape is None:
            self._hidden.deferred = build
            return
        build(input_shape)
        self.built = True

    def _build_for_data(self, x: Any) -> None:
        """Builds a model whose shapes were left to the data for the examples of `x` (an
        input batch, or a tf.data.Dataset of them); then applies a compile given before."""
        build = self._hidden.deferred
        if build is None:
            return
        build(self._example_shapes(_first_inputs(x)))
        self._hidden.deferred = None
        self.built = True
        if self._hidden.compiled is not None:
            self._compile_pipeline(**self._hidden.compiled)

    def _example_shapes(self, x: Any) -> Any:
        """One example's shape of the input batch `x` (as `input_shape` takes it)."""
        return tuple(tf.TensorShape(np.shape(x) if not tf.is_tensor(x) else x.shape)[1:])

    # -- the pipeline ----------------------------------------------------------

    @property
    def pipeline(self) -> pipelining_layer.PipeliningLayer:
        """The PipeliningLayer that runs the layers (partition, devices, schedule)."""
        self._require_built()
        return self._hidden.pipeline

    def _require_built(self) -> None:
        if self._hidden.deferred is not None:
            raise ValueError(
                "PipelinedModel: the input shapes are not known yet: they come from the first "
                "batch that fit, evaluate, predict or loss_and_gradients sees; pass "
                "input_shape=... to plan the pipeline before.")

    def compile(self, optimizer: Any = "rmsprop", loss: Any = None, loss_weights: Any = None,
                metrics: Any = None, weighted_metrics: Any = None, run_eagerly: bool = False,
                steps_per_execution: int = 1, jit_compile: Any = "auto",
                auto_scale_loss: bool = True) -> None:
        """`keras.Model.compile`; a setting the pipeline cannot train exactly is refused here
        with a ValueError that names it and what to do instead."""
        optimizer = keras.optimizers.get(optimizer)
        self._remember_compile(optimizer, loss, loss_weights, jit_compile, metrics,
                               weighted_metrics)
        super().compile(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                        metrics=metrics, weighted_metrics=weighted_metrics,
                        run_eagerly=run_eagerly, steps_per_execution=steps_per_execution,
                        jit_compile=False, auto_scale_loss=auto_scale_loss)

    def _remember_compile(self, optimizer: Any, loss: Any, loss_weights: Any,
                          jit_compile: Any, metrics: Any, weighted_metrics: Any) -> None:
        """Keeps compile's settings (applied to the pipeline now, or once the first batch has
        given the shapes) and the plain model's (`plain_compile_settings`)."""
        self._hidden.compiled = dict(optimizer=optimizer, loss=loss, loss_weights=loss_weights,
                                     jit_compile=self._cells_jit_compile(jit_compile))
        self._hidden.plain_compile = dict(loss=loss, loss_weights=loss_weights, metrics=metrics,
                                          weighted_metrics=weighted_metrics)
        if self._hidden.deferred is None:
            self._compile_pipeline(**self._hidden.compiled)

    def _compile_pipeline(self, optimizer: Any, loss: Any, loss_weights: Any,
                          jit_compile: bool) -> None:
        """The pipeline's side of compile: XLA per cell, refusals, the loss layer's loss."""
        if jit_compile:
            keras_layer.refuse_random_under_xla(
                layer._layer for layer in self.pipeline.layers if hasattr(layer, "_layer"))
        self.pipeline.set_jit_compile(jit_compile)
        self._compile_losses(optimizer, loss, loss_weights)

    def _compile_losses(self, optimizer: Any, loss: Any, loss_weights: Any) -> None:
        front_embeddings.refuse_summed_embeddings(
            [layer.keras_layer for layer in self.pipeline.layers[:-1]], optimizer,
            "sums an embedding's gradient first", "use SGD, freeze the embedding "
            "(trainable=False), or make it the first layer (it then runs before the pipeline)")
        single_loss = _single(loss, "loss")
        weight = _single(loss_weights, "loss_weights")
        if weight is not None and not isinstance(weight, (int, float)):
            raise ValueError(f"PipelinedModel.compile: loss_weights={loss_weights!r}: give one "
                             "number (the weight of the model's one loss).")
        if single_loss is not None:
            self.pipeline.layers[-1].set_loss(
                single_loss, None if weight is None else float(weight))

    def _cells_jit_compile(self, jit_compile: Any) -> bool:
        """Whether compile(jit_compile=...) compiles the cells with XLA: True, or 'auto'
        where Keras would compile the plain model (an accelerator present, every layer
        supporting XLA). Each cell's functions are compiled for its own device; the step
        around them, which places the cells, is not (Keras' own train function is not)."""
        if jit_compile == "auto":
            return bool(keras.Model._resolve_auto_jit_compile(self))
        if not isinstance(jit_compile, bool):
            raise ValueError(f"PipelinedModel.compile: jit_compile={jit_compile!r}; give True, "
                             "False or 'auto'.")
        return jit_compile

    @property
    def cells_jit_compile(self) -> bool:
        """Whether each cell's forward and backward run compiled by XLA (compile's
        jit_compile; Keras' `jit_compile` attribute is False: the step is not compiled)."""
        return self.pipeline.jit_compile

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        if tf.executing_eagerly():
            self._build_for_data(inputs)
        pipe = self.pipeline
        x = tf.convert_to_tensor(inputs)
        collector = fprop_context.UpdateCollector() if training else None
        with fprop_context.fprop_context(training=bool(training), updates=collector):
            batch = x.shape[0]
            pipe_inputs = self._front(x)
            if batch is not None and batch % pipe.num_micro_batches_for(batch) == 0:
                out = pipe.FProp(pipe.theta, pipe_inputs)
            else:
                out = self._unsplit_forward(pipe_inputs)
        if collector is not None:
            collector.apply()
        return _with_mask(out.predictions, out.get("predictions_mask"))

    def _front(self, x: tf.Tensor) -> NestedMap:
        """The pipeline's input map: `x`, or the leading Embedding's output and its mask."""
        front = getattr(self._hidden, "front", None)
        if front is None:
            return NestedMap(x=x)
        with tf.device(self.pipeline.devices[0]):
            embedded = front(x)
        inputs = NestedMap(x=embedded)
        mask = get_keras_mask(embedded)
        if mask is not None:
            inputs.Set(keras_layer.mask_key("x"), mask)
        return inputs

    def _unsplit_forward(self, inputs: NestedMap) -> NestedMap:
        """All cells in order on the whole batch (each on its device): any batch size."""
        pipe = self.pipeline
        x = inputs
        for k in range(pipe.num_cells):
            with tf.device(pipe.devices[k]):
                for i in pipe.cell_layers(k):
                    x = pipe.layers[i].FProp(pipe.theta.layers[i], x)
        return x

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self.plain.compute_output_shape(input_shape)

    def train_step(self, data: Any) -> dict[str, Any]:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        x = self._static_batch(tf.convert_to_tensor(x))
        if process_group.current() is not None:  # A task of a cluster trains its part.
            x, y, sample_weight = multi_worker.local_part(
                x, self._static_batch(tf.convert_to_tensor(y)),
                None if sample_weight is None else self._static_batch(
                    tf.convert_to_tensor(sample_weight)))
        loss, gradients, predictions, collector = self._pipelined_step(x, y, sample_weight)
        self.optimizer.apply_gradients(zip(gradients, self.plain.trainable_variables))
        collector.apply()
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, predictions, sample_weight=sample_weight)

    @property
    def plain_compile_settings(self) -> dict[str, Any]:
        """The compile settings (loss, loss_weights, metrics) as the plain model takes them."""
        if getattr(self._hidden, "plain_compile", None) is None:
            raise ValueError("PipelinedModel: compile the model first (compile(loss=...)).")
        return dict(self._hidden.plain_compile)

    def check_equivalence(self, x: Any, y: Any, sample_weight: Any = None) -> Any:
        """One step's loss and gradients against the plain model's (`keras.equivalence`):
        which weights' gradients differ, e.g. through layers that couple a batch's examples
        (batch norm at T > 1)."""
        from lingvo_lite.keras import equivalence

        return equivalence.check_equivalence(self, x, y, sample_weight)

    def loss_and_gradients(self, x: Any, y: Any, sample_weight: Any = None
                           ) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """One pipelined training step's loss and the gradients of the trainable variables
        (in `self.plain.trainable_variables` order, loss scaling undone); nothing is applied.

        The loss is what `fit` reports for the batch: the compiled loss plus weight penalties.
        """
        self._build_for_data(x)
        loss, gradients, _, _ = self._pipelined_step(tf.convert_to_tensor(x), y, sample_weight)
        scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        return loss, [g / tf.cast(scale, g.dtype) for g in gradients]

    def _pipelined_step(self, x: tf.Tensor, y: Any, sample_weight: Any
                        ) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor,
                                   fprop_context.UpdateCollector]:
        """(reported loss, gradients for the optimizer, predictions, side updates to apply)."""
        front = getattr(self._hidden, "front", None)
        with tf.GradientTape(watch_accessed_variables=False) as front_tape:
            if front is not None:
                front_tape.watch([v.value for v in front.trainable_variables])
            inputs = self._front(x)
        inputs.y = self._static_batch(tf.convert_to_tensor(y))
        if sample_weight is not None:
            inputs.sample_weight = self._static_batch(tf.convert_to_tensor(sample_weight))
        pipe = self.pipeline
        if pipe.layers[-1].loss is None:
            raise ValueError("PipelinedModel: no loss to train with; compile the model with "
                             "loss=....")
        inputs.num_micro_batches = tf.constant(multi_worker.num_micro_batches(pipe, x.shape[0]))
        # Mixed-precision loss scaling (LossScaleOptimizer): as Keras scales the loss before
        # its backward, the loss layer scales each micro-batch's loss, so the pipelined
        # backward runs on scaled gradients and apply_gradients unscales them.
        inputs.loss_scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        collector = fprop_context.UpdateCollector()
        with fprop_context.fprop_context(training=True, updates=collector):
            if front is None:
                out, grads = multi_worker.pipelined_grads(pipe, inputs, False)
            else:
                out, grads, input_grads = multi_worker.pipelined_grads(pipe, inputs, True)
        flat = grads.Flatten()
        if front is not None:
            with tf.device(pipe.devices[0]):
                front_grads = iter(front_tape.gradient(
                    inputs.x, [v.value for v in front.trainable_variables],
                    output_gradients=input_grads.x))
        gradients = [flat[i] if i is not None else next(front_grads)
                     for i in self._hidden.grad_index]
        loss = out.loss / inputs.loss_scale
        loss = weight_penalties.add_weight_penalties(self.plain.trainable_variables, gradients,
                                                     loss, inputs.loss_scale)
        predictions = _with_mask(out.predictions, out.get("predictions_mask"))
        return loss, gradients, predictions, collector

    def _static_batch(self, t: tf.Tensor) -> tf.Tensor:
        if t.shape.rank and t.shape[0] is None and self._hidden.batch_size is not None:
            return tf.ensure_shape(t, [self._hidden.batch_size, *t.shape[1:]])
        return t

    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None,
            **kwargs: Any) -> keras.callbacks.History:
        """`keras.Model.fit`; every training batch must have `batch_size` examples, or, with
        input_buckets, one of the declared shapes."""
        self._build_for_data(x)
        if getattr(self._hidden, "buckets", None):
            return super().fit(x, y, batch_size=batch_size, **kwargs)
        size = _training_batch_size(x, batch_size, kwargs.get("validation_split", 0.0))
        if size != self._hidden.batch_size:
            self.train_function = None  # Traced for the previous static batch size.
        self._hidden.batch_size = size
        if self._hidden.batch_size is not None:
            try:
                self.pipeline.num_micro_batches_for(self._hidden.batch_size)
            except ValueError as e:
                raise ValueError(f"PipelinedModel.fit with batch_size="
                                 f"{self._hidden.batch_size}: {e}") from None
        return super().fit(x, y, batch_size=batch_size, **kwargs)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._build_for_data(x)
        return super().evaluate(x, y, *args, **kwargs)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._build_for_data(x)
        return super().predict(x, *args, **kwargs)

    def train_on_batch(self, x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._build_for_data(x)
        return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._build_for_data(x)
        return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        self._build_for_data(x)
        return super().predict_on_batch(x)

    def make_train_function(self, force: bool = False) -> Any:
        """Keras' train function, or with input_buckets one traced once per bucket."""
        if not getattr(self._hidden, "buckets", None):
            return super().make_train_function(force)
        if not self.optimizer.built:  # Built inside the first trace, it would trace twice.
            self.optimizer.build(self.plain.trainable_variables)
        if self.train_function is None or force:
            self.train_function = keras_buckets.BucketedTrainFunction(
                self.train_step, self.steps_per_execution, self._hidden.buckets,
                lambda data: keras_buckets.shapes_by_name(
                    keras.utils.unpack_x_y_sample_weight(data)[0], self._hidden.input_names))
        return self.train_function

    # -- weights in the plain Sequential's layout --------------------------------

    def get_weights(self) -> list[Any]:
        self._require_built()
        return self.plain.get_weights()

    def set_weights(self, weights: list[Any]) -> None:
        self._require_built()
        self.plain.set_weights(weights)

    def save_weights(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        self._require_built()
        self.plain.save_weights(filepath, overwrite=overwrite, **kwargs)

    def load_weights(self, filepath: str, **kwargs: Any) -> None:
        """Loads weights saved by this model or the plain Sequential. A `.weights.h5` file
        of another model (more or fewer layers, other shapes) is refused with a one-line
        ValueError before anything is loaded (Keras would load a prefix of it silently)."""
        self._require_built()
        if str(filepath).endswith(".weights.h5"):
            self._check_weights_file(str(filepath))
        try:
            self.plain.load_weights(filepath, **kwargs)
        except (ValueError, KeyError) as e:
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            raise ValueError(f"PipelinedModel.load_weights('{filepath}'): {first}") from None

    def _check_weights_file(self, filepath: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            own_path = os.path.join(tmp, "own.weights.h5")
            self.plain.save_weights(own_path)
            expected = _h5_layout(own_path)
        try:
            found = _h5_layout(filepath)
        except OSError:
            return  # Not readable as HDF5: Keras' own error follows.
        if found == expected:
            return
        extra = sorted(set(found) - set(expected))
        missing = sorted(set(expected) - set(found))
        shape = next((k for k in sorted(expected) if k in found and found[k] != expected[k]), None)
        if shape is not None:
            what = f"'{shape}' has shape {found[shape]}, this model's {expected[shape]}"
        elif extra:
            what = f"it has weights this model lacks ('{extra[0]}')"
        else:
            what = f"it lacks '{missing[0]}'"
        layers = ", ".join(type(layer).__name__ for layer in self.plain.layers)
        raise ValueError(
            f"PipelinedModel.load_weights('{filepath}'): the file does not hold this model's "
            f"weights: {what}; this model's layers are {layers}: load a file saved from the "
            "same layers (PipelinedModel.save_weights or the plain Sequential's).")

    # -- the trained model, out --------------------------------------------------

    def save(self, filepath: str, overwrite: bool = True, **kwargs: Any) -> None:
        """Saves the trained model as plain Keras would (`.keras`): the plain model (the
        user's model, or a Sequential of the given layers) with its weights, the compile
        settings and the optimizer's state. Plain `keras.saving.load_model` loads it without
        lingvo-lite; `PipelinedModel.load_model(filepath, num_cells=..., ...)` resumes
        training it in a pipeline."""
        self._require_built()
        if self.compiled and getattr(self._hidden, "plain_compile", None) is not None:
            # The plain model's variables are the ones this optimizer updates.
            self.plain.compile(optimizer=self.optimizer, **self.plain_compile_settings)
        self.plain.save(filepath, overwrite=overwrite, **kwargs)

    def export(self, filepath: str, *args: Any, **kwargs: Any) -> Any:
        """`keras.Model.export` of the plain model with the trained weights: a SavedModel
        for TF Serving (`serve` and `serving_default` signatures) that needs only
        TensorFlow."""
        self._require_built()
        return self.plain.export(filepath, *args, **kwargs)

    @classmethod
    def load_model(cls, filepath: str, **pipeline: Any) -> PipelinedModel:
        """A PipelinedModel over the model of a `.keras` file (from `save`, or any plain
        Keras model), compiled as it was saved with its optimizer's state: `fit` resumes.

        `pipeline`: the PipelinedModel settings (num_cells, num_micro_batches, ...).
        """
        plain = keras.saving.load_model(filepath)
        model = cls(plain, **pipeline)
        if plain.compiled:
            settings = keras.saving.deserialize_keras_object(plain.get_compile_config())
            # The loaded optimizer knows the variables by their tf.Variables, which the
            # pipeline's now replace: a new one of the same config takes over its state.
            saved = plain.optimizer
            optimizer = type(saved).from_config(saved.get_config())
            optimizer.build(model.plain.trainable_variables)
            if len(optimizer.variables) != len(saved.variables):
                raise ValueError(f"PipelinedModel.load_model('{filepath}'): the saved optimizer "
                                 f"has {len(saved.variables)} variables, a new one for this "
                                 f"model {len(optimizer.variables)}; the file is not one model's.")
            for mine, theirs in zip(optimizer.variables, saved.variables):
                mine.assign(theirs)
            model.compile(**dict(settings, optimizer=optimizer))
        return model

    def get_config(self) -> dict[str, Any]:
        layers = [keras_layer.serialize(layer) for layer in self._hidden.sources]
        return dict(self._config, layers=layers, name=self.name)

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> PipelinedModel:
        config = dict(config)
        layers = [keras_layer.deserialize(c) for c in config.pop("layers")]
        return cls(layers, **config)


def _h5_layout(filepath: str) -> dict[str, tuple[int, ...]]:
    """Path -> shape of every array in a `.weights.h5` file."""
    layout = {}
    with h5py.File(filepath, "r") as f:
        f.visititems(lambda name, obj: layout.__setitem__(name, tuple(obj.shape))
                     if isinstance(obj, h5py.Dataset) else None)
    return layout


def _single(setting: Any, name: str) -> Any:
    """The one entry of a compile setting given for the model's one output (or None)."""
    if setting is None or not isinstance(setting, (list, tuple, dict)):
        return setting
    entries = list(setting.values()) if isinstance(setting, dict) else list(setting)
    if len(entries) != 1:
        raise ValueError(
            f"PipelinedModel.compile: {name} has {len(entries)} entries, but a pipelined "
            f"layer stack has one output; give one {name[:-1] if name.endswith('s') else name}"
            " (combine several terms in one loss function).")
    return entries[0]


def _with_mask(predictions: tf.Tensor, mask: Any) -> tf.Tensor:
    if mask is not None:
        predictions = tf.identity(predictions)
        set_keras_mask(predictions, mask)
    return predictions


def _input_shape_of(layers: Any) -> tuple[int, ...] | None:
    """A Sequential's declared example shape (keras.Input), else None: from the data."""
    if isinstance(layers, keras.Sequential):
        try:
            return tuple(layers.input_shape[1:])
        except (AttributeError, ValueError):
            pass
    return None


def _first_inputs(x: Any) -> Any:
    """The model inputs of the first batch of `x` (a batch of arrays, or a tf.data.Dataset
    of batches), from which a model without `input_shape` takes its shapes."""
    if isinstance(x, tf.data.Dataset):
        element = next(iter(x))
        return keras.utils.unpack_x_y_sample_weight(element)[0] if isinstance(
            element, tuple) else element
    leaves = tf.nest.flatten(x)
    if not leaves or not all(tf.is_tensor(t) or isinstance(t, np.ndarray) or
                             hasattr(t, "__array__") for t in leaves):
        raise ValueError(
            f"PipelinedModel: the input shapes are taken from the first batch of arrays or of "
            f"a tf.data.Dataset; with {type(x).__name__} input pass input_shape=... (one "
            "example's shape of each input).")
    return x


def _training_batch_size(x: Any, batch_size: int | None, validation_split: float) -> int | None:
    """The static training batch size, or a one-line error when batches would differ."""
    if isinstance(x, tf.data.Dataset):
        spec = tf.nest.flatten(x.element_spec)[0]
        if spec.shape.rank and spec.shape[0] is None:
            raise ValueError(
                "PipelinedModel.fit: the dataset's batch size is not static; batch it with "
                "dataset.batch(batch_size, drop_remainder=True) so every batch splits into "
                "the same micro-batches, or declare the batch shapes of length buckets with "
                "PipelinedModel(..., input_buckets=[...]).")
        return None
    leaves = tf.nest.flatten(x)
    if not leaves or not hasattr(leaves[0], "shape"):
        return batch_size
    size = batch_size or 32
    num = int(leaves[0].shape[0])
    if validation_split:
        num = int(math.floor(num * (1.0 - validation_split)))
    if num % size:
        raise ValueError(
            f"PipelinedModel.fit: {num} training examples do not split into batches of "
            f"batch_size={size}; the pipeline needs every batch the same size: pass a "
            "batch_size that divides the number of examples (or drop the remainder).")
    return size
