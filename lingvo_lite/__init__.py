"""lingvo-lite: GPipe pipeline parallelism as a Lingvo-style layer framework on TensorFlow 2.

The public surface is what `__all__` lists, here and in the subpackages `lingvo_lite.layers`
(the layers), `lingvo_lite.pipeline` (PipeliningLayer, schedules, the simulator),
`lingvo_lite.keras` (PipelinedModel) and `lingvo_lite.training` (the trainer's options and
entry point). Names are imported on first use: `import lingvo_lite` loads no TensorFlow.

>>> import lingvo_lite
>>> p = lingvo_lite.PipeliningLayer.Params().Set(name="pipe", num_cells=2)
>>> p.num_cells, type(p).__name__
(2, 'InstantiableParams')

Modules not re-exported here are the implementation; their own `__all__` says which of their
names others may rely on (`[]`: none).
"""

from lingvo_lite.core import _lazy

__version__ = "0.1.0"

_EXPORTS = {
    # Hyperparameters and structures.
    "Params": "lingvo_lite.core.hyperparams",
    "InstantiableParams": "lingvo_lite.core.hyperparams",
    "NestedMap": "lingvo_lite.core.nested_map",
    # Layers: the base class, its weights, the per-call context.
    "BaseLayer": "lingvo_lite.core.base_layer",
    "WeightParams": "lingvo_lite.core.weight_params",
    "WeightInit": "lingvo_lite.core.weight_params",
    "fprop_context": "lingvo_lite.core.fprop_context",
    "UpdateCollector": "lingvo_lite.core.fprop_context",
    # The pipeline and its Keras front end.
    "PipeliningLayer": "lingvo_lite.pipeline.pipelining_layer",
    "PipelinedModel": "lingvo_lite.keras.pipelined_model",
    # Tasks, inputs, optimisation and the model registry.
    "BaseTask": "lingvo_lite.tasks.base_task",
    "PipelinedTask": "lingvo_lite.tasks.pipelined_task",
    "BaseInputGenerator": "lingvo_lite.tasks.base_input_generator",
    "optimizers": "lingvo_lite.tasks.optimizers",
    "learning_rate": "lingvo_lite.tasks.learning_rate",
    "model_registry": "lingvo_lite.tasks.model_registry",
    "SingleTaskModelParams": "lingvo_lite.tasks.model_registry",
    "SplitInputModelParams": "lingvo_lite.tasks.model_registry",
    # Stand-in accelerators: logical CPU devices.
    "devices": "lingvo_lite.core.devices",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
