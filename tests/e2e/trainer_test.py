"""Tests of trainer.py and lingvo_lite.training, on the tiny pipelined model of testdata_models.

Expensive work is shared: `setUpClass` trains two runs in-process (one straight to step 10 with
evaluation, one to step 6) and launches every `python trainer.py` subprocess at once (each costs
~5 s of TensorFlow import; they run concurrently). Results are checked against independent
computations: TensorBoard's own event reader, checkpoints read with `tf.train.load_variable`, a
numpy forward pass of the MLP, and the uninterrupted run for resumption.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf
import testdata_models
from conftest import launch_trainer, stop_processes
from tensorboard.backend.event_processing import event_accumulator

from lingvo_lite.core import hyperparams
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.tasks import model_registry
from lingvo_lite.training import loop, model_config, options, runner

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

MODEL = "testdata_models.TinyMlp"  # Registered name (this process imported the module).
CLI_MODEL = "tests.testdata_models.TinyMlp"  # Fully-qualified path, imported by trainer.py.


def _main(**kwargs) -> tuple[int, str, str]:
    """Runs runner.main in-process; returns (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from TensorBoard's own reader (all event files of the dir)."""
    acc = event_accumulator.EventAccumulator(
        event_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def _snapshot(directory: str) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under `directory`."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            st = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), directory)] = (st.st_size, st.st_mtime_ns)
    return out


def _latest(logdir: str) -> str:
    return tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))


def _ckpt_values(path: str) -> dict[str, np.ndarray]:
    """Every variable of a checkpoint except the iterator state and the save counter."""
    return {name: tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)
            if name.endswith("VARIABLE_VALUE") and "save_counter" not in name}


def _ckpt_global_step(path: str) -> int:
    steps = [v for k, v in _ckpt_values(path).items() if "global_step" in k]
    assert len(steps) == 1, list(_ckpt_values(path))
    return int(steps[0])


def _mlp_weights(path: str) -> dict[str, np.ndarray]:
    """The MLP's weights from a checkpoint, keyed fc0.w, fc0.b, fc1.w, fc1.b, out.w, out.b."""
    suffixes = {"fc0.w": "layers[0]..proj..w", "fc0.b": "layers[0]..proj..b",
                "fc1.w": "layers[1]..proj..w", "fc1.b": "layers[1]..proj..b",
                "out.w": "layers[2]..softmax..weight", "out.b": "layers[2]..softmax..bias"}
    values = {k: v for k, v in _ckpt_values(path).items() if not k.startswith("model/optimizer")}
    out = {}
    for key, suffix in suffixes.items():
        (match,) = [v for k, v in values.items() if k.split("/")[1].endswith(suffix)]
        out[key] = match
    return out


def _numpy_metrics(w: dict[str, np.ndarray], x: np.ndarray, labels: np.ndarray) -> dict:
    """Mean cross-entropy and accuracy of the MLP on (x, labels), in float64 numpy."""
    h = np.maximum(x @ w["fc0.w"] + w["fc0.b"], 0.0)
    h = np.maximum(h @ w["fc1.w"] + w["fc1.b"], 0.0)
    logits = (h @ w["out.w"] + w["out.b"]).astype(np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    xent = -log_probs[np.arange(len(labels)), labels]
    return {"loss": xent.mean(), "accuracy": (logits.argmax(-1) == labels).mean()}


class TrainerTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="trainer_test_")
        cls.full = os.path.join(cls.root, "full")
        cls.resumed = os.path.join(cls.root, "resumed")
        cls.frozen = os.path.join(cls.root, "frozen")  # A copy of the 6-step run, never changed.
        cls.full_result = _main(model=MODEL, logdir=cls.full, mode="train_and_eval",
                                max_steps=10)
        cls.first_result = _main(model=MODEL, logdir=cls.resumed, mode="train", max_steps=6)
        shutil.copytree(cls.resumed, cls.frozen)
        cls.frozen_snapshot = _snapshot(cls.frozen)
        launch = launch_trainer
        cls.procs = {
            "resume": launch(f"--model={CLI_MODEL}", f"--logdir={cls.resumed}", "--max_steps=10"),
            "list_models": launch("--mode=list_models", "--model_modules=tests.testdata_models"),
            "inspect_model": launch("--mode=inspect_model", f"--model={CLI_MODEL}",
                                    "--inspect_num_cells=1,3"),
            "unknown_model": launch("--model=tests.testdata_models.TinyMpl",
                                    f"--logdir={cls.frozen}"),
            "missing_model": launch(f"--logdir={cls.frozen}"),
        }
        cls.cli_results = {}

    @classmethod
    def tearDownClass(cls) -> None:
        stop_processes(cls.procs.values())
        shutil.rmtree(cls.root, ignore_errors=True)
        super().tearDownClass()

    def _cli(self, name: str) -> tuple[int, str, str]:
        if name not in self.cli_results:
            stdout, stderr = self.procs[name].communicate(timeout=120)
            self.cli_results[name] = (self.procs[name].returncode, stdout, stderr)
        return self.cli_results[name]

    # ---- list / inspect ------------------------------------------------------------------------

    def test_list_models_cli(self) -> None:
        status, stdout, stderr = self._cli("list_models")
        self.assertEqual(status, 0, stderr)
        line = [ln for ln in stdout.splitlines() if ln.startswith("testdata_models.TinyMlp ")]
        self.assertLen(line, 1)
        self.assertIn("Pipelined 3-layer MLP", line[0])

    def test_inspect_params_applies_overrides_in_order(self) -> None:
        status, out, err = _main(
            model=MODEL, mode="inspect_params",
            model_params_override="train.max_steps : 7; train.learning_rate : 0.5",
            input_params_override="batch_size : 8", num_micro_batches=4, seed=9)
        self.assertEqual(status, 0, err)
        task_text = out.split("# Input params of split 'dev'")[0]
        # The printed text is the FromText format: apply it to fresh params and compare.
        expected = model_registry.get_class(MODEL)().Model()  # The class the trainer ran.
        expected.Set(**{"train.max_steps": 7, "train.learning_rate": 0.5, "input.batch_size": 8,
                        "network.num_micro_batches": 4, "random_seed": 9, "input.seed": 9})
        lines = {ln.split(" : ")[0]: ln for ln in task_text.splitlines() if " : " in ln}
        for line in expected.ToText().splitlines():
            self.assertEqual(lines[line.split(" : ")[0]], line)
        self.assertIn("split : 'dev'", out.split("# Input params of split 'dev'")[1])

    def test_inspect_model_creates_no_variables(self) -> None:
        created = []

        def record(next_creator, **kwargs):
            created.append(kwargs.get("name"))
            return next_creator(**kwargs)

        with tf.variable_creator_scope(record):
            status, out, err = _main(model=MODEL, mode="inspect_model",
                                     inspect_num_cells=(1, 3, 4))
        self.assertEqual(status, 0, err)
        self.assertEqual(created, [])
        # Weight counts of the three layers: in*out + out for each projection.
        counts = [8 * 16 + 16, 16 * 16 + 16, 16 * 4 + 4]
        rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit() and "Map" in ln]
        self.assertEqual([r[1] for r in rows], ["fc0", "fc1", "loss"])
        for row, count in zip(rows, counts):
            self.assertIn(str(count), row)
        self.assertIn(f"Total parameters in PipeliningLayers: {sum(counts)}", out)
        for k in (1, 2, 3):
            self.assertIn(f"Partition of 3 layers into {k} cells by flops", out)
        self.assertIn("K=4: cannot partition", out)
        # K=1, T=2, remat except_last: F0 F1 B1 B0, B0 re-runs micro-batch 0's forward, so
        # the step is 3W + W/2 for a one-device step of 3W (forward W, backward 2W).
        self.assertIn("K=1, T=2, gpipe, remat=except_last: bubble 0.0%, load imbalance 0.0%, "
                      f"recompute {0.5 / 3.5:.1%}; {3 / 3.5:.2f}x the one-device step", out)

    def test_inspect_model_cli(self) -> None:
        status, stdout, stderr = self._cli("inspect_model")
        self.assertEqual(status, 0, stderr)
        self.assertIn("PipeliningLayer 'network': 3 layers, num_cells=2", stdout)
        self.assertIn("Partition of 3 layers into 3 cells", stdout)

    def test_pipeline_params_walk_lists_and_nesting(self) -> None:
        outer = hyperparams.Params()
        inner = hyperparams.Params()
        inner.Define("tower", pipelining_layer.PipeliningLayer.Params().Set(num_cells=5), "")
        first = pipelining_layer.PipeliningLayer.Params().Set(num_cells=3, layers=[None] * 4)
        outer.Define("towers", [first, inner], "")
        outer.Define("other", {"a": 1}, "")
        found = dict(model_config.iter_pipelining_params(outer))
        self.assertEqual(sorted(found), ["towers[0]", "towers[1].tower"])
        self.assertEqual(model_config.auto_num_logical_cpus(outer), 5)
        self.assertEqual(model_config.auto_num_logical_cpus(hyperparams.Params()), 1)
        inner.tower.layers = [None] * 4
        self.assertEqual(model_config.set_pipeline_fields(outer, 4, 8), 2)
        self.assertEqual([(p.num_cells, p.num_micro_batches) for p in found.values()],
                         [(4, 8), (4, 8)])
        with self.assertRaisesRegex(options.UsageError, r"--num_cells=5: .*towers\[0\]"):
            model_config.set_pipeline_fields(outer, num_cells=5)

    # ---- training ------------------------------------------------------------------------------

    def test_train_writes_summaries_params_and_checkpoint(self) -> None:
        status, out, err = self.first_result
        self.assertEqual(status, 0, err)
        self.assertIn(f"tensorboard --logdir {self.resumed}", out)
        self.assertIn("Training from scratch to step 6", out)
        self.assertIn("step 2/6  loss", out)
        self.assertNotIn("WARNING", out)  # In particular: the train step was traced once.
        scalars = _scalars(os.path.join(self.frozen, "train"))
        for tag in ("loss", "accuracy", "learning_rate", "grad_norm", "var_norm",
                    "update_skipped", "steps_per_sec", "examples_per_sec"):
            self.assertIn(tag, scalars)
            self.assertEqual([s for s, _ in scalars[tag]], [2, 4, 6], tag)
        self.assertAllClose([v for _, v in scalars["learning_rate"]], [0.01] * 3)
        self.assertEqual([v for _, v in scalars["update_skipped"]], [0.0] * 3)
        for (_, sps), (_, eps) in zip(scalars["steps_per_sec"], scalars["examples_per_sec"]):
            self.assertGreater(sps, 0)
            self.assertAllClose(eps, 16 * sps)  # Batch size 16.
        acc = event_accumulator.EventAccumulator(os.path.join(self.frozen, "train"))
        acc.Reload()
        self.assertEqual(acc.SummaryMetadata("params").plugin_data.plugin_name, "text")
        expected = model_registry.get_class(MODEL)().Model()
        expected.train.max_steps = 6
        with open(os.path.join(self.frozen, "params.txt")) as f:
            self.assertEqual(f.read(), expected.ToText())
        with open(os.path.join(self.frozen, "model_analysis.txt")) as f:
            self.assertIn("Partition of 3 layers into 2 cells by flops", f.read())
        self.assertEqual(_ckpt_global_step(_latest(self.frozen)), 6)

    def test_resume_continues_exactly_like_an_uninterrupted_run(self) -> None:
        status, stdout, stderr = self._cli("resume")
        self.assertEqual(status, 0, stderr)
        self.assertNotIn("Traceback", stderr)
        self.assertIn("(global step 6)", stdout)
        self.assertIn("Resuming training from step 6 to step 10", stdout)
        self.assertNotIn("step 2/10", stdout)
        self.assertIn("step 8/10", stdout)
        resumed, full = _latest(self.resumed), _latest(self.full)
        self.assertEqual(_ckpt_global_step(resumed), 10)
        self.assertEqual(_ckpt_global_step(full), 10)
        # Same weights and optimizer slots as 10 uninterrupted steps: the weights, slots, step
        # and the input position (batches 7..10, not 1..4) were all restored.
        resumed_values, full_values = _ckpt_values(resumed), _ckpt_values(full)
        self.assertEqual(sorted(resumed_values), sorted(full_values))
        for name, value in full_values.items():
            self.assertAllClose(resumed_values[name], value, rtol=1e-5, atol=1e-6, msg=name)

        # Running the same command again has nothing to do and changes nothing.
        before = _snapshot(self.resumed)
        status, out, err = _main(model=MODEL, logdir=self.resumed, mode="train", max_steps=10)
        self.assertEqual(status, 0, err)
        self.assertIn("Already at global step 10 >= max_steps=10", out)
        self.assertEqual(_snapshot(self.resumed), before)

    def test_retrace_warning_and_end_of_data(self) -> None:
        # 40 examples, no repeat, keep the remainder: batches of 16, 16 and 8, then no more.
        status, out, err = _main(
            model=MODEL, logdir=os.path.join(self.root, "short"), mode="train", max_steps=10,
            input_params_override="num_examples : 40; repeat : False; drop_remainder : False")
        self.assertEqual(status, 0, err)
        self.assertIn("WARNING: the train step was traced 2 times", out)
        self.assertIn("ran out of data at step 3", out)
        self.assertEqual(_ckpt_global_step(_latest(os.path.join(self.root, "short"))), 3)

    def test_train_and_eval_evaluates_at_intervals(self) -> None:
        status, out, err = self.full_result
        self.assertEqual(status, 0, err)
        scalars = _scalars(os.path.join(self.full, "eval_dev"))
        self.assertEqual([s for s, _ in scalars["loss"]], [5, 10])  # eval_interval_steps=5.
        for step in (5, 10):
            self.assertTrue(os.path.exists(
                os.path.join(self.full, "eval_dev", f"metrics_{step}.txt")))
        self.assertIn("eval dev @ step 10", out)

    # ---- evaluation ----------------------------------------------------------------------------

    def test_eval_matches_numpy_forward(self) -> None:
        logdir = os.path.join(self.root, "eval_copy")
        shutil.copytree(self.frozen, logdir)
        status, out, err = _main(model=MODEL, logdir=logdir, mode="eval",
                                 eval_splits=("dev", "test"))
        self.assertEqual(status, 0, err)
        weights = _mlp_weights(_latest(logdir))
        for split in ("dev", "test"):
            expected = _numpy_metrics(weights, *testdata_models.synthetic_examples(split, 64))
            scalars = _scalars(os.path.join(logdir, f"eval_{split}"))
            self.assertEqual([s for s, _ in scalars["loss"]], [6])
            for name, value in expected.items():
                self.assertAllClose(scalars[name][0][1], value, rtol=1e-5, msg=name)
            with open(os.path.join(logdir, f"eval_{split}", "metrics_6.txt")) as f:
                lines = dict(ln.split(" : ") for ln in f.read().splitlines())
            self.assertAllClose(float(lines["loss"]), expected["loss"], rtol=1e-5)
            self.assertEqual(int(lines["num_examples_evaluated"]), 64)

    def test_evaluate_split_weights_batches_by_size(self) -> None:
        task = testdata_models.TinyMlp().Model().Instantiate()
        fc0, fc1, out = (layer.vars for layer in task.network.layers)
        weights = {k: v.numpy() for k, v in {
            "fc0.w": fc0.proj.w, "fc0.b": fc0.proj.b, "fc1.w": fc1.proj.w, "fc1.b": fc1.proj.b,
            "out.w": out.softmax.weight, "out.b": out.softmax.bias}.items()}
        # 64 examples in batches of 24, 24 and 16: a plain mean of batch means would be wrong.
        params = testdata_models.TinyMlp().Dev().Set(batch_size=24, drop_remainder=False)
        x, labels = testdata_models.synthetic_examples("dev", 64)
        metrics = loop.evaluate_split(task, params)
        self.assertEqual(metrics["num_examples_evaluated"], 64)
        self.assertEqual(metrics["num_batches"], 3)
        for name, value in _numpy_metrics(weights, x, labels).items():
            self.assertAllClose(metrics[name], value, rtol=1e-5, msg=name)
        capped = loop.evaluate_split(task, params, max_batches=1)
        self.assertEqual(capped["num_examples_evaluated"], 24)
        self.assertAllClose(capped["loss"], _numpy_metrics(weights, x[:24], labels[:24])["loss"],
                            rtol=1e-5)

    # ---- user errors ---------------------------------------------------------------------------

    def _assert_cli_error(self, name: str, *expected: str) -> None:
        status, stdout, stderr = self._cli(name)
        self.assertEqual(status, 1, stdout + stderr)
        self.assertNotIn("Traceback", stdout + stderr)
        errors = [ln for ln in stderr.splitlines() if ln.startswith("trainer.py: error: ")]
        self.assertLen(errors, 1, stderr)
        for text in expected:
            self.assertIn(text, errors[0])

    def test_cli_user_errors_exit_1_without_traceback(self) -> None:
        # One error found before TensorFlow is imported, one after; the other messages are
        # runner.main's, checked in-process below.
        self._assert_cli_error("unknown_model", "--model", "TinyMpl",
                               "Did you mean: tests.testdata_models.TinyMlp")
        self._assert_cli_error("missing_model", "--model is required")
        self.assertEqual(_snapshot(self.frozen), self.frozen_snapshot)

    def test_in_process_user_errors(self) -> None:
        empty = os.path.join(self.root, "empty")
        os.makedirs(empty, exist_ok=True)
        cases = [
            (dict(model=MODEL, logdir=self.frozen, model_params_override="train.max_step : 30"),
             ["--model_params_override", "train.max_step", "Did you mean: train.max_steps"]),
            (dict(model=MODEL, logdir=empty, mode="eval"),
             ["no checkpoint in", "checkpoints", "train first"]),
            (dict(model=MODEL, logdir=os.path.join(self.root, "no_such_dir", "run")),
             ["--logdir", "no_such_dir", "does not exist"]),
            (dict(model="testdata_models.TinyMpl", logdir=self.frozen),
             ["--model", "Did you mean: testdata_models.TinyMlp"]),
            (dict(model=MODEL, logdir=self.frozen, model_params_override="train.max_steps : 1.5"),
             ["--model_params_override", "train.max_steps", "expected a value of type int"]),
            (dict(model=MODEL, logdir=self.frozen, input_params_override="batch_sise : 2"),
             ["--input_params_override", "batch_sise", "Did you mean: batch_size"]),
            (dict(model=MODEL, logdir=self.frozen, num_cells=4),
             ["--num_cells=4", "'network' has only 3 layers"]),
            (dict(model=MODEL, logdir=self.frozen, num_micro_batches=3),
             ["num_micro_batches=3 does not divide the mini-batch size 16"]),
            (dict(model="testdata_models.TinyMlpNoDev", logdir=self.frozen, mode="eval"),
             ["--eval_splits", "no 'dev' split", "--eval_splits=test"]),
            (dict(model=MODEL, mode="train"), ["--logdir is required"]),
            (dict(model=MODEL, logdir=self.frozen, mode="fit"), ["--mode='fit' is unknown"]),
        ]
        for kwargs, expected in cases:
            status, out, err = _main(**kwargs)
            self.assertEqual(status, 1, (kwargs, out, err))
            self.assertEqual(len(err.splitlines()), 1, err)
            for text in expected:
                self.assertIn(text, err, kwargs)
        self.assertEqual(_snapshot(self.frozen), self.frozen_snapshot)
        self.assertFalse(os.path.exists(os.path.join(self.root, "no_such_dir")))


if __name__ == "__main__":
    tf.test.main()
