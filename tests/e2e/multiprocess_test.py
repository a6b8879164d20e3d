"""trainer.py over two processes on 127.0.0.1 in single-client mode, each with its own TF_CONFIG.

One pipeline across processes: R=1, K=2, one cell per process (a replica that spans tasks runs
single-client: the chief is the one client). After the run the chief's checkpoint must equal a
single-process run on the same global batch. Then faults, in turn in one logdir (the worker
killed, then the chief): each makes the other exit non-zero with a line naming what was lost,
within the bound; re-running both resumes from the last checkpoint and, with --deterministic,
the last run ends with the uninterrupted run's weights bit for bit. Data parallelism across
processes (multi-client mode, the default when replicas fit on a task) is tested the same way in
multi_client_test.py and multi_client_faults_test.py. Only the processes started here are
stopped, by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
import tensorflow as tf
from cluster_test import _free_ports
from conftest import REPO, launch_trainer, stop_processes
from multi_client_helpers import (
    Task,
    addresses,
    assert_survivor_names_the_loss,
    run_to_end,
    start_cluster,
    tf_config,
)

MODEL = "tests.testdata_models.TinyMlp"
BOUND_S = 60.0  # The bound for noticing a lost process.
FAULT_STEPS = 100  # Long enough that the worker is killed mid-run, not after the end.
SIGNAL_ENV = "LINGVO_LITE_TEST_SIGNAL_AT"  # The trainer signals itself at a chosen step.


def _tf_config(addresses: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def _launch(logdir: str, flags: list[str], tf_config: str | None) -> subprocess.Popen:
    return launch_trainer(f"--model={MODEL}", f"--logdir={logdir}", *flags,
                          stderr=subprocess.STDOUT, env={"TF_CONFIG": tf_config or None})


def _weights(logdir: str) -> dict:
    path = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
    return {k: tf.train.load_variable(path, k) for k, _ in tf.train.list_variables(path)
            if k.startswith("model/")}


@pytest.mark.slow
class MultiProcessTrainerTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def _run_cluster(self, logdir: str, flags: list[str]) -> list[tuple[int, str]]:
        addresses = [f"127.0.0.1:{p}" for p in _free_ports(2)]
        procs = [_launch(logdir, flags, _tf_config(addresses, i)) for i in (1, 0)]
        try:
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            stop_processes(procs)
        return [(p.returncode, out) for p, out in zip(procs, outs)]

    def _assert_same_weights(self, want_dir: str, got_dir: str) -> None:
        want, got = _weights(want_dir), _weights(got_dir)
        self.assertCountEqual(want, got)
        for key in want:
            self.assertAllClose(want[key], got[key], rtol=1e-5, atol=1e-6, msg=key)

    def test_two_processes_equal_a_single_process_run(self):
        layouts = {"cell_per_process": ["--num_replicas=1", "--num_cells=2"]}
        singles = {"cell_per_process": ["--num_cells=1", "--num_micro_batches=2"]}
        for name, flags in layouts.items():
            logdir = os.path.join(self.root, name)
            results = self._run_cluster(logdir, flags + ["--max_steps=6"])
            for status, out in results:
                self.assertEqual(0, status, msg=out[-3000:])
            self.assertIn("the chief finished", results[0][1])
            single_dir = os.path.join(self.root, name + "_single")
            single = _launch(single_dir, singles[name] + ["--max_steps=6"], None)
            out = single.communicate(timeout=240)[0]
            self.assertEqual(0, single.returncode, msg=out[-3000:])
            self._assert_same_weights(single_dir, logdir)
        # Only the chief writes: the worker task left no files of its own.
        self.assertFalse([f for f in os.listdir(logdir) if f.startswith("task_")])

    def test_lost_process_stops_the_other_and_a_rerun_resumes_exactly(self):
        # One logdir through two faults: the worker killed once ckpt-10 is written (a
        # single-client worker runs no steps of its own, so this test kills it), then the chief
        # killed by its own hook mid-run. --deterministic: the last rerun must end on the
        # uninterrupted run's weights bit for bit.
        flags = ["--num_replicas=1", "--num_cells=2", f"--max_steps={FAULT_STEPS}",
                 "--deterministic", "--model_params_override=train.save_interval_steps : 10"]
        uninterrupted = os.path.join(self.root, "uninterrupted")
        run_to_end(start_cluster(uninterrupted, 2, flags, model=MODEL))
        logdir = os.path.join(self.root, "faulty")
        ckpt_dir = os.path.join(logdir, "checkpoints")

        tasks = start_cluster(logdir, 2, flags, model=MODEL)
        try:
            deadline = time.monotonic() + 180
            while not tf.train.latest_checkpoint(ckpt_dir):
                self.assertLess(time.monotonic(), deadline, tasks[0].output[-3000:])
                time.sleep(0.1)
            tasks[1].proc.kill()
            assert_survivor_names_the_loss(self, tasks[0], time.monotonic(), "lost task 1",
                                           BOUND_S)
        finally:
            for t in tasks:
                t.stop()
        step = int(tf.train.latest_checkpoint(ckpt_dir).rsplit("-", 1)[1])
        self.assertLess(step, FAULT_STEPS, "the run ended before the kill; nothing to resume")

        kill_at = step + 15  # After the rerun's first checkpoint, step + 10.
        where = addresses(2)
        kill_chief = {SIGNAL_ENV: f"fetched:{kill_at}=SIGKILL"}
        tasks = [Task(logdir, flags, tf_config(where, 0), kill_chief, model=MODEL),
                 Task(logdir, flags, tf_config(where, 1), model=MODEL)]
        try:
            self.assertEqual(-9, tasks[0].wait(timeout=240), tasks[0].output[-3000:])
            self.assertIn(f"Resuming training from step {step}", tasks[0].output)
            assert_survivor_names_the_loss(self, tasks[1], time.monotonic(), "lost the chief",
                                           BOUND_S)
        finally:
            for t in tasks:
                t.stop()

        rerun = start_cluster(logdir, 2, flags, model=MODEL)
        rerun[0].wait_for(f"Resuming training from step {step + 10}", timeout=180)
        run_to_end(rerun)
        want, got = _weights(uninterrupted), _weights(logdir)
        self.assertCountEqual(want, got)
        for key in want:
            self.assertAllEqual(want[key], got[key], msg=key)


@pytest.mark.slow
class ReadmeMeshCommandsTest(tf.test.TestCase):
    """The commands of docs/multi_host.md's 'Processes and hosts', run as written.

    Only the interpreter (`.venv/bin/python` -> this one) and the /tmp logdirs (-> a temporary
    directory) are substituted. The `--mode=inspect_model` line is left to readme_test.py,
    which runs every inspect command of the README and the guide.
    """

    def test_readme_commands_train_to_the_end(self):
        with open(os.path.join(REPO, "docs", "multi_host.md"), encoding="utf-8") as f:
            text = f.read()
        section = text.split("\n## Processes and hosts\n", 1)[1]
        section = section.split("\n## ", 1)[0].split("\n### ", 1)[0]  # Not its subsections.
        blocks = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
        self.assertLen(blocks, 2)
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_CONFIG", None)
        for block, logdir in zip(blocks, ("lingvo_lite_mesh", "lingvo_lite_3hosts")):
            block = "\n".join(line for line in block.splitlines()
                               if "--mode=inspect_model" not in line)
            script = block.replace(".venv/bin/python", sys.executable).replace(
                f"/tmp/{logdir}", os.path.join(root, logdir))
            proc = subprocess.run(["bash", "-c", "set -e\n" + script], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=600)
            self.assertEqual(0, proc.returncode, msg=(proc.stdout + proc.stderr)[-3000:])
            ckpt = tf.train.latest_checkpoint(os.path.join(root, logdir, "checkpoints"))
            self.assertTrue(ckpt and ckpt.endswith("ckpt-20"), msg=ckpt)
