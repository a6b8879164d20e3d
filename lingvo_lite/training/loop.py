"""The training and evaluation loops.

`Trainer` owns one training run: the task, the input iterator, the compiled train step, the
checkpointer and the summary writers. Construction (`Trainer.build`) does all the work that can
fail on a user error (building the model and input, restoring, tracing the step) without writing
anything; `Trainer.run` then trains, writing summaries, progress lines and checkpoints.

`evaluate_split` runs `EvalStep` over one pass of a split and averages the metrics weighted by
batch size; `write_eval_results` records them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import cluster_spec
from lingvo_lite.tasks import base_task
from lingvo_lite.training import checkpointer, interrupts, summaries
from lingvo_lite.training.options import TrainingError

__all__: list[str] = []

TRAIN_SUBDIR = "train"
SKIPPED_UPDATES_KEY = "trainer/skipped_updates"  # Checkpoint key of the skipped-update counter.
PARAMS_FILE = "params.txt"
ANALYSIS_FILE = "model_analysis.txt"


def compile_step(fn: Callable[[NestedMap], NestedMap]) -> Callable[[NestedMap], NestedMap]:
    """`tf.function` without AutoGraph.

    Tasks are written Lingvo-style, with explicit `tf.cond`/`tf.while_loop`; converting their
    Python with AutoGraph cost ~95% of the trace time of a pipelined step (seconds per trace).
    Python control flow on a tensor therefore fails at trace time with TensorFlow's message.
    """
    return tf.function(fn, autograph=False)


def eval_subdir(split: str) -> str:
    return f"eval_{split}"


def examples_in(batch: Any, strategy: tf.distribute.Strategy | None = None) -> int:
    """The examples a batch read from the input holds: the leading dimension of its first
    tensor, static or not (summed over a strategy's replicas). The pipeline's own, static
    batch size is `micro_batch.batch_size_of`."""
    leaves = batch.Flatten() if isinstance(batch, NestedMap) else tf.nest.flatten(batch)
    for leaf in leaves:
        if strategy is not None and isinstance(leaf, tf.distribute.DistributedValues):
            return sum(examples_in(v) for v in strategy.experimental_local_results(leaf))
        if leaf is not None and leaf.shape.rank:
            size = leaf.shape[0]
            return int(size) if size is not None else int(tf.shape(leaf)[0])
    return 1


def _format_duration(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=int(round(seconds))))


def _numpy_metrics(metrics: NestedMap) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in metrics.FlattenItems()}


# ---------------------------------------------------------------------------------------------
# Evaluation.


class EvalStoppedError(Exception):
    """An evaluation abandoned because the run received SIGINT/SIGTERM."""


def evaluate_split(task: base_task.BaseTask, input_params: hyperparams.Params,
                   max_batches: int = 0,
                   eval_step: Callable[[NestedMap], NestedMap] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
    """One evaluation pass: the batch-size-weighted mean of every EvalStep metric.

    Args:
      task: the task, with its weights set.
      input_params: input params of the split (`repeat` should be False).
      max_batches: stop after this many batches; 0 = the whole split.
      eval_step: a compiled `task.EvalStep` to reuse; one is made when None.
      should_stop: checked before each batch; when it returns True, raises EvalStoppedError.

    Returns:
      metric name -> mean, plus `num_examples_evaluated` and `num_batches` (ints).
    """
    if eval_step is None:
        eval_step = compile_step(task.EvalStep)
    sums: dict[str, float] = {}
    total = 0
    num_batches = 0
    input_generator = input_params.Instantiate()
    for batch in _explained(input_generator, iter(input_generator.dataset())):
        if max_batches and num_batches >= max_batches:
            break
        if should_stop is not None and should_stop():
            raise EvalStoppedError()
        size = examples_in(batch)
        for k, v in _numpy_metrics(eval_step(batch)).items():
            sums[k] = sums.get(k, 0.0) + size * v
        total += size
        num_batches += 1
    if not num_batches:
        name = input_params.name if "name" in input_params else type(input_params).__name__
        raise ValueError(
            f"Evaluation input {name!r} yielded no batch; check its params (e.g. a batch_size "
            "larger than the split with drop_remainder=True).")
    out: dict[str, Any] = {k: v / total for k, v in sorted(sums.items())}
    out["num_examples_evaluated"] = total
    out["num_batches"] = num_batches
    return out


def _explained(input_generator: Any, iterator: Any) -> Any:
    """Yields from `iterator`; a data error is raised as a one-line TrainingError."""
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except tf.errors.OpError as e:
            message = _input_error_message(input_generator, e, None, False)
            if message is None:
                raise
            raise TrainingError(message) from None
        yield batch


def write_eval_results(logdir: str, split: str, step: int, metrics: dict[str, Any],
                       writers: summaries.SummaryWriters) -> str:
    """Writes metrics as scalars under `<logdir>/eval_<split>` and to `metrics_<step>.txt`.

    Returns the path of the text file.
    """
    subdir = eval_subdir(split)
    writers.scalars(subdir, step, metrics)
    writers.flush()
    path = os.path.join(logdir, subdir, f"metrics_{step}.txt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(format_metrics(metrics))
    return path


def format_metrics(metrics: dict[str, Any]) -> str:
    """`name : value` lines, sorted (the params text format)."""
    return "".join(f"{k} : {v!r}\n" for k, v in sorted(metrics.items()))


# ---------------------------------------------------------------------------------------------
# Training.


def check_train_params(tp: hyperparams.Params) -> None:
    """Raises ValueError naming the `train.*` param when a loop setting is out of range."""
    minimums = {"max_steps": 0, "save_interval_steps": 0, "summary_interval_steps": 0,
                "log_interval_steps": 0, "eval_interval_steps": 0,
                "max_checkpoints_to_keep": 1, "max_consecutive_nonfinite_steps": 1}
    for name, minimum in minimums.items():
        if name not in tp:
            continue
        value = tp.Get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"train.{name}={value!r} must be an int >= {minimum}; set it with "
                f"--model_params_override='train.{name} : <int>'.")
    if "learning_rate" in tp:
        lr = tp.learning_rate
        if (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                or lr < 0):
            raise ValueError(
                f"train.learning_rate={lr!r} must be a finite number >= 0 (a negative one "
                "climbs the loss); set it with --model_params_override='train.learning_rate : "
                "<float>'.")


@dataclasses.dataclass
class EvalSpec:
    """What train_and_eval evaluates: split name -> input params, and the batch cap."""

    splits: dict[str, hyperparams.Params]
    max_batches: int = 0


def _declared_batch_shapes(task_params: hyperparams.Params) -> int:
    """How many training batch shapes the task's pipelines declare (1 without buckets)."""
    from lingvo_lite.training import model_config

    return max([len(pp.input_buckets or ()) for _, pp in
                model_config.iter_pipelining_params(task_params)] + [1])


class _Rate:
    """Steps and examples per second between two report points."""

    def __init__(self, step: int) -> None:
        self.reset(step)

    def reset(self, step: int) -> None:
        self._time = time.perf_counter()
        self._step = step
        self._examples = 0
        self._positions = 0.0
        self._real_tokens = 0.0

    def has_steps(self, step: int) -> bool:
        return step > self._step

    def add_examples(self, n: int) -> None:
        self._examples += n

    def add_tokens(self, positions: float, real: float) -> None:
        self._positions += positions
        self._real_tokens += real

    def token_rates(self) -> dict[str, float]:
        """Tokens/s (padding included and not) and the padding share since the last
        `measure`; empty for a task without tokens. Call before `measure`."""
        if not self._positions:
            return {}
        elapsed = max(time.perf_counter() - self._time, 1e-9)
        return {"tokens_per_sec": self._positions / elapsed,
                "real_tokens_per_sec": self._real_tokens / elapsed,
                "padding_fraction": 1.0 - self._real_tokens / self._positions}

    def measure(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        elapsed = max(now - self._time, 1e-9)
        rates = ((step - self._step) / elapsed, self._examples / elapsed)
        self._time, self._step, self._examples = now, step, 0
        self._positions = self._real_tokens = 0.0
        return rates


class _WriteFailedError(Exception):
    """Writing into the log directory failed (a full disk, lost permissions); see `writing`."""

    def __init__(self, path: str, step: int, reason: str, reason_code: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.step, self.reason, self.reason_code = path, step, reason, reason_code


class _InputDataError(Exception):
    """The train input failed on its data mid-run; the message names the file and the fix."""


_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_PERMISSION_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


def _reason_code(error: BaseException) -> str:
    if isinstance(error, OSError):
        code = error.errno
    else:  # TensorFlow's C++ file system: the reason is in the text.
        text = str(error)
        code = next((c for c in _FULL_ERRNOS + _PERMISSION_ERRNOS
                     if os.strerror(c) in text), None)
    if code in _FULL_ERRNOS:
        return "full"
    return "permission" if code in _PERMISSION_ERRNOS else "other"


@contextlib.contextmanager
def writing(path: str, step: int):
    """Turns an OSError or TensorFlow error of a write under `path` into _WriteFailedError."""
    try:
        yield
    except OSError as e:
        raise _WriteFailedError(e.filename or path, step, e.strerror or str(e),
                               _reason_code(e)) from e
    except cluster_spec.peer_errors():
        # Another task of the cluster was lost while a checkpoint read its variables: not a
        # write failure (the caller names the lost task).
        raise
    except tf.errors.OpError as e:
        # "{{function_node ...}} /logdir/train/events...; File too large Failed to flush ...":
        # name the file under `path` and the system's reason when the text has them.
        text = re.sub(r"\{\{[^}]*\}\}", "", str(e.message))
        files = re.findall(re.escape(path) + r"[^\s;:'\"]*", text)
        known = [os.strerror(c) for c in _FULL_ERRNOS + _PERMISSION_ERRNOS
                 if os.strerror(c) in text]
        reason = known[0] if known else " ".join(text.split())[:200]
        raise _WriteFailedError(files[0] if files else path, step, reason,
                               _reason_code(e)) from e


class Trainer:
    """One training run of a task in a log directory (see the module docstring)."""

    def __init__(self, *, task: base_task.BaseTask, iterator: Any, first_batch: NestedMap,
                 logdir: str, ckpt: checkpointer.Checkpointer, restored_from: str | None,
                 params_text: str, analysis_text: str, eval_spec: EvalSpec | None,
                 out: TextIO, err: TextIO | None = None,
                 skipped_updates: tf.Variable | None = None,
                 strategy: tf.distribute.Strategy | None = None) -> None:
        self.task = task
        self._strategy = strategy
        self._iterator = iterator
        self._logdir = logdir
        self._ckpt = ckpt
        self._restored_from = restored_from
        self._params_text = params_text
        self._analysis_text = analysis_text
        self._eval_spec = eval_spec
        self._out = out
        self._err = err or out
        # Updates skipped for a non-finite loss or gradient over the whole run (checkpointed).
        self._skipped_updates = (skipped_updates if skipped_updates is not None
                                 else tf.Variable(0, dtype=tf.int64, trainable=False))
        self.trace_count = 0
        self.profiler = None  # A profiling.StepProfiler, set by the runner for --profile_steps.
        # A pipeline with input_buckets traces its step once per bucket.
        self._warned_trace_count = _declared_batch_shapes(task.params)
        self._pending_batch: NestedMap | None = first_batch
        self._input_generator: Any = None  # Explains data errors mid-run (set by `build`).
        self._signals: interrupts.StopSignals | None = None  # Set while `run` trains.
        self._eval_step = compile_step(task.EvalStep)
        self._evaluated = False

        def train_step(batch: NestedMap) -> NestedMap:
            self.trace_count += 1  # Runs only while tracing.
            if strategy is None:
                return task.TrainStep(batch)
            return _replicated_train_step(strategy, task, batch)

        self._train_step = compile_step(train_step)
        self._print("Tracing the train step (builds the step's graph once)...")
        # Trace now, so model errors surface during setup and the run starts with a ready step.
        # The first batch (not the element spec) gives the shapes: a pipeline needs a static
        # batch size, which a spec lacks when the input may yield a smaller last batch.
        self._train_step.get_concrete_function(first_batch)

    @classmethod
    def build(cls, *, task_params: hyperparams.InstantiableParams, logdir: str,
              params_text: str, analysis_text: str, eval_spec: EvalSpec | None = None,
              out: TextIO, err: TextIO | None = None,
              strategy: tf.distribute.Strategy | None = None,
              reset_input_position: bool = False) -> Trainer:
        """Builds task, input, checkpointer (restoring the latest checkpoint) and train step.

        Writes nothing: errors raised here leave the log directory untouched. A checkpoint
        whose input position was saved with another `input.batch_size` is refused (ValueError)
        unless `reset_input_position`, which restores the weights and restarts the input.

        With a `strategy` (a TPUStrategy: see distributed/tpu.py) the task and its variables are
        built in its scope, each batch of the input is split over its replicas, and every
        step runs `TrainStep` in each replica (`strategy.run`). The input position is then
        not checkpointed (a distributed iterator cannot be): a resumed run restarts the input.
        """
        if task_params.input is None:
            raise ValueError("The task params have no train input (p.input is None); a model's "
                             "Model() attaches Train() as p.input.")
        check_train_params(task_params.train)
        # Setup takes seconds to minutes (graph size grows with layers x cells): say what runs.
        print("Building the model and its input...", file=out, flush=True)
        input_generator = task_params.input.Instantiate()
        dataset = input_generator.dataset()
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            task = task_params.Instantiate()
            task.prepare_for_training()
            skipped_updates = tf.Variable(0, dtype=tf.int64, trainable=False,
                                          name="skipped_updates")
        if strategy is not None:
            dataset = strategy.experimental_distribute_dataset(dataset)
        iterator = iter(dataset)
        variables = dict(task.checkpoint_variables())
        variables[SKIPPED_UPDATES_KEY] = skipped_updates

        def warn(msg: str) -> None:
            print(f"trainer.py: warning: {msg}", file=err or out, flush=True)

        ckpt = checkpointer.Checkpointer(
            logdir, variables, iterator if strategy is None else None,
            max_to_keep=task.params.train.max_checkpoints_to_keep, warn=warn,
            input_info={"batch_size": task_params.input.batch_size},
            restore_input_position=not reset_input_position)
        restored = ckpt.restore_latest()
        if restored and reset_input_position:
            print(f"Note: --reset_input_position: restored the weights of {restored}; the train "
                  "input starts from its beginning.", file=out, flush=True)
        interrupts.maybe_signal_self("setup")
        task.sync_replicas()  # Data-parallel replicas start from the restored weights.
        try:
            first_batch = next(iterator)
        except StopIteration:
            raise ValueError(
                "The train input yields no batch; check its params (e.g. batch_size larger than "
                "the data with drop_remainder=True).") from None
        except tf.errors.OpError as e:
            message = _input_error_message(input_generator, e, restored,
                                           ckpt.restored_input_position)
            if message is None:
                raise
            raise ValueError(message) from None
        trainer = cls(task=task, iterator=iterator, first_batch=first_batch,
                      logdir=logdir, ckpt=ckpt, restored_from=restored, params_text=params_text,
                      analysis_text=analysis_text, eval_spec=eval_spec, out=out, err=err,
                      skipped_updates=skipped_updates, strategy=strategy)
        trainer._input_generator = input_generator
        return trainer

    @property
    def global_step(self) -> int:
        return int(self.task.global_step.numpy())

    def _print(self, msg: str) -> None:
        print(msg, file=self._out, flush=True)

    def _write_run_files(self, writers: summaries.SummaryWriters, step: int) -> None:
        os.makedirs(self._logdir, exist_ok=True)
        params_path = os.path.join(self._logdir, PARAMS_FILE)
        if os.path.exists(params_path):
            with open(params_path) as f:
                old = f.read()
            if old != self._params_text:
                self._print(f"Note: the params differ from the previous run's {params_path}:")
                self._print(_line_diff(old, self._params_text))
        _write_atomically(params_path, self._params_text)
        _write_atomically(os.path.join(self._logdir, ANALYSIS_FILE), self._analysis_text)
        writers.text(TRAIN_SUBDIR, step, "params", self._params_text)
        writers.text(TRAIN_SUBDIR, step, "model_analysis", self._analysis_text)

    def run(self) -> int:
        """Trains to `train.max_steps`; returns the exit status (0, or 128 + SIGINT/SIGTERM)."""
        tp = self.task.params.train
        max_steps = tp.max_steps
        step = self.global_step
        if self._restored_from:
            self._print(f"Restored {self._restored_from} (global step {step}).")
        if step >= max_steps:
            self._print(f"Already at global step {step} >= max_steps={max_steps}: nothing to "
                        "train. Raise --max_steps to train further.")
            return 0
        if self._restored_from:
            self._print(f"Resuming training from step {step} to step {max_steps}.")
        else:
            self._print(f"Training from scratch to step {max_steps}.")
        writers = self._summary_writers(first_step=step + 1)
        try:
            with interrupts.StopSignals() as self._signals:
                with writing(self._logdir, step):
                    self._write_run_files(writers, step)
                status = self._loop(writers, step, max_steps, self._signals)
            if self._signals.requested is not None:
                interrupts.maybe_signal_self("stopped")
            with writing(self._logdir, self.global_step):
                writers.close()
            return status
        except _WriteFailedError as e:
            raise TrainingError(self._write_failure_message(e)) from None
        except _InputDataError as e:
            raise TrainingError(f"{e} {self._last_checkpoint_text()}.") from None
        finally:
            with contextlib.suppress(OSError, tf.errors.OpError):
                writers.close()  # After an error (the disk may still be full); else a no-op.

    def _summary_writers(self, first_step: int) -> summaries.SummaryWriters:
        """Where the run's summaries go (a multi-client worker writes none)."""
        return summaries.SummaryWriters(self._logdir, first_step=first_step)

    def _last_checkpoint_text(self) -> str:
        last = checkpointer.latest_checkpoint(self._logdir)
        if last is None:
            return "No checkpoint was written"
        return (f"The last checkpoint {last} (global step {checkpointer.checkpoint_step(last)}) "
                "is intact")

    def _write_failure_message(self, e: _WriteFailedError) -> str:
        where = e.path
        while where and not os.path.exists(where):  # The directory that refused the file.
            where = os.path.dirname(where)
        fix = ("free disk space" if e.reason_code == "full" else
               f"make {where} writable again" if e.reason_code == "permission" else
               f"make sure {where} can be written")
        return (f"writing {e.path} failed at step {e.step}: {e.reason}. "
                f"{self._last_checkpoint_text()}; {fix}, then rerun the same command to resume.")

    def _loop(self, writers: summaries.SummaryWriters, step: int, max_steps: int,
              signals: interrupts.StopSignals) -> int:
        tp = self.task.params.train
        rate = _Rate(step)
        steps_per_sec = float("nan")
        first = True
        last_eval_step = None
        streak = 0  # Consecutive steps whose update was skipped (non-finite loss or gradients).
        while step < max_steps:
            if signals.requested is not None:
                # Here, before the next fetch, the weights and the input position match.
                return self._stop(step, writers, signals)
            try:
                batch = self._next_batch()
            except StopIteration:
                self._print(f"The train input ran out of data at step {step}; set its "
                            "repeat=True to train for max_steps.")
                break
            if first:
                self._print(f"Running step {step + 1}, the first (TensorFlow optimises the "
                            "graph on its first call)...")
            if self.profiler is not None:
                with self.profiler.step(step + 1, writers):
                    metrics = self._train_step(batch)
            else:
                metrics = self._train_step(batch)
            step += 1
            rate.add_examples(examples_in(batch, self._strategy))
            if self._strategy is None:
                tokens = self.task.TokenCounts(batch)
                if tokens is not None:
                    rate.add_tokens(float(tokens[0]), float(tokens[1]))
            streak = self._check_finite(metrics, step, streak)
            if first:
                # The first call also optimises the graph: keep it out of the rates.
                first = False
                float(metrics.loss)
                rate.reset(step)
            self._check_retrace()
            at_end = step == max_steps
            summarize = step % max(tp.summary_interval_steps, 1) == 0 or at_end
            log = step % max(tp.log_interval_steps, 1) == 0 or at_end
            if summarize or log:
                values = _numpy_metrics(metrics)
                values["skipped_updates"] = float(self._skipped_updates.numpy())
                if rate.has_steps(step):
                    values.update(rate.token_rates())
                    steps_per_sec, examples_per_sec = rate.measure(step)
                    values.update(steps_per_sec=steps_per_sec,
                                  examples_per_sec=examples_per_sec)
                if summarize:
                    with writing(os.path.join(self._logdir, TRAIN_SUBDIR), step):
                        writers.scalars(TRAIN_SUBDIR, step, values)
                if log:
                    self._progress(step, max_steps, values, steps_per_sec)
            paused = False
            # No periodic checkpoint while updates are being skipped: the last one then
            # predates the non-finite steps.
            if tp.save_interval_steps and step % tp.save_interval_steps == 0 and not streak:
                self._save(step, writers)
                paused = True
            if (self._eval_spec and tp.eval_interval_steps
                    and step % tp.eval_interval_steps == 0):
                self.evaluate(writers, step)
                last_eval_step = step
                paused = True
            if paused:
                rate.reset(step)  # Saving and evaluating are not training time.
        self._save(step, writers)
        if signals.requested is None and self._eval_spec and last_eval_step != step:
            self.evaluate(writers, step)
        if signals.requested is not None:
            return self._stop(step, writers, signals)
        self._print(f"Done: global step {step}. Checkpoints in {self._ckpt.directory}.")
        return 0

    def _stop(self, step: int, writers: summaries.SummaryWriters,
              signals: interrupts.StopSignals) -> int:
        """Saves at `step` after SIGINT/SIGTERM; returns the exit status 128 + signal."""
        name = interrupts.signal_name(signals.requested)
        self._print(f"Received {name}: saving a checkpoint at step {step}.")
        if self.profiler is not None:
            self.profiler.stop(writers, step)  # Keeps the steps captured so far.
        self._save(step, writers)
        others = sorted({interrupts.signal_name(s) for s in signals.received[1:]})
        if others:
            self._print(f"Note: {', '.join(others)} received again while stopping; ignored "
                        "until the checkpoint was complete.")
        self._print(f"Interrupted by {name} at step {step}; checkpoint saved. Rerun the same "
                    "command to resume.")
        return interrupts.exit_status(signals.requested)

    def _check_finite(self, metrics: NestedMap, step: int, streak: int) -> int:
        """Counts a skipped update (TrainStep's `update_skipped`); returns the new streak.

        Raises:
          TrainingError: `train.max_consecutive_nonfinite_steps` updates in a row were skipped.
        """
        if "update_skipped" not in metrics or not float(metrics.update_skipped):
            return 0
        streak += 1
        self._skipped_updates.assign_add(1)
        limit = self.task.params.train.max_consecutive_nonfinite_steps
        self._print(f"WARNING: step {step}: non-finite loss or gradients; the update was "
                    f"skipped and the weights are unchanged ({streak} in a row, stop at {limit}).")
        if streak >= limit:
            last = checkpointer.latest_checkpoint(self._logdir)
            kept = (f"the last checkpoint {last} is intact" if last
                    else "no checkpoint was written")
            raise TrainingError(
                f"training stopped at step {step}: the loss or gradients were NaN/Inf for "
                f"{streak} consecutive steps ({step - streak + 1}..{step}; "
                f"train.max_consecutive_nonfinite_steps={limit}); {kept}. Check the input data "
                "and lower train.learning_rate (or set train.clip_gradient_norm_to_value), then "
                "rerun the same command to resume.")
        return streak

    def _next_batch(self) -> NestedMap:
        if self._pending_batch is not None:
            batch, self._pending_batch = self._pending_batch, None
        else:
            try:
                batch = next(self._iterator)
            except tf.errors.OpError as e:
                message = _input_error_message(self._input_generator, e, None, False)
                if message is None:
                    raise
                raise _InputDataError(message) from None
        if interrupts.TEST_SIGNAL_ENV in os.environ:  # Spares the step read otherwise.
            interrupts.maybe_signal_self(f"fetched:{self.global_step + 1}")
        return batch

    def _check_retrace(self) -> None:
        if self.trace_count > self._warned_trace_count:
            self._warned_trace_count = self.trace_count
            self._print(
                f"WARNING: the train step was traced {self.trace_count} times; each retrace "
                "rebuilds the graph. Make every batch the same shape (drop_remainder=True), or "
                "declare the shapes as the pipeline's input_buckets.")

    def _progress(self, step: int, max_steps: int, values: dict[str, float],
                  steps_per_sec: float) -> None:
        eta = (max_steps - step) / steps_per_sec if steps_per_sec > 0 else float("nan")
        extras = "  ".join(f"{k} {values[k]:.4g}" for k in sorted(values)
                           if k not in ("loss", "steps_per_sec", "examples_per_sec",
                                        "tokens_per_sec", "real_tokens_per_sec",
                                        "learning_rate", "var_norm", "update_skipped",
                                        "skipped_updates"))
        self._print(f"step {step}/{max_steps}  loss {values['loss']:.4f}  {extras}  "
                    f"{steps_per_sec:.2f} steps/s  ETA {_format_duration(eta)}")

    def _save(self, step: int, writers: summaries.SummaryWriters) -> None:
        with writing(self._logdir, step):
            writers.flush()
        with writing(self._ckpt.directory, step):
            path = self._ckpt.save(step)
        if path:
            self._print(f"Saved checkpoint {path}")

    def evaluate(self, writers: summaries.SummaryWriters, step: int) -> dict[str, dict]:
        """Evaluates every split of the eval spec on the current weights and records it."""
        results = {}
        signals = self._signals
        if not self._evaluated:  # The first evaluation also traces the eval step: seconds.
            self._evaluated = True
            self._print(f"Evaluating on {', '.join(self._eval_spec.splits)} at step {step} "
                        "(the first evaluation also traces the eval step)...")
        for split, params in self._eval_spec.splits.items():
            try:
                # A stop signal abandons the evaluation: a preemption's grace period is short.
                metrics = evaluate_split(
                    self.task, params, self._eval_spec.max_batches, self._eval_step,
                    should_stop=lambda: signals is not None and signals.requested is not None)
            except EvalStoppedError:
                self._print(f"eval {split} @ step {step}: abandoned (stop signal received).")
                break
            with writing(os.path.join(self._logdir, eval_subdir(split)), step):
                write_eval_results(self._logdir, split, step, metrics, writers)
            self._print(f"eval {split} @ step {step}: " + _inline(metrics))
            results[split] = metrics
        return results


def _write_atomically(path: str, text: str) -> None:
    """Replaces `path` with `text`; on a failed write (a full disk) the old file stays whole."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if e.filename == tmp:
            e.filename = path
        raise


def _input_error_message(input_generator: Any, error: tf.errors.OpError,
                         restored: str | None, restored_position: bool) -> str | None:
    """One line for an error of an input's data, or None when it is not one.

    The input generator names a bad file if it can (`explain_data_error`); an input position
    restored from a checkpoint that yields batches of another shape means the input params
    changed (a checkpoint written before batch sizes were recorded in its manifest).
    """
    explain = getattr(input_generator, "explain_data_error", None)
    message = explain(error) if explain is not None else None
    if message:
        return message
    text = " ".join(re.sub(r"\{\{[^}]*\}\}", "", str(error.message)).split())
    if restored and restored_position and isinstance(error, tf.errors.InvalidArgumentError) \
            and "Incompatible shapes" in text:
        return (f"the input position restored from {restored} yields batches of another shape "
                f"than this input ({text[:120]}): were input params such as input.batch_size "
                "changed? Resume with the params of the run that saved it (params.txt in the "
                "logdir), start a new run with a new --logdir, or keep the weights and restart "
                "the input with --reset_input_position.")
    if isinstance(error, (tf.errors.NotFoundError, tf.errors.PermissionDeniedError,
                          tf.errors.DataLossError)):
        name = getattr(getattr(input_generator, "params", None), "name", "input")
        return (f"the input {name!r} could not read its data: {text[:300]}. Check the files "
                "its params point to.")
    return None


def _replicated_train_step(strategy: tf.distribute.Strategy, task: base_task.BaseTask,
                           batch: Any) -> NestedMap:
    """`task.TrainStep` in every replica of `strategy`; the metrics' mean over the replicas.

    The pipeline combines gradients and scalar outputs over the replicas itself (the
    replica context's all-reduce, PipeliningLayer._strategy_replica_step), so every
    replica applies the same update and reports the same loss; the mean only turns the
    per-replica values into one.
    """
    per_replica = strategy.run(task.TrainStep, args=(batch,))
    return NestedMap({key: strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
                      for key, value in per_replica.items()})


def _inline(metrics: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in sorted(metrics.items()))


def _line_diff(old: str, new: str) -> str:
    old_lines, new_lines = old.splitlines(), new.splitlines()
    old_set, new_set = set(old_lines), set(new_lines)
    out = [f"< {line}" for line in old_lines if line not in new_set]
    out += [f"> {line}" for line in new_lines if line not in old_set]
    return "\n".join(out)
