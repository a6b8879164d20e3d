"""A lost task of a Keras TF_CONFIG cluster ends the others in one line (TF's coordination service).

Pairs of tasks on 127.0.0.1 run `PipelinedModel.fit` (the model of multi_client_test's Keras
test). First two pairs at once:
- task 1 of the first pair is killed (kill -9) at step 5 of a long fit: task 0, waiting in a
  collective, ends with exit status 1 within 60 s and exactly one line naming task 1, no
  traceback;
- the second pair trains to the end, but task 0 stays alive for HEARTBEAT_TIMEOUT_S + 3 s after
  task 1 has exited: a finished task is not waited for, so both end with exit status 0.
Processes are stopped by PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import tensorflow as tf
from conftest import REPO
from multi_client_helpers import addresses, report_time, tf_config

from lingvo_lite.distributed import process_group

BOUND_S = 60.0

TASK = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    from lingvo_lite.distributed import process_group
    group = process_group.from_tf_config(num_logical_cpus=2)  # Before any TensorFlow op.
    import keras
    import numpy as np
    sys.path.insert(0, sys.argv[1] + "/tests")
    import multi_client_models as m
    from lingvo_lite.keras import PipelinedModel

    class Mark(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Mark.steps += 1
            if Mark.steps == 5:
                print("task", group.index, "at step 5", flush=True)

    model = PipelinedModel(m.keras_sequential(), num_cells=2)
    x = np.random.default_rng(3).normal(size=(24, 6)).astype(np.float32)
    y = (np.arange(24) % 4).astype(np.int32)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=int(sys.argv[2]), shuffle=False, verbose=0,
              callbacks=[Mark()])
    print("task", group.index, "fit done", flush=True)
    if group.index == 0:
        time.sleep(float(sys.argv[3]))  # Task 1 has long exited: it finished, it is not lost.
""")


class _Proc:
    def __init__(self, config: str, epochs: int, linger_s: float) -> None:
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=config)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TASK, REPO, str(epochs), str(linger_s)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
        self.proc.wait()
        self.ended_at = time.monotonic()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            if self.ended_at is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in:\n{self.output[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        self._reader.join(timeout)
        if self.ended_at is None:
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-3000:]}")
        return self.proc.returncode


@pytest.mark.slow
class KerasClusterFaultsTest(tf.test.TestCase):

    def test_a_killed_task_ends_the_other_in_one_line_a_finished_one_does_not(self):
        killed, normal = addresses(2), addresses(2)
        linger_s = process_group.HEARTBEAT_TIMEOUT_S + 3.0
        procs = {("killed", i): _Proc(tf_config(killed, i), 500, 0.0) for i in (1, 0)}
        procs.update({("normal", i): _Proc(tf_config(normal, i), 2, linger_s) for i in (1, 0)})
        try:
            procs["killed", 1].wait_for("task 1 at step 5", timeout=240)
            procs["killed", 1].proc.kill()  # kill -9, mid-fit.
            killed_at = time.monotonic()
            survivor = procs["killed", 0]
            self.assertEqual(1, survivor.wait(BOUND_S + 5), survivor.output[-3000:])
            report_time("keras worker SIGKILL", survivor.ended_at - killed_at)
            self.assertLess(survivor.ended_at - killed_at, BOUND_S)
            lost = [line.strip() for line in survivor.lines if "lost task" in line]
            # Named at once (its collective failed) or by the coordination service's heartbeats.
            self.assertLen(lost, 1, survivor.output[-3000:])
            self.assertRegex(lost[0], rf"^lingvo_lite: error: task 0 lost task 1 "
                             rf"\({killed[1]}\) of the cluster: it (is gone \(a collective "
                             rf"with it failed\)|sent no heartbeat for "
                             rf"{process_group.HEARTBEAT_TIMEOUT_S:.0f} s \(dead or stopped\)); "
                             rf"rerun every task\.$")
            self.assertEqual(lost[0], survivor.lines[-1].strip())
            self.assertNotIn("Traceback", survivor.output)

            for i in (0, 1):
                self.assertEqual(0, procs["normal", i].wait(240), procs["normal", i].output)
                self.assertIn(f"task {i} fit done", procs["normal", i].output)
            # Task 0 outlived task 1 by more than HEARTBEAT_TIMEOUT_S and was not stopped.
            self.assertGreater(procs["normal", 0].ended_at - procs["normal", 1].ended_at,
                               process_group.HEARTBEAT_TIMEOUT_S)
        finally:
            for p in procs.values():
                if p.proc.poll() is None:
                    p.proc.kill()
                p.proc.wait()

    def test_stopped_or_killed_chief_and_stopped_worker_end_the_other_in_one_line(self):
        faults = {"stop worker": (1, signal.SIGSTOP), "stop chief": (0, signal.SIGSTOP),
                  "kill chief": (0, signal.SIGKILL)}
        where = {name: addresses(2) for name in faults}
        procs = {(name, i): _Proc(tf_config(where[name], i), 500, 0.0)
                 for name in faults for i in (1, 0)}
        try:
            for name, (victim, sig) in faults.items():
                procs[name, victim].wait_for(f"task {victim} at step 5", timeout=240)
                os.kill(procs[name, victim].proc.pid, sig)
                hit_at = time.monotonic()
                survivor = procs[name, 1 - victim]
                self.assertEqual(1, survivor.wait(BOUND_S + 5), survivor.output[-3000:])
                report_time(f"keras {name}", survivor.ended_at - hit_at)
                self.assertLess(survivor.ended_at - hit_at, BOUND_S)
                whom = "the chief, task 0" if victim == 0 else "task 1"
                lost = [line.strip() for line in survivor.lines if " lost " in line]
                self.assertLen(lost, 1, survivor.output[-3000:])
                self.assertRegex(lost[0], rf"^lingvo_lite: error: task {1 - victim} lost "
                                 rf"{whom} \({where[name][victim]}\) of the cluster: .+; "
                                 rf"rerun every task\.$")
                self.assertNotIn("Traceback", survivor.output)
                if sig == signal.SIGSTOP:
                    os.kill(procs[name, victim].proc.pid, signal.SIGCONT)
                procs[name, victim].proc.kill()
        finally:
            for p in procs.values():
                if p.proc.poll() is None:
                    p.proc.kill()
                p.proc.wait()

    def test_a_late_task_is_waited_for_and_other_tf_configs_are_refused(self):
        late, ours, theirs = addresses(2), addresses(2), addresses(1)
        procs = {("late", 0): _Proc(tf_config(late, 0), 1, 0.0)}
        try:
            time.sleep(15.0)  # Task 0 waits in from_tf_config for task 1 to join.
            procs["late", 1] = _Proc(tf_config(late, 1), 1, 0.0)
            # Task 1's own address differs from the one task 0 lists for it.
            procs["other", 0] = _Proc(tf_config(ours, 0), 1, 0.0)
            procs["other", 1] = _Proc(tf_config([ours[0], theirs[0]], 1), 1, 0.0)
            started = time.monotonic()
            for i in (0, 1):
                self.assertEqual(0, procs["late", i].wait(240), procs["late", i].output)
                self.assertIn(f"task {i} fit done", procs["late", i].output)
                other = procs["other", i]
                self.assertNotEqual(0, other.wait(BOUND_S), other.output[-3000:])
                self.assertIn("TF_CONFIG differs between the processes", other.output)
            report_time("keras other TF_CONFIGs", max(
                procs["other", i].ended_at for i in (0, 1)) - started)
        finally:
            for p in procs.values():
                if p.proc.poll() is None:
                    p.proc.kill()
                p.proc.wait()


if __name__ == "__main__":
    tf.test.main()
