"""Multi-client training: every task of a TF_CONFIG cluster is a client of its own replicas.

Every task runs the same `trainer.py` command with its own TF_CONFIG. With N tasks and
`--num_replicas=R` (a multiple of N), task i
- builds its R/N replicas of the pipeline, each on K of its own logical devices;
- reads only its shard of the input: part i of every global batch (`BaseInputGenerator.shard`;
  examples, seeds and order as one process would give that part);
- sums cell k's gradients over all R replicas of all tasks with TensorFlow's collective
  all-reduce across the cluster (`distributed/process_group.py`, the mechanism of
  MultiWorkerMirroredStrategy), and pools batch-norm moments and scalar outputs over the
  global batch (`distributed/cross_process.py`); dropout masks follow each example's place in the
  global batch, so they do not depend on N;
- restores the chief's latest checkpoint (every task must read the same --logdir: one
  machine, or a shared file system); the tasks check with a collective that they restored the
  same step. The chief (task 0) alone writes checkpoints, summaries, params.txt and
  evaluations; each task saves its input position at the checkpoint steps
  (`input_positions.py`), so a rerun resumes exactly.

Faults are TensorFlow's to find (`distributed/process_group.py`): its coordination service,
led by the chief, takes every task's heartbeats, and a task silent for HEARTBEAT_TIMEOUT_S
(dead, or stopped with SIGSTOP) has the others' collectives aborted; a collective with a dead
task fails at once. The blocked step raises, the job leaves through its normal path (the lock
released, summaries closed) and `_supervised` prints one line naming the task (exit status 1).
At start the tasks agree through the service's key-value store on their TF_CONFIG lists,
their trainer.py flags and the step each restored; a task started late is waited for (with a
message, up to CHIEF_START_TIMEOUT_S). The start-up channel (`distributed/heartbeats.py`,
opened by trainer.py before TensorFlow loads) is closed once they agree: a running task has
one open port, its gRPC server's. A run ends when every task has finished its last step (a
barrier of the service: no task leaves while another still needs its part of a collective).

`choose_mode` picks multi-client when every replica fits on one task (R a multiple of N),
else single-client (`cluster.py`: task 0 drives the whole mesh, for a pipeline whose cells
span hosts); `--cluster_mode` forces either.

Example (docs/multi_host.md, "Processes and hosts"): three tasks on one machine,

    for i in 0 1 2; do TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223",
      "127.0.0.1:2224"]}, "task": {"type": "worker", "index": '$i'}}' .venv/bin/python
      trainer.py --model=... --logdir=/tmp/run --num_replicas=3 --num_cells=2 & done
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from lingvo_lite.distributed import cluster_spec, heartbeats
from lingvo_lite.training import cluster as cluster_lib
from lingvo_lite.training import model_config
from lingvo_lite.training.options import UsageError

if TYPE_CHECKING:
    from lingvo_lite.training.options import RunOptions

__all__: list[str] = []

MULTI_CLIENT = "multi_client"
SINGLE_CLIENT = "single_client"
FINAL_WAIT_S = 30.0  # How long a finished task waits for the others to finish.
Job = Callable[[], int]


def choose_mode(options: RunOptions, config: cluster_spec.Cluster,
                task_params: Any) -> str:
    """MULTI_CLIENT or SINGLE_CLIENT for this cluster (see the module docstring).

    Raises:
      UsageError: --cluster_mode=multi_client where a replica cannot live on one task.
    """
    pipelines = list(model_config.iter_pipelining_params(task_params))
    replicas = sorted({pp.num_replicas for _, pp in pipelines})
    n = config.num_tasks
    why = None
    if not pipelines:
        why = "the model has no PipeliningLayer whose gradients the tasks could sum"
    elif len(replicas) > 1:
        why = f"its PipeliningLayers ask for different num_replicas {replicas}"
    elif replicas[0] % n:
        why = (f"num_replicas={replicas[0]} is not a multiple of the {n} tasks (each task "
               "holds whole replicas)")
    if options.cluster_mode == SINGLE_CLIENT:
        return SINGLE_CLIENT
    if why is None:
        return MULTI_CLIENT
    if options.cluster_mode == MULTI_CLIENT:
        raise UsageError(f"--cluster_mode=multi_client: {why}; set --num_replicas to a "
                         f"multiple of {n}, or use --cluster_mode=single_client.")
    return SINGLE_CLIENT


def prepare(options: RunOptions, config: model_config.ModelConfig,
            cluster: cluster_spec.Cluster, eval_splits: dict, out: TextIO, err: TextIO,
            locked: Callable[..., Job]) -> Job:
    """Setup of a multi-client task: devices, collectives, the model, restore; the job.

    `locked(logdir, err, prepare_job, on_acquired=...)` is the runner's logdir lock, which
    only the chief takes (the tasks share the logdir).
    """
    from lingvo_lite.analysis import model_analysis

    task_params = config.task_params
    n, me = cluster.num_tasks, cluster.task_index
    _check_options(options, task_params, n)
    # params.txt and the analysis describe the whole run (R replicas), as one process would.
    params_text = task_params.ToText()
    analysis_text = model_analysis.describe_model(config.name, task_params)
    (_, first), *_ = model_config.iter_pipelining_params(task_params)
    replicas, local = first.num_replicas, first.num_replicas // n
    for _, pp in model_config.iter_pipelining_params(task_params):
        pp.num_replicas = local
        if isinstance(pp.placement, str) and pp.placement.startswith("cluster"):
            pp.placement = "auto"  # This task's own devices.
    num_cpus = options.num_logical_cpus or model_config.auto_num_logical_cpus(task_params)

    from lingvo_lite.distributed import process_group

    channel = cluster_lib.channel()
    if channel is not None:
        channel.set_mode(MULTI_CLIENT)
    _tell_if_waiting(cluster, out)
    try:
        process_group.initialize(cluster.addresses, me, num_cpus, options.intra_op_threads,
                                 options.inter_op_threads, watch=False)
    except cluster_spec.ClusterSpecError as e:
        heartbeats.close_channel()  # Every task sees the difference and refuses on its side.
        raise UsageError(str(e)) from None
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    _agree_on_the_command(cluster)
    heartbeats.close_channel()  # From here TensorFlow's coordination service keeps watch.
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(num_cpus, options.intra_op_threads, options.inter_op_threads)
    import tensorflow as tf

    if options.deterministic:
        tf.config.experimental.enable_op_determinism()
    if options.seed is not None:
        tf.random.set_seed(options.seed)
    logdir = options.abs_logdir
    model_config.set_layer_profile_paths(task_params, logdir)
    print(f"Model {config.name}, mode {options.mode}, multi-client task {me} of {n}: "
          f"{local} of the {replicas} replica(s) on {num_cpus} logical CPU device(s) of this "
          f"task, input shard {me} of {n}.\nLogdir: {logdir}", file=out, flush=True)

    def build() -> Job:
        from lingvo_lite.training import loop, multi_client_trainer

        eval_spec = None
        if cluster.is_chief and eval_splits:
            eval_spec = loop.EvalSpec(eval_splits, task_params.eval.max_eval_batches)
        try:
            return multi_client_trainer.build(
                task_params=task_params, cluster=cluster, logdir=logdir,
                params_text=params_text, analysis_text=analysis_text, eval_spec=eval_spec,
                out=out, err=err, reset_input_position=options.reset_input_position).run
        except cluster_spec.peer_errors() as e:  # Lost while restoring: the same one line.
            task, why = process_group.lost_task(e, cluster)
            raise UsageError(lost_message(cluster, task, logdir, why).removeprefix(
                "trainer.py: error: ")) from None

    job = locked(logdir, err, build) if cluster.is_chief else build()
    return lambda: _supervised(job, cluster, logdir, out, err)


def _check_options(options: RunOptions, task_params: Any, n: int) -> None:
    inp = task_params.input
    if options.profile_steps:
        raise UsageError("--profile_steps in a multi-client cluster: profile one process (no "
                         "TF_CONFIG) or --cluster_mode=single_client.")
    if inp is not None and not inp.repeat:
        raise UsageError(
            "input.repeat=False in a multi-client cluster: the tasks' shards would run out at "
            "different steps; set --input_params_override='repeat : True' (train.max_steps "
            "ends the run).")
    if inp is not None and inp.batch_size % n:
        raise UsageError(
            f"input.batch_size={inp.batch_size} does not split over the {n} tasks; make it a "
            f"multiple of {n} (--input_params_override='batch_size : <int>').")


def _tell_if_waiting(cluster: cluster_spec.Cluster, out: TextIO) -> None:
    """Says which tasks have not started yet (none of them answered the start-up channel
    within a few seconds); `process_group.initialize` then waits for them (bounded)."""
    channel = cluster_lib.channel()
    if channel is None:
        return
    deadline = time.monotonic() + 3.0
    while True:
        missing = [t for t in cluster.peers if channel.last_answer(t) is None]
        if not missing:
            return
        if time.monotonic() > deadline:
            print(f"Task {cluster.task_index}: waiting for task(s) {missing} to start (up to "
                  f"{cluster_lib.CHIEF_START_TIMEOUT_S:.0f} s)...", file=out, flush=True)
            return
        time.sleep(0.2)


def _agree_on_the_command(cluster: cluster_spec.Cluster) -> None:
    """Every task runs the same trainer.py flags: compared through the coordination service's
    key-value store (each task refuses on its side, in one line)."""
    from lingvo_lite.distributed import process_group

    ours = cluster_lib.command()
    if ours is None:
        return
    differ = process_group.agree_on("command", json.dumps(ours))
    if differ:
        task, theirs = next(iter(differ.items()))
        heartbeats.close_channel()  # Every task sees the difference and refuses on its side.
        raise UsageError(cluster_lib.command_mismatch_message(
            cluster, task, ours, json.loads(theirs)).removeprefix("trainer.py: error: "))


def lost_message(cluster: cluster_spec.Cluster, task: int | None, logdir: str,
                 reason: str = "") -> str:
    """The one line of a lost task (`cluster_spec.lost_task_message`), with the checkpoint."""
    from lingvo_lite.training import checkpointer

    latest = checkpointer.latest_checkpoint(logdir)
    kept = (f"the last checkpoint {latest} is intact" if latest
            else "no checkpoint was written")
    reason = reason or (f"it stopped answering for {cluster_lib.LOST_AFTER_S:.0f} s before "
                        "training ended")
    return cluster_spec.lost_task_message(
        cluster, task, reason, f"{kept}. Rerun every process with the same command to resume.")


def _supervised(job: Job, cluster: cluster_spec.Cluster, logdir: str, out: TextIO,
                err: TextIO) -> int:
    """Runs the task's job. A step that a lost task failed (a collective with a dead task, or
    one the coordination service aborted) is reported in one line naming the task: the job
    has left through its normal path (the lock released, the summaries closed). A finished
    task waits (bounded) at a barrier for the others to finish their last step."""
    from lingvo_lite.distributed import process_group

    try:
        status = job()
    except cluster_spec.peer_errors() as e:
        task, why = process_group.lost_task(e, cluster)
        print(lost_message(cluster, task, logdir, why), file=err, flush=True)
        return 1
    out.flush()
    err.flush()
    if status == 0:
        process_group.wait_for_all("finished", FINAL_WAIT_S)
    if cluster.is_chief:
        print(f"Chief: done (exit status {status}).", file=err, flush=True)
    else:
        print(f"Task {cluster.task_index}: done (exit status {status}); exiting.", file=err,
              flush=True)
    return status
