"""Keras models on the pipeline: `PipelinedModel` trains a Keras layer stack with `fit`.

`KerasLayer` (a Keras layer as a lingvo-lite layer) and `KerasLossLayer` (the compiled loss)
are the adapters it is built from; `functional` cuts a functional model into them.

`pipeline_params` (layers) or `functional_network_params` (a functional model) and
`KerasTask` turn a Keras model into a model for `trainer.py` (model_params/keras_digits.py,
model_params/keras_gpt2.py). Importing this package loads Keras and registers
`PipelinedModel` with Keras' serialization (so `keras.models.load_model` finds it).
"""

# Registers functional models with PipelinedModel (which builds the functional subclass).
from lingvo_lite.keras import functional  # noqa: F401
from lingvo_lite.keras.keras_layer import KerasLayer
from lingvo_lite.keras.keras_loss import KerasLossLayer
from lingvo_lite.keras.keras_task import KerasTask, functional_network_params
from lingvo_lite.keras.pipeline_settings import PipelineSettings
from lingvo_lite.keras.pipelined_model import PipelinedModel, pipeline_params

__all__ = ["KerasLayer", "KerasLossLayer", "KerasTask", "PipelinedModel", "PipelineSettings",
           "functional_network_params", "pipeline_params"]
