"""Keras models on the pipeline: `PipelinedModel` trains a Keras layer stack with `fit`."""

from lingvo_lite.keras.keras_task import KerasTask
from lingvo_lite.keras.pipelined_model import PipelinedModel, pipeline_params

__all__ = ["KerasTask", "PipelinedModel", "pipeline_params"]
