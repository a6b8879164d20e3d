"""Summing tensors across devices with TensorFlow's collective all-reduce.

Data-parallel replicas of a pipeline hold the same weights; after each step the
gradients of cell k are summed over the R devices that hold cell k (one per
replica) with `CollectiveReduceV2`, the op `tf.distribute`'s multi-worker
strategy uses. TensorFlow picks the implementation: a ring over gRPC between
hosts, NCCL between GPUs (`communication_hint='auto'`).

Collectives are matched across devices and processes by keys: every member of a
group must build the same groups in the same order and launch the same
instances. The keys here come from counters advanced as the (deterministic)
model code builds its pipelines and traces its step, so every process that runs
the same program agrees on them.

Example (two logical CPU devices, created before TensorFlow starts):

    reduce = AllReduce(["/device:CPU:0", "/device:CPU:1"])
    [[a], [b]] = reduce([[tf.constant([1.0])], [tf.constant([2.0])]])  # both [3.0]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import tensorflow as tf

__all__ = ["AllGather", "AllReduce", "collective_ranks"]

_group_keys = itertools.count(1)
_instance_keys = itertools.count(1)


class _Group:
    """The members of one collective group on this process's devices, with its group key."""

    def __init__(self, devices: Sequence[str], group_size: int | None = None) -> None:
        self.devices = list(devices)
        self.group_size = group_size or len(self.devices)
        if self.group_size < len(self.devices):
            raise ValueError(f"group_size={self.group_size} is smaller than the "
                             f"{len(self.devices)} local devices of the group.")
        self._group_key = next(_group_keys)
        # A per-device token orders the collectives each device launches; without one,
        # collectives between logical devices of one process wait for each other forever.
        self._tokens = []
        for device in self.devices:
            with tf.device(device):
                self._tokens.append(tf.Variable(0.0, trainable=False, name="collective_order"))


class AllReduce(_Group):
    """Sums lists of tensors element-wise across the devices of one group.

    Args:
      devices: this process's members of the group, one device each.
      group_size: members in all processes (default: `len(devices)`, one process).
    """

    def __call__(self, values: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """`values[i]` lives on `devices[i]`; returns the sums, each on its member's device.

        The tensors of one member are packed into one buffer per dtype, so a cell's
        gradients travel as one all-reduce rather than one per variable.
        """
        if len(values) != len(self.devices):
            raise ValueError(f"AllReduce over {len(self.devices)} devices got values for "
                             f"{len(values)}.")
        if tf.executing_eagerly():
            # Eagerly, ops run one at a time and the first member would wait forever for
            # the others: launch all members together as one function call.
            return tf.function(self._reduce, autograph=False)(values)
        return self._reduce(values)

    def _reduce(self, values: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        dtypes = sorted({v.dtype for v in values[0]}, key=lambda d: d.name)
        instance_keys = {dtype: next(_instance_keys) for dtype in dtypes}
        results = []
        for device, token, member in zip(self.devices, self._tokens, values):
            with tf.device(device):
                out: list[tf.Tensor | None] = [None] * len(member)
                for dtype in dtypes:
                    idx = [i for i, v in enumerate(member) if v.dtype == dtype]
                    flat = tf.concat([tf.reshape(member[i], [-1]) for i in idx], axis=0)
                    summed = tf.raw_ops.CollectiveReduceV2(
                        input=flat, group_size=self.group_size, group_key=self._group_key,
                        instance_key=instance_keys[dtype], ordering_token=[token.handle],
                        merge_op="Add", final_op="Id", communication_hint="auto")
                    pieces = tf.split(summed, [member[i].shape.num_elements() for i in idx])
                    for i, piece in zip(idx, pieces):
                        out[i] = tf.reshape(piece, member[i].shape)
                results.append(out)
        return results


def collective_ranks(devices: Sequence[str]) -> list[int]:
    """The rank TensorFlow gives each member of a group: its place in the order of full device
    names (job, replica, task, device type, then index as a number), which is where
    `CollectiveGatherV2` puts its piece. Pass every member's name, in all processes.

    >>> collective_ranks(["/device:CPU:10", "/device:CPU:2", "/device:CPU:1"])
    [2, 1, 0]
    """
    def key(name: str) -> tuple[str, int, int, str, int]:
        spec = tf.DeviceSpec.from_string(name)
        return (spec.job or "localhost", spec.replica or 0, spec.task or 0,
                spec.device_type or "", spec.device_index or 0)

    order = sorted(range(len(devices)), key=lambda i: key(devices[i]))
    ranks = [0] * len(devices)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


class AllGather(_Group):
    """Concatenates one 1-D tensor from every member of a group, in rank order
    (`CollectiveGatherV2`; ranks: `collective_ranks`).

    Args:
      devices: this process's members of the group, one device each.
      group_size: members in all processes (default: `len(devices)`, one process).

    Example:
        gather = AllGather(["/device:CPU:1", "/device:CPU:0"])
        a, b = gather([tf.constant([1.0]), tf.constant([2.0])])  # both [2.0, 1.0]
    """

    def __call__(self, values: Sequence[tf.Tensor],
                 timeout_seconds: float = 0.0) -> list[tf.Tensor]:
        """`values[i]` (1-D, the same size and dtype for every member) lives on `devices[i]`;
        returns the concatenation over all members, on each member's device.
        `timeout_seconds` > 0: fail (DeadlineExceededError) if a member has not joined by then."""
        if len(values) != len(self.devices):
            raise ValueError(f"AllGather over {len(self.devices)} devices got "
                             f"{len(values)} values.")
        if tf.executing_eagerly():  # As in AllReduce: launch every member at once.
            return tf.function(lambda v: self._gather(v, timeout_seconds),
                               autograph=False)(values)
        return self._gather(values, timeout_seconds)

    def _gather(self, values: Sequence[tf.Tensor],
                timeout_seconds: float = 0.0) -> list[tf.Tensor]:
        instance_key = next(_instance_keys)
        out = []
        for device, token, value in zip(self.devices, self._tokens, values):
            with tf.device(device):
                out.append(tf.raw_ops.CollectiveGatherV2(
                    input=value, group_size=self.group_size, group_key=self._group_key,
                    instance_key=instance_key, ordering_token=[token.handle],
                    communication_hint="auto", timeout_seconds=timeout_seconds))
        return out
