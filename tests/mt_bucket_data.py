"""A small generated translation corpus in length buckets, shared by the bucket tests
(tests/unit/models/mt_buckets_test.py, tests/unit/analysis/bucket_plan_test.py,
tests/e2e/mt_packing_test.py)."""

from __future__ import annotations

import pytest

from tasks.mt import corpus, input_generator

SMALL = {"train": 400, "dev": 50, "test": 50}
LENGTHS = [12, 18, 26, 50]
SIZES = [16, 12, 8, 4]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("mt_buckets"))
    corpus.write_corpus(d, SMALL, seed=0)
    input_generator.prepare_data_dir(d, "", 128)
    return d


def _params(data_dir, **kw):
    return input_generator.ParallelTextInput.Params().Set(
        data_dir=data_dir, generate="", split="train", vocab_size=128, max_source_length=48,
        max_target_length=50, shuffle=False, repeat=False, **kw)
