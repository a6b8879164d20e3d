"""KerasTask: a trainer.py task whose pipelined network is a Keras model.

The network is either `pipeline_params(...)` (a stack of Keras layers, then a
KerasLossLayer), fed `NestedMap(x=<input_field>, y=<label_field>)`, or
`functional_network_params(...)` (a functional Keras model, a keras-hub task model
included, cut between its graph nodes), fed its inputs by name from `input_fields`
and `y=<label_field>`. Training, evaluation, checkpoints and `--mode=inspect_model` are
the trainer's, as for any PipelinedTask (model_params/keras_digits.py,
model_params/keras_gpt2.py).

Example:
    >>> import keras
    >>> from lingvo_lite.keras import pipeline_params
    >>> p = KerasTask.Params().Set(name='mlp', input_field='image', label_field='label')
    >>> p.network = pipeline_params([keras.layers.Flatten(), keras.layers.Dense(10)],
    ...                             (8, 8, 1), num_cells=2, loss='mse')
    >>> def two_inputs():
    ...     a, b = keras.Input((3,), name='a'), keras.Input((2,), name='b')
    ...     return keras.Model({'a': a, 'b': b}, keras.layers.Dense(1)(
    ...         keras.layers.Concatenate()([a, b])))
    >>> p.network = functional_network_params(two_inputs, loss='mse', num_cells=1)
    >>> sorted(p.network.input_shapes.keys())   # Feed them with p.input_fields.
    ['a', 'b']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import keras_loss
from lingvo_lite.tasks import inference, pipelined_task

__all__ = ["KerasTask", "functional_network_params"]


class KerasTask(pipelined_task.PipelinedTask):
    """A PipelinedTask that maps the input batch onto the Keras network's inputs and y."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_field", "x", "Input batch field fed to the first Keras layer.")
        p.Define("input_fields", None,
                 "For a functional network: {network input key: input batch field} (the keys "
                 "of network.input_shapes); replaces input_field.")
        p.Define("label_field", "y", "Input batch field holding the labels the loss compares.")
        return p

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        p = self.params
        if p.input_fields:
            inputs = NestedMap({key: input_batch.GetItem(field)
                                for key, field in p.input_fields.items()})
        else:
            inputs = NestedMap(x=input_batch.GetItem(p.input_field))
        inputs.y = input_batch.GetItem(p.label_field)
        return inputs

    def Inference(self) -> inference.InferenceGraph:
        """The plain Keras model's serving signature (`inference.keras_serving_graph`)."""
        return inference.keras_serving_graph(self)


def functional_network_params(build_model: Callable[[], keras.Model] | keras.Model,
                              input_shape: Any = None, loss: Any = None,
                              sparse_accuracy: bool = False, num_cells: int = 1,
                              cost_batch_size: int = 1, name: str = "network",
                              **pipeline: Any) -> hyperparams.InstantiableParams:
    """PipeliningLayer params of a functional Keras model for a KerasTask.

    `build_model` is called inside a `tf.Graph` (no TensorFlow op runs: trainer.py configures
    the devices after reading the params); the pipeline's layers build their own weights
    from the model's layer configs. `input_shape`: one example's static shape of inputs with
    dynamic dimensions, by input name. `loss`: one Keras loss for the model's one output;
    `sparse_accuracy` adds an `accuracy` metric against integer labels. `pipeline`: the
    other `PipeliningLayer.Params()` fields (num_micro_batches, remat, schedule, ...).
    Weight and activity regularizers are refused (the task would drop their penalties).
    """
    from lingvo_lite.keras import functional, pipelined_model, weight_penalties

    with tf.Graph().as_default():
        model = build_model() if not isinstance(build_model, keras.Model) else build_model
        plan = functional.trace_model(model, input_shape)
        for node in plan.nodes:
            if isinstance(node.layer, keras.layers.Layer):
                weight_penalties.check_regularizers(node.layer, allow_weight_regularizers=False)
        p = functional.functional_pipeline_params(model, num_cells=num_cells,
                                                  cost_batch_size=cost_batch_size, name=name,
                                                  plan=plan, **pipeline)
    if loss is not None:
        if not isinstance(plan.outputs, str):
            raise ValueError("functional_network_params: the model has several outputs; a "
                             "trainer.py task trains a model with one output.")
        pipelined_model.check_task_loss(loss, "functional_network_params")
        p.layers[-1].Set(loss=keras_loss.serialize_loss(loss), sparse_accuracy=sparse_accuracy)
    return p
