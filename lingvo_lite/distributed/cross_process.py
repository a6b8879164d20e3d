"""What a multi-client step combines across processes besides gradients.

Within one process the replicas of a pipeline already pool their batch-norm statistics (one
`UpdateCollector` for every replica and micro-batch) and merge their scalar outputs (loss,
metrics) as weighted means. With several processes (`process_group`) each process holds
only its share, so after the local pooling:

- `pool_moments_globally` replaces each layer's reported moments by the moments of the global
  batch, pooled from every micro-batch of every process exactly as one process holding all
  the replicas pools them (`normalization.pool_moments`), so the moving statistics are the
  same, bit for bit;
- `global_scalars` turns the local weighted means into the global ones.

Both run through one small all-reduce group (`side`, one member per process, on the last
cell's device of the first local replica), one collective each per step.

Example (one process stands in for the group; `side` sums over a group of 1):

    side = collectives.AllReduce(["/device:CPU:0"])
    out = global_scalars(side, NestedMap(loss=tf.constant(2.0)), tf.constant(1.0))
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.distributed import collectives
from lingvo_lite.distributed.replica_means import WEIGHT_KEYS
from lingvo_lite.layers.normalization import pool_moments

__all__ = ["global_scalars", "pool_moments_globally"]

_MOMENT_KEYS = {"count", "mean", "variance"}


def _is_moments(value: Any) -> bool:
    return isinstance(value, NestedMap) and set(value.keys()) == _MOMENT_KEYS


def _moment_paths(stats: NestedMap) -> list[str]:
    """Paths of the moment records (NestedMap(count, mean, variance)) within one report."""
    if _is_moments(stats):
        return [""]
    paths = []
    for key, value in stats.items():
        if isinstance(value, NestedMap):
            paths += [f"{key}.{p}" if p else key for p in _moment_paths(value)]
    return paths


def _get(stats: NestedMap, path: str) -> Any:
    return stats if not path else stats.GetItem(path)


def pool_moments_globally(side: collectives.AllReduce,
                          collector: fprop_context.UpdateCollector,
                          layer_ids: set[int], num_processes: int, index: int) -> None:
    """Replaces the reports of the layers in `layer_ids` by one report of global moments.

    Every process's moment records travel to every process (each process fills its own row
    of a zero buffer, and a sum adds only zeros to it: exact), then `pool_moments` pools all
    of them in the order one process with every replica would: the same numbers, bit for
    bit. Other leaves of a report (e.g. a Keras layer's `draws`) are kept from the first.
    """
    entries = [(layer, stats) for layer, stats in collector.items()
               if id(layer) in layer_ids and stats]
    records = [(e, path) for e, (_, stats) in enumerate(entries)
               for path in _moment_paths(stats[0])]
    if not records:
        return
    rows = []  # Per record: [local reports, 1 + 2 * size] (count, mean, variance).
    for e, path in records:
        parts = [_get(s, path) for s in entries[e][1]]
        rows.append(tf.stack([tf.concat([tf.reshape(tf.cast(p.count, tf.float32), [1]),
                                         tf.reshape(tf.cast(p.mean, tf.float32), [-1]),
                                         tf.reshape(tf.cast(p.variance, tf.float32), [-1])], 0)
                              for p in parts]))
    (device,) = side.devices
    with tf.device(device):
        mine = [tf.pad(r[None], [[index, num_processes - 1 - index], [0, 0], [0, 0]])
                for r in rows]
        everyone = side([mine])[0]
    pooled: dict[int, NestedMap] = {}
    for (e, path), table in zip(records, everyone):
        like = _get(entries[e][1][0], path)
        size = like.mean.shape.num_elements()
        with tf.device(device):
            flat = tf.reshape(table, [-1, 1 + 2 * size])
            mean, variance = pool_moments([NestedMap(
                count=flat[i, 0], mean=tf.reshape(flat[i, 1:1 + size], like.mean.shape),
                variance=tf.reshape(flat[i, 1 + size:], like.variance.shape))
                for i in range(flat.shape[0])])
            count = tf.reduce_sum(flat[:, 0])
        record = NestedMap(count=count, mean=mean, variance=variance)
        if path:
            pooled.setdefault(e, entries[e][1][0].DeepCopy()).Set(path, record)
        else:
            pooled[e] = record
    for e, report in pooled.items():
        collector.replace(entries[e][0], [report])


def global_scalars(side: collectives.AllReduce, out: Any, weight: tf.Tensor) -> Any:
    """Float scalar outputs as weighted means over the processes; `WEIGHT_KEYS` summed.

    `weight` is this process's share of the batch's weight (its summed `loss_weight`, or
    its number of replicas when micro-batches weigh the same).
    """
    if not isinstance(out, NestedMap):
        return out
    items = out.FlattenItems()
    idx = [i for i, (_, v) in enumerate(items)
           if v is not None and v.shape.rank == 0 and v.dtype.is_floating]
    if not idx:
        return out
    (device,) = side.devices
    with tf.device(device):
        weight = tf.cast(weight, tf.float32)
        values = [tf.cast(items[i][1], tf.float32) if items[i][0] in WEIGHT_KEYS
                  else tf.cast(items[i][1], tf.float32) * weight for i in idx]
        *summed, total = side([values + [weight]])[0]
        total = tf.maximum(total, 1e-8)
        leaves = [v for _, v in items]
        for i, s in zip(idx, summed):
            value = s if items[i][0] in WEIGHT_KEYS else s / total
            leaves[i] = tf.cast(value, items[i][1].dtype)
    return out.Pack(leaves)
