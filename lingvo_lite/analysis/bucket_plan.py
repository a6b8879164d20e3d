"""Step time of a bucket mix and memory of every bucket, for `--mode=plan` and `inspect_model`.

A pipeline trained on length buckets (`PipeliningLayer.input_buckets`) runs steps of several
shapes with one partition, chosen for `input_shapes` (or the largest bucket). Memory must fit
the fullest step, so the planner's search plans for that shape; the time of training is the
mix: each bucket's simulated step weighted by how often the bucket occurs. The weights are
`input_bucket_weights` when set, else the training input's `bucket_distribution()` when it
has one (ParallelTextInput with bucket_lengths: the share of its batches in each bucket),
else equal. This module adds, for one configuration, each bucket's predicted step time,
positions/s and peak memory per device, the weighted mix, and which bucket fills memory most.

Example:
    >>> import tensorflow as tf
    >>> from lingvo_lite.layers import dense
    >>> from lingvo_lite.pipeline import pipelining_layer
    >>> p = pipelining_layer.PipeliningLayer.Params().Set(
    ...     name="pipe", num_cells=2, num_micro_batches=2,
    ...     input_buckets=[tf.TensorShape([32, 8]), tf.TensorShape([16, 8])],
    ...     layers=[dense.ProjectionLayer.Params().Set(name=f"l{i}", input_dim=8, output_dim=8)
    ...             for i in range(4)])
    >>> steps = bucket_steps(p, weights=[0.75, 0.25])
    >>> [s.batch for s in steps], steps[0].step_time > steps[1].step_time
    ([32, 16], True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from lingvo_lite.analysis import memory_model, planner, simulator
from lingvo_lite.core import base_layer, hyperparams
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.core.sizes import format_bytes
from lingvo_lite.pipeline import buckets, pipelining_layer, step_layout
from lingvo_lite.pipeline.schedules import schedule as schedule_lib

__all__ = ["BucketStep", "bucket_steps", "bucket_weights", "mix_lines"]


@dataclasses.dataclass(frozen=True)
class BucketStep:
    """One bucket's predicted step (None times when its batch does not split so)."""

    shapes: Any
    weight: float
    batch: int
    positions: int  # Elements of the first input: e.g. batch x sequence length.
    step_time: float | None
    peak_bytes: int | None
    num_micro_batches: int | None
    reason: str = ""


def bucket_weights(p: hyperparams.Params, input_params: hyperparams.Params | None = None
                   ) -> tuple[list[float], str]:
    """(how often each of `p.input_buckets` occurs, summing to 1; where that comes from)."""
    n = len(p.input_buckets)
    if p.input_bucket_weights is not None:
        w = [float(x) for x in p.input_bucket_weights]
        if len(w) != n or min(w) < 0 or sum(w) <= 0:
            raise ValueError(f"input_bucket_weights={p.input_bucket_weights!r}: give one weight "
                             f">= 0 for each of the {n} input_buckets (not all 0).")
        return [x / sum(w) for x in w], "input_bucket_weights"
    distribution = getattr(getattr(input_params, "cls", None), "bucket_distribution", None)
    if distribution is not None:
        try:
            w = list(input_params.Instantiate().bucket_distribution())
        except (ValueError, OSError) as e:
            return [1.0 / n] * n, f"equal (the training input's distribution: {e})"
        if len(w) == n and sum(w) > 0:
            return [x / sum(w) for x in w], "the training input's batches per bucket"
    return [1.0 / n] * n, ("equal (set <pipeline>.input_bucket_weights, or use an input with "
                           "bucket_distribution())")


def _first_leaf(shapes: Any) -> tf.TensorShape:
    return (shapes.Flatten() if isinstance(shapes, NestedMap) else [shapes])[0]


def _one_bucket(p: hyperparams.Params, part: Any, bucket: Any, weight: float,
                num_replicas: int, sched: schedule_lib.Schedule | None, remat: str,
                device_flops: float, link_bytes_per_s: float, num_slots: int,
                shard_slots: bool, reason: str) -> BucketStep:
    batch = int(_first_leaf(bucket)[p.batch_dim])
    positions = int(_first_leaf(bucket).num_elements())
    if sched is None:
        return BucketStep(bucket, weight, batch, positions, None, None, None, reason)
    q = p.Copy()
    q.input_shapes = planner.with_batch(bucket, p.batch_dim, batch // num_replicas)
    metas = pipelining_layer.PipeliningLayer.LayerMetas(q)
    layers = memory_model.layer_memory(metas, tf.as_dtype(p.dtype).size)
    ranges = part.cell_layer_ranges
    t = sched.num_micro_batches
    costs = planner.phase_costs([sum(m.flops for m in metas[a:b]) for a, b in ranges],
                                 [layers[b - 1].out_bytes for _, b in ranges[:-1]], t,
                                 device_flops, link_bytes_per_s)
    step = simulator.simulate(sched, costs, remat=remat)
    memory = planner.device_memory(part, layers, base_layer.activation_bytes(q.input_shapes),
                                    sched, remat, num_slots, num_replicas, step,
                                    p.weight_gradients == "batched", shard_slots)
    return BucketStep(bucket, weight, batch, positions, step.step_time,
                      max(m.total for m in memory), t)


def bucket_steps(p: hyperparams.Params, weights: Sequence[float] | None = None,
                 plan: planner.Plan | None = None,
                 device_flops: float = planner.DEFAULT_DEVICE_FLOPS,
                 link_bytes_per_s: float = planner.DEFAULT_LINK_BYTES_PER_S,
                 num_slots: int = 1, shard_slots: bool = False) -> list[BucketStep]:
    """Each bucket's predicted step for `plan` (its K, R, T, schedule and remat), or for the
    params' own configuration (T as the pipeline resolves it for each bucket's batch).

    The partition is the one the pipeline makes: for `input_shapes`, or the largest bucket.
    """
    declared = buckets.normalize(p.input_buckets)
    weights = list(weights) if weights is not None else [1.0 / len(declared)] * len(declared)
    q = p.Copy()
    q.input_shapes = buckets.planning_shapes(p)
    r = plan.num_replicas if plan is not None else p.num_replicas
    q.num_cells = plan.num_cells if plan is not None else p.num_cells
    planned_batch = step_layout.global_batch_size(q)
    q.input_shapes = planner.with_batch(q.input_shapes, p.batch_dim, planned_batch // r)
    part = pipelining_layer.PipeliningLayer.ComputePartition(q)
    remat = plan.remat if plan is not None else p.remat
    out = []
    for bucket, weight in zip(declared, weights):
        batch = int(_first_leaf(bucket)[p.batch_dim])
        sched, reason = None, ""
        if plan is not None:
            t = plan.num_micro_batches
            if batch % r or (batch // r) % t:
                reason = f"T={t} does not split its batch of {batch} over R={r}"
            else:
                sched = plan.step.schedule
        else:
            b = p.Copy()
            b.input_shapes = bucket
            try:
                sched = step_layout.resolve(b, batch, part.num_cells).schedule
            except (ValueError, TypeError) as e:
                reason = str(e)
        out.append(_one_bucket(p, part, bucket, weight, r, sched, remat, device_flops,
                               link_bytes_per_s, num_slots, shard_slots, reason))
    return out


def mix_lines(steps: Sequence[BucketStep], source: str, budget: int | None = None,
              planned: Any = None) -> list[str]:
    """The bucket table, the weighted mix and the memory check, as report lines."""
    lines = [f"Bucket mix (weights: {source}); time: the schedule simulator per bucket:",
             f"  {'bucket (first input)':<22} {'share':>6} {'batch':>6} {'positions':>10} "
             f"{'T':>4} {'step ms':>9} {'positions/s':>13} {'peak/dev':>10}"]
    for s in steps:
        shape = str(_first_leaf(s.shapes).as_list())
        if s.step_time is None:
            lines.append(f"  {shape:<22} {s.weight:>6.1%} {s.batch:>6} {s.positions:>10,}  "
                         f"not run: {s.reason}")
            continue
        lines.append(f"  {shape:<22} {s.weight:>6.1%} {s.batch:>6} {s.positions:>10,} "
                     f"{s.num_micro_batches:>4} {s.step_time * 1e3:>9.3f} "
                     f"{s.positions / s.step_time:>13,.0f} {format_bytes(s.peak_bytes):>10}")
    run = [s for s in steps if s.step_time is not None]
    if not run:
        return lines
    weight = sum(s.weight for s in run)
    time = sum(s.weight * s.step_time for s in run) / weight
    positions = sum(s.weight * s.positions for s in run) / weight
    lines.append(f"  {'mix (weighted mean)':<22} {weight:>6.1%} {'':>6} {positions:>10,.0f} "
                 f"{'':>4} {time * 1e3:>9.3f} {positions / time:>13,.0f}")
    fullest = max(run, key=lambda s: s.peak_bytes)
    text = (f"  Memory is planned for {buckets.describe(_first_leaf(planned))} (first input); "
            if planned is not None else "  ")
    text += (f"the fullest bucket is {_first_leaf(fullest.shapes).as_list()} at "
             f"{format_bytes(fullest.peak_bytes)} per device")
    if budget is not None:
        text += (", within the budget" if fullest.peak_bytes <= budget
                 else f", OVER the budget of {format_bytes(budget)}: plan for it "
                      "(set <pipeline>.input_shapes to that bucket)")
    lines.append(text + ".")
    return lines
