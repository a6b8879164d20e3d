"""What a registered model is: a task (its loss, optimizer step and serving signatures), its
inputs, optimizers and learning-rate schedules, and the model registry.

`base_task` (BaseTask) and `pipelined_task` (PipelinedTask: a task around one network that may
hold PipeliningLayers), `base_input_generator` (tf.data inputs), `optimizers`,
`sharded_optimizer` (optimizer state sharded over the replicas, ZeRO-1), `learning_rate`,
`warm_start`, `inference` (the signatures `--mode=export` writes) and `model_registry`
(`--model=` names). The registered models themselves live in the repository's `tasks/` and
`model_params/`.

>>> from lingvo_lite import tasks
>>> tasks.PipelinedTask.Params().cls.__name__
'PipelinedTask'

Imported on first use, like the names of `lingvo_lite`.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "BaseTask": "lingvo_lite.tasks.base_task",
    "PipelinedTask": "lingvo_lite.tasks.pipelined_task",
    "BaseInputGenerator": "lingvo_lite.tasks.base_input_generator",
    "SingleTaskModelParams": "lingvo_lite.tasks.model_registry",
    "SplitInputModelParams": "lingvo_lite.tasks.model_registry",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
