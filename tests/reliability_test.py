"""Reliability of training: exact resume after SIGKILL, damaged checkpoints, one writer per logdir,
non-finite steps, bad inputs, and a steady state over a long run.

Checks are independent of the code under test: checkpoints are read back with
`tf.train.load_variable`, TensorBoard scalars with TensorBoard's own reader, files are compared by
SHA-256, and "weights untouched" / "resume is exact" mean bit-identical arrays.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
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
from conftest import hash_tree, launch_trainer, stop_processes
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator

from lingvo_lite.training import checkpointer, logdir_lock, loop, options, runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "testdata_models.TinyMlp"
NOISY = "reliability_models.TinyMlpNoisy"
CLI_NOISY = "tests.reliability_models.TinyMlpNoisy"


def _main(**kwargs) -> tuple[int, str, str]:
    """runner.main in-process; returns (status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    status = runner.main(options.RunOptions(**kwargs), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def _launch(*args: str, stderr=subprocess.PIPE, extra_env: dict | None = None
            ) -> subprocess.Popen:
    return launch_trainer(*args, stderr=stderr, env=extra_env)


def _ckpt_dir(logdir: str) -> str:
    return os.path.join(logdir, "checkpoints")


def _state_latest(logdir: str) -> str:
    return tf.train.latest_checkpoint(_ckpt_dir(logdir))


def _ckpt(logdir: str, step: int) -> str:
    return os.path.join(_ckpt_dir(logdir), f"ckpt-{step}")


def _ckpt_values(path: str) -> dict[str, np.ndarray]:
    """Every variable of a checkpoint (weights, slots, steps, counters) but the save counter."""
    return {name: tf.train.load_variable(path, name) for name, _ in tf.train.list_variables(path)
            if name.endswith("VARIABLE_VALUE") and "save_counter" not in name}


def _step_of(path: str) -> int:
    return int(tf.train.load_variable(path, checkpointer.GLOBAL_STEP_KEY))


def _assert_bit_identical(test: tf.test.TestCase, a: dict, b: dict, skip: str = "") -> None:
    keys = [k for k in a if not (skip and re.search(skip, k))]
    test.assertEqual(sorted(keys), sorted(k for k in b if not (skip and re.search(skip, k))))
    for k in keys:
        test.assertEqual(a[k].dtype, b[k].dtype, k)
        test.assertEqual(np.asarray(a[k]).tobytes(), np.asarray(b[k]).tobytes(), k)


def _scalars(event_dir: str) -> dict[str, dict[int, float]]:
    """tag -> {step: value} read with TensorBoard's own event reader."""
    acc = event_accumulator.EventAccumulator(
        event_dir, size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def _scalar_events(event_dir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard's server loads them (restart handling included)."""
    acc = plugin_event_accumulator.EventAccumulator(
        event_dir, size_guidance={plugin_event_accumulator.TENSORS: 0})
    acc.Reload()
    return {tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]
            if acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"}


def _flip_byte(path: str, offset_fraction: float = 0.5) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = int(len(data) * offset_fraction)
        data[i] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def _truncate(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _data_file(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


def _train_overrides(**values) -> str:
    return "; ".join(f"train.{k} : {v}" for k, v in values.items())


# ---------------------------------------------------------------------------------------------
# 1. Exact resume after SIGKILL (+ 3. a live trainer's logdir refuses a second one; its stale
#    lock does not block the resume).


class ExactResumeTest(tf.test.TestCase):

    def test_sigkill_at_arbitrary_step_then_resume_is_bit_identical(self) -> None:
        root = tempfile.mkdtemp(prefix="reliability_resume_")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        full_dir, killed_dir = os.path.join(root, "full"), os.path.join(root, "killed")
        max_steps = 300
        # Dropout and input noise are on (TinyMlpNoisy); checkpoints every 20 steps; 256 examples
        # = 16 batches per epoch, so the run crosses many reshuffled epochs.
        common = [f"--model={CLI_NOISY}", "--deterministic", f"--max_steps={max_steps}",
                  "--model_params_override=" + _train_overrides(
                      log_interval_steps=1, summary_interval_steps=50, save_interval_steps=20,
                      max_checkpoints_to_keep=2)]
        full = _launch(*common, f"--logdir={full_dir}")
        victim = _launch(*common, f"--logdir={killed_dir}", stderr=subprocess.STDOUT)
        kill_at = random.Random(7).randrange(27, 80)  # Arbitrary, after ckpt-20 was written.
        killed_after, refused = None, None
        for line in victim.stdout:
            m = re.match(r"step (\d+)/", line)
            if m and refused is None and int(m.group(1)) >= 21:
                # A second trainer on the live logdir refuses (in-process, while it runs).
                refused = _main(model=NOISY, logdir=killed_dir, max_steps=max_steps)
            if m and int(m.group(1)) >= kill_at:
                victim.send_signal(signal.SIGKILL)
                killed_after = int(m.group(1))
                break
        victim.wait(timeout=60)
        victim.stdout.close()
        self.assertEqual(victim.returncode, -signal.SIGKILL)
        self.assertIsNotNone(killed_after)
        status, _, err = refused
        self.assertEqual(status, 1)
        self.assertRegex(err, r"^trainer.py: error: --logdir=.* is in use by another trainer "
                              rf"\(PID {victim.pid} on {re.escape(socket.gethostname())}, ")
        self.assertEqual(len(err.splitlines()), 1, err)

        left = _state_latest(killed_dir)
        left_step = _step_of(left)
        self.assertGreaterEqual(left_step, 20)
        self.assertLess(left_step, killed_after)
        lock = os.path.join(killed_dir, logdir_lock.LOCK_FILE)
        with open(lock) as f:
            self.assertEqual(json.load(f)["pid"], victim.pid)  # The stale lock is still there.

        resume = _launch(*common, f"--logdir={killed_dir}")
        out, err = resume.communicate(timeout=180)
        self.assertEqual(resume.returncode, 0, err)
        self.assertNotIn("Traceback", err)
        self.assertIn(f"taking over the stale lock {lock} (PID {victim.pid}", err)
        self.assertIn(f"Restored {left} (global step {left_step})", out)
        self.assertFalse(os.path.exists(lock))
        full_out, full_err = full.communicate(timeout=180)
        self.assertEqual(full.returncode, 0, full_err)

        resumed_ckpt, full_ckpt = _state_latest(killed_dir), _state_latest(full_dir)
        self.assertEqual(_step_of(resumed_ckpt), max_steps)
        self.assertEqual(_step_of(full_ckpt), max_steps)
        # Weights, optimizer slots, global step and counters: bit-identical.
        _assert_bit_identical(self, _ckpt_values(resumed_ckpt), _ckpt_values(full_ckpt))
        # The summaries agree too (the loss at the steps both runs summarised).
        loss_full = _scalars(os.path.join(full_dir, "train"))["loss"]
        loss_resumed = _scalars(os.path.join(killed_dir, "train"))["loss"]
        self.assertEqual(loss_resumed[max_steps], loss_full[max_steps])


# ---------------------------------------------------------------------------------------------
# 1b. SIGINT / SIGTERM at chosen moments (issue 17.1, 17.2). The trainer signals itself at an
#     exact point through its test-only hook (interrupts.TEST_SIGNAL_ENV).

SIGNAL_STEPS = 10
SIGNAL_ARGS = [f"--model={CLI_NOISY}", "--deterministic", f"--max_steps={SIGNAL_STEPS}",
               "--model_params_override=" + _train_overrides(
                   log_interval_steps=1, summary_interval_steps=1, save_interval_steps=4,
                   max_checkpoints_to_keep=3)]


@pytest.mark.slow
class StopSignalTest(tf.test.TestCase):
    """Each victim is signalled right after fetching the batch of step 7 (ckpt-4 is the last
    periodic save), then resumed; the result must equal an uninterrupted run's."""

    VICTIMS = {
        "sigint": "fetched:7=SIGINT",
        "sigterm": "fetched:7=SIGTERM",
        # A second signal while the checkpoint of the first is being written.
        "second_signal": "fetched:7=SIGINT,saving:7=SIGTERM",
        # Steps 5 and 6 are summarised, then lost with the process: the resume retrains them.
        "sigkill": "fetched:7=SIGKILL",
    }

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="reliability_signal_")
        cls.full = os.path.join(cls.root, "full")
        procs = {"full": _launch(*SIGNAL_ARGS, f"--logdir={cls.full}")}
        for name, spec in cls.VICTIMS.items():
            procs[name] = _launch(*SIGNAL_ARGS, f"--logdir={os.path.join(cls.root, name)}",
                                  extra_env={"LINGVO_LITE_TEST_SIGNAL_AT": spec})
        procs["setup"] = _launch(*SIGNAL_ARGS, f"--logdir={os.path.join(cls.root, 'setup')}",
                                 extra_env={"LINGVO_LITE_TEST_SIGNAL_AT": "setup=SIGTERM"})
        cls.stopped = cls._wait(procs)
        cls.resumed = cls._wait({name: _launch(*SIGNAL_ARGS,
                                               f"--logdir={os.path.join(cls.root, name)}")
                                 for name in cls.VICTIMS})

    @staticmethod
    def _wait(procs: dict) -> dict[str, tuple[int, str, str]]:
        results = {}
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            results[name] = (proc.returncode, out, err)
        return results

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.root, ignore_errors=True)
        super().tearDownClass()

    def _check_stopped(self, name: str, signum: int) -> str:
        status, out, err = self.stopped[name]
        logdir = os.path.join(self.root, name)
        self.assertEqual(status, 128 + signum, out + err)
        self.assertNotIn("Traceback", out + err)
        sig = signal.Signals(signum).name
        self.assertIn(f"Interrupted by {sig} at step 7; checkpoint saved.", out)
        # The checkpoint pairs the weights of step 7 with the input position after batch 7.
        self.assertIsNone(checkpointer.find_damage(_ckpt(logdir, 7)))
        self.assertEqual(_step_of(_ckpt(logdir, 7)), 7)
        self.assertFalse(os.path.exists(os.path.join(logdir, logdir_lock.LOCK_FILE)))
        return logdir

    def _check_resumed_exactly(self, name: str) -> None:
        status, out, err = self.resumed[name]
        logdir = os.path.join(self.root, name)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(logdir, 7)} (global step 7)", out)
        full_status, _, full_err = self.stopped["full"]
        self.assertEqual(full_status, 0, full_err)
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, SIGNAL_STEPS)),
                              _ckpt_values(_ckpt(self.full, SIGNAL_STEPS)))

    def test_sigint_between_fetch_and_step_resumes_exactly(self) -> None:
        self._check_stopped("sigint", signal.SIGINT)
        self._check_resumed_exactly("sigint")

    def test_sigterm_saves_releases_the_lock_and_resumes_exactly(self) -> None:
        self._check_stopped("sigterm", signal.SIGTERM)
        self._check_resumed_exactly("sigterm")

    def test_resumed_curves_have_one_point_per_step(self) -> None:
        # Issue 17.7: after a SIGKILL at step 7 and a resume from ckpt-4, TensorBoard showed
        # steps 5 and 6 twice.
        self.assertEqual(self.stopped["sigkill"][0], -signal.SIGKILL)
        status, out, err = self.resumed["sigkill"]
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(os.path.join(self.root, 'sigkill'), 4)}", out)
        resumed = _scalar_events(os.path.join(self.root, "sigkill", "train"))
        full = _scalar_events(os.path.join(self.full, "train"))
        self.assertEqual([step for step, _ in resumed["loss"]], list(range(1, SIGNAL_STEPS + 1)))
        for tag, events in resumed.items():
            steps = [step for step, _ in events]
            self.assertEqual(len(steps), len(set(steps)), f"{tag}: {steps}")
        self.assertEqual(resumed["loss"], full["loss"])

    def test_sigterm_during_setup_releases_the_lock(self) -> None:
        status, out, err = self.stopped["setup"]
        self.assertEqual(status, 128 + signal.SIGTERM, out + err)
        self.assertNotIn("Traceback", out + err)
        self.assertIn("trainer.py: interrupted by SIGTERM during setup; nothing was saved.", err)
        # The lock is gone, and with it the logdir the run had created (nothing was written).
        self.assertFalse(os.path.exists(os.path.join(self.root, "setup")))

    def test_second_signal_during_the_save_is_ignored(self) -> None:
        self._check_stopped("second_signal", signal.SIGINT)
        self.assertIn("SIGTERM received again while stopping", self.stopped["second_signal"][1])
        self._check_resumed_exactly("second_signal")


# ---------------------------------------------------------------------------------------------
# 2. Checkpoint integrity.


class CheckpointIntegrityTest(tf.test.TestCase):

    OVERRIDES = _train_overrides(save_interval_steps=5, max_checkpoints_to_keep=2,
                                 summary_interval_steps=5, log_interval_steps=5)

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="reliability_ckpt_")
        cls.base = os.path.join(cls.root, "base")  # ckpt-10, ckpt-15 (max_to_keep=2).
        cls.ref = os.path.join(cls.root, "ref")  # Uninterrupted to step 20.
        cls.base_result = _main(model=TINY, logdir=cls.base, max_steps=15,
                                model_params_override=cls.OVERRIDES)
        cls.ref_result = _main(model=TINY, logdir=cls.ref, max_steps=20,
                               model_params_override=cls.OVERRIDES)
        cls.wide = os.path.join(cls.root, "wide")  # Another model's ckpt-17 (only).
        cls.wide_result = _main(model="reliability_models.TinyMlpWide", logdir=cls.wide,
                                max_steps=17,
                                model_params_override=_train_overrides(save_interval_steps=0))

    @classmethod
    def tearDownClass(cls) -> None:
        shutil.rmtree(cls.root, ignore_errors=True)
        super().tearDownClass()

    def _copy(self, name: str) -> str:
        logdir = os.path.join(self.root, name)
        shutil.copytree(self.base, logdir)
        return logdir

    def test_setup_runs_succeeded(self) -> None:
        for status, _, err in (self.base_result, self.ref_result, self.wide_result):
            self.assertEqual(status, 0, err)
        self.assertEqual(sorted(os.listdir(_ckpt_dir(self.base))), [
            "checkpoint", "ckpt-10.data-00000-of-00001", "ckpt-10.index",
            "ckpt-10.manifest.json", "ckpt-15.data-00000-of-00001", "ckpt-15.index",
            "ckpt-15.manifest.json"])

    def test_every_kind_of_damage_is_detected(self) -> None:
        damages = {
            "flipped data byte": lambda p: _flip_byte(_data_file(p)),
            "truncated data": lambda p: _truncate(_data_file(p)),
            "deleted data": lambda p: os.remove(_data_file(p)),
            "flipped index byte": lambda p: _flip_byte(p + ".index", 0.3),
            "truncated index": lambda p: _truncate(p + ".index"),
            "deleted index": lambda p: os.remove(p + ".index"),
            "garbled manifest": lambda p: open(p + ".manifest.json", "w").write("{not json"),
        }
        for i, (name, damage) in enumerate(damages.items()):
            logdir = self._copy(f"damage_{i}")
            newest = _ckpt(logdir, 15)
            self.assertIsNone(checkpointer.find_damage(newest), name)
            damage(newest)
            self.assertIsNotNone(checkpointer.find_damage(newest), name)
            self.assertIsNone(checkpointer.find_damage(_ckpt(logdir, 10)), name)
            self.assertEqual(checkpointer.latest_checkpoint(logdir), _ckpt(logdir, 10), name)

    def test_damaged_latest_falls_back_to_previous_and_is_kept_aside(self) -> None:
        logdir = self._copy("fallback")
        _flip_byte(_data_file(_ckpt(logdir, 15)))
        damaged_bytes = open(_data_file(_ckpt(logdir, 15)), "rb").read()
        status, out, err = _main(model=TINY, logdir=logdir, max_steps=20,
                                 model_params_override=self.OVERRIDES)
        self.assertEqual(status, 0, err)
        self.assertIn(f"trainer.py: warning: checkpoint {_ckpt(logdir, 15)} is damaged", err)
        self.assertIn("does not match the checksum", err)
        self.assertIn(f"Restored {_ckpt(logdir, 10)} (global step 10)", out)
        # The damaged files were moved aside, not deleted.
        with open(_data_file(os.path.join(_ckpt_dir(logdir), "damaged", "ckpt-15", "ckpt-15")),
                  "rb") as f:
            self.assertEqual(f.read(), damaged_bytes)
        # ckpt-10 was only deleted once two newer good checkpoints existed (max_to_keep=2).
        state = tf.train.get_checkpoint_state(_ckpt_dir(logdir))
        self.assertEqual([os.path.basename(p) for p in state.all_model_checkpoint_paths],
                         ["ckpt-15", "ckpt-20"])
        for step in (15, 20):
            self.assertIsNone(checkpointer.find_damage(_ckpt(logdir, step)))
        # Steps 11..20 were retrained from ckpt-10 with the input position of ckpt-10.
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, 20)),
                              _ckpt_values(_ckpt(self.ref, 20)))

    def test_damage_without_manifest_is_caught_by_the_restore(self) -> None:
        # A crash between TensorFlow's save and the manifest leaves no manifest: the restore's
        # own checksums must still catch a damaged file.
        logdir = self._copy("no_manifest")
        os.remove(_ckpt(logdir, 15) + ".manifest.json")
        _flip_byte(_data_file(_ckpt(logdir, 15)))
        status, out, err = _main(model=TINY, logdir=logdir, max_steps=20,
                                 model_params_override=self.OVERRIDES)
        self.assertEqual(status, 0, err)
        self.assertIn(f"checkpoint {_ckpt(logdir, 15)} is damaged: reading it failed", err)
        self.assertIn(f"Restored {_ckpt(logdir, 10)} (global step 10)", out)
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, 20)),
                              _ckpt_values(_ckpt(self.ref, 20)))

    def test_half_written_save_is_ignored(self) -> None:
        # SIGKILL during a save: TensorFlow had not yet updated the `checkpoint` state file and
        # no manifest was written; the partial ckpt-20 files must not be used.
        logdir = self._copy("partial")
        src = _ckpt(logdir, 15)
        with open(_data_file(src), "rb") as f:
            data = f.read()
        with open(_data_file(_ckpt(logdir, 20)), "wb") as f:
            f.write(data[: len(data) // 3])
        shutil.copy(src + ".index", _ckpt(logdir, 20) + ".index")
        self.assertEqual(checkpointer.latest_checkpoint(logdir), src)
        status, out, err = _main(model=TINY, logdir=logdir, max_steps=20,
                                 model_params_override=self.OVERRIDES)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {src} (global step 15)", out)
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, 20)),
                              _ckpt_values(_ckpt(self.ref, 20)))

    def test_eval_falls_back_too(self) -> None:
        logdir = self._copy("eval")
        _truncate(_data_file(_ckpt(logdir, 15)))
        status, out, err = _main(model=TINY, logdir=logdir, mode="eval")
        self.assertEqual(status, 0, err)
        self.assertIn(f"checkpoint {_ckpt(logdir, 15)} is damaged", err)
        self.assertIn(f"Evaluating {_ckpt(logdir, 10)} (global step 10)", out)

    def test_all_damaged_refuses_and_changes_nothing(self) -> None:
        logdir = self._copy("all_damaged")
        for step in (10, 15):
            _truncate(_data_file(_ckpt(logdir, step)))
        before = hash_tree(logdir)
        status, out, err = _main(model=TINY, logdir=logdir, max_steps=20,
                                 model_params_override=self.OVERRIDES)
        self.assertEqual(status, 1, out)
        self.assertIn("trainer.py: error: every checkpoint in", err)
        self.assertIn("move that directory aside", err)
        self.assertEqual(hash_tree(logdir), before)

    def _train_to(self, logdir: str, max_steps: int) -> tuple[int, str, str]:
        return _main(model=TINY, logdir=logdir, max_steps=max_steps,
                     model_params_override=self.OVERRIDES)

    def _assert_like_ref_at_20(self, logdir: str) -> None:
        _assert_bit_identical(self, _ckpt_values(_ckpt(logdir, 20)),
                              _ckpt_values(_ckpt(self.ref, 20)))

    def test_garbled_state_file_is_rebuilt(self) -> None:
        # Issue 17.3: random bytes in the state file made every later save crash.
        logdir = self._copy("garbled_state")
        with open(os.path.join(_ckpt_dir(logdir), "checkpoint"), "wb") as f:
            f.write(b"\xff\xfe" + random.Random(3).randbytes(300))
        status, out, err = self._train_to(logdir, 20)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(logdir, 15)} (global step 15)", out)
        self._assert_like_ref_at_20(logdir)
        state = tf.train.get_checkpoint_state(_ckpt_dir(logdir))
        self.assertEqual([os.path.basename(p) for p in state.all_model_checkpoint_paths],
                         ["ckpt-15", "ckpt-20"])

    def test_checkpoints_found_without_state_file_and_manifests(self) -> None:
        # Issue 17.3: with both gone, intact checkpoints were ignored (eval: "train first";
        # training: from scratch).
        logdir = self._copy("no_state")
        os.remove(os.path.join(_ckpt_dir(logdir), "checkpoint"))
        for step in (10, 15):
            os.remove(_ckpt(logdir, step) + ".manifest.json")
        status, out, err = _main(model=TINY, logdir=logdir, mode="eval")
        self.assertEqual(status, 0, err)
        self.assertIn(f"Evaluating {_ckpt(logdir, 15)} (global step 15)", out)
        status, out, err = self._train_to(logdir, 20)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(logdir, 15)} (global step 15)", out)
        self.assertIsNone(checkpointer.find_damage(_ckpt(logdir, 20)))
        self._assert_like_ref_at_20(logdir)

    def test_older_checkpoints_are_deleted_again_after_a_fallback(self) -> None:
        # Issue 17.4: after falling back past a damaged checkpoint, older good ones stayed on
        # disk forever.
        logdir = self._copy("fallback_then_keep")
        _flip_byte(_data_file(_ckpt(logdir, 15)))
        status, out, err = self._train_to(logdir, 25)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(logdir, 10)} (global step 10)", out)
        on_disk = sorted(name for name in os.listdir(_ckpt_dir(logdir))
                         if name.startswith("ckpt-"))
        self.assertEqual(on_disk, [  # max_checkpoints_to_keep=2.
            "ckpt-20.data-00000-of-00001", "ckpt-20.index", "ckpt-20.manifest.json",
            "ckpt-25.data-00000-of-00001", "ckpt-25.index", "ckpt-25.manifest.json"])

    def test_same_step_damaged_twice_keeps_both_copies(self) -> None:
        # Issue 17.4: the second quarantine of ckpt-15 overwrote the first in damaged/.
        logdir = self._copy("damaged_twice")
        copies = []
        for damage in (_flip_byte, _truncate):
            damage(_data_file(_ckpt(logdir, 15)))
            with open(_data_file(_ckpt(logdir, 15)), "rb") as f:
                copies.append(f.read())
            status, out, err = self._train_to(logdir, 15)
            self.assertEqual(status, 0, err)
            self.assertIn(f"Restored {_ckpt(logdir, 10)} (global step 10)", out)
        self.assertNotEqual(copies[0], copies[1])
        damaged = os.path.join(_ckpt_dir(logdir), "damaged")
        self.assertEqual(sorted(os.listdir(damaged)), ["ckpt-15", "ckpt-15.2"])
        for name, expected in zip(("ckpt-15", "ckpt-15.2"), copies):
            with open(_data_file(os.path.join(damaged, name, "ckpt-15")), "rb") as f:
                self.assertEqual(f.read(), expected, name)
        self.assertIn(f"moved the unusable checkpoint {_ckpt(logdir, 15)} (3 files) to "
                      f"{os.path.join(damaged, 'ckpt-15.2')}", err)

    def test_leftovers_of_interrupted_saves_are_removed(self) -> None:
        # Issue 17.4: TensorFlow's ckpt-N_temp/ shard directory, a manifest's temporary file
        # and the data shard of a save that never wrote its .index stayed forever.
        logdir = self._copy("leftovers")
        directory = _ckpt_dir(logdir)
        temp_dir = os.path.join(directory, "ckpt-17_temp")
        os.mkdir(temp_dir)
        leftovers = [os.path.join(temp_dir, "part-00000-of-00001.data-00000-of-00001"),
                     os.path.join(directory, "ckpt-15.manifest.json.tmp-99999"),
                     _data_file(_ckpt(logdir, 18))]
        for path in leftovers:
            with open(path, "wb") as f:
                f.write(b"partial")
        status, out, err = self._train_to(logdir, 20)
        self.assertEqual(status, 0, err)
        self.assertIn(f"Restored {_ckpt(logdir, 15)} (global step 15)", out)
        for path in leftovers + [temp_dir]:
            self.assertFalse(os.path.exists(path), path)
        self._assert_like_ref_at_20(logdir)

    def test_foreign_newest_checkpoint_is_set_aside(self) -> None:
        # Issue 17.4: another model's checkpoint as the newest stopped the run ("were the model
        # params changed?") although an older one fits; it is unusable like a damaged one.
        logdir = self._copy("foreign")
        foreign = _ckpt(self.wide, 17)
        names = [os.path.basename(p) for p in checkpointer.checkpoint_files(foreign)]
        names.append("ckpt-17.manifest.json")
        for name in names:
            shutil.copy(os.path.join(_ckpt_dir(self.wide), name), _ckpt_dir(logdir))
        status, out, err = self._train_to(logdir, 20)
        self.assertEqual(status, 0, err)
        self.assertIn(f"checkpoint {_ckpt(logdir, 17)} is unusable: it does not match this "
                      "model", err)
        moved_to = os.path.join(_ckpt_dir(logdir), "damaged", "ckpt-17")
        self.assertIn(f"moved the unusable checkpoint {_ckpt(logdir, 17)} (3 files) to "
                      f"{moved_to}", err)
        self.assertIn(f"Restored {_ckpt(logdir, 15)} (global step 15)", out)
        self.assertEqual(sorted(os.listdir(moved_to)), sorted(names))
        self.assertEqual(hash_tree(moved_to),
                         {n: v for n, v in hash_tree(_ckpt_dir(self.wide)).items()
                          if n in names})
        self._assert_like_ref_at_20(logdir)


# ---------------------------------------------------------------------------------------------
# 3. One writer per logdir (lock records written by hand; the SIGKILL test covers a real one).


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
        # Issue 17.7: every run printed TensorFlow's C++ start-up lines around its own.
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
        (_, quiet_err), _ = results["quiet"]
        (_, loud_err), _ = results["loud"]
        self.assertEqual([ln for ln in quiet_err.splitlines() if _CPP_LOG_LINE.search(ln)], [])
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
        from lingvo_lite.training import analysis, model_config

        config = model_config.build_model_config(config_options)
        trainer = loop.Trainer.build(
            task_params=config.task_params, logdir=config_options.abs_logdir,
            params_text=config.task_params.ToText(),
            analysis_text=analysis.describe_model(config.name, config.task_params),
            out=io.StringIO())
        rss: list[int] = []
        times: list[float] = []
        step_fn = trainer._train_step

        def measured_step(batch):
            start = time.perf_counter()
            metrics = step_fn(batch)
            times.append(time.perf_counter() - start)
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
        # Step time is stable: the last window is not much slower than the first (no retrace,
        # no accumulating work).
        t_first, t_last = np.median(times[100:200]), np.median(times[900:1000])
        self.assertLess(t_last, 2.0 * t_first + 1e-3, (t_first, t_last))


if __name__ == "__main__":
    tf.test.main()
