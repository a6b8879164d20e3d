"""The training library behind `trainer.py`.

Modules (each with one job; import them directly, this package imports nothing so that
`trainer.py` can check its flags before TensorFlow loads):
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
  - `cluster`: TF_CONFIG, the servers of a multi-process run, and losing a task;
  - `runner`: `main(options)`, the per-mode setup and the user-error handling.
"""
