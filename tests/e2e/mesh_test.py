"""Pipeline x data parallelism: R replicas of a K-cell pipeline equal the single-device model.

The reference is the plain model on one device, written here: the global batch cut into the
R x T micro-batches the mesh normalises batch norm over (GPipe's per-micro-batch statistics),
each chained through every layer's FProp with its examples numbered from its start in the
global batch, one GradientTape over the mean of the micro-batch losses. Batch norm's moving
statistics are checked against numpy moments of the batch-norm input over the global batch.

Tolerance: the mesh sums gradients in another order (per micro-batch, per replica, then the
all-reduce), so float32 results differ in the last places: rtol 2e-5, atol 2e-7 as in
pipeline_test.py, and 1e-4 / 1e-5 on weights after 10 steps, where rounding compounds.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile

import tensorflow as tf
from absl.testing import parameterized
from pipeline_models import BATCH, WIDTH, _drop, _field, _loss, _proj, input_shapes, make_batch

from lingvo_lite.core import fprop_context
from lingvo_lite.core.nested_map import NestedMap
from lingvo_lite.layers import composite, normalization
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.tasks import optimizers, pipelined_task
from lingvo_lite.training import options, runner

RTOL, ATOL = 2e-5, 2e-7
BN_INDEX = 4


def mesh_layers() -> list:
    """Dropout before and after a batch norm, so masks and statistics both matter."""
    return [
        _proj("p0", 6, WIDTH), _drop("d0"), _proj("p1", WIDTH, WIDTH, activation="NONE"),
        _drop("d1"),
        _field("bn", normalization.BatchNormLayer.Params().Set(name="bn", dim=WIDTH, decay=0.9)),
        _proj("p2", WIDTH, WIDTH), _loss(WIDTH),
    ]


def mesh_params(num_replicas: int, num_cells: int, num_micro_batches: int,
                micro_batch_loop: bool = False):
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=mesh_layers(), num_cells=num_cells, num_replicas=num_replicas,
        num_micro_batches=num_micro_batches, remat="always", input_shapes=input_shapes(),
        random_seed=7, micro_batch_loop=micro_batch_loop)


def reference(layers, thetas, batch, num_groups: int, step_seed: int):
    """Loss, gradients and batch-norm input of the plain model over `num_groups` micro-batches."""
    size = BATCH // num_groups
    with tf.device("/device:CPU:0"), tf.GradientTape() as tape:
        losses, bn_inputs = [], []
        for g in range(num_groups):
            part = batch.Transform(lambda x, g=g: x[g * size:(g + 1) * size])
            with fprop_context.fprop_context(training=True, step_seed=step_seed,
                                             example_offset=g * size):
                h = composite.chain_fprop(layers[:BN_INDEX], thetas[:BN_INDEX], part)
                out = composite.chain_fprop(layers[BN_INDEX:], thetas[BN_INDEX:], h)
            bn_inputs.append(h.x)
            losses.append(out.loss)
        loss = tf.add_n(losses) / num_groups
    flat = NestedMap(layers=thetas).Flatten()
    return loss, tape.gradient(loss, flat), tf.concat(bn_inputs, 0).numpy()


class MeshEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.product(mesh=[(1, 1), (2, 1), (1, 2), (2, 2)], num_micro_batches=[1, 4])
    def test_step_matches_single_device_model(self, mesh, num_micro_batches):
        self._check_step(mesh, num_micro_batches, micro_batch_loop=False)

    @parameterized.parameters((1, 3), (2, 2))
    def test_micro_batch_loop_step_matches_single_device_model(self, num_replicas, num_cells):
        # The loop hands batch norm's per-micro-batch statistics on after it ends.
        self._check_step((num_replicas, num_cells), 4, micro_batch_loop=True)

    def _check_step(self, mesh, num_micro_batches, micro_batch_loop):
        num_replicas, num_cells = mesh
        pipe = mesh_params(num_replicas, num_cells, num_micro_batches,
                           micro_batch_loop).Instantiate()
        batch = make_batch()
        bn = pipe.layers[BN_INDEX].sub
        init_mean, init_var = bn.moving_mean.numpy(), bn.moving_variance.numpy()
        ref_loss, ref_grads, h = reference(pipe.layers, pipe.theta.layers, batch,
                                           num_replicas * num_micro_batches, step_seed=3)
        collector = fprop_context.UpdateCollector()

        @tf.function(autograph=False)
        def step(batch):
            with fprop_context.fprop_context(training=True, step_seed=3, updates=collector):
                out, grads = pipe.FPropAndReplicaGrads(pipe.replica_thetas(pipe.theta), batch)
            with tf.control_dependencies(collector.apply()):
                return tf.identity(out.loss), [g.Flatten() for g in grads]

        loss, replica_grads = step(batch)
        self.assertAllClose(ref_loss, loss, rtol=RTOL, atol=ATOL)
        self.assertLen(replica_grads, num_replicas)
        for grads in replica_grads:
            for ref_g, g in zip(ref_grads, grads):
                if ref_g is None:
                    self.assertIsNone(g)
                else:
                    self.assertAllClose(ref_g, g, rtol=RTOL, atol=ATOL)
        # Moving statistics: one update from the pooled statistics of the whole global batch.
        self.assertAllClose(0.9 * init_mean + 0.1 * h.mean(0), bn.moving_mean,
                            rtol=1e-5, atol=1e-6)
        self.assertAllClose(0.9 * init_var + 0.1 * h.var(0), bn.moving_variance,
                            rtol=1e-5, atol=1e-6)

    def test_each_replica_cell_lives_on_its_mesh_device(self):
        pipe = mesh_params(2, 2, 2).Instantiate()
        self.assertEqual([[d[-5:] for d in row] for row in pipe.mesh],
                         [["CPU:0", "CPU:1"], ["CPU:2", "CPU:3"]])
        for r, theta in enumerate(pipe.replica_thetas(pipe.theta)):
            for i, layer_theta in enumerate(theta.layers):
                k = pipe.partition.cell_of_layer(i)
                for v in layer_theta.Flatten():
                    # Non-trainable state (batch-norm moving statistics) is kept once.
                    want = pipe.mesh[r if v.trainable else 0][k]
                    self.assertEqual(tf.DeviceSpec.from_string(v.device).device_index,
                                     tf.DeviceSpec.from_string(want).device_index, msg=v.name)

    def test_refuses_single_replica_entry_point_and_uneven_shards(self):
        pipe = mesh_params(2, 1, 1).Instantiate()
        with fprop_context.fprop_context(training=True):
            with self.assertRaisesRegex(ValueError, "FPropAndReplicaGrads"):
                pipe.FPropAndGrads(pipe.theta, make_batch())
            odd = make_batch().Transform(lambda x: x[:BATCH - 1])
            with self.assertRaisesRegex(ValueError, "input.batch_size a multiple of 2"):
                pipe.FPropAndReplicaGrads(pipe.replica_thetas(pipe.theta), odd)
        with self.assertRaisesRegex(ValueError, "num_replicas=0"):
            mesh_params(0, 1, 1).Instantiate()


class MeshTrainingTest(tf.test.TestCase):

    def test_weights_match_after_ten_optimizer_steps(self):
        learning_rate = 0.3
        p = pipelined_task.PipelinedTask.Params().Set(name="task")
        p.network = mesh_params(2, 2, 2)
        p.train.Set(learning_rate=learning_rate, optimizer=optimizers.SGD.Params())
        task = p.Instantiate()
        task.prepare_for_training()
        ref = mesh_params(1, 1, 1).Instantiate()
        for v_task, v_ref in zip(task.network.vars.Flatten(), ref.vars.Flatten()):
            v_ref.assign(v_task)
        initial = ref.vars.Flatten()[0].numpy()
        train_step = tf.function(task.TrainStep, autograph=False)
        for step in range(10):
            batch = make_batch(seed=step)
            train_step(batch)
            # The task's layers (their dropout seeds come from their paths) on the copy's weights.
            _, grads, _ = reference(task.network.layers, ref.theta.layers, batch, 4,
                                    step_seed=step)
            for v, g in zip(ref.vars.Flatten(), grads):
                if g is not None:
                    v.assign_sub(learning_rate * g)
        for v_task, v_ref in zip(task.network.vars.Flatten(), ref.vars.Flatten()):
            if v_ref.trainable:
                self.assertAllClose(v_ref, v_task, rtol=1e-4, atol=1e-5)
        self.assertNotAllClose(initial, ref.vars.Flatten()[0])
        # Every replica applied the same all-reduced gradient: bitwise equal weights.
        pairs = task.replica_variable_pairs()
        self.assertNotEmpty(pairs)
        for var, copy in pairs:
            self.assertAllEqual(var, copy)

    def test_checkpoint_holds_one_copy_and_restore_syncs_replicas(self):
        p = pipelined_task.PipelinedTask.Params().Set(name="task")
        p.network = mesh_params(2, 2, 1)
        p.train.optimizer = optimizers.Adam.Params()
        task = p.Instantiate()
        task.prepare_for_training()
        names = task.checkpoint_variables()
        self.assertFalse([k for k in names if "replica_" in k])
        single = p.Copy()
        single.network.num_replicas = 1
        single_task = single.Instantiate()
        single_task.prepare_for_training()
        self.assertCountEqual(single_task.checkpoint_variables(), names)
        # Restoring changes replica 0; sync_replicas carries weights and slots to the copies.
        var, copy = task.replica_variable_pairs()[0]
        var.assign(var + 1.0)
        task.optimizer.slot_variables([var])[f"{var.name}/m"].assign(tf.ones_like(var))
        task.sync_replicas()
        self.assertAllEqual(var, copy)
        self.assertAllEqual(tf.ones_like(var), task.optimizer.slot_variables([copy])[
            f"{copy.name}/m"])


if __name__ == "__main__":
    tf.test.main()


class MeshTrainerTest(tf.test.TestCase):

    def test_trainer_with_replicas_ends_like_a_single_device_run(self):
        # R=2 x T=2 cuts the batch into the same 4 micro-batches as R=1 x T=4 on one device.
        root = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        runs = {"mesh": dict(num_replicas=2, num_cells=2, num_micro_batches=2),
                "single": dict(num_replicas=1, num_cells=1, num_micro_batches=4)}
        for name, flags in runs.items():
            out = io.StringIO()
            status = runner.main(options.RunOptions(
                model="testdata_models.TinyMlp", model_modules=("testdata_models",),
                logdir=os.path.join(root, name), max_steps=8, **flags), out=out, err=out)
            self.assertEqual(0, status, msg=out.getvalue())
        paths = {name: tf.train.latest_checkpoint(os.path.join(root, name, "checkpoints"))
                 for name in runs}
        keys = {name: sorted(k for k, _ in tf.train.list_variables(path))
                for name, path in paths.items()}
        self.assertEqual(keys["single"], keys["mesh"])  # One copy of the weights and slots.
        for key in keys["single"]:
            if key.startswith("model/"):
                self.assertAllClose(tf.train.load_variable(paths["single"], key),
                                    tf.train.load_variable(paths["mesh"], key),
                                    rtol=1e-5, atol=1e-6, msg=key)
