"""Launching trainer.py tasks of a multi-client cluster on 127.0.0.1 (multi_client*_test.py).

Every process is started here and stopped by its PID (`Task.stop`), never by name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import tensorflow as tf
from cluster_test import _free_ports
from conftest import launch_trainer

MODEL = "tests.multi_client_models.TinyMlpBnNoisy"


def tf_config(addresses: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def addresses(n: int) -> list[str]:
    return [f"127.0.0.1:{p}" for p in _free_ports(n)]


class Task:
    """A trainer process (merged output, read as it comes)."""

    def __init__(self, logdir: str, flags: list[str], config: str | None,
                 env: dict[str, str] | None = None, model: str = MODEL) -> None:
        self.proc = launch_trainer(f"--model={model}", f"--logdir={logdir}", *flags,
                                   stderr=subprocess.STDOUT,
                                   env={"TF_CONFIG": config, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def wait_for(self, text: str, timeout: float, times: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while self.count(text) < times:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} (x{times}) in:\n{self.output[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        status = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # Also ends a stopped (SIGSTOP) process.
        self.proc.wait()
        self._reader.join(timeout=10)

    def errors(self) -> list[str]:
        return [line.strip() for line in self.lines if line.startswith("trainer.py: error:")]


def start_cluster(logdir: str, n: int, flags: list[str],
                  env: dict[str, str] | None = None, model: str = MODEL) -> list[Task]:
    """Tasks 0..n-1 (started last to first), each with its own TF_CONFIG."""
    where = addresses(n)
    tasks = [Task(logdir, flags, tf_config(where, i), env, model) for i in reversed(range(n))]
    return tasks[::-1]


def run_to_end(tasks: list[Task], timeout: float = 300) -> None:
    try:
        for t in tasks:
            status = t.wait(timeout)
            assert status == 0, t.output[-3000:]
    finally:
        for t in tasks:
            t.stop()


def weights(logdir: str) -> dict[str, np.ndarray]:
    path = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
    return {k: tf.train.load_variable(path, k) for k, _ in tf.train.list_variables(path)
            if k.startswith("model/")}


def report_time(what: str, seconds: float) -> None:
    """Prints the time a fault took to its one-line report (read with `pytest -s`)."""
    print(f"\nFAULT-TIME {what}: {seconds:.1f} s", file=sys.stderr, flush=True)


def assert_survivor_names_the_loss(test, survivor: Task, lost_at: float, message: str,
                                   bound_s: float) -> None:
    """`survivor` exits 1 within `bound_s` of `lost_at` with one error line naming the loss
    (`message`) and telling the user to rerun, and no traceback."""
    status = survivor.wait(timeout=bound_s + 30)
    report_time(message, time.monotonic() - lost_at)
    test.assertLess(time.monotonic() - lost_at, bound_s)
    test.assertEqual(1, status, msg=survivor.output[-3000:])
    test.assertLen(survivor.errors(), 1, msg=survivor.output[-3000:])
    test.assertIn(message, survivor.errors()[0])
    test.assertIn("Rerun every process", survivor.errors()[0])
    test.assertNotIn("Traceback", survivor.output)
