"""The training loop of one task of a multi-client run (see multi_client.py).

`build` is `loop.Trainer.build` for task i of N: its shard of the input, the chief's latest
checkpoint restored in every task (checked with a collective: every task at the same step),
its own input position (`input_positions.py`). `MultiClientTrainer` is the same loop with the
writes split by role: the chief writes checkpoints, summaries, params.txt and evaluations;
every task saves its input position at the checkpoint steps (and, with ZeRO-1, joins the
gather of the optimizer-slot shards the chief saves); workers write nothing else.

Example (what multi_client.prepare runs in each task, after the collectives are set up):

    trainer = build(task_params=tp, cluster=cluster, logdir=logdir, params_text=text,
                    analysis_text=analysis, eval_spec=None, out=sys.stdout, err=sys.stderr)
    status = trainer.run()
"""

from __future__ import annotations

import math
from typing import Any, TextIO

import tensorflow as tf

from lingvo_lite.core import hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import cluster_spec
from lingvo_lite.training import checkpointer, loop, summaries
from lingvo_lite.training.input_positions import InputPositions
from lingvo_lite.training.options import UsageError

__all__: list[str] = []

SLOT_GATHER_TIMEOUT_SECONDS = 600.0


class _NoSummaries(summaries.SummaryWriters):
    """A worker's summary writers: the chief writes the run's summaries."""

    def scalars(self, subdir: str, step: int, values: Any) -> None:
        pass

    def text(self, subdir: str, step: int, tag: str, text: str) -> None:
        pass


class MultiClientTrainer(loop.Trainer):
    """`loop.Trainer` for one task of a multi-client run (see the module docstring)."""

    config: cluster_spec.Cluster
    positions: InputPositions
    examples_read = 0

    def _summary_writers(self, first_step: int) -> summaries.SummaryWriters:
        if self.config.is_chief:
            return super()._summary_writers(first_step)
        return _NoSummaries(self._logdir, first_step)

    def _write_run_files(self, writers: summaries.SummaryWriters, step: int) -> None:
        if self.config.is_chief:
            super()._write_run_files(writers, step)

    def _save(self, step: int, writers: summaries.SummaryWriters) -> None:
        with loop.writing(self.positions.directory, step):
            self.positions.save(step)
        # ZeRO-1: every task reaches this step and joins the gather of the slot shards, so
        # the chief saves whole slots (bounded: a task lost meanwhile fails the gather).
        sharded = self.task.sharded_state
        if sharded is not None:
            sharded.gather_slots(timeout_seconds=SLOT_GATHER_TIMEOUT_SECONDS)
        try:
            if self.config.is_chief:
                super()._save(step, writers)
        finally:
            if sharded is not None:
                sharded.release_gathered()

    def _next_batch(self) -> NestedMap:
        batch = super()._next_batch()
        self.examples_read += loop.examples_in(batch)
        return batch

    def run(self) -> int:
        status = super().run()
        self._print(f"Task {self.config.task_index} read {self.examples_read} examples of its "
                    f"input shard ({self.config.task_index} of {self.config.num_tasks}) in "
                    "this run.")
        return status


def build(*, task_params: hyperparams.InstantiableParams, cluster: cluster_spec.Cluster,
          logdir: str, params_text: str, analysis_text: str,
          eval_spec: loop.EvalSpec | None, out: TextIO, err: TextIO | None = None,
          reset_input_position: bool = False) -> MultiClientTrainer:
    """Builds task i's model, input shard, restore and traced step (writes nothing)."""
    if task_params.input is None:
        raise ValueError("The task params have no train input (p.input is None); a model's "
                         "Model() attaches Train() as p.input.")
    loop.check_train_params(task_params.train)
    print("Building the model and its input shard...", file=out, flush=True)
    input_generator = task_params.input.Instantiate()
    input_generator.shard(cluster.num_tasks, cluster.task_index)
    iterator = iter(input_generator.dataset())
    task = task_params.Instantiate()
    task.prepare_for_training()
    _check_every_weight_is_pipelined(task)
    if task.sharded_state is not None:
        held = "; ".join(
            f"{device}: {len(shapes)} variables, "
            f"{sum(math.prod(s) for s in shapes)} elements"
            for device, shapes in task.sharded_state.slot_shapes().items())
        print(f"Task {cluster.task_index}: ZeRO-1 optimizer slot shards "
              f"(1/{task.sharded_state.num_shards} of each weight's) per device: {held}",
              file=out, flush=True)
    skipped_updates = tf.Variable(0, dtype=tf.int64, trainable=False, name="skipped_updates")
    variables = dict(task.checkpoint_variables())
    variables[loop.SKIPPED_UPDATES_KEY] = skipped_updates

    def warn(msg: str) -> None:
        print(f"trainer.py: warning: {msg}", file=err or out, flush=True)

    keep = task.params.train.max_checkpoints_to_keep
    ckpt = checkpointer.Checkpointer(logdir, variables, None, max_to_keep=keep, warn=warn)
    restored = ckpt.restore_latest()
    step = int(task.global_step.numpy())
    positions = InputPositions(logdir, cluster.num_tasks, cluster.task_index, iterator, keep)
    skip = step if reset_input_position else positions.restore(step)
    if reset_input_position and restored:
        skip = 0
        print(f"Note: --reset_input_position: restored the weights of {restored}; the train "
              "input shard starts from its beginning.", file=out, flush=True)
    _check_same_step(cluster, step)
    task.sync_replicas()
    if skip:
        print(f"Task {cluster.task_index}: skipping {skip} batch(es) of its shard to reach "
              f"step {step} (its input position at step {step} was not saved).", file=out,
              flush=True)
    skipped_examples = 0
    for _ in range(skip + 1):
        first_batch = next(iterator)
        skipped_examples += loop.examples_in(first_batch)
    trainer = MultiClientTrainer(
        task=task, iterator=iterator, first_batch=first_batch, logdir=logdir, ckpt=ckpt,
        restored_from=restored, params_text=params_text, analysis_text=analysis_text,
        eval_spec=eval_spec, out=out, err=err, skipped_updates=skipped_updates)
    trainer.config = cluster
    trainer.positions = positions
    trainer.examples_read = skipped_examples - loop.examples_in(first_batch)
    trainer._input_generator = input_generator
    return trainer


def _check_every_weight_is_pipelined(task: Any) -> None:
    """Only PipeliningLayers sum gradients across tasks: refuse weights outside them."""
    from lingvo_lite.pipeline import pipelining_layer

    pipelined = set()
    stack = [task]
    while stack:
        layer = stack.pop()
        if isinstance(layer, pipelining_layer.PipeliningLayer):
            pipelined.update(id(v) for v in layer.vars.Flatten())
            continue
        if hasattr(layer, "children"):
            stack.extend(layer.children.Flatten())
    outside = [v.name for v in task.trainable_vars() if id(v) not in pipelined]
    if outside:
        raise UsageError(
            f"multi-client training sums only the gradients of PipeliningLayers across tasks, "
            f"but {outside[0]} (and {len(outside) - 1} other weight(s)) lies outside one; use "
            "--cluster_mode=single_client.")


def _check_same_step(config: cluster_spec.Cluster, step: int) -> None:
    """Every task restored the same global step (else they read different logdirs): agreed
    through the coordination service's key-value store."""
    from lingvo_lite.distributed import process_group

    differ = process_group.agree_on("restored_step", str(step))
    if differ:
        task, theirs = next(iter(differ.items()))
        raise UsageError(
            f"the tasks restored different checkpoints (task {config.task_index}: global step "
            f"{step}; task {task}: global step {theirs}): every task must read the chief's "
            "checkpoints, i.e. the same --logdir on one machine or a shared file system.")
