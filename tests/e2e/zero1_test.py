"""ZeRO-1 (train.shard_optimizer_state): the same weights as the unsharded run, 1/R of the slots.

References: the unsharded run of the same task (the optimizers' fused kernels on whole
weights), and for one case an independent computation: a plain GradientTape over the layers'
FProp on the whole batch and the momentum rule in numpy.
"""

from __future__ import annotations

import io
import math
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized
from conftest import launch_trainer, stop_processes
from multi_client_helpers import Task, run_to_end, start_cluster
from pipeline_models import BATCH, IN_DIM, _loss, _proj, input_shapes, make_batch

from lingvo_lite.analysis import memory_model, planner
from lingvo_lite.core import fprop_context
from lingvo_lite.distributed import collectives
from lingvo_lite.layers import composite
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.tasks import optimizers, pipelined_task, sharded_optimizer
from lingvo_lite.training import options, runner

LEARNING_RATE = 0.05
MOMENTUM = optimizers.SGD.Params().Set(momentum=0.9)
ADAM = optimizers.Adam.Params()
SLOT = "model/optimizer."  # Checkpoint keys of the optimizer slots.
WIDTH = 10  # The softmax's 5 biases and 10 x 5 weights do not split evenly over R = 4.


def make_task(num_replicas: int, num_cells: int, optimizer, sharded: bool, **train):
    p = pipelined_task.PipelinedTask.Params().Set(name="task")
    p.network = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", num_cells=num_cells, num_replicas=num_replicas, num_micro_batches=1,
        layers=[_proj("p0", IN_DIM, WIDTH), _proj("p1", WIDTH, WIDTH), _loss(WIDTH)],
        remat="never", input_shapes=input_shapes(), random_seed=7)
    p.train.Set(learning_rate=LEARNING_RATE, optimizer=optimizer,
                shard_optimizer_state=sharded, **train)
    task = p.Instantiate()
    task.prepare_for_training()
    return task, tf.function(task.TrainStep, autograph=False)


def train(step_fn, first: int, last: int) -> None:
    for step in range(first, last):
        step_fn(make_batch(seed=step))


def values(task) -> list[np.ndarray]:
    return [v.numpy() for v in task.trainable_vars()]


class ShardedTrainingTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters((2, 1, "momentum"), (4, 2, "adam"))
    def test_weights_equal_unsharded_and_slots_hold_one_rth(self, num_replicas, num_cells,
                                                              optimizer):
        opt = {"momentum": MOMENTUM, "adam": ADAM}[optimizer]
        # With Adam, also clipping to a global norm below the gradients' (so it scales every
        # step) and an L2 term: both need the whole gradient, which every replica still has.
        extra = (dict(clip_gradient_norm_to_value=0.05, l2_regularizer_weight=0.01)
                 if optimizer == "adam" else {})
        plain, plain_step = make_task(num_replicas, num_cells, opt, sharded=False, **extra)
        task, step = make_task(num_replicas, num_cells, opt, sharded=True, **extra)
        for a, b in zip(plain.vars.Flatten(), task.vars.Flatten()):
            self.assertAllEqual(a, b)  # The same initial weights.
        train(plain_step, 0, 3)
        train(step, 0, 3)
        if extra:
            self.assertGreater(float(plain_step(make_batch(seed=3))["grad_norm"]), 0.05)
            step(make_batch(seed=3))
        for a, b in zip(values(plain), values(task)):
            self.assertAllClose(a, b, rtol=1e-6, atol=1e-7)
        for var, copy in task.replica_variable_pairs():
            self.assertAllEqual(var, copy)  # Every replica gathered the same weights.
        # Each device holds, per weight of its cell, ceil(n / R) elements of every
        # weight-sized slot (scalar slots, Adam's step count, whole).
        rules = task.optimizer
        sizes = {}
        for v in task._sharded.slot_variables():
            sizes.setdefault(tf.DeviceSpec.from_string(v.device).device_index, []).append(
                v.shape.num_elements())
        self.assertLen(sizes, num_replicas * num_cells)
        for row in task.network.mesh:
            for k, device in enumerate(row):
                want = [1 if name in rules._scalar_slots()
                        else math.ceil(v.shape.num_elements() / num_replicas)
                        for v in task.network.cell_variables(k) if v.trainable
                        for name in rules._slot_names()]
                self.assertEqual(sorted(want), sorted(
                    sizes[tf.DeviceSpec.from_string(device).device_index]), msg=device)
        unsharded = sum(v.shape.num_elements() for v in plain.optimizer.slot_variables().values()
                        if v.shape.rank) / (num_replicas * num_cells)
        sharded = sum(n for got in sizes.values() for n in got if n > 1) / len(sizes)
        self.assertBetween(sharded / unsharded, 1 / num_replicas, 1.1 / num_replicas)
        # The memory model: 1/R of the weight-sized slots of each cell, padding not counted.
        predicted = planner.predict_memory(
            task.network.params, num_cells, num_replicas, 1, "gpipe", "never",
            memory_model.optimizer_slots(opt), shard_optimizer_state=True)
        for k, device in enumerate(task.network.mesh[0]):
            measured = 4 * sum(n for n in sizes[tf.DeviceSpec.from_string(device).device_index]
                               if n > 1)
            padding = 4 * (num_replicas - 1) * len(rules._slot_names()) * len(
                task.network.cell_variables(k))
            self.assertBetween(measured - predicted[k].optimizer_slots, 0, padding)

    def test_momentum_equals_plain_tensorflow_and_numpy(self):
        task, step = make_task(2, 2, MOMENTUM, sharded=True)
        layers = task.network.layers
        weights = [tf.Variable(v) for v in task.network.vars.Flatten()]
        accum = [np.zeros(v.shape, np.float32) for v in weights]
        for s in range(3):
            batch = make_batch(seed=s)
            step(batch)
            theta = task.network.theta.Pack(weights)
            with fprop_context.fprop_context(training=True, step_seed=s, example_offset=0):
                with tf.GradientTape() as tape:
                    loss = composite.chain_fprop(layers, theta.layers, batch).loss
            for i, g in enumerate(tape.gradient(loss, weights)):
                accum[i] = 0.9 * accum[i] + g.numpy()
                weights[i].assign(weights[i].numpy() - LEARNING_RATE * accum[i])
        for ref, got in zip(weights, task.network.vars.Flatten()):
            self.assertAllClose(ref, got, rtol=1e-5, atol=1e-6)
        self.assertEqual(BATCH, make_batch().x.shape[0])

    def test_checkpoint_is_unsharded_and_resumes_with_any_replicas(self):
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        whole, whole_step = make_task(2, 1, ADAM, sharded=True)
        train(whole_step, 0, 4)  # The uninterrupted run.
        first, first_step = make_task(2, 1, ADAM, sharded=True)
        train(first_step, 0, 2)
        path = tf.train.Checkpoint(model=first.checkpoint_variables()).save(
            os.path.join(root, "ckpt"))
        plain, _ = make_task(2, 1, ADAM, sharded=False)
        plain_path = tf.train.Checkpoint(model=plain.checkpoint_variables()).save(
            os.path.join(root, "plain"))  # The unsharded layout: the same keys and shapes.
        self.assertEqual(tf.train.list_variables(plain_path), tf.train.list_variables(path))
        for replicas, cells, sharded in ((1, 1, False), (4, 1, True)):
            task, step = make_task(replicas, cells, ADAM, sharded)
            tf.train.Checkpoint(model=task.checkpoint_variables()).restore(
                path).assert_existing_objects_matched()
            task.sync_replicas()
            train(step, 2, 4)
            for a, b in zip(values(whole), values(task)):
                self.assertAllClose(a, b, rtol=1e-5, atol=1e-6, msg=(replicas, sharded))


class RanksAndRefusalsTest(tf.test.TestCase):

    def test_ranks_are_where_collective_gather_puts_each_member(self):
        devices = ["/device:CPU:5", "/device:CPU:2", "/device:CPU:4"]
        gather = collectives.AllGather(devices)
        out = gather([tf.constant([float(i)]) for i in range(3)])
        ranks = collectives.collective_ranks(devices)
        self.assertEqual([2, 0, 1], ranks)  # CPU:2, CPU:4, CPU:5.
        for o in out:
            self.assertAllEqual([float(ranks.index(r)) for r in range(3)], o)

    def test_refusals_are_one_line(self):
        class Lars(optimizers.SGD):  # Scales each weight's step by its norm: not element-wise.
            update_shard = optimizers.BaseOptimizer.update_shard

        cases = [(Lars.Params().Instantiate(), 2, False, "has no element-wise update"),
                 (optimizers.Adam.Params().Instantiate(), 1, False, "nothing to shard"),
                 (optimizers.Adam.Params().Instantiate(), 2, True, "strategy")]
        for opt, replicas, strategy, message in cases:
            with self.assertRaisesRegex(ValueError, message) as e:
                sharded_optimizer.check_shardable(opt, replicas, strategy)
            self.assertNotIn("\n", str(e.exception))
        out = io.StringIO()
        status = runner.main(options.RunOptions(
            model="testdata_models.TinyMlp", model_modules=("testdata_models",), max_steps=1,
            logdir=tempfile.mkdtemp(), num_replicas=1, shard_optimizer_state=True),
            out=out, err=out)
        self.assertNotEqual(0, status)
        lines = [line for line in out.getvalue().splitlines() if "error" in line]
        self.assertLen(lines, 1, out.getvalue())
        self.assertIn("--num_replicas >= 2", lines[0])


class TrainerFlagTest(tf.test.TestCase):

    def test_trainer_flag_ends_on_the_unsharded_weights(self):
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        # trainer.py with the flag, beside the unsharded run of the same model in this process.
        proc = launch_trainer("--model=tests.testdata_models.TinyMlp", "--num_replicas=2",
                              "--num_cells=2", "--max_steps=4", f"--logdir={root}/sharded",
                              "--shard_optimizer_state", stderr=subprocess.STDOUT)
        try:
            out = io.StringIO()
            self.assertEqual(0, runner.main(options.RunOptions(
                model="testdata_models.TinyMlp", model_modules=("testdata_models",),
                max_steps=4, logdir=f"{root}/plain", num_replicas=2, num_cells=2),
                out=out, err=out), out.getvalue())
            log, _ = proc.communicate(timeout=240)
        finally:
            stop_processes([proc])
        self.assertEqual(0, proc.returncode, log)
        with open(f"{root}/sharded/params.txt") as f:
            self.assertIn("train.shard_optimizer_state : True", f.read())
        paths = [tf.train.latest_checkpoint(f"{root}/{name}/checkpoints")
                 for name in ("sharded", "plain")]
        keys = [sorted(k for k, _ in tf.train.list_variables(p)) for p in paths]
        self.assertEqual(keys[1], keys[0])
        for key in keys[0]:
            if key.startswith(("model/", "optimizer/")):
                self.assertAllClose(tf.train.load_variable(paths[1], key),
                                    tf.train.load_variable(paths[0], key),
                                    rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
class MultiClientTest(tf.test.TestCase):

    def test_two_tasks_end_on_the_weights_and_slots_of_one_unsharded_process(self):
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        # N=2 tasks, one replica each (R=2), K=2, Adam (TinyMlpBnNoisy's): 2 steps, then
        # resumed (each task slices its shards from the whole slots) to step 4; against one
        # unsharded process on the same global batches (R=1, K=1, the same 2 x T
        # micro-batches): no collective, no shard.
        common = ["--deterministic", "--model_params_override=train.save_interval_steps : 2"]
        cluster = common + ["--num_replicas=2", "--num_cells=2", "--num_micro_batches=2",
                            "--cluster_mode=multi_client", "--shard_optimizer_state"]
        tasks = start_cluster(f"{root}/sharded", 2, cluster + ["--max_steps=2"])
        single = Task(f"{root}/single", common + [
            "--max_steps=4", "--num_replicas=1", "--num_cells=1", "--num_micro_batches=4"], None)
        run_to_end(tasks)
        resumed = start_cluster(f"{root}/sharded", 2, cluster + ["--max_steps=4"])
        run_to_end(resumed + [single])
        self.assertIn("(global step 2)", resumed[0].output)
        want, got = checkpoint(f"{root}/single"), checkpoint(f"{root}/sharded")
        self.assertEqual(sorted(want), sorted(got))
        slots = [k for k in want if k.startswith(SLOT) and want[k].ndim]
        self.assertNotEmpty(slots)
        self.assertTrue(any(".Sm/" in k for k in slots) and any(".Sv/" in k for k in slots),
                        slots)  # Adam's m and v (and its step count t, a scalar).
        for key in want:
            self.assertAllClose(want[key], got[key], rtol=1e-5, atol=1e-7, msg=key)
        # Each task's devices hold ceil(n / 2) elements of every m and v (and t, a scalar).
        want_slots = [v for k, v in want.items() if k.startswith(SLOT)]
        elements = sum(math.ceil(v.size / 2) if v.ndim else 1 for v in want_slots)
        for i, task in enumerate(tasks):
            line = next(x for x in task.lines if "ZeRO-1 optimizer slot shards" in x)
            held = re.findall(r"(/job:worker/replica:0/task:\d+/device:CPU:\d+): "
                              r"(\d+) variables, (\d+) elements", line)
            self.assertLen(held, 2, line)  # K=2 devices.
            self.assertEqual({f"/task:{i}/"}, {re.search(r"/task:\d+/", d)[0]
                                               for d, _, _ in held})
            self.assertEqual(len(want_slots), sum(int(n) for _, n, _ in held))
            self.assertEqual(elements, sum(int(e) for _, _, e in held))


def checkpoint(logdir: str) -> dict[str, np.ndarray]:
    path = tf.train.latest_checkpoint(os.path.join(logdir, "checkpoints"))
    return {k: tf.train.load_variable(path, k) for k, _ in tf.train.list_variables(path)
            if k.startswith("model/")}  # Weights, batch-norm statistics, slots.


if __name__ == "__main__":
    tf.test.main()
