"""Reliability of training: exact resume after SIGKILL, damaged checkpoints, one writer per logdir,
non-finite steps, bad inputs, and a steady state over a long run.

Checks are independent of the code under test: checkpoints are read back with
`tf.train.load_variable`, TensorBoard scalars with TensorBoard's own reader, files are compared by
SHA-256, and "weights untouched" / "resume is exact" mean bit-identical arrays.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile

import pytest
import reliability_models  # noqa: F401 (registers reliability_models.*)
import tensorflow as tf
import testdata_models  # noqa: F401 (registers testdata_models.*)
from conftest import hash_tree
from reliability_helpers import (
    CLI_NOISY,
    NOISY,
    TINY,
    _assert_bit_identical,
    _ckpt,
    _ckpt_dir,
    _ckpt_values,
    _data_file,
    _flip_byte,
    _launch,
    _main,
    _scalar_events,
    _scalars,
    _state_latest,
    _step_of,
    _train_overrides,
    _truncate,
)

from lingvo_lite.training import checkpointer, logdir_lock


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
        # SIGTERM, then a second signal while the checkpoint of the first is being written.
        # (SIGINT is handled as SIGTERM is; a SIGINT mid-run, and twice more while stopping:
        # fault_messages_test.InterruptTest.)
        "second_signal": "fetched:7=SIGTERM,saving:7=SIGINT",
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

    def test_sigterm_saves_releases_the_lock_and_a_second_signal_is_ignored(self) -> None:
        self._check_stopped("second_signal", signal.SIGTERM)
        self.assertIn("SIGINT received again while stopping", self.stopped["second_signal"][1])
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
