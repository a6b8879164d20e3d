"""TensorFlow's cluster machinery in place of ours (issue 45), checked from the outside.

- The start-up agreement: two tasks that publish different values through the coordination
  service's key-value store (`process_group.agree_on`) each see the other's, and tasks whose
  TF_CONFIG lists differ are both refused by `process_group.initialize`; no UDP channel runs.
- A running task (multi-client and single-client) has no UDP socket: its sockets are read from
  /proc/<pid>/fd and /proc/<pid>/net/udp{,6} (one open port per task, the gRPC server's).
- The fault path never calls os._exit: a trainer whose peer is killed mid-run ends with one
  line, exit status 1 and its lock removed, and the only os._exit it reaches is trainer.py's
  normal exit (`_exit_promptly`, after `runner.main` returned).
Processes are started here on 127.0.0.1 and stopped by PID.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import tensorflow as tf
from conftest import REPO
from multi_client_helpers import Task, addresses, report_time, tf_config

pytestmark = pytest.mark.slow

FLAGS = ["--num_replicas=2", "--num_cells=1", "--num_micro_batches=2",
         "--model_params_override=train.save_interval_steps : 10"]
SIGNAL_ENV = "LINGVO_LITE_TEST_SIGNAL_AT"

AGREE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from lingvo_lite.distributed import cluster_spec, heartbeats, process_group
    addresses, index, value = json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        process_group.initialize(addresses, index, watch=False)
    except cluster_spec.ClusterSpecError as e:
        print("REFUSED", e, flush=True)
        sys.exit(3)
    print("AGREE", json.dumps(process_group.agree_on("flags", value)),
          "UDP", heartbeats.channel() is not None, flush=True)
""")

# trainer.py with os._exit recorded: prints the function that called it, then exits.
RECORD_EXIT = textwrap.dedent("""
    import os, runpy, sys, traceback
    real_exit = os._exit

    def recorded_exit(status):
        caller = traceback.extract_stack()[-2].name
        sys.stderr.write(f"OS_EXIT from {caller} status {status}\\n")
        sys.stderr.flush()
        real_exit(status)

    os._exit = recorded_exit
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
""")


def _run_pair(values: list[str], configs: list[list[str]]) -> list[tuple[int, str]]:
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, REPO, json.dumps(configs[i]),
                               str(i), values[i]], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        return [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(match.group(1))
    return inodes


def _table_inodes(pid: int, table: str) -> set[str]:
    """Inodes of /proc/<pid>/net/<table> (udp, udp6, tcp, tcp6): column 10 of each row."""
    with open(f"/proc/{pid}/net/{table}") as f:
        return {line.split()[9] for line in list(f)[1:] if line.strip()}


class ClusterMachineryTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="cluster_machinery_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.tasks: list[Task] = []
        self.addCleanup(lambda: [t.stop() for t in self.tasks])

    def test_start_up_agreement_goes_through_the_coordination_service(self):
        where = addresses(2)
        (s0, out0), (s1, out1) = _run_pair(["--max_steps=5", "--max_steps=7"], [where, where])
        self.assertEqual((0, 0), (s0, s1), out0 + out1)
        self.assertIn('AGREE {"1": "--max_steps=7"} UDP False', out0)
        self.assertIn('AGREE {"0": "--max_steps=5"} UDP False', out1)
        (s0, out0), (s1, out1) = _run_pair(["a", "a"], [where, where])
        self.assertIn("AGREE {} UDP False", out0 + out1)
        # TF_CONFIG lists that differ (task 1's own address): both refuse in one line.
        other = [where[0], addresses(1)[0]]
        results = _run_pair(["a", "a"], [where, other])
        for status, out in results:
            self.assertEqual(3, status, out)
            self.assertIn("REFUSED TF_CONFIG differs between the processes", out)

    def test_a_running_task_has_no_udp_socket(self):
        single = ["--num_replicas=1", "--num_cells=2",
                  "--model_params_override=train.save_interval_steps : 10"]
        for mode, flags, model in (
                ("multi_client", FLAGS, "tests.multi_client_models.TinyMlpBnNoisy"),
                ("single_client", single, "tests.testdata_models.TinyMlp")):
            with self.subTest(mode):
                self._check_sockets(mode, flags, model)

    def _check_sockets(self, mode: str, flags: list[str], model: str) -> None:
        where = addresses(2)
        logdir = os.path.join(self.root, mode)
        self.tasks = [Task(logdir, flags + ["--max_steps=100000"], tf_config(where, i),
                           model=model) for i in (0, 1)]
        self.tasks[0].wait_for("Saved checkpoint", timeout=240)  # Both tasks are training.
        time.sleep(3.0)  # The start-up channel closes within a few seconds of the agreement.
        for i, t in enumerate(self.tasks):
            pid = t.proc.pid
            sockets = _socket_inodes(pid)
            udp = sockets & (_table_inodes(pid, "udp") | _table_inodes(pid, "udp6"))
            self.assertEqual(set(), udp, f"task {i} has UDP sockets")
            port = int(where[i].rpartition(":")[2])
            with open(f"/proc/{pid}/net/tcp6") as f6, open(f"/proc/{pid}/net/tcp") as f4:
                rows = [line.split() for line in list(f4)[1:] + list(f6)[1:]]
            listening = {int(r[1].rpartition(":")[2], 16) for r in rows
                         if r[3] == "0A" and r[9] in sockets}
            if mode == "multi_client":
                self.assertEqual({port}, listening, f"task {i}: one port, the gRPC server's")
            else:  # The one client also serves TensorFlow's 'localhost' job (its own port).
                self.assertIn(port, listening, f"task {i} serves its gRPC port")
        for t in self.tasks:
            t.stop()

    def test_the_fault_path_leaves_through_the_normal_exit(self):
        where = addresses(2)
        logdir = os.path.join(self.root, "run")
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        procs = []
        for i in (0, 1):
            task_env = dict(env, TF_CONFIG=tf_config(where, i))
            if i == 1:
                task_env[SIGNAL_ENV] = "fetched:15=SIGKILL"
            procs.append(subprocess.Popen(
                [sys.executable, "-c", RECORD_EXIT, os.path.join(REPO, "trainer.py"),
                 "--model=tests.multi_client_models.TinyMlpBnNoisy", f"--logdir={logdir}",
                 *FLAGS, "--max_steps=100"], cwd=REPO, env=task_env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))
        try:
            procs[1].wait(timeout=300)
            killed_at = time.monotonic()
            status = procs[0].wait(timeout=90)
            report_time("multi-client worker SIGKILL (os._exit recorded)",
                        time.monotonic() - killed_at)
            out = procs[0].stdout.read()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.assertEqual(-9, procs[1].returncode)
        self.assertEqual(1, status, out[-3000:])
        errors = [line for line in out.splitlines() if line.startswith("trainer.py: error:")]
        self.assertLen(errors, 1, out[-3000:])
        self.assertIn("lost task 1", errors[0])
        self.assertEqual(["OS_EXIT from _exit_promptly status 1"],
                         re.findall(r"OS_EXIT from \w+ status \d+", out), out[-3000:])
        self.assertFalse(os.path.exists(os.path.join(logdir, "trainer.lock")))
        self.assertNotIn("Traceback", out)


if __name__ == "__main__":
    tf.test.main()
