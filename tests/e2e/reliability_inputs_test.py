"""Reliability, part two: the logdir lock, non-finite steps, bad inputs, profiling ranges,
start-up logs and steady-state memory (part one, reliability_test.py: exact resume, stop
signals, checkpoint integrity)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
import reliability_models  # noqa: F401 (registers reliability_models.*)
import tensorflow as tf
import testdata_models  # noqa: F401 (registers testdata_models.*)
from conftest import hash_tree, stop_processes
from reliability_helpers import (
    CLI_NOISY,
    NOISY,
    REPO,
    TINY,
    _assert_bit_identical,
    _ckpt,
    _ckpt_values,
    _launch,
    _main,
    _scalars,
    _state_latest,
    _step_of,
    _train_overrides,
)

from lingvo_lite.training import checkpointer, logdir_lock, loop, options


class LogdirLockTest(tf.test.TestCase):

    def setUp(self) -> None:
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="reliability_lock_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.logdir = os.path.join(self.root, "run")
        os.mkdir(self.logdir)
        self.lock = os.path.join(self.logdir, logdir_lock.LOCK_FILE)
        self.sleeper = subprocess.Popen(["sleep", "60"])
        self.addCleanup(self._stop_sleeper)

    def _stop_sleeper(self) -> None:
        if self.sleeper.poll() is None:
            self.sleeper.kill()
        self.sleeper.wait()

    def _write_lock(self, pid: int, hostname: str, start_ticks) -> None:
        with open(self.lock, "w") as f:
            json.dump({"pid": pid, "hostname": hostname, "proc_start_ticks": start_ticks,
                       "start_time": "2026-01-01 00:00:00 UTC"}, f)

    def _ticks(self, pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])

    def _train(self) -> tuple[int, str, str]:
        return _main(model=TINY, logdir=self.logdir, max_steps=2)

    def test_live_owner_refuses_and_changes_nothing(self) -> None:
        self._write_lock(self.sleeper.pid, socket.gethostname(), self._ticks(self.sleeper.pid))
        before = hash_tree(self.logdir)
        status, out, err = self._train()
        self.assertEqual(status, 1, out)
        self.assertEqual(err.splitlines(), [
            f"trainer.py: error: --logdir={self.logdir} is in use by another trainer (PID "
            f"{self.sleeper.pid} on {socket.gethostname()}, started 2026-01-01 00:00:00 UTC; "
            f"lock file {self.lock}): stop it first, or use a different --logdir."])
        self.assertEqual(hash_tree(self.logdir), before)

    def test_other_host_refuses_with_the_manual_fix(self) -> None:
        self._write_lock(self.sleeper.pid, "elsewhere.example", 1)
        status, _, err = self._train()
        self.assertEqual(status, 1)
        self.assertIn(f"if no trainer runs on host elsewhere.example any more, delete {self.lock}",
                      err)

    def test_stale_lock_of_dead_process_is_taken_over(self) -> None:
        pid = self.sleeper.pid
        ticks = self._ticks(pid)
        self._stop_sleeper()
        self._write_lock(pid, socket.gethostname(), ticks)
        status, out, err = self._train()
        self.assertEqual(status, 0, err)
        self.assertIn(f"taking over the stale lock {self.lock} (PID {pid}", err)
        self.assertIn("Done: global step 2", out)
        self.assertFalse(os.path.exists(self.lock))

    def test_stale_lock_with_reused_pid_is_taken_over(self) -> None:
        # The PID is alive, but it is another process than the one that wrote the lock.
        self._write_lock(self.sleeper.pid, socket.gethostname(),
                         self._ticks(self.sleeper.pid) - 1)
        status, _, err = self._train()
        self.assertEqual(status, 0, err)
        self.assertIn("taking over the stale lock", err)

    def test_lock_is_released_after_a_setup_error(self) -> None:
        status, _, _ = _main(model=TINY, logdir=os.path.join(self.root, "fresh"), max_steps=2,
                             model_params_override="train.save_interval_steps : -1")
        self.assertEqual(status, 1)
        self.assertFalse(os.path.exists(os.path.join(self.root, "fresh")))


# ---------------------------------------------------------------------------------------------
# 4. Non-finite loss / gradients.


class NonFiniteTest(tf.test.TestCase):

    def setUp(self) -> None:
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="reliability_nan_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def test_nan_steps_skip_the_update_and_are_counted(self) -> None:
        # Step s trains on batch s-1: batches 6 and 7 (NaN features) are steps 7 and 8.
        logdir = os.path.join(self.root, "skip")
        status, out, err = _main(
            model=NOISY, logdir=logdir, max_steps=10, input_params_override="nan_batches : [6, 7]",
            model_params_override=_train_overrides(
                save_interval_steps=3, summary_interval_steps=1, max_checkpoints_to_keep=5))
        self.assertEqual(status, 0, err)
        for step in (7, 8):
            self.assertIn(f"WARNING: step {step}: non-finite loss or gradients; the update was "
                          "skipped", out)
        # ckpt-6 is the state before step 7; step 9 trains again (and is saved normally).
        before = _ckpt_values(_ckpt(logdir, 6))
        scalars = _scalars(os.path.join(logdir, "train"))
        self.assertEqual([scalars["update_skipped"][s] for s in range(1, 11)],
                         [0, 0, 0, 0, 0, 0, 1, 1, 0, 0])
        self.assertEqual([scalars["skipped_updates"][s] for s in range(1, 11)],
                         [0, 0, 0, 0, 0, 0, 1, 2, 2, 2])
        # Whether NaN features reach the loss or only the gradients depends on the kernels
        # (oneDNN's fused matmul+relu may map NaN to 0), so either counts as non-finite.
        non_finite = [s for s in range(1, 11)
                      if not (np.isfinite(scalars["loss"][s])
                              and np.isfinite(scalars["grad_norm"][s]))]
        self.assertEqual(non_finite, [7, 8])
        after = _ckpt_values(_ckpt(logdir, 9))
        (counter,) = [v for k, v in after.items() if "skipped_updates" in k]
        self.assertEqual(int(counter), 2)
        for values in (before, after):
            for k, v in values.items():
                self.assertTrue(np.all(np.isfinite(v)), k)

    def test_weights_untouched_by_skipped_steps(self) -> None:
        logdir = os.path.join(self.root, "untouched")
        status, _, err = _main(
            model=NOISY, logdir=logdir, max_steps=8, input_params_override="nan_batches : [6, 7]",
            model_params_override=_train_overrides(save_interval_steps=6))
        self.assertEqual(status, 0, err)
        # Steps 7 and 8 were skipped: ckpt-8 holds ckpt-6's weights and optimizer slots exactly.
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, 8)),
                              _ckpt_values(_ckpt(logdir, 6)),
                              skip=r"global_step|skipped_updates")
        self.assertEqual(_step_of(_ckpt(logdir, 8)), 8)

    def test_too_many_consecutive_nonfinite_steps_stop_the_run(self) -> None:
        logdir = os.path.join(self.root, "stop")
        status, out, err = _main(
            model=NOISY, logdir=logdir, max_steps=30,
            input_params_override=f"nan_batches : {list(range(4, 40))}",
            model_params_override=_train_overrides(
                save_interval_steps=2, max_consecutive_nonfinite_steps=3))
        self.assertEqual(status, 1, out)
        self.assertNotIn("Traceback", out + err)
        self.assertEqual(err.splitlines(), [
            "trainer.py: error: training stopped at step 7: the loss or gradients were NaN/Inf "
            "for 3 consecutive steps (5..7; train.max_consecutive_nonfinite_steps=3); the last "
            f"checkpoint {_ckpt(logdir, 4)} is intact. Check the input data and lower "
            "train.learning_rate (or set train.clip_gradient_norm_to_value), then rerun the same "
            "command to resume."])
        self.assertEqual(_state_latest(logdir), _ckpt(logdir, 4))
        self.assertFalse(os.path.exists(_ckpt(logdir, 6) + ".index"))
        self.assertIsNone(checkpointer.find_damage(_ckpt(logdir, 4)))
        for k, v in _ckpt_values(_ckpt(logdir, 4)).items():
            self.assertTrue(np.all(np.isfinite(v)), k)
        self.assertFalse(os.path.exists(os.path.join(logdir, logdir_lock.LOCK_FILE)))


# ---------------------------------------------------------------------------------------------
# 5. Bad inputs everywhere users type.


class BadInputTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="reliability_bad_")
        cls.good = os.path.join(cls.root, "good")  # A TinyMlp run at step 5.
        cls.good_result = _main(model=TINY, logdir=cls.good, max_steps=5)
        # Data directories live apart from the logdirs: an input may write into its data_dir
        # (e.g. a vocabulary), the test only requires the logdirs to stay untouched.
        cls.data_root = tempfile.mkdtemp(prefix="reliability_bad_data_")
        cls.empty = os.path.join(cls.root, "empty")
        cls.empty_data = os.path.join(cls.data_root, "empty_data")
        for d in (cls.empty, cls.empty_data):
            os.mkdir(d)
        cls.a_file = os.path.join(cls.root, "a_file")
        open(cls.a_file, "w").close()
        # Parallel text files whose line counts differ (a malformed MT corpus).
        cls.bad_text = os.path.join(cls.data_root, "bad_text")
        os.mkdir(cls.bad_text)
        for split in ("train", "dev", "test"):
            with open(os.path.join(cls.bad_text, f"{split}.src"), "w") as f:
                f.write("one two\nthree\nfour five six\n")
            with open(os.path.join(cls.bad_text, f"{split}.tgt"), "w") as f:
                f.write("eins zwei\ndrei\n")
        cls.procs = {
            "flag_type": _launch(f"--model={CLI_NOISY}", f"--logdir={cls.good}",
                                 "--max_steps=ten"),
            "unknown_flag": _launch(f"--model={CLI_NOISY}", f"--logdir={cls.good}",
                                    "--max_step=10"),
        }

    @classmethod
    def tearDownClass(cls) -> None:
        stop_processes(cls.procs.values())
        shutil.rmtree(cls.root, ignore_errors=True)
        shutil.rmtree(cls.data_root, ignore_errors=True)
        super().tearDownClass()

    def cases(self) -> list[tuple[str, dict, list[str]]]:
        good, imagenet = self.good, "image.AmoebaNetD_6_208"
        fresh = os.path.join(self.root, "fresh")
        return [
            ("unknown model", dict(model="testdata_models.TinyMpl", logdir=good),
             ["--model", "Did you mean: testdata_models.TinyMlp"]),
            ("unknown registered name", dict(model="image.AmoebaNetZ", logdir=good),
             ["--model", "image.AmoebaNetZ"]),
            ("model is a module", dict(model="tests.testdata_models", logdir=good),
             ["--model", "tests.testdata_models"]),
            ("mistyped override key",
             dict(model=TINY, logdir=good, model_params_override="train.max_step : 30"),
             ["--model_params_override", "train.max_step", "Did you mean: train.max_steps"]),
            ("unknown input key", dict(model=TINY, logdir=good,
                                       input_params_override="batch_sise : 2"),
             ["--input_params_override", "batch_sise", "Did you mean: batch_size"]),
            ("wrong value type int",
             dict(model=TINY, logdir=good, model_params_override="train.max_steps : 1.5"),
             ["--model_params_override", "train.max_steps", "int"]),
            ("wrong value type float",
             dict(model=TINY, logdir=good, model_params_override="train.learning_rate : 'fast'"),
             ["--model_params_override", "train.learning_rate"]),
            ("override without colon",
             dict(model=TINY, logdir=good, model_params_override="train.max_steps 30"),
             ["--model_params_override", "train.max_steps 30"]),
            ("override with malformed value",
             dict(model=TINY, logdir=good, model_params_override="network.num_cells : [1,"),
             ["--model_params_override", "network.num_cells"]),
            ("batch size not divisible by micro-batches",
             dict(model=TINY, logdir=good, num_micro_batches=3),
             ["num_micro_batches=3", "does not divide the mini-batch size 16"]),
            ("more partitions than layers", dict(model=TINY, logdir=good, num_cells=4),
             ["--num_cells=4", "has only 3 layers"]),
            ("explicit split out of range",
             dict(model=TINY, logdir=good, model_params_override=(
                 "network.partition_method : 'explicit'; network.split_points : [7]")),
             ["split_points", "7"]),
            ("cell output does not fit next input",
             dict(model=TINY, logdir=fresh,
                  model_params_override="network.layers[1].proj.input_dim : 12"),
             ["input_dim"]),
            ("empty tfds data_dir",
             dict(model=imagenet, logdir=fresh,
                  input_params_override=f"data_dir : '{self.empty_data}'"),
             ["data_dir", self.empty_data, "tfds build imagenet2012"]),
            ("missing tfds data_dir",
             dict(model=imagenet, logdir=fresh,
                  input_params_override=f"data_dir : '{self.data_root}/no_such_data'"),
             ["data_dir", "no_such_data"]),
            ("malformed parallel text files",
             dict(model="mt.TransformerSmall", logdir=fresh,
                  input_params_override=f"data_dir : '{self.bad_text}'; generate : ''"),
             ["train.src", "train.tgt"]),
            ("checkpoint of a different model",
             dict(model="reliability_models.TinyMlpWide", logdir=good),
             ["does not match this model", "new --logdir"]),
            ("eval before any checkpoint", dict(model=TINY, logdir=self.empty, mode="eval"),
             ["no checkpoint in", "train first"]),
            ("batch_size 0", dict(model=TINY, logdir=good, input_params_override="batch_size : 0"),
             ["input.batch_size=0", ">= 1"]),
            ("batch_size 0 via model override",
             dict(model=TINY, logdir=good, model_params_override="input.batch_size : 0"),
             ["input.batch_size=0", ">= 1"]),
            ("unknown partition method",
             dict(model=TINY, logdir=good,
                  model_params_override="network.partition_method : 'bogus'"),
             ["network.partition_method='bogus'", "min_max"]),
            ("unknown partition cost",
             dict(model=TINY, logdir=good,
                  model_params_override="network.partition_cost : 'bogus'"),
             ["network.partition_cost='bogus'", "flops"]),
            ("num_micro_batches 0", dict(model=TINY, logdir=good, num_micro_batches=0),
             ["--num_micro_batches=0", ">= 1"]),
            ("max_steps -1", dict(model=TINY, logdir=good, max_steps=-1),
             ["--max_steps=-1", ">= 0"]),
            ("train.max_steps negative",
             dict(model=TINY, logdir=good, model_params_override="train.max_steps : -5"),
             ["train.max_steps=-5", ">= 0"]),
            ("save interval negative",
             dict(model=TINY, logdir=good, model_params_override="train.save_interval_steps : -1"),
             ["train.save_interval_steps=-1", ">= 0"]),
            ("keep no checkpoint", dict(model=TINY, logdir=good,
                                        model_params_override="train.max_checkpoints_to_keep : 0"),
             ["train.max_checkpoints_to_keep=0", ">= 1"]),
            ("nonfinite limit 0", dict(
                model=TINY, logdir=good,
                model_params_override="train.max_consecutive_nonfinite_steps : 0"),
             ["train.max_consecutive_nonfinite_steps=0", ">= 1"]),
            ("num_logical_cpus 0", dict(model=TINY, logdir=good, num_logical_cpus=0),
             ["--num_logical_cpus=0"]),
            ("logdir is a file", dict(model=TINY, logdir=self.a_file),
             ["--logdir", "not a directory"]),
            ("logdir parent missing", dict(model=TINY, logdir=f"{self.root}/nope/run"),
             ["--logdir", "does not exist", "mkdir -p"]),
            ("unknown eval split", dict(model=TINY, logdir=good, mode="eval",
                                        eval_splits=("valid",)),
             ["--eval_splits", "valid"]),
            ("unknown model module", dict(model=TINY, logdir=good,
                                          model_modules=("no_such.module",)),
             ["--model_modules", "no_such.module"]),
            ("negative seed", dict(model=TINY, logdir=good, seed=-1), ["--seed=-1"]),
            ("input seed wrong type",
             dict(model=TINY, logdir=good, input_params_override="seed : 'abc'"),
             ["seed"]),
            ("negative learning rate",
             dict(model=TINY, logdir=good, model_params_override="train.learning_rate : -0.1"),
             ["train.learning_rate=-0.1", ">= 0", "--model_params_override"]),
            ("micro-batches 0 via override",
             dict(model=TINY, logdir=good, model_params_override="network.num_micro_batches : 0"),
             ["num_micro_batches"]),
        ]

    def test_bad_inputs_give_one_clear_line_and_damage_nothing(self) -> None:
        status, _, err = self.good_result
        self.assertEqual(status, 0, err)
        cases = self.cases()
        self.assertGreaterEqual(len(cases), 20)
        failures = []
        for name, kwargs, expected in cases:
            logdir = kwargs.get("logdir")
            watched = logdir if logdir and os.path.isdir(logdir) else self.root
            before = hash_tree(watched)
            status, out, err = _main(**kwargs)
            lines = err.splitlines()
            problems = []
            if status != 1:
                problems.append(f"status {status}")
            if len(lines) != 1 or not lines[0].startswith("trainer.py: error: "):
                problems.append("not one error line")
            if "Traceback" in out + err:
                problems.append("traceback")
            problems += [f"missing {text!r}" for text in expected if text not in err]
            if hash_tree(watched) != before:
                problems.append(f"{watched} changed")
            if os.path.exists(os.path.join(self.root, "fresh")):
                problems.append("fresh logdir left behind")
            if problems:
                failures.append(f"{name}: {', '.join(problems)}\n    stderr: {err.strip()}")
        self.assertEqual(failures, [], "\n" + "\n".join(failures))

    def test_malformed_flags_on_the_command_line(self) -> None:
        for name, expected in (("flag_type", "--max_steps=ten"),
                               ("unknown_flag", "max_step")):
            stdout, stderr = self.procs[name].communicate(timeout=120)
            self.assertEqual(self.procs[name].returncode, 1, name)
            self.assertNotIn("Traceback", stdout + stderr)
            errors = [ln for ln in stderr.splitlines() if ln.startswith("trainer.py: error: ")]
            self.assertLen(errors, 1, stderr)
            self.assertIn(expected, errors[0])
            self.assertIn("--helpfull", errors[0])


class ProfileStepsRangeTest(tf.test.TestCase):

    def test_profile_steps_outside_the_run_warn_before_training(self) -> None:
        # Issue 17.6: --profile_steps beyond max_steps was silently accepted.
        root = tempfile.mkdtemp(prefix="reliability_profile_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        status, out, err = _main(model=TINY, logdir=os.path.join(root, "run"), max_steps=3,
                                 profile_steps="5,6")
        self.assertEqual(status, 0, err)
        self.assertIn("trainer.py: warning: --profile_steps=5,6 asks for steps this run does "
                      "not train (it trains steps 1..3); none of them will be profiled.", err)
        self.assertFalse(os.path.exists(os.path.join(root, "run", "train", "plugins")))


# TensorFlow's C++ log lines ("I0000 00:00:1795470611.323789   16687 port.cc:153] oneDNN ...")
# and their preamble; not the project's own Python absl lines ("... pipelining_layer.py:55] ...").
_CPP_LOG_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\.(cc|h):\d+\]|absl::InitializeLog")


@pytest.mark.slow
class StartupLogsTest(tf.test.TestCase):

    def test_tensorflow_startup_logs_hidden_unless_asked_for(self) -> None:
        # Issue 17.7: every run printed TensorFlow's C++ start-up lines around its own. They
        # are hidden by default and shown with --tf_logs (TF_CPP_MIN_LOG_LEVEL unset, as in a
        # user's shell).
        root = tempfile.mkdtemp(prefix="reliability_logs_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        procs = {}
        for name, extra in (("quiet", []), ("loud", ["--tf_logs"])):
            procs[name] = subprocess.Popen(
                [sys.executable, os.path.join(REPO, "trainer.py"), f"--model={CLI_NOISY}",
                 f"--logdir={os.path.join(root, name)}", "--max_steps=1", *extra],
                cwd=REPO, env=dict(env, PYTHONPATH=REPO), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
        results = {name: (p.communicate(timeout=240), p.returncode) for name, p in procs.items()}
        for name, ((out, err), status) in results.items():
            self.assertEqual(status, 0, f"{name}: {err}")
            self.assertIn("Done: global step 1", out, name)
        (quiet_out, quiet_err), _ = results["quiet"]
        (_, loud_err), _ = results["loud"]
        quiet = (quiet_out + quiet_err).splitlines()
        self.assertEqual([ln for ln in quiet if _CPP_LOG_LINE.search(ln)], [])
        # Its Python-side start-up lines too (CUDA probing, CPU features, oneDNN).
        marks = ("cuda", "cpu_feature_guard", "oneDNN", "absl::InitializeLog")
        self.assertEqual([ln for ln in quiet if any(m in ln for m in marks)], [])
        self.assertNotEqual([ln for ln in loud_err.splitlines() if _CPP_LOG_LINE.search(ln)], [])


# ---------------------------------------------------------------------------------------------
# 6. Steady state over a long run.


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
class SteadyStateTest(tf.test.TestCase):

    def test_thousand_steps_flat_memory_and_one_trace(self) -> None:
        root = tempfile.mkdtemp(prefix="reliability_steady_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        config_options = options.RunOptions(
            model=NOISY, logdir=os.path.join(root, "run"), max_steps=1000,
            model_params_override=_train_overrides(
                summary_interval_steps=50, log_interval_steps=100, save_interval_steps=250))
        from lingvo_lite.analysis import model_analysis
        from lingvo_lite.training import model_config

        config = model_config.build_model_config(config_options)
        trainer = loop.Trainer.build(
            task_params=config.task_params, logdir=config_options.abs_logdir,
            params_text=config.task_params.ToText(),
            analysis_text=model_analysis.describe_model(config.name, config.task_params),
            out=io.StringIO())
        rss: list[int] = []
        times: list[float] = []
        step_fn = trainer._train_step

        def measured_step(batch):
            # The process's CPU time, not wall time: other work on the machine does not
            # stretch it.
            start = time.process_time()
            metrics = step_fn(batch)
            times.append(time.process_time() - start)
            rss.append(_rss_bytes())
            return metrics

        trainer._train_step = measured_step
        self.assertEqual(trainer.run(), 0)
        self.assertLen(rss, 1000)
        self.assertEqual(trainer.trace_count, 1)  # Traced at setup, never again.
        windows = [np.median(rss[i:i + 100]) for i in range(100, 1000, 100)]
        growth = (windows[-1] - windows[0]) / windows[0]
        self.assertLess(growth, 0.05, f"RSS medians per 100 steps (MB): "
                        f"{[round(w / 2**20, 1) for w in windows]}")
        # A step's CPU time is stable: the last window costs not much more than the first (no
        # retrace, no accumulating work).
        t_first, t_last = np.median(times[100:200]), np.median(times[900:1000])
        self.assertLess(t_last, 2.0 * t_first + 1e-3, (t_first, t_last))


if __name__ == "__main__":
    tf.test.main()
