"""The time model against measured pipeline steps, at small scale (issue 16).

Each cell's work is a layer that sleeps a known time in its forward and in its backward (a
Python function: the sleep holds no core, so the step's time does not depend on what else the
machine runs). The pipelined step, on serial devices, is then timed and compared with
`simulator.simulate` on the same schedule with those durations: the simulator's dependencies,
per-device order and re-computation must be what the executor does. The benchmark models'
comparison (every schedule, K in {2, 4}, calls timed alone) is BENCHMARKS.md sections 12 and
12c.
"""

from __future__ import annotations

import statistics
import time

import tensorflow as tf
from absl.testing import parameterized

from lingvo_lite import base_layer, fprop_context
from lingvo_lite.layers import dense, losses, structural
from lingvo_lite.nested_map import NestedMap
from lingvo_lite.pipeline import pipelining_layer, schedule, simulator

FORWARD, BACKWARD = 0.02, 0.04  # Seconds each sleep layer takes per micro-batch.
TOLERANCE = 0.15  # Issue 16: within 15% of the measured step.


def _sleeping(seconds: float):
    def sleep(x):
        time.sleep(seconds)
        return x
    return sleep


class SleepLayer(base_layer.BaseLayer):
    """Identity that takes FORWARD seconds forward and BACKWARD seconds backward."""

    def FProp(self, theta, x):
        @tf.custom_gradient
        def slow_identity(x):
            y = tf.ensure_shape(tf.py_function(_sleeping(FORWARD), [x], x.dtype), x.shape)

            def grad(dy):
                return tf.ensure_shape(tf.py_function(_sleeping(BACKWARD), [dy], dy.dtype),
                                       dy.shape)
            return y, grad
        return slow_identity(x)

    @classmethod
    def FPropMeta(cls, p, x_shape):
        # Costed so that the partition gives each cell one sleep layer.
        return base_layer.fprop_meta(1e9, base_layer.to_shape(x_shape))


def _pipeline(num_cells: int, num_micro_batches: int, name: str, virtual_stages: int):
    layers = []
    for i in range(num_cells):
        layers += [
            structural.FieldLayer.Params().Set(
                name=f"dense_{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
                    name="proj", input_dim=8, output_dim=8)),
            structural.FieldLayer.Params().Set(
                name=f"sleep_{i}", field="x", sub=SleepLayer.Params().Set(name="sleep"))]
    layers.append(structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"], sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=8, num_classes=4)))
    shapes = NestedMap(x=tf.TensorShape([8, 8]), labels=tf.TensorShape([8]))
    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=num_cells, num_micro_batches=num_micro_batches,
        schedule=name, virtual_stages=virtual_stages, remat="except_last",
        serial_devices=True, input_shapes=shapes, random_seed=1).Instantiate()


class SimulatedVsMeasuredTest(parameterized.TestCase):

    @parameterized.parameters(("gpipe", 2, 1, 1), ("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1),
                              ("zero_bubble", 2, 4, 1), ("interleaved", 4, 4, 2),
                              ("1f1b", 3, 4, 1))
    def test_step_within_tolerance(self, name, num_cells, num_micro_batches, virtual_stages):
        pipe = _pipeline(num_cells, num_micro_batches, name, virtual_stages)
        # Each cell: a dense layer and a sleep layer (the last one the loss too).
        self.assertEqual([2] * (num_cells - 1) + [3],
                         [b - a for a, b in pipe.partition.cell_layer_ranges])
        batch = NestedMap(x=tf.ones([8, 8]), labels=tf.zeros([8], tf.int32))

        @tf.function(autograph=False)
        def step(batch):
            with fprop_context.fprop_context(training=True):
                out, grads = pipe.FPropAndGrads(pipe.theta, batch)
            return out.loss + tf.add_n([tf.reduce_sum(g) for g in grads.Flatten()])

        float(step(batch))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            float(step(batch))
            times.append(time.perf_counter() - start)
        measured = statistics.median(times)
        # The sleeps dominate: a whole forward or backward per micro-batch of each cell; the
        # sleep layers have no weights, so a split backward's W takes nothing.
        sched = schedule.make_schedule(name, num_cells, num_micro_batches, virtual_stages)
        costs = simulator.PhaseCosts.uniform(num_cells, FORWARD, BACKWARD, weight=0.0)
        predicted = simulator.simulate(sched, costs, remat="except_last").step_time
        self.assertLess(abs(predicted / measured - 1), TOLERANCE,
                        f"{name} K={num_cells} T={num_micro_batches}: predicted "
                        f"{predicted * 1e3:.0f} ms, measured {measured * 1e3:.0f} ms")
        # And it is not the sequential time: the devices did overlap.
        if num_micro_batches > 1:
            work = sum(sched.num_micro_batches * (FORWARD + BACKWARD) for _ in range(num_cells))
            self.assertLess(measured, 0.9 * work)


if __name__ == "__main__":
    tf.test.main()
