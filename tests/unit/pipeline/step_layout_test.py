"""One resolver of T, devices and the per-replica batch, and every reader of a step agreeing
with it (model analysis, layer profile, step profiler, device count), worked out by hand."""

from __future__ import annotations

import doctest
import re

import tensorflow as tf
from absl.testing import absltest

from lingvo_lite.analysis import model_analysis
from lingvo_lite.layers import dense
from lingvo_lite.pipeline import pipelining_layer, step_layout
from lingvo_lite.pipeline.partition import layer_profile
from lingvo_lite.pipeline.schedules import schedule
from lingvo_lite.training import model_config, profiling


def _params(**kwargs):
    """4 projections of width 8 on a mini-batch of 16 examples."""
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", input_shapes=tf.TensorShape([16, 8]), layers=[
            dense.ProjectionLayer.Params().Set(name=f"l{i}", input_dim=8, output_dim=8)
            for i in range(4)], **kwargs)


class StepLayoutTest(absltest.TestCase):

    def test_micro_batch_size_counts_per_replica(self):
        # 16 examples over R=2 replicas: 8 each; micro-batches of 4: T=2 (not 16 / 4 = 4).
        p = _params(num_cells=2, num_replicas=2, micro_batch_size=4)
        layout = step_layout.resolve(p, 16)
        self.assertEqual((2, 8, 2, 4, 16), (
            layout.num_replicas, layout.replica_batch_size, layout.num_micro_batches,
            layout.micro_batch_size, layout.global_batch_size))
        self.assertEqual((2, 2), (layout.schedule.num_cells, layout.schedule.num_micro_batches))
        self.assertEqual(16, step_layout.global_batch_size(p))
        # num_micro_batches counts micro-batches of one replica's shard.
        q = _params(num_cells=2, num_replicas=2, num_micro_batches=4)
        self.assertEqual((8, 4, 2), (step_layout.resolve(q, 16).replica_batch_size,
                                     step_layout.resolve(q, 16).num_micro_batches,
                                     step_layout.resolve(q, 16).micro_batch_size))

    def test_batch_that_does_not_split_is_refused(self):
        with self.assertRaisesRegex(ValueError, "does not split into num_replicas=3"):
            step_layout.resolve(_params(num_cells=2, num_replicas=3), 16)
        with self.assertRaisesRegex(ValueError, "micro_batch_size=3 does not divide"):
            step_layout.resolve(_params(num_cells=2, micro_batch_size=3), 16)

    def test_the_schedule_places_the_cells(self):
        zbv = step_layout.resolve(_params(num_cells=4, schedule="zbv"), 16)
        self.assertEqual(((0, 1, 1, 0), 2), (zbv.cell_devices, zbv.num_devices))
        interleaved = step_layout.resolve(
            _params(num_cells=4, num_micro_batches=2, schedule="interleaved",
                    virtual_stages=2), 16)
        self.assertEqual(((0, 1, 0, 1), 2), (interleaved.cell_devices,
                                             interleaved.num_devices))
        custom = schedule.make_schedule("zbv", 4, 1)  # A Schedule object places as it says.
        self.assertEqual((0, 1, 1, 0), step_layout.placement_schedule(
            _params(num_cells=4, schedule=custom)).cell_devices)

    def test_pipeline_and_analyses_agree_on_t_with_replicas(self):
        # The bug this resolver fixed: inspect_model predicted with T = 16 / 4 = 4 while the
        # pipeline (and the layer profile) ran T = 8 / 4 = 2 per replica.
        p = _params(num_cells=2, num_replicas=2, micro_batch_size=4)
        self.assertEqual(2, layer_profile._num_micro_batches(p))  # noqa: SLF001
        text, _ = model_analysis.describe_pipeline("pipe", p)
        predicted = re.findall(r"K=2, T=(\d+), gpipe", text)
        self.assertEqual(["2"], predicted, msg=text)
        self.assertEqual(2, profiling.PipelineDescription.from_task_params(
            "M", _params(num_cells=2, num_replicas=2, micro_batch_size=4)).num_micro_batches)

    def test_inspect_model_mesh_lines_are_the_schedules_devices(self):
        # ZB-V, 4 cells on 2 devices per replica, 2 replicas: replica r's device d is
        # r x 2 + d; cell k sits on device (0, 1, 1, 0)[k] of its replica.
        p = _params(num_cells=4, num_replicas=2, schedule="zbv")
        text, _ = model_analysis.describe_pipeline("pipe", p)
        self.assertIn("Mesh: 2 data-parallel replicas x 2 devices of 2 cells each (schedule "
                      "zbv) = 4 devices", text)
        self.assertIn("  replica 0: cell 0 -> device 0, cell 1 -> device 1, cell 2 -> device "
                      "1, cell 3 -> device 0", text)
        self.assertIn("  replica 1: cell 0 -> device 2, cell 1 -> device 3, cell 2 -> device "
                      "3, cell 3 -> device 2", text)
        self.assertIn("K=4 on 2 devices, T=1, zbv", text)  # The prediction's schedule.

    def test_logical_devices_needed_come_from_the_schedule(self):
        task = _params(num_cells=4, num_replicas=2, schedule="zbv")
        self.assertEqual(4, model_config.auto_num_logical_cpus(task))
        self.assertEqual(8, model_config.auto_num_logical_cpus(
            _params(num_cells=4, num_replicas=2)))

    def test_docstring_example(self):
        self.assertEqual(0, doctest.testmod(step_layout).failed)


if __name__ == "__main__":
    absltest.main()
