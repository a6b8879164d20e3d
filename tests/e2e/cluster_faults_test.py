"""Faults of a two-process run (TF_CONFIG on 127.0.0.1), each answered in one line, no hang.

Issue 39's held-out attack: a taken port gave a gRPC traceback and the other task hung past
150 s; two tasks with index 0, a mismatched address or a mismatched task count left processes
running after 200 s; a worker stopped with SIGSTOP made the chief wait forever (its port still
accepted connections); SIGTERM to the chief left its trainer.lock. Now each task answers small
UDP messages on its port number before TensorFlow loads (distributed/heartbeats.py), then is
watched over its gRPC port (single-client mode, as here):
- the configuration faults end both processes with one `trainer.py: error:` line each, exit 1,
  no traceback, within the bound (they are found in seconds);
- a stopped worker is lost like a dead one (LOST_AFTER_S = 10 s without a gRPC answer);
- SIGTERM to the chief: checkpoint, exit 143, lock released; the worker ends too.
Only the processes started here are stopped, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
import unittest

import pytest
from cluster_test import _free_ports
from multi_client_helpers import Task, report_time, tf_config

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

MODEL = "tests.testdata_models.TinyMlp"
BOUND_S = 90.0  # Generous: the faults are found within seconds of both processes starting.
LOST_BOUND_S = 60.0  # A stopped task: found after LOST_AFTER_S = 10 s without an answer.


class ClusterFaultsTest(unittest.TestCase):

    def setUp(self):
        self.root = tempfile.mkdtemp(prefix="cluster_faults_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.tasks: list[Task] = []
        self.addCleanup(lambda: [t.stop() for t in self.tasks])

    def _start(self, tf_configs: list[str], *flags: str) -> list[Task]:
        logdir = os.path.join(self.root, "run")
        self.tasks = [Task(logdir, ["--num_replicas=1", "--num_cells=2", *flags], c,
                           model=MODEL) for c in tf_configs]
        return self.tasks

    def _assert_each_ends_with_one_line(self, tasks: list[Task], *wanted: str) -> None:
        started = time.monotonic()
        for task, text in zip(tasks, wanted):
            status = task.wait(timeout=BOUND_S + 60)
            report_time(text, time.monotonic() - started)
            out = task.output
            self.assertEqual(1, status, msg=out[-3000:])
            self.assertNotIn("Traceback", out)
            errors = task.errors()
            self.assertEqual(1, len(errors), msg=out[-3000:])
            self.assertIn(text, errors[0])
        self.assertLess(time.monotonic() - started, BOUND_S)

    def test_taken_port_ends_both_tasks_with_one_line(self):
        for taken in (1, 0):  # Another program holds the worker's, then the chief's port.
            with self.subTest(taken=taken), socket.socket() as holder:
                holder.bind(("127.0.0.1", 0))
                holder.listen()
                port = holder.getsockname()[1]
                addresses = [f"127.0.0.1:{_free_ports(1)[0]}"] * 2
                addresses[taken] = f"127.0.0.1:{port}"
                tasks = self._start([tf_config(addresses, 0), tf_config(addresses, 1)],
                                    "--max_steps=4")
                self._assert_each_ends_with_one_line(
                    [tasks[taken], tasks[1 - taken]],
                    f"address 127.0.0.1:{port} is in use by another program",
                    f"task {taken} (127.0.0.1:{port}) of the cluster could not start")
                for t in tasks:
                    t.stop()

    def test_mismatched_tf_configs_end_both_tasks_with_one_line(self):
        p0, p1, p2 = _free_ports(3)
        two = [f"127.0.0.1:{p0}", f"127.0.0.1:{p1}"]
        cases = {
            "same index": ([tf_config(two, 0), tf_config(two, 0)],
                           "task index 0", "task index 0"),
            "mismatched address": ([tf_config(two, 0), tf_config(
                [f"127.0.0.1:{p0}", f"127.0.0.1:{p2}"], 1)],
                "TF_CONFIG differs between the processes", "TF_CONFIG differs"),
            "mismatched task count": ([tf_config(two, 0), tf_config(
                two + [f"127.0.0.1:{p2}"], 1)],
                "TF_CONFIG differs between the processes", "TF_CONFIG differs"),
        }
        for name, (configs, *wanted) in cases.items():
            with self.subTest(name):
                tasks = self._start(configs, "--max_steps=4")
                self._assert_each_ends_with_one_line(tasks, *wanted)
                for t in tasks:
                    t.stop()

    def test_stopped_worker_is_lost_and_sigterm_to_the_chief_releases_the_lock(self):
        addresses = [f"127.0.0.1:{p}" for p in _free_ports(2)]
        flags = ["--max_steps=100000",
                 "--model_params_override=train.save_interval_steps : 50"]
        lock = os.path.join(self.root, "run", "trainer.lock")

        # SIGSTOP: the worker's kernel still accepts connections, but it answers nothing.
        chief, worker = self._start([tf_config(addresses, 0), tf_config(addresses, 1)],
                                    *flags)
        chief.wait_for("Saved checkpoint", timeout=300)
        os.kill(worker.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        self.assertEqual(1, chief.wait(timeout=LOST_BOUND_S + 60), msg=chief.output[-3000:])
        report_time("single-client worker SIGSTOP", time.monotonic() - stopped_at)
        self.assertLess(time.monotonic() - stopped_at, LOST_BOUND_S)
        self.assertEqual(1, len(chief.errors()), msg=chief.output[-3000:])
        self.assertIn("lost task 1", chief.errors()[0])
        self.assertNotIn("Traceback", chief.output)
        # Only the project's lines: no TensorFlow session-config dump (shown with --tf_logs).
        self.assertNotIn("default session config", chief.output + worker.output)
        self.assertFalse(os.path.exists(lock), "the chief left its lock")
        worker.stop()

        # SIGTERM to the chief: it saves, releases the lock and exits 143; the worker ends.
        addresses = [f"127.0.0.1:{p}" for p in _free_ports(2)]
        chief, worker = self._start([tf_config(addresses, 0), tf_config(addresses, 1)],
                                    *flags)
        chief.wait_for("Resuming training", timeout=300)
        chief.wait_for("step ", timeout=300)
        os.kill(chief.proc.pid, signal.SIGTERM)
        termed_at = time.monotonic()
        self.assertEqual(143, chief.wait(timeout=120), msg=chief.output[-3000:])
        self.assertIn("checkpoint saved", chief.output)
        self.assertNotIn("Traceback", chief.output)
        self.assertFalse(os.path.exists(lock), "the chief left its lock after SIGTERM")
        self.assertEqual(1, worker.wait(timeout=LOST_BOUND_S + 60), msg=worker.output[-3000:])
        report_time("single-client chief SIGTERM, worker's line", time.monotonic() - termed_at)
        self.assertIn("lost the chief", worker.output)


if __name__ == "__main__":
    unittest.main()
