"""Training a Transformer on length buckets with trainer.py's library: one trace per bucket, the
tokens/s and padding summaries, and a resume in the middle of the bucketed stream that ends on
the weights of the uninterrupted run."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import toy_mt
from tensorboard.backend.event_processing import event_accumulator
from toy_mt import run_trainer

from tasks.mt import input_generator

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

LENGTHS, SIZES = [5, 8, 12], [24, 16, 8]


class TinyBucketedMt(toy_mt.ToyMt):
    """The toy translation task on length buckets (not registered)."""

    def _input(self, split):
        p = super()._input(split)
        if split == "train":
            p.Set(bucket_lengths=LENGTHS, bucket_batch_sizes=SIZES)
        return p

    def Task(self):
        p = super().Task()
        shapes = input_generator.bucket_shapes(LENGTHS, SIZES)
        p.network.Set(input_buckets=shapes, input_shapes=shapes[-1])
        p.train.Set(max_steps=8, save_interval_steps=4, summary_interval_steps=2,
                    log_interval_steps=4)
        return p


def _train(logdir: str, *overrides: str) -> tuple[int, str, str]:
    return run_trainer(model=f"{__name__}.TinyBucketedMt", logdir=logdir, mode="train",
                       model_params_override="; ".join(overrides))


def _weights(logdir: str) -> dict[str, np.ndarray]:
    import tensorflow as tf

    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if "iterator" not in name.lower() and "save_counter" not in name}


def test_buckets_train_resume_exactly_and_report_tokens(tmp_path, monkeypatch):
    import tensorflow as tf

    # tf.data derives the shuffle order from TensorFlow's global seed as well as the input's
    # own; an earlier test in this process may have set one (keras.utils.set_random_seed).
    # None, as in a fresh trainer.py, gives the stream the assertions below describe.
    tf.random.set_seed(None)
    data = tmp_path / "data"
    data.mkdir()
    toy_mt.write_toy_corpus(str(data))
    monkeypatch.setenv(toy_mt.DATA_DIR_ENV, str(data))
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    status, out, err = _train(whole)
    assert status == 0, err
    assert "traced" not in out + err  # At most one trace per bucket: no retrace warning.
    status, _, err = _train(split, "train.max_steps : 4")
    assert status == 0, err
    status, out, err = _train(split)  # Resumes at step 4, mid-stream, and trains to 8.
    assert status == 0, err
    assert "Resuming training from step 4" in out
    # Step 4 is mid-epoch (of 9 batches), and the resumed steps come from several buckets,
    # some filled from pairs the stream passed before the interruption.
    one_pass = TinyBucketedMt().Train().Set(repeat=False).Instantiate().dataset()
    shapes = [tuple(batch["src_ids"].shape) for batch in one_pass]
    assert len(shapes) > 8 and len(set(shapes[4:8])) > 1, shapes
    a, b = _weights(whole), _weights(split)
    assert a.keys() == b.keys() and len(a) > 10
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    events = event_accumulator.EventAccumulator(glob.glob(os.path.join(whole, "train"))[0])
    events.Reload()
    tags = set(events.Tags()["scalars"]) | set(events.Tags().get("tensors", []))
    for tag in ("tokens_per_sec", "real_tokens_per_sec", "padding_fraction"):
        assert any(t.endswith(tag) for t in tags), (tag, sorted(tags))
