"""`serial_devices`: each logical device runs one op at a time, like an accelerator.

Equivalence is checked against the unpipelined model (the same reference as
pipeline_test.py). Seriality is checked behaviourally: a layer with two
independent branches records when each branch runs (a host callback that
sleeps, declared stateless so only the executor orders it); on a serial
device the two branches never overlap, while the two cells of a pipeline
still do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pipeline_models as pt
import pytest
import tensorflow as tf
from absl.testing import parameterized
from conftest import REPO

from lingvo_lite.core import base_layer, fprop_context
from lingvo_lite.layers import composite, structural

pytestmark = pytest.mark.slow  # Several seconds and more: scheduled first.

SLEEP_S = 0.05


class _Recorder:
    """Thread-safe log of (branch name, start, end) host intervals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.intervals: list[tuple[str, float, float]] = []

    def branch(self, name: str, x: tf.Tensor) -> tf.Tensor:
        def run(x):
            start = time.perf_counter()
            time.sleep(SLEEP_S)
            with self.lock:
                self.intervals.append((name, start, time.perf_counter()))
            return x

        # Stateless, so tf.function adds no automatic control dependencies between calls.
        out = tf.numpy_function(run, [x], x.dtype, stateful=False)
        return tf.stop_gradient(tf.ensure_shape(out, x.shape))


RECORDER = _Recorder()


class TwoBranchLayer(base_layer.BaseLayer):
    """x + 0 * (branch_a(x) + branch_b(x)): two independent host callbacks per call."""

    @classmethod
    def Params(cls):
        p = super().Params()
        p.Define("tag", "", "Prefix of the recorded branch names.")
        return p

    def FProp(self, theta, x):
        del theta
        tag = self.params.tag
        a = RECORDER.branch(f"{tag}/a", x)
        b = RECORDER.branch(f"{tag}/b", x)
        return x + 0.0 * (a + b)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        shape = base_layer.to_shape(x_shape)
        return base_layer.fprop_meta(float(shape.num_elements()), shape, 0, tf.float32)


def _two_branch(name: str):
    return structural.FieldLayer.Params().Set(
        name=name, field="x", sub=TwoBranchLayer.Params().Set(name=name, tag=name))


def _overlap(a: tuple[str, float, float], b: tuple[str, float, float]) -> bool:
    return a[1] < b[2] and b[1] < a[2]


class SerialDevicesEquivalenceTest(tf.test.TestCase, parameterized.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.batch = pt.make_batch()
        ref_pipe = pt.make_pipeline(pt.mlp_layers())
        cls.ref_loss, cls.ref_grads = pt.reference_loss_and_grads(ref_pipe, cls.batch, 3)

    @parameterized.parameters(
        (1, 1, "never"), (2, 1, "except_last"), (2, 4, "except_last"), (3, 4, "always"),
        (4, 8, "never"), (2, 4, "always", "1f1b"))
    def test_loss_and_gradients_match_unpipelined_model(self, num_cells, num_micro_batches,
                                                        remat, schedule="gpipe"):
        pipe = pt.make_pipeline(pt.mlp_layers(), num_cells, num_micro_batches, remat,
                                schedule=schedule, serial_devices=True)
        loss, grads = pt.pipeline_loss_and_grads(pipe, self.batch, 3)
        self.assertAllClose(self.ref_loss, loss, rtol=pt.RTOL, atol=pt.ATOL)
        self.assertLen(grads, len(self.ref_grads))
        for ref_g, g in zip(self.ref_grads, grads):
            self.assertAllClose(ref_g, g, rtol=pt.RTOL, atol=pt.ATOL)

    def test_eval_forward_matches_unpipelined_model(self):
        pipe = pt.make_pipeline(pt.mlp_layers(), 2, 4, serial_devices=True)
        got = tf.function(lambda b: pipe.FProp(pipe.theta, b).loss, autograph=False)(self.batch)
        want = composite.chain_fprop(pipe.layers, pipe.theta.layers, self.batch).loss
        self.assertAllClose(want, got, rtol=pt.RTOL, atol=pt.ATOL)


class SerialEagerTest(tf.test.TestCase):

    def test_four_cells_eagerly_with_two_inter_op_threads_complete(self):
        # Issue 12: eagerly, K=4, T=8, remat always/except_last with 2 inter-op threads
        # never returned (each serial call with an argument from another device, or an
        # int32 one, blocked a pool thread). A subprocess, since the device set-up differs
        # and a hang must fail the test, not the suite.
        script = os.path.join(REPO, "tests", "serial_eager_child.py")
        try:
            proc = subprocess.run([sys.executable, script, "2"], capture_output=True,
                                  text=True, timeout=150)
        except subprocess.TimeoutExpired:
            self.fail("serial_devices=True with K=4 hung when run eagerly (issue 12)")
        self.assertEqual(0, proc.returncode, msg=proc.stderr[-3000:])
        diffs = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertLen(diffs, 6)  # {always, except_last} x {eager, traced, eager FProp}.
        for name, rel in diffs.items():
            self.assertLess(rel, pt.RTOL, msg=name)


class SerialExecutionTest(tf.test.TestCase):

    def _run(self, serial: bool) -> list[tuple[str, float, float]]:
        layers = [_two_branch("c0"), _two_branch("c1"), pt._loss(pt.IN_DIM)]
        pipe = pt.make_pipeline(layers, num_cells=2, num_micro_batches=2, remat="never",
                                split_points=[1], partition_method="explicit",
                                serial_devices=serial)
        def train(b):
            with fprop_context.fprop_context(training=True):
                return pipe.FPropAndGrads(pipe.theta, b)[0].loss

        step = tf.function(train, autograph=False)
        step(pt.make_batch())  # Trace and warm up.
        RECORDER.intervals.clear()
        step(pt.make_batch())
        return list(RECORDER.intervals)

    def test_one_op_at_a_time_per_device_and_cells_overlap(self):
        intervals = self._run(serial=True)
        self.assertLen(intervals, 8)  # 2 cells x 2 micro-batches x 2 branches.
        for i, a in enumerate(intervals):
            for b in intervals[i + 1:]:
                if a[0][:2] == b[0][:2]:  # Same cell.
                    self.assertFalse(_overlap(a, b), msg=f"{a} overlaps {b} on one device")
        cross = [(a, b) for a in intervals for b in intervals
                 if a[0].startswith("c0") and b[0].startswith("c1") and _overlap(a, b)]
        self.assertNotEmpty(cross, msg="cells should run concurrently")

    def test_without_it_one_cell_runs_branches_concurrently(self):
        # The shared inter-op pool runs a cell's independent ops in parallel: the
        # behaviour serial_devices exists to remove.
        intervals = self._run(serial=False)
        same_cell = [(a, b) for i, a in enumerate(intervals) for b in intervals[i + 1:]
                     if a[0][:2] == b[0][:2] and _overlap(a, b)]
        self.assertNotEmpty(same_cell)


if __name__ == "__main__":
    tf.test.main()
