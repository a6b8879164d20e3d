"""Placement: which device each cell runs on, and how a pipeline is placed (placement.py)."""

from __future__ import annotations

import graph_structure
import tensorflow as tf
from pipeline_models import make_batch, make_pipeline, mlp_layers

from lingvo_lite.core import fprop_context
from lingvo_lite.distributed import placement
from lingvo_lite.layers import dense
from lingvo_lite.pipeline import pipelining_layer
from lingvo_lite.pipeline.partition import layer_profile


class PlacementTest(tf.test.TestCase):

    def test_nested_layers_variables_are_on_their_cells_device(self):
        # AmoebaNet's cells hold lists of children (their operations); those were once
        # created on the default device, so cell 1 read most of its weights from device 0.
        from model_params import image

        network = image.AmoebaNetDigits().Task().network.Copy().Set(name="pipe", num_cells=3)
        pipe = network.Instantiate()
        for k in range(3):
            variables = pipe.cell_variables(k)
            self.assertNotEmpty(variables)
            for v in variables:
                self.assertEndsWith(v.device, f"CPU:{k}", msg=v.name)

    def test_every_cell_op_and_variable_is_on_its_device(self):
        num_cells = 4
        pipe = make_pipeline(mlp_layers(), num_cells=num_cells, num_micro_batches=2)
        for k in range(num_cells):
            for v in pipe.cell_variables(k):
                self.assertEndsWith(v.device, f"CPU:{k}")

        @tf.function(autograph=False)
        def step(batch):
            with fprop_context.fprop_context(training=True):
                out, grads = pipe.FPropAndGrads(pipe.theta, batch)
            return out.loss, grads.Flatten()

        graph = step.get_concrete_function(make_batch()).graph
        seen = {(k, kind): 0 for k in range(num_cells) for kind in ("fprop", "bprop")}
        for op in graph.get_operations():
            parts = op.name.split("/")
            if not parts[0].startswith("cell_") or op.type in ("Placeholder", "ReadVariableOp"):
                # Placeholders stand for captured variables (function inputs); reads take
                # the device of the variable they read, which is checked above.
                continue
            k = int(parts[0].split("_")[1])
            self.assertEndsWith(op.device, f"CPU:{k}", msg=op.name)
            kind = parts[1].split("_mb_")[0]
            if op.type in graph_structure.CALL_OPS and kind in ("fprop", "bprop"):
                seen[(k, kind)] += 1
        for key, count in seen.items():
            self.assertGreater(count, 0, msg=f"no function call for cell/phase {key}")
        # The calls' bodies hold the cell's ops (they run on the call's device): forward,
        # re-computation and backward of every cell.
        bodies = " ".join(
            name for f in graph_structure.function_library(graph).values()
            for name in [n.name for n in f.node_def])
        for k in range(num_cells):
            for scope in (f"cell_{k}/fprop/", f"cell_{k}/bprop/recompute/"):
                self.assertIn(scope, bodies)


class MeshTest(tf.test.TestCase):

    def test_mesh_is_replica_major_over_devices_per_replica(self):
        mesh = placement.resolve_mesh("cpu", 2, 3)
        self.assertEqual([[f"/device:CPU:{i}" for i in range(3)],
                          [f"/device:CPU:{i}" for i in range(3, 6)]], mesh)

    def test_too_few_devices_names_what_sets_the_count(self):
        # 8 logical CPUs (conftest); 2 replicas of 5 devices need 10.
        with self.assertRaisesRegex(ValueError, r"needs 10 devices \(num_replicas x num_cells "
                                    r"/ virtual_stages\)"):
            placement.resolve_mesh("cpu", 2, 5)

    def test_profile_device_counts_devices_not_cells(self):
        # 16 cells, 2 per device: 8 devices, which exist; as 16 devices they would not.
        layers = [dense.ProjectionLayer.Params().Set(name=f"p{i}", input_dim=2, output_dim=2)
                  for i in range(16)]
        p = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=layers, num_cells=16, virtual_stages=2, schedule="interleaved",
            placement="cpu", input_shapes=tf.TensorShape([4, 2]))
        self.assertEqual("/device:CPU:0", layer_profile.profile_device(p))


class ChoosePathTest(tf.test.TestCase):

    def test_paths(self) -> None:
        devices, strategy = placement.DEVICES_PATH, placement.TPU_STRATEGY_PATH
        cpus = {"CPU": 8}
        cases = [
            ("auto", 1, 2, cpus, False, devices),
            ("cpu", 2, 2, cpus, False, devices),
            ("gpu", 1, 2, {"CPU": 1, "GPU": 2}, False, devices),
            ("cluster:worker", 2, 2, cpus, False, devices),
            (["/device:CPU:0", "/device:CPU:1"], 1, 2, cpus, False, devices),
            ("tpu", 2, 4, {"CPU": 1, "TPU": 8}, False, devices),  # Cores visible, no strategy.
            ("tpu", 1, 4, {"CPU": 1}, True, strategy),
            ("auto", 1, 4, cpus, True, strategy),
        ]
        for where, num_replicas, num_cells, counts, active, expected in cases:
            self.assertEqual(
                placement.choose_path(where, num_replicas, num_cells, counts, active), expected,
                (where, num_replicas, num_cells, counts, active))

    def test_contradictions_are_errors(self) -> None:
        with self.assertRaisesRegex(ValueError, r"placement='tpu'.*8 TPU cores but 4 .*--tpu"):
            placement.choose_path("tpu", 2, 4, {"CPU": 1, "TPU": 4}, False)
        with self.assertRaisesRegex(ValueError, r"placement='tpu'.*but 0 are visible"):
            placement.choose_path("tpu", 1, 2, {"CPU": 8}, False)
        with self.assertRaisesRegex(ValueError, r"placement='cpu' inside a TPUStrategy"):
            placement.choose_path("cpu", 1, 2, {"CPU": 8}, True)
        with self.assertRaisesRegex(ValueError, r"placement='a list of devices' inside"):
            placement.choose_path(["/device:CPU:0"], 1, 1, {"CPU": 8}, True)
        with self.assertRaisesRegex(ValueError, r"num_replicas=2 inside a TPUStrategy"):
            placement.choose_path("tpu", 2, 2, {}, True)


if __name__ == "__main__":
    tf.test.main()
