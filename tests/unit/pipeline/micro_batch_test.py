"""Micro-batch settings: T from num_micro_batches or micro_batch_size (micro_batch.py)."""

from __future__ import annotations

import tensorflow as tf
from pipeline_models import make_batch, make_pipeline, mlp_layers

from lingvo_lite.core import fprop_context
from lingvo_lite.pipeline import micro_batch, pipelining_layer


class MicroBatchSettingsTest(tf.test.TestCase):

    def test_conflicting_micro_batch_settings_are_an_error(self):
        # Issue 12: num_micro_batches=8 with micro_batch_size=1 on 16 examples ran T=16.
        with self.assertRaisesRegex(ValueError, "num_micro_batches=8 and micro_batch_size=1 "
                                    "disagree for a mini-batch of 16"):
            micro_batch.resolve_num_micro_batches(16, 8, 1)
        pipe = make_pipeline(mlp_layers(), num_cells=2, num_micro_batches=8, micro_batch_size=1)
        with self.assertRaisesRegex(ValueError, "disagree for a mini-batch of 32"):
            with fprop_context.fprop_context(training=True):
                pipe.FPropAndGrads(pipe.theta, make_batch())
        with self.assertRaisesRegex(ValueError, "disagree"):
            pipe.FProp(pipe.theta, make_batch())
        # Agreeing settings, either one alone, and neither (T=1) are fine.
        self.assertEqual(4, micro_batch.resolve_num_micro_batches(32, 4, 8))
        self.assertEqual(4, micro_batch.resolve_num_micro_batches(32, None, 8))
        self.assertEqual(8, micro_batch.resolve_num_micro_batches(32, 8, None))
        self.assertEqual(1, micro_batch.resolve_num_micro_batches(32, None, None))
        self.assertIsNone(pipelining_layer.PipeliningLayer.Params().num_micro_batches)

    def test_zero_micro_batches_must_be_at_least_one(self):
        for kwargs, message in [
                (dict(num_micro_batches=0), "num_micro_batches must be an integer >= 1"),
                (dict(micro_batch_size=0), "micro_batch_size must be an integer >= 1"),
                (dict(num_micro_batches=-2), "num_micro_batches must be an integer >= 1")]:
            with self.subTest(kwargs=kwargs):
                with self.assertRaisesRegex(ValueError, message):
                    make_pipeline(mlp_layers(), **kwargs)
        with self.assertRaisesRegex(ValueError, ">= 1"):
            micro_batch.resolve_num_micro_batches(16, 0, None)


if __name__ == "__main__":
    tf.test.main()
