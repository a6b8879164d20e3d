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

from lingvo_lite import _lazy

__version__ = "0.1.0"

_EXPORTS = {
    # Hyperparameters and structures.
    "Params": "lingvo_lite.hyperparams",
    "InstantiableParams": "lingvo_lite.hyperparams",
    "NestedMap": "lingvo_lite.nested_map",
    # Layers: the base class, its weights, the per-call context.
    "BaseLayer": "lingvo_lite.base_layer",
    "WeightParams": "lingvo_lite.weight_params",
    "WeightInit": "lingvo_lite.weight_params",
    "fprop_context": "lingvo_lite.fprop_context",
    "UpdateCollector": "lingvo_lite.fprop_context",
    # The pipeline and its Keras front end.
    "PipeliningLayer": "lingvo_lite.pipeline.pipelining_layer",
    "PipelinedModel": "lingvo_lite.keras.pipelined_model",
    # Tasks, inputs, optimisation and the model registry.
    "BaseTask": "lingvo_lite.base_task",
    "PipelinedTask": "lingvo_lite.pipelined_task",
    "BaseInputGenerator": "lingvo_lite.base_input_generator",
    "optimizers": "lingvo_lite.optimizers",
    "learning_rate": "lingvo_lite.learning_rate",
    "model_registry": "lingvo_lite.model_registry",
    "SingleTaskModelParams": "lingvo_lite.model_registry",
    "SplitInputModelParams": "lingvo_lite.model_registry",
    # Stand-in accelerators: logical CPU devices.
    "devices": "lingvo_lite.devices",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
