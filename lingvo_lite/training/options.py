"""RunOptions: what one `trainer.py` invocation asks for, and the checks that need no TensorFlow.

`trainer.py` turns its flags into a `RunOptions`; tests and notebooks build one directly. The
checks here (required flags, value ranges, the log directory's parent) run before TensorFlow or any
model module is imported, so a mistyped command line fails in a fraction of a second.

Every user error is raised as `UsageError` (a ValueError) whose message names the flag or param
and says how to fix it; `runner.main` prints it as one line and exits with status 1.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

__all__ = [
    "MODES",
    "parse_int_list",
    "parse_profile_steps",
    "RunOptions",
    "TrainingError",
    "UsageError",
]

MODES = ("train", "eval", "train_and_eval", "decode", "export", "list_models",
         "inspect_params", "inspect_model", "check_equivalence", "plan")
TRAIN_MODES = ("train", "train_and_eval")
LOGDIR_MODES = ("train", "eval", "train_and_eval", "decode", "export")
CLUSTER_MODES = ("auto", "single_client", "multi_client")


class UsageError(ValueError):
    """A mistake on the command line or in an override; the message says how to fix it."""


class TrainingError(RuntimeError):
    """A run stopped on a condition the user must act on (e.g. too many non-finite steps).

    `runner.main` prints the message as one line and returns 1; the checkpoints stay intact.
    """


@dataclasses.dataclass
class RunOptions:
    """One trainer invocation; field names mirror the `trainer.py` flags.

    Attributes:
      model: registered model name (`image.AmoebaNetDigits`) or the fully-qualified path of a
        model params class (`tests.testdata_models.TinyMlp`), imported on demand.
      logdir: directory of checkpoints, summaries, params.txt and model_analysis.txt.
      mode: one of MODES.
      model_params_override: `name : value` lines (newline- or `;`-separated) applied to the task
        params, whose `input.*` holds the train input params.
      input_params_override: the same, applied to the train input params.
      max_steps: overrides `train.max_steps`.
      eval_splits: splits evaluated in eval / train_and_eval mode.
      num_logical_cpus: logical CPU devices to create; None = the largest `num_cells` of any
        PipeliningLayer in the task params (at least 1).
      intra_op_threads, inter_op_threads: TF thread-pool sizes; None keeps TF's defaults.
      num_cells, num_micro_batches, num_replicas: override these fields in every
        PipeliningLayer's params (num_replicas: data-parallel replicas, R x K devices).
      seed: sets the task's `random_seed` (weights, dropout) and the train input's `seed`.
      inspect_num_cells: extra K values whose partition `inspect_model` reports.
      model_modules: modules imported first so that the models they register are known.
      deterministic: enable TensorFlow's deterministic ops (`enable_op_determinism`), so a run
        and its resumption after a crash give bit-identical weights (may be slower).
      profile_steps: 'N,M': capture global steps N..M with the TF profiler and write the
        pipeline's Gantt chart and time breakdown (see `profiling`); '' = off.
      equivalence_tolerance: check_equivalence fails when the loss or a gradient differs by
        more than this (relative; see `equivalence.relative_difference`); None =
        `equivalence.DEFAULT_TOLERANCE`.
      reset_input_position: resume from the latest checkpoint's weights but start the train
        input from its beginning instead of the checkpoint's input position (needed after
        changing `input.batch_size`: a saved position only fits the batch size it was saved
        with). The run then no longer sees the same batches as an uninterrupted one.
      plan_devices, plan_memory_per_device, plan_device_flops: --mode=plan's number of
        devices, memory per device ('16GiB', '512MiB', '8GB') and achieved FLOP/s per device
        (None: `planner.DEFAULT_DEVICE_FLOPS`).
      cluster_mode: with a TF_CONFIG of several tasks, 'multi_client' (every task a client of
        its own replicas, training/multi_client.py), 'single_client' (task 0 the one client
        of the whole mesh, training/cluster.py) or 'auto' (multi-client when every replica's
        cells fit on one task, i.e. num_replicas is a multiple of the number of tasks).
      shard_optimizer_state: ZeRO-1, sets `train.shard_optimizer_state`: each of the R
        data-parallel replicas keeps 1/R of the optimizer slots (lingvo_lite/sharded_optimizer).
      tpu: train on this TPU (name or grpc:// address, 'local' on a TPU VM) under a
        TPUStrategy, cell k on core k of each replica; None = no TPU unless a
        PipeliningLayer has placement='tpu' (then the TPU comes from the environment).
      export_checkpoint: --mode=export: the checkpoint to export, a global step (`400`) or a
        checkpoint path (`<logdir>/checkpoints/ckpt-400`); None = the latest intact one.
    """

    model: str | None = None
    logdir: str | None = None
    mode: str = "train"
    model_params_override: str = ""
    input_params_override: str = ""
    max_steps: int | None = None
    eval_splits: Sequence[str] = ("dev",)
    num_logical_cpus: int | None = None
    intra_op_threads: int | None = None
    inter_op_threads: int | None = None
    num_cells: int | None = None
    num_micro_batches: int | None = None
    num_replicas: int | None = None
    seed: int | None = None
    inspect_num_cells: Sequence[int] = ()
    model_modules: Sequence[str] = ()
    deterministic: bool = False
    profile_steps: str = ""
    tpu: str | None = None
    reset_input_position: bool = False
    shard_optimizer_state: bool = False
    cluster_mode: str = "auto"
    equivalence_tolerance: float | None = None
    plan_devices: int | None = None
    plan_memory_per_device: str | None = None
    plan_device_flops: float | None = None
    export_checkpoint: str | None = None

    def validate(self) -> None:
        """Raises UsageError for missing or out-of-range options (no TensorFlow needed)."""
        if self.mode not in MODES:
            raise UsageError(f"--mode={self.mode!r} is unknown; use one of {', '.join(MODES)}.")
        if self.mode != "list_models" and not self.model:
            raise UsageError(
                f"--model is required for --mode={self.mode}; run --mode=list_models to see the "
                "registered models.")
        if self.mode in LOGDIR_MODES:
            self._validate_logdir()
        for name in ("num_logical_cpus", "intra_op_threads", "inter_op_threads", "num_cells",
                     "num_micro_batches", "num_replicas"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("max_steps", self.max_steps, minimum=0)
        _check_int("seed", self.seed, minimum=0)
        for name in ("deterministic", "reset_input_position", "shard_optimizer_state"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"--{name}={getattr(self, name)!r} must be true or false.")
        if self.cluster_mode not in CLUSTER_MODES:
            raise UsageError(f"--cluster_mode={self.cluster_mode!r} is unknown; use one of "
                             f"{', '.join(CLUSTER_MODES)}.")
        if self.reset_input_position and self.mode not in TRAIN_MODES:
            raise UsageError(f"--reset_input_position only applies to training, not "
                             f"--mode={self.mode}; drop it.")
        for k in self.inspect_num_cells:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise UsageError(
                    f"--inspect_num_cells: {k!r} is not an int >= 1; pass e.g. "
                    "--inspect_num_cells=2,4,8.")
        tol = self.equivalence_tolerance
        if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float))
                                or not tol > 0):
            raise UsageError(f"--equivalence_tolerance={tol!r} must be a number > 0, e.g. 1e-4.")
        if self.mode == "plan":
            self._validate_plan()
        if self.export_checkpoint is not None and self.mode != "export":
            raise UsageError(f"--export_checkpoint only applies to --mode=export, not "
                             f"--mode={self.mode}; drop it.")
        if self.profile_steps:
            parse_profile_steps(self.profile_steps)
        if self.tpu is not None and self.mode in LOGDIR_MODES and self.mode != "train":
            raise UsageError(f"--tpu: only --mode=train runs on TPUs, not --mode={self.mode}; "
                             "drop --tpu to evaluate on CPU or GPU.")
        if self.mode in ("eval", "train_and_eval", "decode") and not list(self.eval_splits):
            raise UsageError(f"--eval_splits is empty; pass e.g. --eval_splits=dev for "
                             f"--mode={self.mode}.")

    def _validate_plan(self) -> None:
        if self.plan_devices is None:
            raise UsageError("--plan_devices is required for --mode=plan; pass the number of "
                             "devices to plan for, e.g. --plan_devices=8.")
        _check_int("plan_devices", self.plan_devices, minimum=1)
        if not self.plan_memory_per_device:
            raise UsageError("--plan_memory_per_device is required for --mode=plan; pass each "
                             "device's memory, e.g. --plan_memory_per_device=16GiB.")
        from lingvo_lite.core import sizes

        try:
            sizes.parse_size(self.plan_memory_per_device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        flops = self.plan_device_flops
        if flops is not None and (isinstance(flops, bool) or not isinstance(flops, (int, float))
                                  or not flops > 0):
            raise UsageError(f"--plan_device_flops={flops!r} must be a number > 0 (FLOP/s), "
                             "e.g. 1e14.")

    def _validate_logdir(self) -> None:
        if not self.logdir:
            raise UsageError(f"--logdir is required for --mode={self.mode}; pass the run's "
                             "directory, e.g. --logdir=/tmp/my_run.")
        logdir = os.path.abspath(os.path.expanduser(self.logdir))
        if os.path.exists(logdir) and not os.path.isdir(logdir):
            raise UsageError(f"--logdir={self.logdir} exists but is not a directory; choose a "
                             "directory path.")
        parent = os.path.dirname(logdir)
        if not os.path.isdir(parent):
            raise UsageError(
                f"--logdir: parent directory {parent} does not exist; create it first "
                f"(mkdir -p {parent}) or choose another --logdir.")
        # Every mode with a logdir writes there (checkpoints, summaries, eval results).
        target = logdir if os.path.isdir(logdir) else parent
        if not os.access(target, os.W_OK | os.X_OK):
            what = "" if target == logdir else f" (its parent, to create {logdir})"
            raise UsageError(
                f"--logdir={self.logdir}: {target}{what} is not writable by this user; give "
                f"write access (e.g. chmod u+w {target}) or choose another --logdir.")

    @property
    def abs_logdir(self) -> str:
        """The log directory as an absolute path ('' when unset)."""
        return os.path.abspath(os.path.expanduser(self.logdir)) if self.logdir else ""


def _check_int(name: str, value: object, minimum: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"--{name}={value!r} must be an int >= {minimum}.")


def parse_int_list(flag: str, values: Sequence[str]) -> list[int]:
    """Parses a comma-separated flag value (already split) into ints; UsageError names the flag."""
    out = []
    for v in values:
        try:
            out.append(int(str(v).strip()))
        except ValueError:
            raise UsageError(
                f"--{flag}: {v!r} is not an integer; pass e.g. --{flag}=2,4,8.") from None
    return out


def parse_profile_steps(value: str | None) -> tuple[int, int] | None:
    """'N,M' (or 'N') -> (N, M); '' or None -> None. UsageError names --profile_steps."""
    if value is None or not str(value).strip():
        return None
    parts = [p.strip() for p in str(value).split(",")]
    try:
        steps = [int(p) for p in parts]
    except ValueError:
        raise UsageError(
            f"--profile_steps={value!r} is not 'N,M'; pass the first and last global step to "
            "profile, e.g. --profile_steps=5,7.") from None
    if len(steps) == 1:
        steps = steps * 2
    if len(steps) != 2 or steps[0] < 1 or steps[1] < steps[0]:
        raise UsageError(
            f"--profile_steps={value!r} must be 'N,M' with 1 <= N <= M (global steps, "
            "inclusive), e.g. --profile_steps=5,7.")
    return steps[0], steps[1]


def _runnable_path(path: str) -> str:
    """`path` as a command to type in the current directory: relative when below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith(os.pardir) else path


def python_command() -> str:
    """This interpreter as the start of a command line that runs as printed.

    `.venv/bin/python` when the trainer runs from a fresh clone's venv (no activation needed),
    the absolute path when the interpreter lives outside the current directory.
    """
    import sys

    return _runnable_path(sys.executable) if sys.executable else "python3"


def trainer_command() -> str:
    """`<python> trainer.py` as the running trainer would be typed from the current directory."""
    import sys

    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    script = (_runnable_path(os.path.abspath(main)) if os.path.basename(main) == "trainer.py"
              else "trainer.py")
    return f"{python_command()} {script}"


def tensorboard_command() -> str:
    """The `tensorboard` installed beside this interpreter (e.g. `.venv/bin/tensorboard`).

    Falls back to plain `tensorboard` (on PATH) when none is installed there.
    """
    import sys

    candidate = os.path.join(os.path.dirname(sys.executable or ""), "tensorboard")
    if sys.executable and os.access(candidate, os.X_OK):
        return _runnable_path(candidate)
    return "tensorboard"


def default_run_logdir(model: str) -> str:
    """A fresh logdir for a command the trainer prints (e.g. --mode=plan's chosen plan)."""
    name = "".join(c if c.isalnum() else "_" for c in model.rsplit(".", 1)[-1])
    return f"/tmp/lingvo_lite_{name}"
