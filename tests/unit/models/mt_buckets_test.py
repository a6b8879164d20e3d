"""Length-bucketed translation batches (ParallelTextInput.bucket_lengths), checked against the
fixed-length batches of the same sentences: the same pairs, each in the first bucket that holds
it, padded to its bucket's length; deterministic; resumable from an iterator checkpoint."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from mt_bucket_data import LENGTHS, SIZES, _params, data_dir  # noqa: F401  (a fixture)

from tasks.mt import input_generator


def _rows(batch) -> list[tuple]:
    """Each pair's real source and target ids (padding stripped)."""
    out = []
    for i in range(batch["src_ids"].shape[0]):
        src = batch["src_ids"][i][batch["src_paddings"][i] == 0]
        tgt = batch["tgt_ids"][i][batch["tgt_paddings"][i] == 0]
        out.append((tuple(np.asarray(src)), tuple(np.asarray(tgt))))
    return out


def test_each_pair_in_the_first_bucket_that_holds_it(data_dir):  # noqa: F811
    fixed = list(_params(data_dir, batch_size=1).Instantiate().dataset())
    every = [r for b in fixed for r in _rows(b)]
    bucketed = list(_params(data_dir, bucket_lengths=LENGTHS,
                            bucket_batch_sizes=SIZES).Instantiate().dataset())
    seen = []
    shapes = {(b_, n) for n, b_ in zip(LENGTHS, SIZES)}
    for batch in bucketed:
        b, n = batch["src_ids"].shape
        assert (b, n) in shapes
        for k in ("src_paddings", "tgt_ids", "tgt_labels", "tgt_paddings", "tgt_weights"):
            assert batch[k].shape == (b, n)
        assert "bucket" not in batch
        for src, tgt in _rows(batch):
            longest = max(len(src), len(tgt))
            bucket = LENGTHS.index(n)
            assert longest <= n and (bucket == 0 or longest > LENGTHS[bucket - 1])
            seen.append((src, tgt))
    # Every pair once, except those left in a bucket's last, incomplete batch.
    assert len(set(seen)) == len(seen)
    assert set(seen) <= set(every)
    assert len(every) - len(seen) < sum(SIZES)
    # Far less padding than padding every pair to the longest.
    real = sum(len(s) + len(t) for s, t in seen)
    padded = sum(2 * b["src_ids"].shape[0] * b["src_ids"].shape[1] for b in bucketed)
    fixed_padded = len(seen) * (48 + 50)
    assert padded < 0.6 * fixed_padded and real / padded > 0.7


def test_deterministic_and_resumes_exactly_from_an_iterator_checkpoint(data_dir, tmp_path):  # noqa: F811
    p = _params(data_dir, bucket_lengths=LENGTHS, bucket_batch_sizes=SIZES).Set(
        shuffle=True, repeat=True, seed=7)
    first = iter(p.Instantiate().dataset())
    for _ in range(5):
        next(first)
    path = tf.train.Checkpoint(it=first).write(os.path.join(str(tmp_path), "it"))
    expected = [next(first) for _ in range(6)]
    again = iter(p.Instantiate().dataset())
    tf.train.Checkpoint(it=again).read(path).assert_consumed()
    for want, got in zip(expected, [next(again) for _ in range(6)]):
        assert want["src_ids"].shape == got["src_ids"].shape
        for k in want:
            np.testing.assert_array_equal(want[k], got[k])
    lengths = {int(b["src_ids"].shape[1]) for b in expected}
    assert len(lengths) > 1  # The stream mixes buckets.


@pytest.mark.parametrize("kw, message", [
    (dict(bucket_lengths=[18, 12, 50], bucket_batch_sizes=[1, 1, 1]), "must be ascending ints"),
    (dict(bucket_lengths=[6, 50], bucket_batch_sizes=[8]), "one batch size >= 1 for each of"),
    (dict(bucket_lengths=[6, 20], bucket_batch_sizes=[8, 4]), "add a bucket of 50"),
])
def test_bad_buckets_named_in_one_line(data_dir, kw, message):  # noqa: F811
    with pytest.raises(ValueError, match=message) as info:
        _params(data_dir, **kw).Instantiate()
    assert "\n" not in str(info.value)


def test_bucket_shapes_are_the_pipelines_input_buckets():
    shapes = input_generator.bucket_shapes([8, 16], [32, 16])
    assert [tuple(s.tgt_weights) for s in shapes] == [(32, 8), (16, 16)]
