"""The training library behind `trainer.py`.

Its public surface is one invocation: `main(RunOptions(...))` runs what `trainer.py` runs
(`RunOptions` mirrors the flags; a `UsageError` is the user's to fix) and returns the exit
status. The names are imported on first use, so that `trainer.py` can check its flags before
TensorFlow loads.

>>> from lingvo_lite import training
>>> training.RunOptions(mode="list_models").validate()   # Cheap checks, no TensorFlow.
>>> training.RunOptions(mode="train").validate()  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
lingvo_lite.training.options.UsageError: --model is required for --mode=train; ...

Modules (each with one job; the trainer's own, `__all__ = []`, except `options` and `runner`):
  - `options`: RunOptions (one invocation, mirroring the flags), UsageError, cheap checks;
  - `model_config`: --model / override flags -> the final task and input params;
  - `analysis`: per-layer costs, partitions and predicted steps from params alone
    (inspect_model);
  - `planner`: the dry-run search over cells, replicas, micro-batches, schedule and remat
    (plan), with `sizes` (byte sizes as users write them, '16GiB');
  - `equivalence`: pipelined vs unpipelined gradients on one batch (check_equivalence);
  - `checkpointer`: checkpoints of weights, optimizer slots, global step and input position;
  - `logdir_lock`: one trainer per logdir;
  - `interrupts`: SIGINT and SIGTERM stop the run at a step boundary;
  - `summaries`: TensorBoard event writers per log sub-directory;
  - `profiling`: --profile_steps (op traces -> pipeline boxes, the step breakdown, its
    charts, Chrome trace and suggestions);
  - `loop`: the Trainer (training loop) and the evaluation pass;
  - `decoding`: the decode mode (beam search over an eval split);
  - `cluster`: TF_CONFIG, the heartbeats between the processes of a cluster, losing a task,
    and the single-client mode (task 0 drives the whole mesh);
  - `multi_client`, `multi_client_trainer`, `input_positions`: the multi-client mode (every
    task a client of its own replicas and input shard) and each task's saved input position;
  - `runner`: `main(options)`, the per-mode setup and the user-error handling.
"""

from lingvo_lite.core import _lazy

_EXPORTS = {
    "main": "lingvo_lite.training.runner",
    "RunOptions": "lingvo_lite.training.options",
    "UsageError": "lingvo_lite.training.options",
    "TrainingError": "lingvo_lite.training.options",
    "MODES": "lingvo_lite.training.options",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = _lazy.exporter(__name__, _EXPORTS, globals())
