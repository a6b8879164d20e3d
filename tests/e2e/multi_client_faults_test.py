"""Faults of a multi-client run (issue 37, item 3): two tasks on 127.0.0.1, R=2, K=1.

One logdir goes through four faults, each landed at an exact step by the victim itself
(`LINGVO_LITE_TEST_SIGNAL_AT=fetched:<step>=SIGKILL|SIGSTOP`, i.e. kill -9 or a stop while
the other task is mid-step): the worker killed, the chief stopped, the chief killed, the worker
stopped. They take both ways a loss is found (a collective that fails at once; TensorFlow's
coordination service, whose heartbeats a stopped task no longer sends) and both wordings (the
chief's, a worker's) of `multi_client.lost_message`; a surviving chief removed its lock.
(Single-client: a killed chief in multiprocess_test.py, a stopped worker in
cluster_faults_test.py.) Each time the survivor ends with exit status 1
and exactly one line naming the lost task, within 60 s of the fault, and the next run of both
resumes from the last checkpoint; the last run ends with the weights of an uninterrupted run,
bit for bit (--deterministic). The uninterrupted run starts its worker late: the chief waits
with a message. Then a worker given other flags than the chief: both refused in one line.
Processes are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
import tensorflow as tf
from multi_client_helpers import (
    Task,
    addresses,
    assert_survivor_names_the_loss,
    report_time,
    run_to_end,
    start_cluster,
    tf_config,
    weights,
)

BOUND_S = 60.0
MAX_STEPS = 50
FLAGS = ["--num_replicas=2", "--num_cells=1", "--num_micro_batches=2", "--deterministic",
         f"--max_steps={MAX_STEPS}", "--model_params_override=train.save_interval_steps : 10"]
SIGNAL_ENV = "LINGVO_LITE_TEST_SIGNAL_AT"


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
class MultiClientFaultsTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="multi_client_faults_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.tasks: list[Task] = []
        self.addCleanup(lambda: [t.stop() for t in self.tasks])

    def test_lost_tasks_end_the_others_in_one_line_and_reruns_resume_exactly(self):
        want_dir = os.path.join(self.root, "uninterrupted")
        where = addresses(2)
        chief = Task(want_dir, FLAGS, tf_config(where, 0))
        self.tasks = [chief]
        chief.wait_for("waiting for task(s) [1] to start", timeout=120)
        self.tasks.append(Task(want_dir, FLAGS, tf_config(where, 1)))
        run_to_end(self.tasks)

        logdir = os.path.join(self.root, "faulty")
        faults = [(1, "SIGKILL", "lost task 1"), (0, "SIGSTOP", "lost the chief"),
                  (0, "SIGKILL", "lost the chief"), (1, "SIGSTOP", "lost task 1")]
        resumed_from = 0
        for run, (victim, sig, wanted) in enumerate(faults):
            step = 10 * run + 15  # Mid-run: after checkpoint 10 * run + 10.
            where = addresses(2)
            self.tasks = [Task(logdir, FLAGS, tf_config(where, i),
                               {SIGNAL_ENV: f"fetched:{step}={sig}"} if i == victim else None)
                          for i in (0, 1)]
            survivor, dead = self.tasks[1 - victim], self.tasks[victim]
            if resumed_from:
                survivor.wait_for(f"Resuming training from step {resumed_from}", timeout=180)
            deadline = time.monotonic() + 240
            while dead.proc.poll() is None and not _stopped(dead.proc.pid):
                self.assertLess(time.monotonic(), deadline, dead.output[-3000:])
                time.sleep(0.05)
            assert_survivor_names_the_loss(self, survivor, time.monotonic(), wanted, BOUND_S)
            if victim == 1:  # The surviving chief released its lock on its way out.
                self.assertFalse(os.path.exists(os.path.join(logdir, "trainer.lock")),
                                 "the chief left its lock behind")
            for t in self.tasks:
                t.stop()
            resumed_from = step - 5
            latest = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
            self.assertTrue(latest.endswith(f"ckpt-{resumed_from}"), latest)
        self.tasks = start_cluster(logdir, 2, FLAGS)
        self.tasks[0].wait_for(f"Resuming training from step {resumed_from}", timeout=180)
        run_to_end(self.tasks)
        want, got = weights(want_dir), weights(logdir)
        self.assertCountEqual(want, got)
        for key in want:
            self.assertAllEqual(want[key], got[key], msg=key)

    def test_a_task_with_other_flags_is_refused_in_one_line(self):
        where = addresses(2)
        logdir = os.path.join(self.root, "mismatch")
        self.tasks = [Task(logdir, FLAGS, tf_config(where, 0)),
                      Task(logdir, FLAGS + ["--max_steps=7"], tf_config(where, 1))]
        started = time.monotonic()
        for t in self.tasks:
            self.assertEqual(1, t.wait(timeout=BOUND_S + 30), msg=t.output[-3000:])
            report_time("multi-client other flags", time.monotonic() - started)
            self.assertLen(t.errors(), 1, msg=t.output[-3000:])
            self.assertIn("the trainer.py command differs between the processes", t.errors()[0])
            self.assertIn("--max_steps=7", t.errors()[0])
            self.assertNotIn("Traceback", t.output)
        self.assertLess(time.monotonic() - started, BOUND_S)


if __name__ == "__main__":
    tf.test.main()
