"""`main(options)`: what `trainer.py` does for each --mode, with user errors as one-line messages.

Each invocation has two phases:
  1. setup (`prepare`): validate the options, resolve the model and overrides, configure the
     logical devices, build the task and input, restore the latest checkpoint, trace the step.
     Nothing is written to the log directory but the layer-time cache of
     partition_cost='measured' pipelines (`layer_profile.json`). A user error here
     (`ValueError` -- including `UsageError` --, `KeyError`, `AttributeError`,
     `FileNotFoundError`) or an `OSError` of the environment (permissions, a full disk) is
     printed as `trainer.py: error: <message>` and `main` returns 1, without a traceback.
  2. the job: train / evaluate / print. A `TrainingError` (a write that failed mid-run, bad
     data met mid-run, too many non-finite steps) is printed the same way; other exceptions
     here are bugs and propagate.
SIGINT/SIGTERM outside the training loop (which saves and stops by itself) prints
`trainer.py: interrupted by SIG...` and returns 128 + the signal's number.
"""

from __future__ import annotations

import errno
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from lingvo_lite.training import interrupts, model_config
from lingvo_lite.training.options import (
    TRAIN_MODES,
    RunOptions,
    TrainingError,
    UsageError,
    parse_profile_steps,
    tensorboard_command,
)

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["main", "prepare"]

USER_ERRORS = (ValueError, KeyError, AttributeError, FileNotFoundError)
Job = Callable[[], int]


def _message(e: BaseException) -> str:
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(str(text).split())


def main(options: RunOptions, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Runs one trainer invocation; returns the process exit status.

    SIGINT and SIGTERM raise `Interrupted` during setup and outside the training loop, which
    stops at a step boundary itself; after the first, further signals are only noted.

    `trainer.py --mode=M` runs `main(RunOptions(mode=M, ...))`; the modes that need no logdir
    run in-process in a moment (the others: docs/models.md):

    >>> import io
    >>> from lingvo_lite.tasks import model_registry
    >>> from lingvo_lite.training import RunOptions, main
    >>> model_registry.add_model_package("model_params")      # As trainer.py does.
    >>> out = io.StringIO()
    >>> main(RunOptions(mode="list_models"), out=out)
    0
    >>> "image.AmoebaNetDigits" in out.getvalue()
    True
    >>> out = io.StringIO()
    >>> main(RunOptions(mode="inspect_params", model="image.AmoebaNetDigits",
    ...                 model_params_override="train.learning_rate : 0.01"), out=out)
    0
    >>> [line for line in out.getvalue().splitlines() if line.startswith("train.learning_rate ")]
    ['train.learning_rate : 0.01']
    >>> out = io.StringIO()
    >>> main(RunOptions(mode="inspect_model", model="image.AmoebaNetDigits",
    ...                 inspect_num_cells=[2]), out=out)                  # No weight allocated.
    0
    >>> print(out.getvalue().split("Partition of ")[1].splitlines()[0])
    7 layers into 2 cells by flops
    >>> err = io.StringIO()
    >>> main(RunOptions(mode="train", model="image.AmoebaNetDigits"), err=err)  # A user error:
    1
    >>> print(err.getvalue().strip())  # doctest: +ELLIPSIS
    trainer.py: error: --logdir is required for --mode=train; pass the run's directory, ...
    """
    out = out or sys.stdout
    err = err or sys.stderr
    with interrupts.raise_on_signals(reset=True):
        status = _main(options, out, err)
        late = sorted({interrupts.signal_name(s) for s in interrupts.late_signals()})
        if late:
            print(f"trainer.py: note: {', '.join(late)} received again while stopping; "
                  "ignored.", file=err, flush=True)
        return status


def _setup_failed(message: str, err: TextIO) -> int:
    """Prints a setup error; in a task of a cluster, tells the other tasks (bounded)."""
    print(f"trainer.py: error: {message}", file=err, flush=True)
    from lingvo_lite.training import cluster

    cluster.announce_failure(message)
    return 1


def _main(options: RunOptions, out: TextIO, err: TextIO) -> int:
    try:
        job = prepare(options, out, err)
    except USER_ERRORS as e:
        return _setup_failed(_message(e), err)
    except OSError as e:  # The environment (permissions, a full disk), not a bug.
        return _setup_failed(_os_error_message(e), err)
    except KeyboardInterrupt as e:
        return _interrupted(e, " during setup", err)
    try:
        return job()
    except TrainingError as e:
        print(f"trainer.py: error: {_message(e)}", file=err, flush=True)
        return 1
    except OSError as e:  # E.g. eval results that cannot be written.
        print(f"trainer.py: error: {_os_error_message(e)}", file=err, flush=True)
        return 1
    except KeyboardInterrupt as e:  # Outside the training loop, which saves and returns.
        return _interrupted(e, "", err, options)


def _os_error_message(e: OSError) -> str:
    """One line for an OSError of the environment: the path, the reason and what to check."""
    path = e.filename if e.filename is not None else "a file"
    reason = e.strerror or type(e).__name__
    fix = {errno.EACCES: "fix its permissions or run as a user who may access it",
           errno.EPERM: "fix its permissions or run as a user who may access it",
           errno.EROFS: "the file system is read-only; choose a writable location",
           errno.ENOSPC: "free disk space",
           errno.EDQUOT: "free space within your disk quota"}.get(e.errno, "check it")
    return f"cannot access {path}: {reason}; {fix}."


def _interrupted(e: KeyboardInterrupt, when: str, err: TextIO,
                 options: RunOptions | None = None) -> int:
    signum = e.signum if isinstance(e, interrupts.Interrupted) else signal.SIGINT
    interrupts.maybe_signal_self("interrupted")
    saved = "nothing was saved"
    if options is not None and options.mode in TRAIN_MODES and options.logdir:
        from lingvo_lite.training import checkpointer

        latest = checkpointer.latest_checkpoint(options.abs_logdir)
        if latest:
            saved = f"the last checkpoint {latest} is intact"
    print(f"trainer.py: interrupted by {interrupts.signal_name(signum)}{when}; {saved}.",
          file=err, flush=True)
    return interrupts.exit_status(signum)


def _printer(text: str, out: TextIO) -> Job:
    def job() -> int:
        out.write(text if text.endswith("\n") else text + "\n")
        out.flush()
        return 0

    return job


def prepare(options: RunOptions, out: TextIO, err: TextIO | None = None) -> Job:
    """Setup phase (see the module docstring); returns the job to run.

    Warnings (e.g. a damaged checkpoint skipped) go to `err` (default: `out`).
    """
    err = err or out
    options.validate()
    if options.mode == "list_models":
        return _printer(model_config.list_models_text(list(options.model_modules)), out)
    config = model_config.build_model_config(options)
    if options.mode == "inspect_params":
        return _printer(model_config.describe_params(config, list(options.eval_splits)), out)
    if options.mode == "inspect_model":
        from lingvo_lite.analysis import model_analysis

        _check_batch_splits(config, "inspect_model")
        if model_config.uses_measured_costs(config.task_params):
            _prepare_layer_timing(options, config)
        return _printer(model_analysis.describe_model(
            config.name, config.task_params, list(options.inspect_num_cells),
            read_input=True), out)
    if options.mode == "check_equivalence":
        return _prepare_check_equivalence(options, config, out, err)
    if options.mode == "plan":
        from lingvo_lite.analysis import planner
        from lingvo_lite.training import plan_mode

        print(f"Searching plans for {config.name} on {options.plan_devices} device(s): cells, "
              "replicas, micro-batches, schedule and remat, each simulated (this can take a "
              "minute)...", file=out, flush=True)
        return _printer(plan_mode.plan_text(
            config.name, config.task_params, options.plan_devices,
            planner.parse_size(options.plan_memory_per_device), options.plan_device_flops,
            options.model_params_override), out)
    return _prepare_run(options, config, out, err)


def _check_batch_splits(config: model_config.ModelConfig, mode: str) -> None:
    """UsageError (one line) when a pipeline's mini-batch does not split as configured.

    E.g. num_micro_batches not dividing the batch: inspect_model would otherwise leave out the
    prediction without a word, check_equivalence fail with a traceback around the message.
    """
    from lingvo_lite.pipeline import step_layout

    for path, p in model_config.iter_pipelining_params(config.task_params):
        batch = step_layout.global_batch_size(p)
        if batch is None:
            continue
        try:
            step_layout.resolve(p, batch)
        except ValueError as e:
            raise UsageError(f"--mode={mode}: PipeliningLayer '{path}': {_message(e)}") from None


def _prepare_layer_timing(options: RunOptions, config: model_config.ModelConfig) -> None:
    """inspect_model with partition_cost='measured': time layers as training would.

    The same logical devices and thread pools as a train run (the profile's key holds the
    device kind and thread count), and with --logdir the run's cached layer profile.
    """
    from lingvo_lite.core import devices

    num_cpus = options.num_logical_cpus or model_config.auto_num_logical_cpus(config.task_params)
    devices.configure_logical_cpus(num_cpus, options.intra_op_threads, options.inter_op_threads)
    if options.logdir:
        model_config.set_layer_profile_paths(config.task_params, options.abs_logdir)


def _prepare_check_equivalence(options: RunOptions, config: model_config.ModelConfig,
                               out: TextIO, err: TextIO) -> Job:
    """Setup of check_equivalence: devices, the task with fresh weights, one train batch."""
    if not list(model_config.iter_pipelining_params(config.task_params)):
        raise UsageError(
            f"--mode=check_equivalence: model {config.name} has no PipeliningLayer, so there is "
            "no pipeline to compare with the unpipelined model.")
    _check_batch_splits(config, "check_equivalence")
    from lingvo_lite.core import devices

    num_cpus = options.num_logical_cpus or model_config.auto_num_logical_cpus(config.task_params)
    devices.configure_logical_cpus(num_cpus, options.intra_op_threads, options.inter_op_threads)
    import tensorflow as tf

    from lingvo_lite.analysis import equivalence
    from lingvo_lite.core.nested_map import NestedMap

    if options.deterministic:
        tf.config.experimental.enable_op_determinism()
    if options.seed is not None:
        tf.random.set_seed(options.seed)
    task = config.task_params.Instantiate()
    batch = NestedMap(next(iter(config.train_input_params.Instantiate().dataset())))
    tolerance = options.equivalence_tolerance or equivalence.DEFAULT_TOLERANCE
    print(f"Model {config.name}, mode check_equivalence, {num_cpus} logical CPU device(s).",
          file=out, flush=True)

    def job() -> int:
        print("Running one train batch through the pipelined step and through the unpipelined "
              "reference (each is traced first; this can take a minute)...", file=out,
              flush=True)
        try:
            report = equivalence.check_equivalence(task, batch, tolerance=tolerance)
        except ValueError as e:  # The configuration does not fit this batch: the user's to fix.
            print(f"trainer.py: error: --mode=check_equivalence: {_message(e)}", file=err,
                  flush=True)
            return 1
        out.write(report.format())
        out.flush()
        if report.passed:
            return 0
        print(f"trainer.py: error: check_equivalence failed: "
              f"{report.verdict().removeprefix('FAIL: ')}", file=err, flush=True)
        return 1

    return job


def _prepare_run(options: RunOptions, config: model_config.ModelConfig, out: TextIO,
                 err: TextIO) -> Job:
    """Setup of train / eval / train_and_eval / decode / export."""
    eval_splits = {}
    if options.mode in ("eval", "train_and_eval", "decode"):
        eval_splits = {s: config.eval_input_params(s) for s in options.eval_splits}
    tpu_run = _tpu_run(options, config) if options.mode in TRAIN_MODES else None
    if tpu_run is not None:
        return _prepare_tpu_train(options, config, tpu_run, out, err)
    num_cpus = options.num_logical_cpus or model_config.auto_num_logical_cpus(config.task_params)
    cluster = None
    if options.mode in TRAIN_MODES:
        from lingvo_lite.training import cluster as cluster_lib

        cluster = cluster_lib.from_environment()
    if cluster is not None:
        from lingvo_lite.training import multi_client

        if multi_client.choose_mode(options, cluster, config.task_params) == \
                multi_client.MULTI_CLIENT:  # Every task a client of its own replicas.
            return multi_client.prepare(options, config, cluster, eval_splits, out, err,
                                        locked=_locked)
        if cluster_lib.channel() is not None:  # Single-client: the channel compares flags.
            cluster_lib.channel().set_mode(multi_client.SINGLE_CLIENT)
        # The mesh's R x K devices are spread evenly over the tasks; each serves its share.
        num_cpus = cluster_lib.devices_per_task(
            cluster, model_config.auto_num_logical_cpus(config.task_params))
        model_config.set_pipeline_fields(config.task_params, placement="cluster")

    from lingvo_lite.core import devices  # TensorFlow is imported (no op has run yet).

    devices.configure_logical_cpus(num_cpus, options.intra_op_threads, options.inter_op_threads)

    import tensorflow as tf

    if cluster is not None:
        cluster_lib.start_server(cluster, num_cpus)
        if not cluster.is_chief:
            return _serve(cluster, options, config, num_cpus, out, err)

    if options.deterministic:
        tf.config.experimental.enable_op_determinism()
    if options.seed is not None:
        tf.random.set_seed(options.seed)
    for params in eval_splits.values():
        params.Instantiate()  # Validates the eval input params now rather than mid-run.
    logdir = options.abs_logdir
    model_config.set_layer_profile_paths(config.task_params, logdir)
    watch = ("" if options.mode == "export"  # Writes no summaries.
             else f"\nWatch it with: {tensorboard_command()} --logdir {logdir}")
    print(f"Model {config.name}, mode {options.mode}, {num_cpus} logical CPU device(s).\n"
          f"Logdir: {logdir}{watch}", file=out, flush=True)

    if options.mode == "eval":
        return _prepare_eval(config, logdir, eval_splits, out, err)
    if options.mode == "decode":
        from lingvo_lite.training import decoding

        return decoding.prepare_decode(config, logdir, eval_splits, out, err)
    if options.mode == "export":
        from lingvo_lite.training import export

        return export.prepare_export(config, logdir, options.export_checkpoint, out, err)
    if cluster is not None:
        locked_job = _locked(
            logdir, err, lambda: _prepare_chief(cluster, options, config, logdir, eval_splits,
                                                out, err),
            on_acquired=lambda lock: cluster_lib.before_exit(lock.release))

        def chief_main() -> int:
            status = locked_job()  # Releases the lock, also after SIGINT/SIGTERM.
            # TensorFlow's gRPC server cannot be stopped and keeps the interpreter from exiting.
            out.flush()
            err.flush()
            cluster_lib.exit_now(f"Chief: done (exit status {status}).", status=status)
            return status

        return chief_main
    return _locked(logdir, err, lambda: _prepare_train(options, config, logdir, eval_splits,
                                                       out, err))


def _tpu_run(options: RunOptions, config: model_config.ModelConfig
             ) -> tuple[int, int, str] | None:
    """(R, K, what asked for it) when this run trains on TPUs, else None.

    A run trains on TPUs with --tpu, or when a PipeliningLayer has placement='tpu'.
    """
    pipelines = list(model_config.iter_pipelining_params(config.task_params))
    on_tpu = [path for path, pp in pipelines if pp.placement == "tpu"]
    if options.tpu is None and not on_tpu:
        return None
    source = (f"--tpu={options.tpu}" if options.tpu is not None
              else f"PipeliningLayer '{on_tpu[0]}' has placement='tpu'")
    if not pipelines:
        raise UsageError(f"{source}: model {options.model} has no PipeliningLayer to place on "
                         "TPU cores; drop --tpu.")
    if options.mode != "train":
        raise UsageError(
            f"{source}: only --mode=train runs on TPUs; train with --mode=train, then "
            "evaluate the checkpoints with --mode=eval and placement 'cpu' or 'gpu'.")
    replicas = sorted({pp.num_replicas for _, pp in pipelines})
    if len(replicas) > 1:
        raise UsageError(
            f"{source}: the PipeliningLayers ask for different num_replicas {replicas}, but "
            "one TPUStrategy replicates the whole step; set one value with --num_replicas.")
    return replicas[0], max(pp.num_cells for _, pp in pipelines), source


def _prepare_tpu_train(options: RunOptions, config: model_config.ModelConfig,
                       tpu_run: tuple[int, int, str], out: TextIO, err: TextIO) -> Job:
    """Setup of --mode=train on a TPU: a TPUStrategy of R replicas of K cores, then the task.

    The strategy is made before any variable: the task is built in its scope and each of its
    R replicas runs a one-replica pipeline (cell k on the replica's logical core k); the
    pipeline sums the gradients over the replicas with the replica context's all-reduce.
    Not verified on TPU hardware (see docs/accelerators.md).
    """
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(options.num_logical_cpus or 1, options.intra_op_threads,
                                   options.inter_op_threads)
    import tensorflow as tf

    from lingvo_lite.distributed import tpu

    num_replicas, num_cells, source = tpu_run
    try:
        strategy = tpu.create_tpu_strategy(num_replicas, num_cells, options.tpu or "")
    except ValueError as e:
        raise UsageError(f"{source}: {e}") from None
    model_config.set_pipeline_fields(config.task_params, num_replicas=1, placement="tpu")
    if options.deterministic:
        tf.config.experimental.enable_op_determinism()
    if options.seed is not None:
        tf.random.set_seed(options.seed)
    logdir = options.abs_logdir
    model_config.set_layer_profile_paths(config.task_params, logdir)
    print(f"Model {config.name}, mode train, TPUStrategy of {num_replicas} replica(s) x "
          f"{num_cells} core(s).\nLogdir: {logdir}\nWatch it with: {tensorboard_command()} "
          f"--logdir {logdir}", file=out, flush=True)
    return _locked(logdir, err, lambda: _prepare_train(options, config, logdir, {}, out, err,
                                                       strategy=strategy))


def _serve(cluster, options: RunOptions, config: model_config.ModelConfig, num_cpus: int,
           out: TextIO, err: TextIO) -> Job:
    """A non-chief task: serve this task's devices until the chief is gone."""
    from lingvo_lite.training import cluster as cluster_lib
    from lingvo_lite.training import multi_client

    chief = cluster.addresses[0]
    me = cluster.addresses[cluster.task_index]
    max_steps = config.task_params.train.max_steps

    lost: list[int] = []

    def job() -> int:
        print(f"Task {cluster.task_index} of {cluster.num_tasks} serving {num_cpus} device(s) at "
              f"{me} for the chief (task 0 at {chief}).", file=out, flush=True)
        cluster_lib.Watchdog(cluster, [0], lambda t, _: lost.append(t),
                             start_timeout_s=cluster_lib.CHIEF_START_TIMEOUT_S).start()
        cluster_lib.close_when_agreed([0])  # The flags were compared: one open port from here.
        served = False  # Whether the chief's server was up once (then gone means ended).
        while True:  # Serving is TensorFlow's; this thread waits for the chief's end.
            time.sleep(1.0)
            up = cluster_lib.reachable(chief)
            served = served or up
            if (served and not up) or lost:
                if _finished(options.abs_logdir, max_steps):
                    print(f"Task {cluster.task_index}: the chief finished; exiting.", file=out,
                          flush=True)
                    return 0
                print(multi_client.lost_message(cluster, 0, options.abs_logdir, "it is gone"
                                                if not up else ""), file=err, flush=True)
                return 1

    return job


def _prepare_chief(cluster, options: RunOptions, config: model_config.ModelConfig, logdir: str,
                   eval_splits: dict, out: TextIO, err: TextIO) -> Job:
    """The chief (task 0): wait for the other tasks, then train as the cluster's one client."""
    from lingvo_lite.distributed import cluster_spec
    from lingvo_lite.training import cluster as cluster_lib
    from lingvo_lite.training import multi_client

    others = list(range(1, cluster.num_tasks))
    deadline = time.monotonic() + cluster_lib.CHIEF_START_TIMEOUT_S
    print(f"Chief of {cluster.num_tasks} tasks: waiting for tasks {others} to serve.", file=out,
          flush=True)
    for t in others:
        while not cluster_lib.reachable(cluster.addresses[t]):
            if time.monotonic() > deadline:
                raise ValueError(
                    f"TF_CONFIG task {t} ({cluster.addresses[t]}) did not start serving within "
                    f"{cluster_lib.CHIEF_START_TIMEOUT_S:.0f} s; start trainer.py on every task "
                    "with its own TF_CONFIG.")
            time.sleep(0.5)

    cluster_lib.close_when_agreed(others)  # The flags were compared: one open port from here.

    def task_lost(task: int | None, address: str = "") -> None:
        # A step blocked on a stopped task is ended by nothing TensorFlow offers a single
        # client (bench/single_client_probe.py): the process ends here, its lock released.
        cluster_lib.exit_now(multi_client.lost_message(cluster, task, logdir))

    watchdog = cluster_lib.Watchdog(cluster, others, task_lost).start()
    job = _prepare_train(options, config, logdir, eval_splits, out, err)

    def chief_job() -> int:
        try:
            status = job()
        except cluster_spec.peer_errors() as e:
            # A step that reached a dead task fails at once; name the task like the watchdog.
            match = re.search(r"/job:\w+/replica:\d+/task:(\d+)", str(e))
            task = int(match.group(1)) if match else None
            if task is None:  # E.g. "Connection reset by peer": the task that stopped answering.
                task = next((t for t in others
                             if not cluster_lib.reachable(cluster.addresses[t])), None)
            task_lost(task)
        finally:
            watchdog.stop()
        return status

    return chief_job


def _finished(logdir: str, max_steps: int) -> bool:
    """Whether the chief's checkpoints (in a logdir this task can read) reached max_steps."""
    from lingvo_lite.training import checkpointer

    latest = checkpointer.latest_checkpoint(logdir) if logdir else None
    return latest is not None and checkpointer.checkpoint_step(latest) >= max_steps


def _locked(logdir: str, err: TextIO, prepare_job: Callable[[], Job],
            on_acquired: Callable[[object], None] | None = None) -> Job:
    """Takes the logdir lock, runs `prepare_job`; the returned job releases the lock at its end.

    The lock is also released when setup fails or is interrupted (and a logdir it created is
    removed if empty). `on_acquired(lock)` runs once the lock is taken (a cluster's chief
    registers its release for the exits that skip `finally`).
    """
    from lingvo_lite.training import logdir_lock

    # SIGINT and SIGTERM raise here (main's raise_on_signals; the default SIGTERM would kill the
    # process and leave the lock behind); the training loop itself stops at a step boundary.
    lock = logdir_lock.LogdirLock(logdir)
    lock.acquire(note=lambda msg: print(f"trainer.py: note: {msg}", file=err, flush=True))
    if on_acquired is not None:
        on_acquired(lock)
    try:
        job = prepare_job()
    except BaseException:
        lock.release()
        raise

    def locked_job() -> int:
        try:
            return job()
        finally:
            lock.release()
            if lock.release_error:
                print(f"trainer.py: note: {lock.release_error}; the next run takes it over "
                      "(its owner is gone).", file=err, flush=True)

    return locked_job


def _prepare_train(options: RunOptions, config: model_config.ModelConfig, logdir: str,
                   eval_splits: dict, out: TextIO, err: TextIO,
                   strategy: tf.distribute.Strategy | None = None) -> Job:
    """Setup of train / train_and_eval (under the logdir lock)."""
    from lingvo_lite.analysis import model_analysis
    from lingvo_lite.training import checkpointer, loop

    task_params = config.task_params
    loop.check_train_params(task_params.train)
    latest = checkpointer.latest_checkpoint(logdir)
    max_steps = task_params.train.max_steps
    if options.profile_steps:
        _check_profilable(task_params)
    if latest is not None and checkpointer.checkpoint_step(latest) >= max_steps:
        step = checkpointer.checkpoint_step(latest)
        done = (f"Already at global step {step} >= max_steps={max_steps} ({latest}): nothing "
                "to train. Raise --max_steps to train further.")
        if not (options.mode == "train_and_eval" and eval_splits):
            return _printer(done, out)
        # Training is complete: train_and_eval re-evaluates the final checkpoint.
        evaluate = _prepare_eval(config, logdir, eval_splits, out, err)

        def done_and_eval() -> int:
            print(done, file=out, flush=True)
            return evaluate()

        return done_and_eval
    eval_spec = None
    if options.mode in TRAIN_MODES and eval_splits:
        eval_spec = loop.EvalSpec(eval_splits, task_params.eval.max_eval_batches)
    trainer = loop.Trainer.build(
        task_params=task_params, logdir=logdir, params_text=task_params.ToText(),
        analysis_text=model_analysis.describe_model(config.name, task_params),
        eval_spec=eval_spec, out=out, err=err, strategy=strategy,
        reset_input_position=options.reset_input_position)
    if options.profile_steps:
        from lingvo_lite.training import profiling

        first, last = parse_profile_steps(options.profile_steps)
        start = trainer.global_step + 1
        if first < start or last > max_steps:
            what = ("none of them" if last < start or first > max_steps else
                    f"only steps {max(first, start)}..{min(last, max_steps)}")
            print(f"trainer.py: warning: --profile_steps={options.profile_steps} asks for steps "
                  f"this run does not train (it trains steps {start}..{max_steps}); "
                  f"{what} will be profiled.", file=err, flush=True)
        trainer.profiler = profiling.StepProfiler(
            logdir, max(first, start), min(last, max_steps),
            description=profiling.PipelineDescription.from_task_params(config.name, task_params),
            out=out)
    return trainer.run


def _check_profilable(task_params) -> None:
    """--profile_steps needs every cell op in the trace; serial cells hide theirs."""
    serial = [path for path, pp in model_config.iter_pipelining_params(task_params)
              if pp.serial_devices]
    if serial:
        raise UsageError(
            f"--profile_steps cannot map a step whose pipeline {serial[0]} runs with "
            "serial_devices=True: TensorFlow's single-threaded executor does not report the "
            "ops inside each cell call to the profiler. Profile with "
            f"--model_params_override='{serial[0]}.serial_devices : False'.")


def _prepare_eval(config: model_config.ModelConfig, logdir: str,
                  eval_splits: dict, out: TextIO, err: TextIO) -> Job:
    from lingvo_lite.training import checkpointer, loop, summaries

    if not checkpointer.candidate_checkpoints(logdir):
        raise FileNotFoundError(
            f"no checkpoint in {checkpointer.checkpoint_dir(logdir)}, train first "
            f"(--mode=train with the same --logdir).")
    task = config.task_params.Instantiate()

    def warn(msg: str) -> None:
        print(f"trainer.py: warning: {msg}", file=err, flush=True)

    # The newest intact checkpoint: a damaged one is skipped with a warning (and left in place).
    ckpt = checkpointer.Checkpointer(logdir, task.checkpoint_variables(), warn=warn)
    latest = ckpt.restore_latest()
    step = checkpointer.checkpoint_step(latest)
    max_batches = config.task_params.eval.max_eval_batches

    def job() -> int:
        print(f"Evaluating {latest} (global step {step}).", file=out, flush=True)
        writers = summaries.SummaryWriters(logdir)
        try:
            for split, params in eval_splits.items():
                metrics = loop.evaluate_split(task, params, max_batches)
                path = loop.write_eval_results(logdir, split, step, metrics, writers)
                print(f"eval {split} @ step {step} ({path}):\n"
                      + loop.format_metrics(metrics).rstrip(), file=out, flush=True)
        finally:
            writers.close()
        return 0

    return job
