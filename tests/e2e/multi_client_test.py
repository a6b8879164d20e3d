"""Multi-client trainer.py (issue 37, item 1): N tasks on 127.0.0.1, each its own client.

N = 3 tasks, K = 2 cells, one replica per task (R = N), T = 2, on a model with seeded input
noise, batch norm and dropout (tests/multi_client_models.py):
- the chief's final weights equal one process trained on the same global batches: R=1, K=1,
  T = R x 2 (the same micro-batches; an independent computation: no collective, no shard) at
  rtol 1e-5, and bit for bit one process with the same R x K mesh (--deterministic: the same
  collective ring sums in the same order);
- each task preprocessed only its shard: the ids its input logged all sit in its part of
  their global batch (positions from the unsharded input, computed here), and cover it;
- only the chief wrote the run's files; every task saved its input position.
Two tasks: against one process with K = 2 and ZeRO-1 (zero1_test.py); with K = 1, bit for bit
an uninterrupted two-task run after two faults (multi_client_faults_test.py).
Keras (item 4): `PipelinedModel.fit` in both tasks of a TF_CONFIG cluster (K=2 each, dropout,
Adam) ends on the weights of plain `keras.Sequential.fit` in this process (rtol 1e-5).
Processes are stopped by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from conftest import REPO, stop_processes
from multi_client_helpers import Task, addresses, run_to_end, start_cluster, tf_config, weights
from multi_client_models import (
    BATCH_SIZE,
    READ_LOG_ENV,
    LoggedNoisyInput,
    keras_fit,
    keras_sequential,
)

STEPS = 6
T = 2

KERAS_TASK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    from lingvo_lite.distributed import process_group
    process_group.from_tf_config(num_logical_cpus=2)  # Before any TensorFlow op.
    import numpy as np
    from lingvo_lite.keras import PipelinedModel
    sys.path.insert(0, sys.argv[1] + "/tests")
    import multi_client_models as m
    from lingvo_lite.keras import multi_worker
    part, sizes = multi_worker.local_part, []
    multi_worker.local_part = lambda *t: sizes.append(part(*t)[0].shape[0]) or part(*t)
    model = PipelinedModel(m.keras_sequential(), num_cells=2)
    m.keras_fit(model)
    print("task", process_group.current().index, "trained parts of", sorted(set(sizes)))
    np.savez(sys.argv[2], *model.get_weights())
""")


@pytest.mark.slow
class MultiClientTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = tempfile.mkdtemp(prefix="multi_client_")
        self.addCleanup(shutil.rmtree, self.root, ignore_errors=True)

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def test_n_tasks_train_the_weights_of_one_process_each_on_its_shard(self):
        n, k = 3, 2
        common = [f"--max_steps={STEPS}", f"--num_micro_batches={T}", "--deterministic",
                  "--model_params_override=train.save_interval_steps : 3"]
        os.makedirs(self._dir("reads"))
        tasks = start_cluster(self._dir("cluster"), n, common + [
            f"--num_replicas={n}", f"--num_cells={k}", "--cluster_mode=multi_client"],
            env={READ_LOG_ENV: self._dir("reads")})
        singles = [
            # One device, the same micro-batches: R x T of them.
            Task(self._dir("single"), common + [
                "--num_replicas=1", "--num_cells=1", f"--num_micro_batches={n * T}"], None),
            # One process, the same mesh of R x K devices.
            Task(self._dir("mesh"), common + [f"--num_replicas={n}", f"--num_cells={k}"], None),
        ]
        run_to_end(tasks)
        run_to_end(singles)

        want, got = weights(self._dir("single")), weights(self._dir("cluster"))
        self.assertCountEqual(want, got)
        for key in want:
            self.assertAllClose(want[key], got[key], rtol=1e-5, atol=1e-6, msg=key)
        # The chief alone wrote the run's files; each task its input position.
        self.assertEqual(["checkpoints", "input_positions", "model_analysis.txt", "params.txt",
                          "train"], sorted(os.listdir(self._dir("cluster"))))
        self.assertEqual([f"task_{i}" for i in range(n)], sorted(os.listdir(
            os.path.join(self._dir("cluster"), "input_positions", f"{n}_tasks"))))
        want = weights(self._dir("mesh"))
        for key in want:
            self.assertAllEqual(want[key], got[key], msg=key)
        self._assert_each_task_read_its_shard(tasks)

    def _assert_each_task_read_its_shard(self, tasks: list[Task]) -> None:
        n = len(tasks)
        shard = BATCH_SIZE // n
        # Where each example sits in the unsharded stream (1024 examples: one epoch covers
        # the steps trained and what the tasks' input pipelines read ahead).
        params = LoggedNoisyInput.Params().Set(name="train", split="train", num_examples=1024,
                                               batch_size=BATCH_SIZE)
        position = {}
        for b, batch in zip(range(1024 // BATCH_SIZE), params.Instantiate().dataset()):
            for slot, example_id in enumerate(batch.id.numpy()):
                position[int(example_id)] = (b, slot)
        for i, task in enumerate(tasks):
            with open(os.path.join(self._dir("reads"), f"{task.proc.pid}.txt")) as f:
                ids = [int(line) for line in f]
            self.assertLen(set(ids), len(ids), "an example was preprocessed twice")
            parts = {position[x][1] // shard for x in ids}
            self.assertEqual({i}, parts, f"task {i} preprocessed another task's examples")
            mine = {(b, s) for b in range(STEPS) for s in range(i * shard, (i + 1) * shard)}
            self.assertLessEqual(mine, {position[x] for x in ids})
            self.assertIn(f"Task {i} read {STEPS * shard} examples", task.output)

    def test_keras_fit_in_every_task_of_a_cluster_equals_one_process(self):
        where = addresses(2)
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
        procs = [subprocess.Popen(
            [sys.executable, "-c", KERAS_TASK, REPO, self._dir(f"keras_{i}.npz")],
            env=dict(env, TF_CONFIG=tf_config(where, i)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True) for i in (1, 0)]
        try:
            outs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            stop_processes(procs)
        for i, (p, out) in zip((1, 0), zip(procs, outs)):
            self.assertEqual(0, p.returncode, msg=out[-3000:])
            self.assertIn(f"task {i} trained parts of [4]", out)  # Of each batch of 8.
        plain = keras_sequential()
        keras_fit(plain)
        for i in (0, 1):
            got = np.load(self._dir(f"keras_{i}.npz"))
            want = plain.get_weights()
            self.assertLen(got.files, len(want))
            for k, w in enumerate(want):
                self.assertAllClose(w, got[f"arr_{k}"], rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
    tf.test.main()
