"""A training run says what it is doing, shows only the project's lines, and ends promptly.

Issue 39: training was silent for 14-36 s between "Watch it with" and "Training from scratch";
the process stayed alive 3-44 s after printing `Done:`; every resume printed TensorFlow's 3-line
`update_checkpoint_state` deprecation warning. Asserted from a real trainer.py's output: the
progress lines of the slow phases, the exit within 10 s of `Done:` (a generous bound: it now
exits in a fraction of a second), no TensorFlow warning on resume, and the printed TensorBoard
command naming the `tensorboard` beside this interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import pytest
from conftest import REPO, launch_trainer, stop_processes

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

EXIT_AFTER_DONE_S = 10.0


def run_until_exit(*args: str, env: dict | None = None) -> tuple[int, str, float | None]:
    """(exit status, output, seconds from reading the `Done:` line to the exit)."""
    proc = launch_trainer(*args, stderr=subprocess.STDOUT, env=env)
    lines, done_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Done:"):
                done_at = time.monotonic()
        proc.wait(timeout=600)
    finally:
        stop_processes([proc])
    after = None if done_at is None else time.monotonic() - done_at
    return proc.returncode, "".join(lines), after


class QuietAndPromptTest(unittest.TestCase):

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="quiet_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def test_progress_lines_prompt_exit_and_a_quiet_resume(self):
        logdir = os.path.join(self.root, "run")
        flags = ["--model=tests.testdata_models.TinyMlp", f"--logdir={logdir}"]
        status, out, after = run_until_exit(*flags, "--max_steps=3")
        self.assertEqual(0, status, msg=out)
        order = ["Starting --mode=train: loading TensorFlow", "Watch it with: ",
                 "Building the model and its input...",
                 "Tracing the train step", "Training from scratch to step 3.",
                 "Running step 1, the first", "Done: global step 3."]
        positions = [out.find(text) for text in order]
        self.assertNotIn(-1, positions, msg=out)
        self.assertEqual(sorted(positions), positions, msg=out)
        # The TensorBoard installed beside this interpreter (.venv/bin/tensorboard in a fresh
        # clone), as a path from the trainer's working directory (the repository).
        tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
        program = out.split("Watch it with: ", 1)[1].split()[0]
        if os.path.exists(tensorboard):
            self.assertTrue(os.path.samefile(os.path.join(REPO, program), tensorboard),
                            msg=program)
        self.assertIsNotNone(after)
        self.assertLess(after, EXIT_AFTER_DONE_S, msg=out)

        # Resuming (the checkpoint state is rewritten): no TensorFlow warning, prompt exit.
        status, out, after = run_until_exit(*flags, "--max_steps=5")
        self.assertEqual(0, status, msg=out)
        self.assertIn("Resuming training from step 3 to step 5.", out)
        for noise in ("deprecat", "update_checkpoint_state", "WARNING:tensorflow",
                      "Instructions for updating"):
            self.assertNotIn(noise, out)
        self.assertLess(after, EXIT_AFTER_DONE_S, msg=out)


if __name__ == "__main__":
    unittest.main()
