"""check_equivalence: verdicts, the useful failure message, and the numbers it reports.

Keras pipelines (KerasTask): only a layer holding BatchNormalization is batch-statistical (a
Dense/Dropout pipeline is compared on the whole batch), and a Keras layer that centres its input
over the batch (a batch-coupling bug) fails the check with the verdict naming that layer, not
one of the layers before it, whose gradients differ too.

The broken model is testdata_models.TinyMlpBrokenDropout, whose dropout ignores the example's
offset (each micro-batch reuses the first micro-batch's mask). Its reported differences are
checked against an independent computation: the pipeline's own FPropAndGrads and a plain tape
over the layers, compared in numpy. The registered models are checked in
equivalence_models_test.py and equivalence_mt_models_test.py.
"""

from __future__ import annotations

import subprocess

import keras
import numpy as np
import tensorflow as tf
import testdata_models
from conftest import launch_trainer

from lingvo_lite.analysis import equivalence
from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.keras import KerasTask, pipeline_params
from lingvo_lite.layers import composite
from lingvo_lite.training import model_config


def _launch(*args: str) -> subprocess.Popen:
    return launch_trainer("--mode=check_equivalence", *args)


def _task_and_batch(model, num_cells: int, num_micro_batches: int):
    task_p = model.Model()
    model_config.set_pipeline_fields(task_p, num_cells=num_cells,
                                     num_micro_batches=num_micro_batches)
    batch = NestedMap(next(iter(task_p.input.Instantiate().dataset())))
    return task_p.Instantiate(), batch


@keras.saving.register_keras_serializable(package="equivalence_test")
class BatchCentering(keras.layers.Layer):
    """Subtracts the batch mean: every example's output depends on the whole batch."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def _keras_task(layers, num_micro_batches: int = 4):
    p = KerasTask.Params().Set(name="keras_mlp", input_field="x", label_field="labels")
    p.network = pipeline_params(
        layers, (testdata_models.INPUT_DIM,), num_cells=2, num_micro_batches=num_micro_batches,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), name="network")
    p.random_seed = 3
    batch = NestedMap(next(iter(testdata_models.SyntheticInput.Params().Set(
        name="train").Instantiate().dataset())))
    return p.Instantiate(), batch


class KerasEquivalenceTest(tf.test.TestCase):

    def test_batch_statistics_only_for_batch_norm(self) -> None:
        def dense_dropout():
            return [keras.layers.Dense(8, activation="relu", name="d0"),
                    keras.layers.Dropout(0.3, name="drop"), keras.layers.Dense(4, name="d1")]

        task, batch = _keras_task(dense_dropout)
        report = equivalence.check_equivalence(task, batch, use_tf_function=False)
        self.assertTrue(report.passed, report.format())
        self.assertIn("on the whole batch at once", report.format())

        def with_batch_norm():
            return [keras.layers.Dense(8, activation="relu", name="d0"),
                    keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(4, name="d1")]

        task, batch = _keras_task(with_batch_norm)
        report = equivalence.check_equivalence(task, batch, use_tf_function=False)
        self.assertTrue(report.passed, report.format())
        self.assertIn("its layers use batch statistics", report.format())

    def test_batch_coupling_is_caught_and_located(self) -> None:
        def coupled():
            return [keras.layers.Dense(8, activation="tanh", name="d0"),
                    keras.layers.Dense(8, activation="tanh", name="d1"),
                    BatchCentering(name="centering"),
                    keras.layers.Dense(8, activation="tanh", name="d2"),
                    keras.layers.Dense(4, name="d3")]

        task, batch = _keras_task(coupled)
        report = equivalence.check_equivalence(task, batch, use_tf_function=False)
        self.assertFalse(report.passed)
        self.assertIn("on the whole batch at once", report.format())
        # The independent check: every layer's gradient differs, the ones before the
        # centering layer included, so the worst gradient does not locate the bug ...
        failing = {v.where for v in report.variables if v.max_rel_diff > report.tolerance}
        self.assertTrue(any("layer 0 " in w or "layer 1 " in w for w in failing), failing)
        # ... the verdict names the centering layer itself.
        self.assertIn("layer 2 (keras_2_centering)", report.suspect)
        self.assertIn("layer 2 (keras_2_centering)", report.verdict())
        self.assertGreater(report.suspect_rel_diff, 1e-2)
        # With one micro-batch the layer sees the whole batch: nothing to find.
        task, batch = _keras_task(coupled, num_micro_batches=1)
        self.assertTrue(equivalence.check_equivalence(task, batch, use_tf_function=False).passed)


class EquivalenceTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        # Both trainer.py runs start now and overlap with the in-process tests.
        cls.good = _launch("--model=tests.testdata_models.TinyMlp", "--num_cells=2",
                           "--num_micro_batches=4")
        cls.broken = _launch("--model=tests.testdata_models.TinyMlpBrokenDropout")

    def test_cli_passes_on_a_correct_model(self) -> None:
        stdout, stderr = self.good.communicate(timeout=300)
        self.assertEqual(self.good.returncode, 0, stderr)
        self.assertIn("K=2 cells, T=4 micro-batches", stdout)
        self.assertIn("on the whole batch at once", stdout)
        self.assertIn("tolerance 1e-03", stdout)
        self.assertTrue(stdout.rstrip().splitlines()[-1].startswith("PASS:"), stdout)

    def test_cli_fails_on_a_broken_layer_with_one_useful_line(self) -> None:
        stdout, stderr = self.broken.communicate(timeout=300)
        self.assertEqual(self.broken.returncode, 1, stdout)
        errors = [line for line in stderr.splitlines() if line.startswith("trainer.py: error:")]
        self.assertLen(errors, 1, stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertIn("check_equivalence failed", errors[0])
        self.assertIn("network.layers[", errors[0])
        self.assertIn("cell ", errors[0])
        self.assertIn("not keyed on the example's position", errors[0])
        self.assertTrue(stdout.rstrip().splitlines()[-1].startswith("FAIL:"), stdout)

    def test_broken_layer_passes_at_one_micro_batch(self) -> None:
        # With T=1 the broken mask is the right one: the failure is the micro-batching.
        task, batch = _task_and_batch(testdata_models.TinyMlpBrokenDropout(), 2, 1)
        self.assertTrue(equivalence.check_equivalence(task, batch, use_tf_function=False).passed)

    def test_reported_numbers_match_an_independent_computation(self) -> None:
        task, batch = _task_and_batch(testdata_models.TinyMlpBrokenDropout(), 2, 2)
        report = equivalence.check_equivalence(task, batch, use_tf_function=False)
        self.assertFalse(report.passed)

        net, inputs = task.network, task.NetworkInputs(batch)
        with fprop_context.fprop_context(training=True, step_seed=1,
                                         updates=fprop_context.UpdateCollector()):
            out, grads = net.FPropAndGrads(net.theta, inputs)
        with fprop_context.fprop_context(training=True, step_seed=1), \
                tf.GradientTape() as tape:
            ref_out = composite.chain_fprop(net.layers, net.theta.layers, inputs)
        names = [name for name, _ in net.theta.FlattenItems()]
        ref_grads = tape.gradient(ref_out.loss, net.theta.Flatten())
        pipe = {f"network.{n}": g.numpy() for n, g in zip(names, grads.Flatten())}
        ref = {f"network.{n}": g.numpy() for n, g in zip(names, ref_grads)}
        floor = 1e-3 * max(np.abs(g).max() for g in ref.values())

        self.assertAllClose(float(ref_out.loss), report.reference_loss, rtol=1e-6)
        self.assertAllClose(float(out.loss), report.loss, rtol=1e-6)
        self.assertEqual(sorted(ref), sorted(v.name for v in report.variables))
        for v in report.variables:
            diff = np.abs(pipe[v.name].astype(np.float64) - ref[v.name]).max()
            expected = diff / max(np.abs(ref[v.name]).max(), floor)
            self.assertAllClose(expected, v.max_rel_diff, rtol=1e-4, atol=1e-9, msg=v.name)
        self.assertEqual(report.worst.max_rel_diff, max(v.max_rel_diff for v in report.variables))
        self.assertGreater(report.worst.max_rel_diff, 1e-2)  # A real bug is far above rounding.
        self.assertIn(report.worst.name, report.verdict())
        # The worst gradient belongs to a layer before the broken dropout; the verdict names
        # the dropout itself.
        self.assertIn("layer 1 (bad_drop)", report.suspect)
        self.assertIn("layer 1 (bad_drop)", report.verdict())

    def test_relative_difference_of_a_known_perturbation(self) -> None:
        reference = np.random.default_rng(0).normal(size=(5, 7))
        perturbed = reference.copy()
        perturbed[2, 3] += 0.01
        scale = np.abs(reference).max()
        self.assertAllClose(0.01 / scale, equivalence.relative_difference(perturbed, reference))
        # A zero reference gradient is compared at the floor's scale; 0 vs 0 is 0.
        self.assertAllClose(0.5, equivalence.relative_difference([1e-3], [0.0], floor=2e-3))
        self.assertEqual(0.0, equivalence.relative_difference([0.0], [0.0]))

    def test_model_without_pipeline_is_a_clear_error(self) -> None:
        task_p = testdata_models.TinyMlp().Model()
        task = task_p.Instantiate()
        with self.assertRaisesRegex(ValueError, "no PipeliningLayer"):
            equivalence.check_equivalence(task.network.layers[0], NestedMap())
