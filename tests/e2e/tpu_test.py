"""The TPUStrategy path, without a TPU: device assignment on mock topologies and path choice.

No TPU exists here, so nothing checks that the strategy runs on hardware. What is checked:
- on mock slices built with `tf.tpu.experimental.Topology` (a v3-8-like 2x2 chips x 2 cores,
  a v4-like 2x2x2 chips x 1 core, and a 4x4 chips x 2 cores slice spread over 4 hosts), the
  (replica, cell) -> core assignment against expectations computed here from the mesh shape:
  distinct cores, each replica one aligned block of the expected shape, consecutive cells on
  the same or adjacent chips, and device names from this file's own map of the topology;
- errors name num_cells / num_replicas;
- `placement.choose_path` for each case;
- PipeliningLayer under a stand-in TPUStrategy whose logical core k is a logical CPU: cell k's
  variables are created in logical device k and its ops run there, and its loss and gradients
  equal the ordinary CPU pipeline's;
- trainer.py fails up front with one line when asked for a TPU that does not exist.
"""

from __future__ import annotations

import contextlib
import doctest
import itertools
import os
import subprocess
import sys
import tempfile
from unittest import mock

import numpy as np
import tensorflow as tf
from conftest import REPO, stop_processes
from pipeline_models import WIDTH, _loss, _proj, input_shapes, make_batch

from lingvo_lite.core import fprop_context
from lingvo_lite.distributed import placement, tpu
from lingvo_lite.pipeline import pipelining_layer

RTOL, ATOL = 2e-5, 2e-7


def mock_topology(mesh_shape: list[int], num_tasks: int = 1):
    """A slice whose devices, core fastest, then x, y, z, are dealt to tasks in equal runs.

    Returns the topology and coordinates -> (task, device ordinal within the task).
    """
    x_size, y_size, z_size, cores = mesh_shape
    coords = [(x, y, z, c) for z in range(z_size) for y in range(y_size)
              for x in range(x_size) for c in range(cores)]
    per_task = len(coords) // num_tasks
    owner = {c: (i // per_task, i % per_task) for i, c in enumerate(coords)}
    device_coordinates = np.array(coords, dtype=np.int32).reshape(num_tasks, per_task, 4)
    topology = tf.tpu.experimental.Topology(mesh_shape=mesh_shape,
                                            device_coordinates=device_coordinates)
    return topology, owner


# mesh shape -> {K: the block one replica must use}: all the cores of a chip before a second
# chip, then chips along x before y before z.
EXPECTED_SHAPES = {
    (2, 2, 1, 2): {1: [1, 1, 1, 1], 2: [1, 1, 1, 2], 4: [2, 1, 1, 2], 8: [2, 2, 1, 2]},
    (2, 2, 2, 1): {1: [1, 1, 1, 1], 2: [2, 1, 1, 1], 4: [2, 2, 1, 1], 8: [2, 2, 2, 1]},
    (4, 4, 1, 2): {1: [1, 1, 1, 1], 2: [1, 1, 1, 2], 4: [2, 1, 1, 2], 8: [4, 1, 1, 2],
                   16: [4, 2, 1, 2], 32: [4, 4, 1, 2]},
}
NUM_TASKS = {(2, 2, 1, 2): 1, (2, 2, 2, 1): 1, (4, 4, 1, 2): 4}


class DeviceAssignmentTest(tf.test.TestCase):

    def test_computation_shapes(self) -> None:
        for mesh_shape, expected in EXPECTED_SHAPES.items():
            for num_cells, shape in expected.items():
                self.assertEqual(tpu.computation_shape(list(mesh_shape), num_cells), shape,
                                 (mesh_shape, num_cells))

    def test_every_replica_is_one_block_of_distinct_adjacent_cores(self) -> None:
        for mesh_shape, expected in EXPECTED_SHAPES.items():
            topology, owner = mock_topology(list(mesh_shape), NUM_TASKS[mesh_shape])
            num_cores = int(np.prod(mesh_shape))
            for num_cells, shape in expected.items():
                for num_replicas in sorted({1, 2, num_cores // num_cells} - {0}):
                    if num_replicas * num_cells > num_cores:
                        continue
                    with self.subTest(mesh=mesh_shape, R=num_replicas, K=num_cells):
                        self._check_assignment(topology, owner, shape, num_replicas,
                                               num_cells)

    def _check_assignment(self, topology, owner, shape, num_replicas, num_cells) -> None:
        assignment = tpu.device_assignment(topology, num_replicas, num_cells)
        self.assertEqual(assignment.num_replicas, num_replicas)
        self.assertEqual(assignment.num_cores_per_replica, num_cells)
        block = set(itertools.product(*(range(n) for n in shape)))
        used = []
        for r in range(num_replicas):
            cores = [tuple(int(c) for c in assignment.coordinates(r, k))
                     for k in range(num_cells)]
            used += cores
            origin = tuple(min(c[i] for c in cores) for i in range(4))
            # One whole block of the expected shape, at a multiple of the shape.
            self.assertEqual(set(cores), {tuple(o + b for o, b in zip(origin, offset))
                                          for offset in block})
            self.assertEqual([o % n for o, n in zip(origin, shape)], [0, 0, 0, 0])
            for a, b in zip(cores, cores[1:]):
                hops = sum(abs(a[i] - b[i]) for i in range(3))
                self.assertLessEqual(hops, 1, f"cells on {a} and {b} are not neighbours")
            if num_cells <= topology.mesh_shape[-1]:
                self.assertLen({c[:3] for c in cores}, 1, "cells should share one chip")
        self.assertLen(set(used), num_replicas * num_cells)  # Every (r, k) on its own core.

        mesh = tpu.tpu_mesh(assignment, job="worker")
        self.assertLen(mesh, num_replicas)
        for r, row in enumerate(mesh):
            self.assertLen(row, num_cells)
            for k, name in enumerate(row):
                task, ordinal = owner[tuple(int(c) for c in assignment.coordinates(r, k))]
                self.assertEqual(assignment.tpu_ordinal(replica=r, logical_core=k), ordinal)
                self.assertEqual(name, f"/job:worker/task:{task}/device:TPU:{ordinal}")
        described = placement.describe_mesh(mesh).splitlines()
        self.assertLen(described, num_replicas)
        self.assertIn(f"cell {num_cells - 1} -> {mesh[0][-1]}", described[0])

    def test_errors_name_the_parameter(self) -> None:
        topology, _ = mock_topology([2, 2, 1, 2])
        with self.assertRaisesRegex(ValueError, r"num_cells=3 .*fit: 1, 2, 4, 8\."):
            tpu.computation_shape(topology.mesh_shape, 3)
        with self.assertRaisesRegex(ValueError, r"num_cells=3"):
            tpu.device_assignment(topology, 1, 3)
        with self.assertRaisesRegex(ValueError,
                                    r"num_replicas=3 x num_cells=4 = 12 cores.* only 8"):
            tpu.device_assignment(topology, 3, 4)
        with self.assertRaisesRegex(ValueError, r"num_cells=16 .*fit: 1, 2, 4, 8\."):
            tpu.device_assignment(topology, 1, 16)
        with self.assertRaisesRegex(ValueError, r"num_replicas=0"):
            tpu.device_assignment(topology, 0, 2)
        # 3 chips in a row fit 8 times (x 4 // 3, y 4, 2 cores) on 4x4x2: 9 replicas do not.
        big, _ = mock_topology([4, 4, 1, 2], num_tasks=4)
        self.assertLen(tpu.tpu_mesh(tpu.device_assignment(big, 8, 3)), 8)
        with self.assertRaisesRegex(ValueError, r"num_replicas=9: only 8 blocks of num_cells=3"):
            tpu.device_assignment(big, 9, 3)

    def test_chain_order_steps_one_axis_at_a_time(self) -> None:
        for shape in ([2, 2, 1, 2], [4, 2, 2, 1], [3, 3, 1, 2]):
            order = tpu.chain_order(shape)
            self.assertEqual(set(order), set(itertools.product(*(range(n) for n in shape))))
            for a, b in zip(order, order[1:]):
                self.assertEqual(sum(abs(i - j) for i, j in zip(a, b)), 1, (shape, a, b))

    def test_docstring_example_runs(self) -> None:
        result = doctest.testmod(tpu, optionflags=doctest.NORMALIZE_WHITESPACE)
        self.assertGreater(result.attempted, 0)
        self.assertEqual(result.failed, 0)

    def test_no_tpu_is_one_clear_value_error(self) -> None:
        with self.assertRaises(ValueError) as raised:
            tpu.create_tpu_strategy(2, 4, tpu="")
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        for text in ("Cannot connect to a TPU", "Please provide a TPU Name", "--tpu=<name>",
                     "--tpu=local", "placement 'cpu' or 'gpu'"):
            self.assertIn(text, message)


class _StandInExtended:
    """The parts of TPUExtended the pipeline uses; logical core k of replica r is a CPU.

    As inside a TPU replica, entering logical device k also places ops on its core (here
    the replica-0 CPU standing for it); `stack` is TPUExtended's `_logical_device_stack`.
    """

    def __init__(self, cores: list[list[str]]) -> None:
        self.cores = cores  # cores[r][k]
        self.stack = [0]

    @contextlib.contextmanager
    def experimental_logical_device(self, k: int):
        if k >= len(self.cores[0]):
            raise ValueError(f"`logical_device_id` not in range (was {k})")
        self.stack.append(k)
        try:
            with tf.device(self.cores[0][k]):
                yield
        finally:
            self.stack.pop()

    @property
    def worker_devices(self) -> tuple[str, ...]:
        return tuple(row[self.stack[-1]] for row in self.cores)


class _StandInStrategy:
    def __init__(self, cores: list[list[str]]) -> None:
        self.extended = _StandInExtended(cores)


def tiny_layers() -> list:
    return [_proj("p0", 6, WIDTH), _proj("p1", WIDTH, WIDTH), _proj("p2", WIDTH, WIDTH),
            _loss(WIDTH)]


def tiny_pipeline(placement_name: str, num_replicas: int = 1, num_cells: int = 2):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=tiny_layers(), num_cells=num_cells, num_micro_batches=2,
        remat="always", input_shapes=input_shapes(), random_seed=7,
        num_replicas=num_replicas, placement=placement_name).Instantiate()


class PipelineUnderTPUStrategyTest(tf.test.TestCase):
    """Cores: replica 0's logical cores 0 and 1 are CPU:4 and CPU:5 (replica 1: 6, 7)."""

    CORES = [["/device:CPU:4", "/device:CPU:5"], ["/device:CPU:6", "/device:CPU:7"]]

    def _stand_in(self):
        strategy = _StandInStrategy(self.CORES)
        return strategy, mock.patch.object(tpu, "current_tpu_strategy", return_value=strategy)

    def test_no_strategy_outside_a_tpu_strategy(self) -> None:
        self.assertIsNone(tpu.current_tpu_strategy())
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            self.assertIsNone(tpu.current_tpu_strategy())
        pipe = tiny_pipeline("cpu")
        self.assertIsNone(pipe.tpu_strategy)
        self.assertEqual(pipe.mesh, [["/device:CPU:0", "/device:CPU:1"]])
        for k in range(2):
            for v in pipe.cell_variables(k):
                self.assertEqual(tf.DeviceSpec.from_string(v.device).device_index, k)

    def test_cells_are_created_and_run_on_their_logical_core(self) -> None:
        strategy, active = self._stand_in()
        created_in: dict[str, int] = {}

        def record(next_creator, **kwargs):
            var = next_creator(**kwargs)
            created_in[var.name] = strategy.extended.stack[-1]
            return var

        with active, tf.variable_creator_scope(record):
            pipe = tiny_pipeline("tpu")
        self.assertIs(pipe.tpu_strategy, strategy)
        self.assertEqual(pipe.mesh, self.CORES)
        for k in range(2):
            self.assertNotEmpty(pipe.cell_variables(k))
            for v in pipe.cell_variables(k):
                self.assertEqual(created_in[v.name], k, v.name)
                self.assertEqual(v.device, f"/job:localhost/replica:0/task:0/device:CPU:{4 + k}")

        batch = make_batch()

        @tf.function(autograph=False)
        def train(batch):
            with fprop_context.fprop_context(training=True, step_seed=3):
                out, grads = pipe.FPropAndReplicaGrads(pipe.replica_thetas(pipe.theta), batch)
            return out.loss, grads[0]

        with active:
            graph = train.get_concrete_function(batch).graph
            loss, grads = train(batch)
        # Captured variables and their reads take the variable's device at run time.
        cell_ops = [op for op in graph.get_operations() if op.name.startswith("cell_1/")
                    and op.type not in ("Placeholder", "ReadVariableOp")]
        self.assertNotEmpty(cell_ops)
        for op in cell_ops:
            self.assertEqual(tf.DeviceSpec.from_string(op.device).device_index, 5, op.name)

        # The same weights (same seed) on the ordinary CPU path give the same step.
        plain = tiny_pipeline("cpu")
        for a, b in zip(plain.vars.Flatten(), pipe.vars.Flatten()):
            self.assertAllEqual(a, b)
        with fprop_context.fprop_context(training=True, step_seed=3):
            plain_out, plain_grads = plain.FPropAndGrads(plain.theta, batch)
        self.assertAllClose(loss, plain_out.loss, rtol=RTOL, atol=ATOL)
        for g, expected in zip(grads.Flatten(), plain_grads.Flatten()):
            if expected is not None:
                self.assertAllClose(g, expected, rtol=RTOL, atol=ATOL)

    def test_layer_errors_under_the_strategy(self) -> None:
        _, active = self._stand_in()
        with active, self.assertRaisesRegex(ValueError, r"num_replicas=2 inside a TPUStrategy"):
            tiny_pipeline("tpu", num_replicas=2)
        with active, self.assertRaisesRegex(ValueError, r"num_cells=3, but the TPUStrategy"):
            tiny_pipeline("tpu", num_cells=3)
        with active, self.assertRaisesRegex(ValueError, r"placement='cpu' inside a TPUStrategy"):
            tiny_pipeline("cpu")

    def test_optimizer_slots_sit_on_their_weights_core(self) -> None:
        strategy, active = self._stand_in()
        with active:
            pipe = tiny_pipeline("tpu")
            var = pipe.cell_variables(1)[0]
            self.assertEqual(tpu.logical_core_of(strategy, var), 1)
            with tpu.colocated(var):
                slot = tf.Variable(tf.zeros_like(var))
        self.assertEqual(slot.device, var.device)


class TrainerWithoutTPUTest(tf.test.TestCase):
    """trainer.py asked for a TPU that is not there: one line naming the flag/param and fix."""

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        cls.root = tempfile.mkdtemp(prefix="tpu_test_")
        env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")

        def launch(name: str, *args: str) -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, os.path.join(REPO, "trainer.py"),
                 "--model=tests.testdata_models.TinyMlp",
                 f"--logdir={os.path.join(cls.root, name)}", *args],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        cls.procs = {
            "flag": launch("flag", "--tpu=local", "--num_replicas=2"),
            "param": launch("param", "--model_params_override=network.placement : 'tpu'"),
            "eval": launch("eval", "--tpu=local", "--mode=eval"),
        }

    @classmethod
    def tearDownClass(cls) -> None:
        stop_processes(cls.procs.values())
        super().tearDownClass()

    def _assert_one_line_error(self, name: str, *expected: str) -> None:
        stdout, stderr = self.procs[name].communicate(timeout=180)
        self.assertEqual(self.procs[name].returncode, 1, stdout + stderr)
        self.assertNotIn("Traceback", stdout + stderr)
        errors = [ln for ln in stderr.splitlines() if ln.startswith("trainer.py: error: ")]
        self.assertLen(errors, 1, stderr)
        for text in expected:
            self.assertIn(text, errors[0])
        self.assertFalse(os.path.exists(os.path.join(self.root, name)))

    def test_tpu_flag_without_a_tpu(self) -> None:
        self._assert_one_line_error("flag", "--tpu=local: Cannot connect to a TPU",
                                    "--tpu=<name>", "placement 'cpu' or 'gpu'")

    def test_tpu_placement_without_a_tpu(self) -> None:
        self._assert_one_line_error(
            "param", "PipeliningLayer 'network' has placement='tpu'",
            "Please provide a TPU Name to connect to.", "--tpu=<name>")

    def test_tpu_flag_with_eval_mode(self) -> None:
        self._assert_one_line_error("eval", "--tpu", "only --mode=train runs on TPUs")


if __name__ == "__main__":
    tf.test.main()
