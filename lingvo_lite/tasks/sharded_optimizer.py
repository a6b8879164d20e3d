"""ZeRO-1 (Rajbhandari et al.): optimizer slots sharded over the data-parallel replicas.

Every replica holds the whole weights but only 1/R of their optimizer slots. Weight w, n
elements, flattened and padded to R x s elements (s = ceil(n / R)), is cut into R shards of s
elements; the replica of collective rank i (`collectives.collective_ranks` of the R devices
that hold w) owns shard i: its slots are s-element variables on its device (scalar slots, such
as Adam's step count, stay whole). A step then

1. sums the gradients over the replicas and keeps, on each replica, its own shard of the sum.
   TensorFlow 2.21 has no CPU implementation of `CollectiveReduceScatterV2` ("CollectiveRegistry
   ::Lookup did not find collective implementation"), so the reduce-scatter is its exact
   equivalent from collectives: the pipeline's all-reduce (`CollectiveReduceV2`), then each
   replica slices its shard (the same values a reduce-scatter gives, bit for bit);
2. updates each replica's weight shard with its slot shards (`optimizer.update_shard`: the
   fused kernel's formula element by element, so only element-wise optimizers qualify);
3. all-gathers the new shards (`CollectiveGatherV2`, one per device group and dtype, every
   weight of the group packed) and writes the whole weights back on every replica.

Checkpoints keep the unsharded layout: `checkpoint_slots` gives, per weight and slot, an object
saved as the whole tensor (the shards concatenated in rank order, padding dropped) under the
key an unsharded run uses, and restored by slicing each replica's shard from the whole tensor.
A run resumes with any R, sharded or not.

Multi-client (`process_group`): the group spans every task's replicas (R_local x N shards); a
replica's rank is its place among every task's device names ('/job:worker/replica:0/task:i/
...', task-major), where `CollectiveGatherV2` puts its piece. At each checkpoint every task
calls `gather_slots` (a collective) so that the chief saves the whole slots; on restore each
task slices its own replicas' shards.

Example (2 replicas on 2 logical CPUs, created before TensorFlow starts):

    import tensorflow as tf
    from lingvo_lite.core import devices
    from lingvo_lite.tasks import optimizers, sharded_optimizer
    devices.configure_logical_cpus(2)
    ws = []
    for d in ("/device:CPU:0", "/device:CPU:1"):
        with tf.device(d):
            ws.append(tf.Variable([1.0, 2.0, 3.0]))
    opt = sharded_optimizer.ShardedOptimizer(
        optimizers.Adam.Params().Instantiate(), [[ws[0]], [ws[1]]])
    g = tf.constant([0.1, 0.2, 0.3])
    opt.apply([[(g, ws[0])], [(g, ws[1])]], tf.constant(0.01))  # ws[0] == ws[1] after it
    opt.slot_shapes()  # {'/job:localhost/replica:0/task:0/device:CPU:0': [(2,), (2,), ()],
                       #  ...}: m and v of ceil(3 / 2) = 2 elements, the step count t
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.trackable import base as trackable

from lingvo_lite.distributed import cluster_spec, collectives, process_group
from lingvo_lite.tasks import optimizers

__all__ = ["ShardedOptimizer", "check_shardable"]


def check_shardable(optimizer: optimizers.BaseOptimizer, num_replicas: int,
                    under_strategy: bool = False) -> None:
    """Raises a one-line ValueError when `train.shard_optimizer_state` cannot be honoured
    (`num_replicas`: the replicas of all processes)."""
    if under_strategy:
        raise ValueError(
            "train.shard_optimizer_state=True under a tf.distribute strategy (TPU): the "
            "strategy keeps the optimizer state; drop --shard_optimizer_state.")
    if num_replicas < 2:
        raise ValueError(
            f"train.shard_optimizer_state=True with {num_replicas} replica: there is nothing to "
            "shard the optimizer state over; set --num_replicas >= 2 or drop "
            "--shard_optimizer_state.")
    if not optimizer.updates_elementwise:
        raise ValueError(
            f"train.shard_optimizer_state=True: optimizer {type(optimizer).__name__} has no "
            "element-wise update (update_shard), so a replica cannot update its slice of a "
            "weight alone; use SGD, Adam or RMSProp, or drop --shard_optimizer_state.")


def _global_ranks(devices: Sequence[str],
                  processes: cluster_spec.Cluster | None) -> list[int]:
    """The collective ranks of this process's `devices` in the group spanning every task,
    each of which holds the same devices under its own '/job:worker/replica:0/task:i'."""
    if processes is None:
        return collectives.collective_ranks(devices)
    names = [tf.DeviceSpec.from_string(d).replace(
        job=cluster_spec.JOB, replica=0, task=t).to_string()
        for t in range(processes.num_processes) for d in devices]
    ranks = collectives.collective_ranks(names)
    start = processes.index * len(devices)
    return ranks[start:start + len(devices)]


class _Weight:
    """One trainable weight's copies (one per local replica) and its shard geometry."""

    def __init__(self, copies: list[tf.Variable], num_shards: int) -> None:
        self.copies = copies
        self.shape = copies[0].shape
        self.dtype = copies[0].dtype
        self.size = self.shape.num_elements()
        self.shard_size = max(1, math.ceil(self.size / num_shards))

    def shard_of(self, flat: tf.Tensor, rank: int, fill: float = 0.0) -> tf.Tensor:
        """Elements [rank * s, (rank + 1) * s) of `flat` (n elements), padded with `fill`."""
        start = min(rank * self.shard_size, self.size)
        stop = min(start + self.shard_size, self.size)
        piece = flat[start:stop]
        if stop - start == self.shard_size:
            return piece
        pad = tf.fill([self.shard_size - (stop - start)], tf.cast(fill, flat.dtype))
        return tf.concat([piece, pad], axis=0)


class _FullSlot(trackable.Trackable):
    """One slot of one weight, saved and restored as the whole (unsharded) tensor."""

    def __init__(self, weight: _Weight, shards: list[tf.Variable], ranks: list[int],
                 num_shards: int, scalar: bool, fill: float,
                 gathered: Callable[[], tf.Tensor | None]) -> None:
        self._weight, self._shards, self._ranks = weight, shards, ranks
        self._num_shards, self._scalar, self._fill = num_shards, scalar, fill
        self._gathered = gathered

    def _whole(self) -> tf.Tensor:
        if self._scalar:
            return tf.identity(self._shards[0])
        if self._num_shards != len(self._shards):  # Other processes hold the other shards.
            whole = self._gathered()
            if whole is None:
                # TensorFlow also serializes to learn the shape and dtype when it restores.
                # Only a save without gather_slots() (a bug) writes these NaNs.
                return tf.fill(self._weight.shape, tf.constant(math.nan, self._weight.dtype))
            return whole
        by_rank = sorted(zip(self._ranks, self._shards), key=lambda pair: pair[0])
        with tf.device(self._shards[0].device):
            flat = tf.concat([s.read_value() for _, s in by_rank], axis=0)
            return tf.reshape(flat[:self._weight.size], self._weight.shape)

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        return {trackable.VARIABLE_VALUE_KEY: self._whole()}

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> tf.Operation:
        value = restored_tensors[trackable.VARIABLE_VALUE_KEY]
        want = tf.TensorShape([]) if self._scalar else self._weight.shape
        if not value.shape.is_compatible_with(want):
            raise ValueError(f"Received incompatible tensor with shape {value.shape} when "
                             f"attempting to restore a sharded slot of shape {want}.")
        ops = []
        for rank, shard in zip(self._ranks, self._shards):
            with tf.device(shard.device):
                v = tf.cast(value, shard.dtype)
                ops.append(shard.assign(v if self._scalar else self._weight.shard_of(
                    tf.reshape(v, [-1]), rank, self._fill)))
        return tf.group(*ops)


class ShardedOptimizer:
    """Applies an element-wise optimizer with its slots sharded over the replicas (ZeRO-1).

    Args:
      optimizer: the task's optimizer (its rules; it keeps no slots itself).
      replica_variables: `replica_variables[r][i]`, local replica r's copy of trainable weight
        i, each replica's copies on its own devices (`task.replica_thetas()`).
      group_size: replicas in all processes (default: the local ones times the processes
        of `process_group.current()`, whose tasks all build the same replicas).
      ranks: `ranks[r]`, local replica r's collective rank among all replicas (default:
        `collectives.collective_ranks` of every process's devices, see `_global_ranks`; the
        ranks must be the same for every weight's device group).
    """

    def __init__(self, optimizer: optimizers.BaseOptimizer,
                 replica_variables: Sequence[Sequence[tf.Variable]],
                 group_size: int | None = None, ranks: Sequence[int] | None = None) -> None:
        self._optimizer = optimizer
        local = len(replica_variables)
        self._processes = process_group.current()
        if self._processes is not None and self._processes.num_processes < 2:
            self._processes = None
        self.num_shards = group_size or local * (
            1 if self._processes is None else self._processes.num_processes)
        self._gathered: dict[tuple[int, str], tf.Tensor] = {}
        check_shardable(optimizer, self.num_shards)
        self._weights = [_Weight([replica_variables[r][i] for r in range(local)],
                                 self.num_shards)
                         for i in range(len(replica_variables[0]))]
        self._ranks = list(ranks) if ranks is not None else None
        self._groups: dict[tuple[tuple[str, ...], tf.DType], collectives.AllGather] = {}
        self._group_of: list[tuple[tuple[str, ...], tf.DType]] = []
        self._member_ranks: dict[tuple[str, ...], list[int]] = {}
        for w in self._weights:
            devices = tuple(v.device for v in w.copies)
            if len(set(devices)) != len(devices):
                raise ValueError(f"Replicas of {w.copies[0].name} share a device ({devices}); "
                                 "every replica's weights need their own device.")
            key = (devices, w.dtype)
            if key not in self._groups:
                self._groups[key] = collectives.AllGather(list(devices), self.num_shards)
                self._member_ranks[devices] = (self._ranks if self._ranks is not None
                                               else _global_ranks(devices, self._processes))
            self._group_of.append(key)
        scalar = optimizer._scalar_slots()
        self._slots: list[list[dict[str, tf.Variable]]] = []  # [weight][local replica]
        for w in self._weights:
            per_replica = []
            for v in w.copies:
                with tf.device(v.device):
                    per_replica.append({
                        name: tf.Variable(
                            tf.fill([] if name in scalar else [w.shard_size],
                                    tf.cast(init, w.dtype)),
                            trainable=False, name=f"{v.name.split(':')[0]}.{name}.shard")
                        for name, init in optimizer._slot_names().items()})
            self._slots.append(per_replica)

    def _ranks_of(self, i: int) -> list[int]:
        return self._member_ranks[self._group_of[i][0]]

    def apply(self, replica_pairs: Sequence[Sequence[tuple[Any, tf.Variable]]],
              learning_rate: tf.Tensor) -> tf.Operation:
        """Updates every replica's weights from `replica_pairs[r]`, replica r's (summed
        gradient, variable) pairs (each replica holding the whole sum); returns the update op."""
        grads: dict[tuple[int, int], tf.Tensor] = {}
        index = {w.copies[r].ref(): (i, r) for i, w in enumerate(self._weights)
                 for r in range(len(w.copies))}
        for pairs in replica_pairs:
            for g, v in pairs:
                if g is not None:
                    grads[index[v.ref()]] = g
        updates = []
        for key, gather in self._groups.items():
            members = [i for i in range(len(self._weights)) if self._group_of[i] == key
                       and all((i, r) in grads for r in range(len(gather.devices)))]
            if members:
                updates.append(self._update_group(gather, members, grads, learning_rate))
        return tf.group(*updates)

    def _update_group(self, gather: collectives.AllGather, members: list[int],
                      grads: dict[tuple[int, int], tf.Tensor],
                      learning_rate: tf.Tensor) -> tf.Operation:
        ranks = self._ranks_of(members[0])
        packed = []
        for r, device in enumerate(gather.devices):
            with tf.device(device):
                new_shards = []
                for i in members:
                    w = self._weights[i]
                    g = tf.reshape(tf.convert_to_tensor(grads[(i, r)], w.dtype), [-1])
                    # The weight's slice is read once the gradient exists (not at the step's
                    # start, where it would be held through the forward and backward).
                    with tf.control_dependencies([g]):
                        value = w.shard_of(tf.reshape(w.copies[r].read_value(), [-1]),
                                           ranks[r])
                    new_shards.append(self._optimizer.update_shard(
                        w.shard_of(g, ranks[r]), value, self._slots[i][r],
                        tf.cast(learning_rate, w.dtype)))
                packed.append(tf.concat(new_shards, axis=0))
        writes = []
        sizes = [self._weights[i].shard_size for i in members]
        for r, (device, whole) in enumerate(zip(gather.devices, gather(packed))):
            with tf.device(device):
                columns = tf.split(tf.reshape(whole, [self.num_shards, sum(sizes)]), sizes,
                                   axis=1)
                for i, column in zip(members, columns):
                    w = self._weights[i]
                    writes.append(w.copies[r].assign(
                        tf.reshape(tf.reshape(column, [-1])[:w.size], w.shape)))
        return tf.group(*writes)

    def checkpoint_slots(self) -> dict[str, trackable.Trackable]:
        """The slots in the unsharded layout, keyed like `optimizer.slot_variables()`
        ('<replica 0's variable name>/<slot name>')."""
        scalar = self._optimizer._scalar_slots()
        inits = self._optimizer._slot_names()
        out = {}
        for i, w in enumerate(self._weights):
            for name in sorted(inits):
                out[f"{w.copies[0].name}/{name}"] = _FullSlot(
                    w, [s[name] for s in self._slots[i]], self._ranks_of(i), self.num_shards,
                    name in scalar, inits[name], lambda key=(i, name): self._gathered.get(key))
        return dict(sorted(out.items()))

    def gather_slots(self, timeout_seconds: float = 0.0) -> None:
        """Gathers every process's slot shards so that the next save writes the whole slots.

        A collective: every process of the group calls it at the same point (multi-client:
        at each checkpoint step, before the chief saves); `release_gathered` frees them.
        `timeout_seconds` > 0 bounds the wait for the other processes. No-op in one process.
        """
        self._gathered = {}
        if not self._weights or self.num_shards == len(self._weights[0].copies):
            return
        names = sorted(set(self._optimizer._slot_names()) - set(self._optimizer._scalar_slots()))
        for key, gather in self._groups.items():
            members = [i for i in range(len(self._weights)) if self._group_of[i] == key]
            packed = []
            for r, device in enumerate(gather.devices):
                with tf.device(device):
                    packed.append(tf.concat([tf.convert_to_tensor(self._slots[i][r][name])
                                             for i in members for name in names], axis=0))
            sizes = [self._weights[i].shard_size for i in members for _ in names]
            with tf.device(gather.devices[0]):
                whole = gather(packed, timeout_seconds=timeout_seconds)[0]
                columns = tf.split(tf.reshape(whole, [self.num_shards, sum(sizes)]), sizes,
                                   axis=1)
                for (i, name), column in zip([(i, n) for i in members for n in names],
                                             columns):
                    w = self._weights[i]
                    self._gathered[(i, name)] = tf.reshape(
                        tf.reshape(column, [-1])[:w.size], w.shape)

    def release_gathered(self) -> None:
        """Drops the slots `gather_slots` gathered."""
        self._gathered = {}

    def slot_variables(self) -> list[tf.Variable]:
        """Every slot shard variable (of every local replica)."""
        return [v for per_replica in self._slots for slots in per_replica
                for v in slots.values()]

    def slot_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        """Device -> the shapes of the slot shards it holds."""
        out: dict[str, list[tuple[int, ...]]] = {}
        for per_replica in self._slots:
            for slots in per_replica:
                for v in slots.values():
                    out.setdefault(v.device, []).append(tuple(v.shape.as_list()))
        return out
