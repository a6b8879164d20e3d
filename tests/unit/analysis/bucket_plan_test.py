"""Planning a pipeline trained on length buckets (analysis/bucket_plan.py, planner, analysis).

Memory is planned for the largest bucket: the search on the buckets alone finds the plans of
the same model declared with that one shape. Time is the bucket mix: each bucket's step, as
the planner predicts it for the same model declared with that bucket's shape alone (the layers
are identical, so every shape gets the same partition), weighted by how often the bucket
occurs. The weights come from input_bucket_weights, else from the training input's
distribution, which is checked against the pairs counted per bucket with numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf
from mt_bucket_data import LENGTHS, SIZES, _params, data_dir  # noqa: F401

from lingvo_lite.analysis import bucket_plan, model_analysis, planner
from lingvo_lite.core import hyperparams
from lingvo_lite.layers import dense
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.training import plan_mode

BUCKETS = [[32, 16], [16, 16], [8, 16]]
BUDGET = 64 * 2**20


def _pipeline(**kw) -> hyperparams.Params:
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", num_cells=2, num_micro_batches=2,
        input_buckets=[tf.TensorShape(b) for b in BUCKETS],
        layers=[dense.ProjectionLayer.Params().Set(name=f"l{i}", input_dim=16, output_dim=16)
                for i in range(6)], **kw)


def _fixed(shape) -> hyperparams.Params:
    return _pipeline().Set(input_buckets=None, input_shapes=tf.TensorShape(shape))


def _same(plans, plan):
    """The plan of `plans` with `plan`'s K, R, T, schedule and remat."""
    return next(x for x in plans if x.label() == plan.label())


def test_memory_planned_for_the_largest_bucket_and_t_splitting_every_bucket():
    result = planner.search(_pipeline().Set(input_shapes=tf.TensorShape(BUCKETS[0])), 4, BUDGET)
    fixed = planner.search(_fixed(BUCKETS[0]), 4, BUDGET)
    assert result.fitting
    for plan in result.fitting + result.too_big:
        assert all((b[0] // plan.num_replicas) % plan.num_micro_batches == 0 for b in BUCKETS)
        same = _same(fixed.fitting + fixed.too_big, plan)
        assert (plan.peak_bytes, plan.step_time) == (same.peak_bytes, same.step_time)
    # The fixed-shape search also tries T and R that split 32 but not 8.
    assert max(x.num_micro_batches * x.num_replicas for x in fixed.fitting) > 8
    assert max(x.num_micro_batches * x.num_replicas for x in result.fitting) <= 8


def test_bucket_mix_time_is_each_buckets_planned_step_weighted():
    p = _pipeline(input_bucket_weights=[1, 2, 5])
    weights, source = bucket_plan.bucket_weights(p)
    assert source == "input_bucket_weights"
    np.testing.assert_allclose(weights, [1 / 8, 2 / 8, 5 / 8])
    best = planner.search(p.Copy().Set(input_shapes=tf.TensorShape(BUCKETS[0])), 4,
                          BUDGET).fitting[0]
    steps = bucket_plan.bucket_steps(p, weights, best)
    for step, bucket in zip(steps, BUCKETS):
        same = _same(planner.search(_fixed(bucket), 4, BUDGET).fitting, best)
        assert step.step_time == pytest.approx(same.step.step_time, rel=1e-12)
        assert step.peak_bytes == same.peak_bytes
        assert step.positions == math.prod(bucket)
    lines = bucket_plan.mix_lines(steps, source, BUDGET, planned=tf.TensorShape(BUCKETS[0]))
    mix = sum(w * s.step_time for w, s in zip(weights, steps))
    row = next(line for line in lines if "mix (weighted mean)" in line)
    assert f"{mix * 1e3:.3f}" in row.split()
    assert lines[-1].startswith("  Memory is planned for [32, 16] (first input); the fullest "
                                "bucket is [32, 16]")
    assert lines[-1].endswith("within the budget.")


def test_plan_and_inspect_model_of_buckets_without_input_shapes():
    p = _pipeline()
    task = hyperparams.Params()
    task.Define("network", p, "")
    text = plan_mode.plan_text("m", task, 4, BUDGET)
    assert "Bucket mix (weights: equal" in text and "[8, 16]" in text
    assert "Memory is planned for [32, 16]" in text
    best = planner.search(_fixed(BUCKETS[0]), 4, BUDGET).fitting[0]  # Same partition, T <= 8.
    assert f"Per-device memory of plan 1 ({best.label()})" in text
    described, _ = model_analysis.describe_pipeline("network", p)
    assert "Bucket mix (weights: equal" in described
    assert "K=2, gpipe, remat=except_last" in described


def test_input_bucket_distribution_counts_its_batches(data_dir):  # noqa: F811
    fixed = list(_params(data_dir, batch_size=1).Instantiate().dataset())
    longest = [max(int((b["src_paddings"][0] == 0).numpy().sum()),
                   int((b["tgt_paddings"][0] == 0).numpy().sum())) for b in fixed]
    pairs = np.bincount(np.searchsorted(LENGTHS, longest), minlength=len(LENGTHS))
    expected = pairs / np.asarray(SIZES)
    got = _params(data_dir, bucket_lengths=LENGTHS,
                  bucket_batch_sizes=SIZES).Instantiate().bucket_distribution()
    np.testing.assert_allclose(got, expected / expected.sum(), rtol=1e-12)
    p = _pipeline().Set(input_buckets=[tf.TensorShape([b, n]) for n, b in zip(LENGTHS, SIZES)])
    weights, source = bucket_plan.bucket_weights(p, _params(
        data_dir, bucket_lengths=LENGTHS, bucket_batch_sizes=SIZES))
    assert source == "the training input's batches per bucket"
    np.testing.assert_allclose(weights, got)
