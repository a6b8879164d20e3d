"""Trains, evaluates and inspects registered models.

    .venv/bin/python trainer.py --model=image.AmoebaNetDigits --logdir=/tmp/amoeba --mode=train
    .venv/bin/tensorboard --logdir /tmp/amoeba
    .venv/bin/python trainer.py --model=image.AmoebaNetDigits --logdir=/tmp/amoeba --mode=eval
    .venv/bin/python trainer.py --mode=list_models
    .venv/bin/python trainer.py --model=image.AmoebaNetDigits --mode=inspect_model \\
        --inspect_num_cells=2,4
    .venv/bin/python trainer.py --model=image.AmoebaNetDigits --mode=plan --plan_devices=8 \\
        --plan_memory_per_device=16GiB

Each invocation is `lingvo_lite.training.main(RunOptions(...))` after this file declares where
the models live (`model_registry.add_model_package("model_params")`); that function's
docstring runs the modes that need no logdir in-process, as a tested example.

Modes:
  train           train to train.max_steps, resuming from the latest checkpoint in --logdir;
                  writes params.txt, model_analysis.txt, checkpoints/, and summaries in train/.
  eval            evaluate the latest checkpoint on --eval_splits (summaries in eval_<split>/).
  train_and_eval  train, evaluating every train.eval_interval_steps and at the end.
  decode          run the task's Decode (e.g. beam search + BLEU) on --eval_splits with the
                  latest checkpoint: metrics in eval_<split>/, output in decode_<split>/.
  export          write the latest checkpoint (or --export_checkpoint=<step or path>) as a
                  SavedModel with the task's serving signatures (its Inference()) to
                  <logdir>/export/<step>/, unpipelined: loadable with TensorFlow alone
                  (docs/export.md).
  list_models     list the registered models.
  inspect_params  print the task and input params (the format --*_params_override accepts).
  inspect_model   per-layer shapes, params, flops and the pipeline partition, without
                  allocating any weight (add --inspect_num_cells=2,4,8 to compare K). With
                  partition_cost='measured' it times each layer alone (with --logdir, cached
                  in <logdir>/layer_profile.json).
  check_equivalence  one train batch through the pipelined model (K, T, remat, schedule as
                  configured) and through the same layers unpipelined on one device: loss and
                  per-variable gradient differences, worst first; exit status 1 if one exceeds
                  --equivalence_tolerance. Needs no --logdir and writes nothing.
  plan            dry run: for --plan_devices=N devices of --plan_memory_per_device=16GiB each
                  (optionally --plan_device_flops=1e14, achieved FLOP/s), search cells K, data
                  replicas R, micro-batches T, schedule and remat; drop what does not fit the
                  memory model; rank the rest by predicted examples/s (schedule simulator);
                  print the top plans with per-device memory and time breakdown, why the best
                  beats the runner-up, and the flags that run it. Allocates no weight.

--profile_steps=N,M (train modes) captures global steps N..M with the TensorFlow profiler into
<logdir>/train (TensorBoard's profile tab) and writes the pipeline's Gantt chart with the
schedule's prediction and GPipe's Figure 4 breakdown (image pipeline/gantt), the breakdown as a
table with suggestions (text pipeline/breakdown, also printed), scalars pipeline/*, and a Chrome
trace <logdir>/train/pipeline_trace_M.json (Perfetto, chrome://tracing).

--tpu=<name> (train mode; 'local' on a TPU VM) trains under tf.distribute.TPUStrategy with
--num_replicas replicas of --num_cells cores, cell k on core k of each replica (not verified on
TPU hardware; docs/accelerators.md).

--model takes a registered name (`<module under model_params>.<Class>`) or the fully-qualified path
of a model params class, e.g. `tests.testdata_models.TinyMlp` (imported on demand; run from the
repository root or put the module's root on PYTHONPATH). `--model_modules` imports modules first so
their registered models appear in list_models.

TensorFlow's C++ start-up and INFO/WARNING logs are hidden unless --tf_logs is given or
TF_CPP_MIN_LOG_LEVEL is set; its Python INFO/WARNING lines (and those of the libraries it uses)
are hidden unless --tf_logs is given: by default only the project's own lines show.

A user error (unknown model or param, bad value, missing flag or directory, a logdir or data file
that cannot be read or written, a full disk) prints one line `trainer.py: error: ...` and exits
with status 1. SIGINT (Ctrl-C) or SIGTERM during start-up prints one line and exits with status
128 + the signal's number (docs/recovery.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

from absl import app, flags
from absl import logging as absl_logging

from lingvo_lite.training import interrupts
from lingvo_lite.training import options as options_lib

__all__ = ["main"]

TF_LOG_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"
# Where this repository's registered models live (`--model=image.AmoebaNetDigits` is
# `AmoebaNetDigits` in model_params/image.py).
MODEL_PACKAGE = "model_params"

# Modes that report progress (the others print one report): they say so while TensorFlow loads.
_SLOW_START_MODES = ("train", "train_and_eval", "eval", "decode", "export",
                     "check_equivalence")

_MODEL = flags.DEFINE_string("model", None, "Registered model name or module.path.ClassName.")
_LOGDIR = flags.DEFINE_string("logdir", None, "Directory of checkpoints and summaries.")
_MODE = flags.DEFINE_enum("mode", "train", options_lib.MODES, "What to do.")
_MODEL_PARAMS_OVERRIDE = flags.DEFINE_string(
    "model_params_override", "",
    "Overrides of the task params, 'name : value' separated by ';' or newlines, e.g. "
    "'train.learning_rate : 0.01; input.batch_size : 64'.")
_INPUT_PARAMS_OVERRIDE = flags.DEFINE_string(
    "input_params_override", "", "Overrides of the train input params (same format).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Overrides train.max_steps.")
_EVAL_SPLITS = flags.DEFINE_list("eval_splits", ["dev"], "Splits evaluated by eval modes.")
_NUM_LOGICAL_CPUS = flags.DEFINE_integer(
    "num_logical_cpus", None,
    "Logical CPU devices to create; default: the largest num_cells of any PipeliningLayer.")
_INTRA_OP_THREADS = flags.DEFINE_integer(
    "intra_op_threads", None, "TF intra-op threads (default: TF's).")
_INTER_OP_THREADS = flags.DEFINE_integer(
    "inter_op_threads", None, "TF inter-op threads (default: TF's).")
_NUM_CELLS = flags.DEFINE_integer(
    "num_cells", None, "Sets num_cells (K) of every PipeliningLayer in the params.")
_NUM_MICRO_BATCHES = flags.DEFINE_integer(
    "num_micro_batches", None, "Sets num_micro_batches (T) of every PipeliningLayer.")
_NUM_REPLICAS = flags.DEFINE_integer(
    "num_replicas", None,
    "Sets num_replicas (R, data-parallel replicas of the pipeline) of every PipeliningLayer; "
    "the run uses R x K devices.")
_SEED = flags.DEFINE_integer(
    "seed", None, "Sets the task's random_seed and the train input's seed.")
_INSPECT_NUM_CELLS = flags.DEFINE_list(
    "inspect_num_cells", [], "inspect_model: also report the partition for these K values.")
_PROFILE_STEPS = flags.DEFINE_string(
    "profile_steps", "",
    "'N,M': profile global steps N..M (TensorBoard profile tab, run 'train') and write the "
    "pipeline's Gantt chart, time breakdown and suggestions to TensorBoard and a Chrome trace "
    "to <logdir>/train.")
_MODEL_MODULES = flags.DEFINE_list(
    "model_modules", [], "Modules to import first so the models they register are known.")
_DETERMINISTIC = flags.DEFINE_boolean(
    "deterministic", False,
    "Use TensorFlow's deterministic ops: a run resumed after a crash then ends with weights "
    "bit-identical to an uninterrupted run's (may be slower).")

_SHARD_OPTIMIZER_STATE = flags.DEFINE_boolean(
    "shard_optimizer_state", False,
    "ZeRO-1: each of the --num_replicas data-parallel replicas keeps the optimizer slots of 1/R "
    "of every weight, updates that slice and all-gathers the weights; checkpoints keep the "
    "unsharded layout (resume with any R, sharded or not).")
_RESET_INPUT_POSITION = flags.DEFINE_boolean(
    "reset_input_position", False,
    "Resume from the latest checkpoint's weights but start the train input from its beginning "
    "instead of the checkpoint's input position; needed to resume with another "
    "input.batch_size (a saved position only fits the batch size it was saved with).")

_CLUSTER_MODE = flags.DEFINE_enum(
    "cluster_mode", "auto", options_lib.CLUSTER_MODES,
    "With a TF_CONFIG of several tasks: 'multi_client' (every task trains its own replicas on "
    "its own shard of the input, gradients summed across tasks), 'single_client' (task 0 "
    "drives the whole mesh; for a pipeline whose cells span hosts) or 'auto' (multi-client "
    "when num_replicas is a multiple of the number of tasks).")

_EQUIVALENCE_TOLERANCE = flags.DEFINE_float(
    "equivalence_tolerance", None,
    "check_equivalence: the largest accepted relative difference of the loss and of each "
    "gradient (default 1e-3: float32 rounding measured up to 7.2e-5; a broken layer gives ~0.6).")

_PLAN_DEVICES = flags.DEFINE_integer(
    "plan_devices", None, "plan: number of devices N to plan for (plans use R x K <= N).")
_PLAN_MEMORY_PER_DEVICE = flags.DEFINE_string(
    "plan_memory_per_device", None,
    "plan: memory of each device, e.g. 16GiB, 512MiB or 8GB (GB = 10^9 bytes, GiB = 2^30).")
_PLAN_DEVICE_FLOPS = flags.DEFINE_float(
    "plan_device_flops", None,
    "plan: achieved FLOP/s of one device (default 5e13, see lingvo_lite/analysis/planner.py).")

_EXPORT_CHECKPOINT = flags.DEFINE_string(
    "export_checkpoint", None,
    "export: the checkpoint to export, a global step (e.g. 400) or a checkpoint path "
    "(<logdir>/checkpoints/ckpt-400); default: the latest intact checkpoint.")

_TF_LOGS = flags.DEFINE_boolean(
    "tf_logs", False,
    "Show TensorFlow's logs: its C++ start-up lines (oneDNN, CUDA probing, CPU features) and "
    "INFO/WARNING messages, and its Python INFO/WARNING lines (e.g. deprecations, the session "
    "config of a multi-process run). By default only the project's own lines show.")

_TPU = flags.DEFINE_string(
    "tpu", None,
    "Train on this TPU (its name or grpc:// address; 'local' on a TPU VM) with "
    "tf.distribute.TPUStrategy: --num_replicas replicas of --num_cells cores, cell k on core k "
    "of each replica. Not verified on TPU hardware.")


class _DropCheckpointTimings(logging.Filter):
    """Drops TensorFlow's INFO line about checkpoint sharding, logged on every save."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding callback duration")


class _OnlyProjectLogs(logging.Filter):
    """Passes log records of this repository's code, and errors of any code (see --tf_logs)."""

    _ROOT = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def filter(self, record: logging.LogRecord) -> bool:
        path = os.path.abspath(record.pathname or "")
        own = path.startswith(self._ROOT) and "site-packages" not in path
        return own or record.levelno >= logging.ERROR


def _options() -> options_lib.RunOptions:
    return options_lib.RunOptions(
        model=_MODEL.value,
        logdir=_LOGDIR.value,
        mode=_MODE.value,
        model_params_override=_MODEL_PARAMS_OVERRIDE.value,
        input_params_override=_INPUT_PARAMS_OVERRIDE.value,
        max_steps=_MAX_STEPS.value,
        eval_splits=tuple(_EVAL_SPLITS.value),
        num_logical_cpus=_NUM_LOGICAL_CPUS.value,
        intra_op_threads=_INTRA_OP_THREADS.value,
        inter_op_threads=_INTER_OP_THREADS.value,
        num_cells=_NUM_CELLS.value,
        num_micro_batches=_NUM_MICRO_BATCHES.value,
        num_replicas=_NUM_REPLICAS.value,
        seed=_SEED.value,
        inspect_num_cells=tuple(
            options_lib.parse_int_list("inspect_num_cells", _INSPECT_NUM_CELLS.value)),
        model_modules=tuple(_MODEL_MODULES.value),
        deterministic=_DETERMINISTIC.value,
        profile_steps=_PROFILE_STEPS.value,
        tpu=_TPU.value,
        reset_input_position=_RESET_INPUT_POSITION.value,
        shard_optimizer_state=_SHARD_OPTIMIZER_STATE.value,
        cluster_mode=_CLUSTER_MODE.value,
        equivalence_tolerance=_EQUIVALENCE_TOLERANCE.value,
        plan_devices=_PLAN_DEVICES.value,
        plan_memory_per_device=_PLAN_MEMORY_PER_DEVICE.value,
        plan_device_flops=_PLAN_DEVICE_FLOPS.value,
        export_checkpoint=_EXPORT_CHECKPOINT.value,
    )


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        print(f"trainer.py: error: unexpected arguments {argv[1:]}; flags look like "
              "--name=value.", file=sys.stderr)
        sys.exit(1)
    try:
        opts = _options()
        opts.validate()
    except options_lib.UsageError as e:
        print(f"trainer.py: error: {e}", file=sys.stderr)
        sys.exit(1)
    if opts.mode in options_lib.TRAIN_MODES and os.environ.get("TF_CONFIG", "").strip():
        _claim_cluster_address()
    absl_logging.get_absl_logger().addFilter(_DropCheckpointTimings())
    if not _TF_LOGS.value:
        # TensorFlow's Python INFO/WARNING lines (a 20-line "default session config" dump in
        # multi-process runs, deprecation notices): only the project's own lines by default.
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
        absl_logging.get_absl_handler().addFilter(_OnlyProjectLogs())
    interrupts.maybe_signal_self("start")
    if opts.mode in _SLOW_START_MODES:
        # Loading TensorFlow and the model takes 3 s on an idle machine, 20 s on a busy one.
        print(f"Starting --mode={opts.mode}: loading TensorFlow and {opts.model}...", flush=True)
    if not _TF_LOGS.value and TF_LOG_LEVEL_ENV not in os.environ:
        os.environ[TF_LOG_LEVEL_ENV] = "2"  # C++ errors only, once its logging is set up.
        _import_tensorflow_quietly()
    # Imported only now: it loads TensorFlow, which the checks above do not need.
    from lingvo_lite.tasks import model_registry
    from lingvo_lite.training import runner

    model_registry.add_model_package(MODEL_PACKAGE)

    _exit_promptly(runner.main(opts))


def _claim_cluster_address() -> None:
    """A task of a multi-process run: checks TF_CONFIG, claims this task's port and starts its
    heartbeats before TensorFlow loads (a taken port, a second process with the same task
    index, or another process's different TF_CONFIG then cost a second, not a hang)."""
    from lingvo_lite.training import cluster

    try:
        config = cluster.from_environment()
        if config is not None:
            cluster.open_channel(config, sorted(sys.argv[1:]))
    except options_lib.UsageError as e:
        print(f"trainer.py: error: {e}", file=sys.stderr, flush=True)
        cluster.announce_failure(str(e))  # The other tasks end too instead of waiting.
        _exit_promptly(1)


def _exit_promptly(status: int) -> None:
    """Ends the process as soon as the run's output is out.

    Everything the run writes is complete when `runner.main` returns (checkpoints are saved
    synchronously and synced, summary writers closed, results files closed). What is left is
    interpreter teardown: garbage-collecting TensorFlow's graphs, functions and input pipelines,
    joining its thread pools and destroying a cluster's gRPC server, which took 3-44 s after
    `Done:` (a user thinks the run hung). So flush the streams and logs, then exit at once.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(status)


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow with file descriptor 2 captured in a temporary file.

    TensorFlow's C++ start-up lines are printed before TF_CPP_MIN_LOG_LEVEL takes effect, so
    only capturing them hides them. They are replayed when the import fails.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # Probes CUDA (more start-up lines).
        except BaseException:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.buffer.write(captured.read())
            sys.stderr.flush()
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a malformed flag reported as one `trainer.py: error:` line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        print(f"trainer.py: error: {' '.join(str(e).split())}; run with --helpfull for the "
              "flags and their types.", file=sys.stderr)
        sys.exit(1)


def _run() -> None:
    """app.run(main) with SIGINT/SIGTERM before setup (importing TensorFlow) as one line."""
    interrupts.raise_on_signals_for_process()
    try:
        app.run(main, flags_parser=_parse_flags)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, interrupts.Interrupted) else signal.SIGINT
        interrupts.maybe_signal_self("interrupted")
        print(f"trainer.py: interrupted by {interrupts.signal_name(signum)} during start-up; "
              "nothing was saved.", file=sys.stderr, flush=True)
        if interrupts.late_signals():
            late = sorted({interrupts.signal_name(s) for s in interrupts.late_signals()})
            print(f"trainer.py: note: {', '.join(late)} received again while stopping; ignored.",
                  file=sys.stderr, flush=True)
        sys.exit(interrupts.exit_status(signum))


if __name__ == "__main__":
    _run()
