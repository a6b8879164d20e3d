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

__all__ = ["AllReduce"]

_group_keys = itertools.count(1)
_instance_keys = itertools.count(1)


class AllReduce:
    """Sums lists of tensors element-wise across the devices of one group.

    Args:
      devices: this process's members of the group, one device each.
      group_size: members in all processes (default: `len(devices)`, one process).
    """

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
