"""The time model against measured pipeline steps whose cells sleep known times.

Each cell's work is a layer that sleeps a known time in its forward and in its backward (a
Python function: the sleep holds no core). The pipelined step, on serial devices, is timed
and compared with `simulator.simulate` on the same schedule with those durations: the
simulator's dependencies, per-device order and re-computation must be what the executor does.
A timing, so a benchmark, not a unit test: other work on the machine moves it.

    python bench/simulated_vs_measured.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lingvo_lite.core import devices  # noqa: E402

devices.configure_logical_cpus(4)

import tensorflow as tf  # noqa: E402

from lingvo_lite.analysis import simulator  # noqa: E402
from lingvo_lite.core import base_layer, fprop_context  # noqa: E402
from lingvo_lite.core.nested_map import NestedMap  # noqa: E402
from lingvo_lite.layers import dense, losses, structural  # noqa: E402
from lingvo_lite.pipeline import pipelining_layer  # noqa: E402
from lingvo_lite.pipeline.schedules import schedule  # noqa: E402

FORWARD, BACKWARD = 0.02, 0.04  # Seconds each sleep layer takes per micro-batch.
TOLERANCE = 0.15  # The target: within 15% of the measured step.


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


CONFIGURATIONS = (("gpipe", 2, 1, 1), ("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1),
                  ("zero_bubble", 2, 4, 1), ("interleaved", 4, 4, 2), ("1f1b", 3, 4, 1))


def measure(name: str, num_cells: int, num_micro_batches: int,
            virtual_stages: int) -> tuple[float, float, float]:
    """(predicted, measured, sequential) step seconds of one configuration."""
    pipe = _pipeline(num_cells, num_micro_batches, name, virtual_stages)
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
    # The sleeps dominate; the sleep layers have no weights, so a split backward's W is free.
    sched = schedule.make_schedule(name, num_cells, num_micro_batches, virtual_stages)
    costs = simulator.PhaseCosts.uniform(num_cells, FORWARD, BACKWARD, weight=0.0)
    predicted = simulator.simulate(sched, costs, remat="except_last").step_time
    sequential = num_cells * num_micro_batches * (FORWARD + BACKWARD)
    return predicted, measured, sequential


def main() -> None:
    print("| schedule | K | T | predicted ms | measured ms | error | within 15% | overlap |")
    print("|---|---|---|---|---|---|---|---|")
    for name, k, t, v in CONFIGURATIONS:
        predicted, measured, sequential = measure(name, k, t, v)
        error = predicted / measured - 1
        print(f"| {name} | {k} | {t} | {predicted * 1e3:.0f} | {measured * 1e3:.0f} | "
              f"{error:+.1%} | {'yes' if abs(error) < TOLERANCE else 'no'} | "
              f"{'yes' if measured < 0.9 * sequential else 'no'} |")


if __name__ == "__main__":
    main()
