"""Checkpointer: a checkpoint from an older lingvo-lite is refused with the reason, untouched.

(Crash safety, damaged checkpoints and resuming are exercised end to end through trainer.py in
tests/e2e/reliability_test.py.)
"""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

from lingvo_lite.training import checkpointer


def _variables(step_count_shape: list[int]) -> dict[str, tf.Variable]:
    # As the trainer names them: a weight and Adam's step count `t` beside it.
    return {"w": tf.Variable(tf.ones([3, 2]), name="layer.w"),
            "optimizer/layer.w:0/t": tf.Variable(tf.fill(step_count_shape, 7.0),
                                                 name="layer.w.t")}


def _contents(directory: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def test_weight_sized_adam_step_count_is_refused_with_its_reason(tmp_path):
    # lingvo-lite before 2026-11-25 kept Adam's step count per weight element.
    old = checkpointer.Checkpointer(str(tmp_path), _variables([3, 2]))
    path = old.save(5)
    saved = os.path.join(str(tmp_path), "checkpoints")
    before = _contents(saved)

    new = checkpointer.Checkpointer(str(tmp_path), _variables([]))
    with pytest.raises(checkpointer.CheckpointMismatchError) as error:
        new.restore_latest()
    message = str(error.value)
    assert "\n" not in message
    assert path in message and "Adam's step count per weight element" in message
    assert "new --logdir" in message
    assert _contents(saved) == before  # Nothing written before is changed or moved.


def test_other_mismatches_keep_the_params_message(tmp_path):
    checkpointer.Checkpointer(str(tmp_path), {"w": tf.Variable(tf.ones([3, 2]),
                                                               name="layer.w")}).save(1)
    new = checkpointer.Checkpointer(str(tmp_path), {"w": tf.Variable(tf.ones([4, 2]),
                                                                     name="layer.w")})
    with pytest.raises(checkpointer.CheckpointMismatchError, match="model params changed"):
        new.restore_latest()
