"""Weighted means over data-parallel replicas: gradients (collectives) and scalar outputs.

Each replica r of a pipeline trains on its shard of the mini-batch and weighs its gradients
and scalar outputs by w_r (its share of the loss weight: examples, or the sum of sample
weights). The step's value is sum_r w_r x_r / sum_r w_r, the mean one replica would compute
over the whole batch.

Example (two replicas on two logical CPUs, one weight each):

    reduce = collectives.AllReduce(["/device:CPU:0", "/device:CPU:1"])
    grads = [NestedMap(w=tf.constant([1.0])), NestedMap(w=tf.constant([4.0]))]
    means = weighted_mean_grads(grads, [tf.constant(3.0), tf.constant(1.0)], [reduce], [0])
    # Both replicas get w = (3 * 1 + 1 * 4) / 4 = 1.75.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import collectives

__all__ = ["WEIGHT_KEYS", "weighted_mean_grads", "weighted_mean_scalars"]

# Scalar outputs that count examples (or real tokens) in a micro-batch: they are summed across
# micro-batches, replicas and tasks, and weigh the other scalars' means.
WEIGHT_KEYS = ("loss_weight", "num_examples")


def weighted_mean_grads(grads: list[NestedMap], weights: list[tf.Tensor],
                        all_reduces: Sequence[collectives.AllReduce],
                        cell_of_leaf: Sequence[int]) -> list[NestedMap]:
    """sum_r w_r g_r / sum_r w_r for every gradient, on each replica's devices.

    Args:
      grads: each replica's gradients, NestedMaps of the same structure (None: not trained).
      weights: each replica's loss weight w_r.
      all_reduces: cell k's all-reduce over the devices holding cell k, one per cell.
      cell_of_leaf: the cell of each leaf of the gradients, in `Flatten()` order.
    """
    flat = [g.Flatten() for g in grads]
    reduced = [list(f) for f in flat]
    for k, all_reduce in enumerate(all_reduces):
        idx = [i for i, g in enumerate(flat[0]) if g is not None and cell_of_leaf[i] == k]
        if not idx:
            continue
        members = []
        for r, device in enumerate(all_reduce.devices):
            with tf.device(device):
                w = tf.cast(weights[r], tf.float32)
                members.append([flat[r][i] * tf.cast(w, flat[r][i].dtype) for i in idx] + [w])
        for r, summed in enumerate(all_reduce(members)):
            with tf.device(all_reduce.devices[r]):
                total = tf.maximum(summed[-1], 1e-8)
                for i, g in zip(idx, summed[:-1]):
                    reduced[r][i] = g / tf.cast(total, g.dtype)
    return [g.Pack(f) for g, f in zip(grads, reduced)]


def weighted_mean_scalars(context: tf.distribute.ReplicaContext, out: NestedMap,
                          weight: tf.Tensor) -> NestedMap:
    """Scalar float outputs as their weighted mean over a strategy's replicas; the loss
    weights themselves (WEIGHT_KEYS) summed."""
    items = out.FlattenItems()
    idx = [i for i, (_, v) in enumerate(items)
           if v is not None and v.shape.rank == 0 and v.dtype.is_floating]
    if not idx:
        return out
    values = [items[i][1] if items[i][0] in WEIGHT_KEYS
              else items[i][1] * tf.cast(weight, items[i][1].dtype) for i in idx]
    *summed, total = context.all_reduce(tf.distribute.ReduceOp.SUM, values + [weight])
    total = tf.maximum(total, 1e-8)
    leaves = [v for _, v in items]
    for i, v in zip(idx, summed):
        leaves[i] = v if items[i][0] in WEIGHT_KEYS else v / tf.cast(total, v.dtype)
    return out.Pack(leaves)
