"""KerasTask: a trainer.py task whose pipelined network is a stack of Keras layers.

The network is `pipeline_params(...)` (KerasLayers then a KerasLossLayer); the task
feeds it `NestedMap(x=<input_field>, y=<label_field>)` from the input generator's
batch. Training, evaluation, checkpoints and `--mode=inspect_model` are the trainer's,
as for any PipelinedTask.

Example:
    >>> import keras
    >>> from lingvo_lite.keras import pipeline_params
    >>> p = KerasTask.Params().Set(name='mlp', input_field='image', label_field='label')
    >>> p.network = pipeline_params([keras.layers.Flatten(), keras.layers.Dense(10)],
    ...                             (8, 8, 1), num_cells=2, loss='mse')
"""

from __future__ import annotations

from lingvo_lite import hyperparams, pipelined_task
from lingvo_lite.nested_map import NestedMap

__all__ = ["KerasTask"]


class KerasTask(pipelined_task.PipelinedTask):
    """A PipelinedTask that maps the input batch onto the Keras network's x and y."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input_field", "x", "Input batch field fed to the first Keras layer.")
        p.Define("label_field", "y", "Input batch field holding the labels the loss compares.")
        return p

    def NetworkInputs(self, input_batch: NestedMap) -> NestedMap:
        p = self.params
        return NestedMap(x=input_batch.GetItem(p.input_field),
                         y=input_batch.GetItem(p.label_field))
