"""Transfer learning: every layer from a checkpoint except a new softmax for the new classes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf

from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.tasks import model_registry
from tasks.image import amoebanet

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.


def digits_task_params(num_classes: int):
    model = model_registry.get_params("image.AmoebaNetDigits")
    p = model.Task()
    p.network.layers = amoebanet.amoebanet_layers(model.Network().Set(num_classes=num_classes))
    return p


class TransferTest(tf.test.TestCase):

    def test_new_softmax_rest_from_checkpoint_then_fine_tune(self):
        source = digits_task_params(10).Instantiate()
        source.prepare_for_training()
        path = tf.train.Checkpoint(model=source.checkpoint_variables()).write(
            os.path.join(self.get_temp_dir(), "source"))

        target_p = digits_task_params(3)
        with self.assertRaisesRegex(ValueError, "init_exclude"):
            target_p.train.init_from_checkpoint = path
            target_p.Instantiate().prepare_for_training()  # Softmax shapes differ: must say so.

        target_p.train.init_exclude = [r"softmax"]
        target = target_p.Instantiate()
        fresh = digits_task_params(3).Set(random_seed=99).Instantiate()
        target.prepare_for_training()
        source_vars = source.checkpoint_variables()
        checked = 0
        for name, var in target.checkpoint_variables().items():
            if not name.startswith("model/"):
                continue
            if "softmax" in name:
                self.assertEqual(3, var.shape[-1])
            else:
                self.assertAllEqual(source_vars[name], var, msg=name)
                checked += 1
        self.assertGreater(checked, 50)
        self.assertNotAllClose(fresh.checkpoint_variables()["model/network.layers[0].conv0.w"],
                               target.checkpoint_variables()["model/network.layers[0].conv0.w"])

        # Fine-tuning runs on 3-class data.
        rng = np.random.default_rng(0)
        batch = NestedMap(image=tf.constant(rng.random((32, 16, 16, 1)), tf.float32),
                          label=tf.constant(rng.integers(0, 3, 32), tf.int32))
        losses = [float(target.TrainStep(batch).loss) for _ in range(3)]  # Eager: no trace.
        self.assertTrue(np.all(np.isfinite(losses)))
        self.assertEqual(3, int(target.global_step.numpy()))
