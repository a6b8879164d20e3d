"""BaseTask: a model with its loss, optimizer and learning-rate schedule.

A task is the root layer of a model. Subclasses create their network in
`__init__` and implement `FProp(theta, input_batch)`, returning a NestedMap with a
scalar `loss` and any scalar metrics (means over the batch). The trainer only
calls `TrainStep` and `EvalStep`; pipelined tasks override `ComputeLossAndGrads`
to let their `PipeliningLayer` run the micro-batched forward and backward.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import base_layer, colocation, fprop_context, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import process_group
from lingvo_lite.tasks import inference, learning_rate, optimizers, sharded_optimizer, warm_start

__all__ = ["BaseTask", "scalar_outputs"]


def _train_params() -> hyperparams.Params:
    tp = hyperparams.Params()
    tp.Define("learning_rate", 1e-3, "Base learning rate; the schedule multiplies it.")
    tp.Define("lr_schedule", learning_rate.Constant.Params(), "Learning-rate schedule params.")
    tp.Define("optimizer", optimizers.Adam.Params(), "Optimizer params.")
    tp.Define("shard_optimizer_state", False,
              "ZeRO-1: each of the R data-parallel replicas keeps the optimizer slots of 1/R of "
              "every weight and updates that slice; the weights are all-gathered after the "
              "update (lingvo_lite/tasks/sharded_optimizer.py). Checkpoints keep the unsharded "
              "layout.")
    tp.Define("clip_gradient_norm_to_value", 0.0,
              "Clip the global gradient norm to this value; 0 disables clipping.")
    tp.Define("l2_regularizer_weight", 0.0,
              "Adds 0.5 * w * sum(v^2) over trainable weights to the loss (weights of rank >= 2).")
    tp.Define("max_steps", 1000, "Training stops at this global step.")
    tp.Define("save_interval_steps", 200, "Checkpoint every this many steps.")
    tp.Define("summary_interval_steps", 20, "Write training summaries every this many steps.")
    tp.Define("log_interval_steps", 20, "Print a progress line every this many steps.")
    tp.Define("max_checkpoints_to_keep", 5, "Checkpoints kept in the logdir.")
    tp.Define("init_from_checkpoint", None,
              "Transfer learning: a checkpoint path (<logdir>/checkpoints/ckpt-N) whose model "
              "weights initialise this model before step 0. A checkpoint of this run's own "
              "logdir, when present, takes precedence (resume).")
    tp.Define("init_exclude", [],
              "Regexes of variable keys (see checkpoint_variables) not taken from "
              "init_from_checkpoint, e.g. the new softmax layer.")
    tp.Define("eval_interval_steps", 0,
              "In train_and_eval mode, evaluate every this many steps (0 = at the end only).")
    tp.Define("max_consecutive_nonfinite_steps", 10,
              "Stop training with an error after this many consecutive steps whose loss or "
              "gradients were NaN/Inf (each such update is skipped).")
    return tp


def _eval_params() -> hyperparams.Params:
    ep = hyperparams.Params()
    ep.Define("max_eval_batches", 0, "Batches per evaluation; 0 = one full pass of the split.")
    return ep


class BaseTask(base_layer.BaseLayer):
    """The root layer of a trainable model."""

    @classmethod
    def Params(cls) -> hyperparams.InstantiableParams:
        p = super().Params()
        p.Define("input", None, "Training input generator params (set from the model params).")
        p.Define("train", _train_params(), "Training hyperparameters.")
        p.Define("eval", _eval_params(), "Evaluation hyperparameters.")
        return p

    def __init__(self, params: hyperparams.InstantiableParams) -> None:
        super().__init__(params)
        self._global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        tp = self.params.train
        self._optimizer = tp.optimizer.Instantiate()
        self._schedule = tp.lr_schedule.Instantiate()
        self._optimizer_ready = False
        self._sharded: sharded_optimizer.ShardedOptimizer | None = None

    @property
    def global_step(self) -> tf.Variable:
        return self._global_step

    @property
    def optimizer(self) -> optimizers.BaseOptimizer:
        return self._optimizer

    def trainable_vars(self) -> list[tf.Variable]:
        """Trainable variables in theta order."""
        return [v for v in self.vars.Flatten() if v.trainable]

    def replica_thetas(self) -> list[NestedMap]:
        """The theta of each data-parallel replica; replica 0's is `self.theta`."""
        return [self.theta]

    def replica_variable_pairs(self) -> list[tuple[tf.Variable, tf.Variable]]:
        """(variable, its copy in another replica) for every replica copy of a weight."""
        return []

    def sync_replicas(self) -> None:
        """Copies replica 0's weights and optimizer slots to the other replicas.

        Call after anything changes replica 0's weights outside a training step
        (restoring a checkpoint, warm-starting); the trainer does.
        """
        for var, copy in self.replica_variable_pairs():
            copy.assign(var)
            if self._sharded is None:  # Sharded slots are restored by each replica itself.
                self._optimizer.copy_slots(var, copy)

    def learning_rate(self, step: tf.Tensor | None = None) -> tf.Tensor:
        step = self._global_step if step is None else step
        return self.params.train.learning_rate * self._schedule.value(step)

    def prepare_for_training(self) -> None:
        """Creates optimizer slots (eagerly, each beside its weight) and warm-starts. Idempotent.

        The trainer restores its own latest checkpoint after this, so a resumed run
        continues from its own weights, not from `train.init_from_checkpoint`.
        """
        if self._optimizer_ready:
            return
        tp = self.params.train
        if tp.shard_optimizer_state:
            replicas = [[v for v in theta.Flatten() if isinstance(v, tf.Variable) and v.trainable]
                        for theta in self.replica_thetas()]
            group = process_group.current()
            sharded_optimizer.check_shardable(
                self._optimizer, len(replicas) * (1 if group is None else group.num_processes),
                tf.distribute.has_strategy())
            self._sharded = sharded_optimizer.ShardedOptimizer(self._optimizer, replicas)
        else:
            self._optimizer.create_slots(self.trainable_vars())
            self._optimizer.create_slots([copy for _, copy in self.replica_variable_pairs()])
        if tp.init_from_checkpoint:
            warm_start.warm_start(self.checkpoint_variables(), tp.init_from_checkpoint,
                                  tp.init_exclude)
            self.sync_replicas()
        self._optimizer_ready = True

    def ComputeLossAndGrads(
        self, theta: NestedMap, input_batch: NestedMap
    ) -> tuple[NestedMap, NestedMap]:
        """Forward and backward of one mini-batch.

        Returns (metrics, grads) where grads is shaped like theta (None for leaves
        without a gradient). Runs inside the training fprop context.
        """
        with tf.GradientTape() as tape:
            out = self.FProp(theta, input_batch)
        flat = theta.Flatten()
        grads = tape.gradient(out.loss, flat)
        return out, theta.Pack(list(grads))

    def ComputeReplicaLossAndGrads(
        self, thetas: list[NestedMap], input_batch: NestedMap
    ) -> tuple[NestedMap, list[NestedMap]]:
        """Forward and backward of one mini-batch over the data-parallel replicas.

        Returns (metrics, grads) where grads[r], shaped like thetas[r], is the
        gradient of the whole mini-batch's loss to apply to replica r. Tasks
        without replicas (the default) have one.
        """
        out, grads = self.ComputeLossAndGrads(thetas[0], input_batch)
        return out, [grads]

    def TokenCounts(self, input_batch: NestedMap) -> tuple[Any, Any] | None:
        """(positions, real positions) of a batch of sequences, for the trainer's tokens/s and
        padding summaries; None (the default) for a task whose examples are not sequences."""
        del input_batch
        return None

    def TrainStep(self, input_batch: NestedMap) -> NestedMap:
        """One optimizer step on a mini-batch: forward, backward, update, side updates.

        Returns the scalar metrics of the step (loss and the task's metrics, plus
        learning_rate, grad_norm and var_norm).
        """
        if not self._optimizer_ready:
            raise RuntimeError("Call task.prepare_for_training() before the first TrainStep.")
        tp = self.params.train
        collector = fprop_context.UpdateCollector()
        step_seed = tf.cast(self._global_step % (2**31 - 1), tf.int32)
        thetas = self.replica_thetas()
        with fprop_context.fprop_context(training=True, step_seed=step_seed,
                                         example_offset=0, updates=collector):
            out, replica_grads = self.ComputeReplicaLossAndGrads(thetas, input_batch)
        # One (gradient, variable) list per replica; the gradients are equal across
        # replicas, so norms and metrics are computed on replica 0's and every replica
        # applies the same update to its own weights.
        replica_pairs = [
            [(g, v) for g, v in zip(grads.Flatten(), theta.Flatten())
             if isinstance(v, tf.Variable) and v.trainable and g is not None]
            for grads, theta in zip(replica_grads, thetas)
        ]
        metrics = scalar_outputs(out)
        if tp.l2_regularizer_weight:
            added = [self._add_l2(pairs, tp.l2_regularizer_weight) for pairs in replica_pairs]
            replica_pairs = [pairs for pairs, _ in added]
            metrics.l2_loss = added[0][1]
            metrics.loss = metrics.loss + metrics.l2_loss
        pairs = replica_pairs[0]
        grad_norm = tf.linalg.global_norm([g for g, _ in pairs])
        all_finite = tf.math.is_finite(grad_norm) & tf.math.is_finite(metrics.loss)
        if tp.clip_gradient_norm_to_value:
            replica_pairs = [
                list(zip(tf.clip_by_global_norm([g for g, _ in ps], tp.clip_gradient_norm_to_value,
                                                use_norm=grad_norm)[0], [v for _, v in ps]))
                for ps in replica_pairs]
        lr = self.learning_rate()

        def update() -> tf.Tensor:
            ops = [self._sharded.apply(replica_pairs, lr) if self._sharded is not None
                   else self._optimizer.apply([gv for ps in replica_pairs for gv in ps], lr)]
            ops += collector.apply()
            with tf.control_dependencies(ops):
                return tf.constant(True)

        # A non-finite loss or gradient skips the update and leaves the weights intact.
        applied = tf.cond(all_finite, update, lambda: tf.constant(False))
        with tf.control_dependencies([applied]):
            self._global_step.assign_add(1)
        metrics.learning_rate = lr
        metrics.grad_norm = grad_norm
        metrics.var_norm = tf.linalg.global_norm([v for _, v in pairs])
        metrics.update_skipped = 1.0 - tf.cast(applied, tf.float32)
        return metrics

    @staticmethod
    def _add_l2(pairs: list[tuple[Any, tf.Variable]], weight: float
                ) -> tuple[list[tuple[Any, tf.Variable]], tf.Tensor]:
        """Adds weight * v to the gradient of every weight matrix/kernel (rank >= 2)."""
        new_pairs, terms = [], []
        for g, v in pairs:
            if v.shape.rank >= 2:
                with colocation.colocated(v):
                    g = g + weight * v
                    terms.append(tf.reduce_sum(tf.square(v)))
            new_pairs.append((g, v))
        l2 = 0.5 * weight * tf.add_n(terms) if terms else tf.constant(0.0)
        return new_pairs, l2

    def EvalStep(self, input_batch: NestedMap) -> NestedMap:
        """Forward in eval mode (moving BN statistics, no dropout); scalar metrics."""
        with fprop_context.fprop_context(training=False, updates=None):
            out = self.FProp(self.theta, input_batch)
        return scalar_outputs(out)

    def Inference(self) -> inference.InferenceGraph:
        """The serving signatures `trainer.py --mode=export` writes (Lingvo's `Inference()`).

        Called on the task built unpipelined (one cell, one micro-batch, one replica) with a
        checkpoint restored; returns an `inference.InferenceGraph` whose signatures read this
        task's variables (see lingvo_lite/tasks/inference.py and docs/export.md). A task that serves
        nothing keeps this default, which refuses the export in one line.
        """
        raise inference.InferenceNotDefinedError(
            f"task {type(self).__name__} ({self.path}) defines no serving signatures: add a "
            "method Inference(self) returning "
            "lingvo_lite.tasks.inference.InferenceGraph(signatures="
            "{'serving_default': <tf.function with an input_signature>}) to export it "
            "(docs/export.md).")

    @property
    def sharded_state(self) -> sharded_optimizer.ShardedOptimizer | None:
        """The ZeRO-1 optimizer state (`train.shard_optimizer_state`), else None."""
        return self._sharded

    def checkpoint_variables(self) -> dict[str, tf.Variable]:
        """Every variable to save, keyed by a stable path (independent of the partition)."""
        named = {f"model/{path}": v for path, v in self.vars.FlattenItems()}
        named["global_step"] = self._global_step
        # Replica copies of the weights (and their slots) equal replica 0's: not saved.
        slots = (self._sharded.checkpoint_slots() if self._sharded is not None
                 else self._optimizer.slot_variables(self.trainable_vars()))
        named.update({f"optimizer/{k}": v for k, v in slots.items()})
        return named


def scalar_outputs(out: NestedMap) -> NestedMap:
    """The float scalar entries of a FProp output (losses and metrics)."""
    return out.FilterKeyVal(
        lambda _, v: isinstance(v, tf.Tensor) and v.shape.rank == 0 and v.dtype.is_floating)
