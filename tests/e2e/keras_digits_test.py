"""The registered Keras example through trainer.py's runner: inspect, train, evaluate."""

from __future__ import annotations

import io
import os
import tempfile

import pytest
import tensorflow as tf

from lingvo_lite.training import options, runner

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

MODEL = "keras_digits.ResNetDigits"


def _main(**kwargs) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


class KerasDigitsTest(tf.test.TestCase):

    def test_inspect_model_prints_the_partition_of_the_keras_layers(self):
        status, out, err = _main(model=MODEL, mode="inspect_model")
        self.assertEqual(status, 0, err)
        self.assertIn("Partition of 14 layers into 2 cells by flops", out)
        self.assertIn("keras_3_block_1", out)  # A nested functional model is one layer.
        row = next(line for line in out.splitlines() if "keras_3_block_1" in line)
        self.assertIn("4,736", row)  # 2 x 3*3*16*16 kernels + 2 x 4*16 batch-norm values.

    def test_trains_evaluates_and_resumes(self):
        logdir = tempfile.mkdtemp()
        status, out, err = _main(model=MODEL, logdir=logdir, mode="train_and_eval",
                                 max_steps=4, eval_splits=("dev",))
        self.assertEqual(status, 0, err)
        self.assertIn("eval dev @ step 4", out)
        self.assertTrue(os.path.exists(os.path.join(logdir, "checkpoints", "checkpoint")))
        # Every Keras weight (batch-norm statistics and dropout seed states included) has a
        # stable checkpoint key, so a new process restores them.
        status, out, err = _main(model=MODEL, logdir=logdir, mode="train", max_steps=6)
        self.assertEqual(status, 0, err)
        self.assertIn("Resuming training from step 4 to step 6.", out)


if __name__ == "__main__":
    tf.test.main()
