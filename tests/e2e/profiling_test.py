"""`trainer.py --profile_steps`: what a profiled run writes, and the flag's checks."""

from __future__ import annotations

import io
import json
import os
import tempfile

import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator
from trace_readers import boxes_from_trace

from lingvo_lite.analysis import trace_analysis
from lingvo_lite.training import options, runner


class TrainerProfileTest(tf.test.TestCase):

    def test_profile_steps_writes_gantt_breakdown_text_and_trace(self):
        import testdata_models  # noqa: F401  (registers TinyMlp)

        logdir = os.path.join(tempfile.mkdtemp(), "run")
        out, err = io.StringIO(), io.StringIO()
        status = runner.main(options.RunOptions(
            model="testdata_models.TinyMlp", logdir=logdir, mode="train", max_steps=4,
            profile_steps="2,3"), out=out, err=err)
        self.assertEqual(0, status, msg=err.getvalue())
        train_dir = os.path.join(logdir, "train")
        self.assertTrue(trace_analysis.find_xplane_files(train_dir))  # TensorBoard's profile tab.
        acc = event_accumulator.EventAccumulator(
            train_dir, size_guidance={event_accumulator.TENSORS: 0})
        acc.Reload()
        tags = set(acc.Tags()["tensors"])
        self.assertIn("pipeline/gantt", tags)
        self.assertIn("pipeline/breakdown", tags)
        for name in ("setup", "bubble", "load_imbalance", "recompute", "weight_update",
                     "device_0_busy", "device_1_busy"):
            self.assertIn(f"pipeline/{name}", tags)
        gantt = acc.Tensors("pipeline/gantt")[-1]
        self.assertEqual(3, gantt.step)
        encoded = tf.make_ndarray(gantt.tensor_proto)  # [width, height, png bytes]
        img = tf.io.decode_png(encoded[2]).numpy()
        self.assertEqual((int(encoded[1]), int(encoded[0]), 3), img.shape)
        text = tf.make_ndarray(acc.Tensors("pipeline/breakdown")[-1].tensor_proto)
        text = text.item().decode()
        self.assertIn("| load imbalance |", text)
        self.assertIn("testdata_models.TinyMlp", text)
        with open(os.path.join(train_dir, "pipeline_trace_3.json")) as f:
            boxes = boxes_from_trace(json.load(f))
        self.assertEqual({0, 1}, {b.cell for b in boxes})
        self.assertIn("Pipeline profile of step 3: bubble ", out.getvalue())

    def test_interleaved_pipeline_is_profiled_per_device(self):
        # 4 cells on 2 devices (v=2), T=2: the run starts (its model analysis simulates the
        # interleaved schedule with its virtual stages) and the breakdown has one entry per
        # device, not per cell.
        import plan_models  # noqa: F401  (registers PlanMlp)

        logdir = os.path.join(tempfile.mkdtemp(), "run")
        out, err = io.StringIO(), io.StringIO()
        status = runner.main(options.RunOptions(
            model="plan_models.PlanMlp", logdir=logdir, mode="train", max_steps=3,
            profile_steps="2", model_params_override=(
                "network.schedule : 'interleaved'; network.virtual_stages : 2; "
                "network.num_cells : 4; network.num_micro_batches : 2")), out=out, err=err)
        self.assertEqual(0, status, msg=err.getvalue())
        train_dir = os.path.join(logdir, "train")
        with open(os.path.join(train_dir, "pipeline_breakdown.json")) as f:
            step = json.load(f)["steps"][-1]
        self.assertEqual({"device_0_busy", "device_1_busy"},
                         {k for k in step if k.endswith("_busy")})
        with open(os.path.join(train_dir, "pipeline_trace_2.json")) as f:
            trace = json.load(f)
        self.assertEqual({0, 1, 2, 3}, {b.cell for b in boxes_from_trace(trace)})
        self.assertIn("device 0, cell 2", {e["args"]["name"] for e in trace["traceEvents"]
                                           if e.get("name") == "thread_name"})

    def test_zbv_pipeline_is_profiled_on_the_schedules_devices(self):
        # ZB-V, 4 cells on 2 devices (device 0 holds cells 0 and 3, device 1 cells 1 and 2):
        # the breakdown has one entry per device and the trace names each cell's device as
        # the schedule placed it, not k % 2.
        import plan_models  # noqa: F401  (registers PlanMlp)

        logdir = os.path.join(tempfile.mkdtemp(), "run")
        out, err = io.StringIO(), io.StringIO()
        status = runner.main(options.RunOptions(
            model="plan_models.PlanMlp", logdir=logdir, mode="train", max_steps=3,
            profile_steps="2", model_params_override=(
                "network.schedule : 'zbv'; network.num_cells : 4; "
                "network.num_micro_batches : 2")), out=out, err=err)
        self.assertEqual(0, status, msg=err.getvalue())
        train_dir = os.path.join(logdir, "train")
        with open(os.path.join(train_dir, "pipeline_breakdown.json")) as f:
            step = json.load(f)["steps"][-1]
        self.assertEqual({"device_0_busy", "device_1_busy"},
                         {k for k in step if k.endswith("_busy")})
        with open(os.path.join(train_dir, "pipeline_trace_2.json")) as f:
            trace = json.load(f)
        self.assertEqual({0, 1, 2, 3}, {b.cell for b in boxes_from_trace(trace)})
        tracks = {e["args"]["name"] for e in trace["traceEvents"]
                  if e.get("name") == "thread_name"}
        self.assertTrue({"device 0, cell 0", "device 1, cell 1", "device 1, cell 2",
                         "device 0, cell 3"} <= tracks, msg=tracks)

    def test_serial_devices_cannot_be_profiled_and_nothing_is_written(self):
        import testdata_models  # noqa: F401  (registers TinyMlp)

        logdir = os.path.join(tempfile.mkdtemp(), "run")
        out, err = io.StringIO(), io.StringIO()
        status = runner.main(options.RunOptions(
            model="testdata_models.TinyMlp", logdir=logdir, mode="train", max_steps=4,
            profile_steps="2,3", model_params_override="network.serial_devices : True"),
            out=out, err=err)
        self.assertNotEqual(0, status)
        self.assertIn("serial_devices", err.getvalue())
        self.assertIn("--profile_steps", err.getvalue())
        self.assertFalse(os.path.exists(logdir))

    def test_bad_profile_steps_name_the_flag(self):
        for value in ("a,b", "3,2", "0,1", "1,2,3"):
            with self.assertRaisesRegex(options.UsageError, "--profile_steps"):
                options.parse_profile_steps(value)
        self.assertEqual((5, 5), options.parse_profile_steps("5"))
        self.assertIsNone(options.parse_profile_steps(""))


if __name__ == "__main__":
    tf.test.main()
