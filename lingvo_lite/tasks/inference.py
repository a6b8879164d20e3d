"""What a task serves: `BaseTask.Inference()` returns an `InferenceGraph`.

`trainer.py --mode=export` (lingvo_lite/training/export.py) builds the task unpipelined (one
cell, one micro-batch, one replica), restores a checkpoint into it, calls `Inference()` and
writes a SavedModel whose signatures are `InferenceGraph.signatures`. Each signature is a
`tf.function` with an `input_signature` whose `TensorSpec`s carry the input names a client
passes, returning a dict of named outputs. The functions may read the task's variables (the
export saves them as plain `tf.Variable`s) and any lookup table, tokenizer or
`tf.saved_model.Asset` listed in `InferenceGraph.resources` (the export tracks them so the
SavedModel carries them). Nothing of lingvo-lite is needed to load the result.

`keras_serving_graph` is a KerasTask's: the plain Keras model's own signature (its inputs by
the task's input batch field names, its output as `output_0`, as `keras.Model.export` names
it). `network_forward` runs a pipelined network's layers one after the other (eval mode, no
micro-batching): the unpipelined model that the signatures of the image and Keras tasks wrap.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from lingvo_lite.core import fprop_context

__all__ = ["InferenceGraph", "InferenceNotDefinedError", "keras_input_specs", "keras_predictions",
           "keras_serving_graph", "network_forward"]


class InferenceNotDefinedError(ValueError):
    """A task without serving signatures was asked to export (`BaseTask.Inference`)."""


@dataclasses.dataclass
class InferenceGraph:
    """The serving signatures of a task and what they use besides the model's variables.

    Attributes:
      signatures: signature name ('serving_default' for the main one) -> a `tf.function`
        with an `input_signature` of named `TensorSpec`s, returning a dict name -> tensor.
      resources: attribute name -> a trackable the signatures use (a lookup table, a
        tokenizer, a `tf.saved_model.Asset`); saved with the model.
    """

    signatures: dict[str, Any]
    resources: dict[str, Any] = dataclasses.field(default_factory=dict)


def network_forward(network: Any, theta: Any, inputs: Any) -> Any:
    """The layers of a PipeliningLayer one after the other in eval mode, each on its cell's
    device, on the whole batch (any batch size): the network without the pipeline schedule.

    Args:
      network: the PipeliningLayer (e.g. `task.network`).
      theta: its theta (e.g. `task.theta.network`).
      inputs: what its first layer takes (a tensor or a NestedMap).

    Returns:
      The last layer's output.
    """
    x = inputs
    with fprop_context.fprop_context(training=False, updates=None):
        for i, layer in enumerate(network.layers):
            with tf.device(network.devices[network.partition.cell_of_layer(i)]):
                x = layer.FProp(theta.layers[i], x)
    return x


def keras_input_specs(task: Any) -> dict[str, tf.TensorSpec]:
    """A KerasTask's network inputs as serving specs: network input key -> TensorSpec named
    after the input batch field that feeds it, batch dimension None, the train input's dtype
    (float32 when the task has no train input params)."""
    p = task.params
    fields = dict(p.input_fields) if p.input_fields else {"x": p.input_field}
    element_spec: dict[str, Any] = {}
    if p.input is not None:
        element_spec = dict(p.input.Instantiate().dataset().element_spec)
    specs = {}
    for key, field in fields.items():
        shape = p.network.input_shapes[key]
        data = element_spec.get(field)
        dtype = data.dtype if data is not None else tf.float32
        specs[key] = tf.TensorSpec([None, *shape.as_list()[1:]], dtype, name=field)
    return specs


def keras_predictions(task: Any, inputs: dict[str, tf.Tensor]) -> Any:
    """The Keras network's predictions (eval mode, unpipelined) on inputs keyed like
    `keras_input_specs`: the last layer's `predictions` without labels."""
    from lingvo_lite.core.nested_map import NestedMap

    out = network_forward(task.network, task.theta.network, NestedMap(inputs))
    return out.predictions


def keras_serving_graph(task: Any) -> InferenceGraph:
    """`serving_default` of a KerasTask: the plain model's inputs -> `output_0` (and
    `output_1`, ... for a model with several outputs), any batch size."""
    specs = keras_input_specs(task)

    @tf.function(input_signature=[specs])
    def serving_default(inputs: dict[str, tf.Tensor]) -> dict[str, tf.Tensor]:
        outputs = tf.nest.flatten(keras_predictions(task, inputs))
        return {f"output_{i}": y for i, y in enumerate(outputs)}

    return InferenceGraph(signatures={"serving_default": serving_default})
