"""Peak activation memory of a pipelined training step, with and without re-materialisation.

Runs in its own process: TF_CPU_ALLOCATOR_USE_BFC must be set before TensorFlow
is imported for CPU memory statistics to exist. All logical CPU devices share
one allocator, so the figure is the sum over devices.

    python bench/remat_memory.py --num_layers=16 --num_cells=2 --num_micro_batches=8

Prints one JSON object: peak bytes above the pre-step baseline per remat mode, plus the
weight, gradient and activation parts (`measure_peaks` gives the same dict to importers).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """Command-line flags; defined only when run as a script so importers add none."""
    flags.DEFINE_integer("num_layers", 16, "Dense layers in the model (L).")
    flags.DEFINE_integer("num_cells", 2, "Pipeline cells (K).")
    flags.DEFINE_integer("num_micro_batches", 8, "Micro-batches (T).")
    flags.DEFINE_integer("batch_size", 2048, "Mini-batch size (N).")
    flags.DEFINE_integer("width", 64, "Layer width: small, so activations dominate weights.")
    flags.DEFINE_integer("inter_op_threads", None, "Inter-op threads (None: TF default).")
    flags.DEFINE_bool("bias", True, "Dense layers have a bias.")
    flags.DEFINE_list("modes", ["never", "except_last", "always"], "Remat modes to measure.")


def measure_peaks(num_layers: int = 16, num_cells: int = 2, num_micro_batches: int = 8,
                  batch_size: int = 2048, width: int = 64, modes: list[str] | None = None,
                  bias: bool = True, inter_op_threads: int | None = None) -> dict:
    """Peak bytes above the pre-step baseline of one training step, per remat mode.

    Also reports what the peak is made of: `weight_bytes` (trainable variables, allocated
    before the step), `grad_bytes` (the summed gradients the step returns: one per weight)
    and `activation_bytes[mode]` = peak - grad_bytes, the transient activations (and
    per-micro-batch gradient temporaries) at the peak.
    """
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(num_cells, inter_op_threads=inter_op_threads)
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.layers import dense, losses, structural
    from lingvo_lite.pipeline import pipelining_layer

    modes = list(modes or ["never", "except_last", "always"])
    n, d = batch_size, width
    layers = [
        structural.FieldLayer.Params().Set(
            name=f"dense_{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
                name="proj", input_dim=d, output_dim=d, activation="TANH", has_bias=bias))
        for i in range(num_layers)
    ] + [structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"],
        sub=losses.SoftmaxCrossEntropyLayer.Params().Set(name="xent", input_dim=d, num_classes=10))]
    rng = np.random.default_rng(0)
    batch = NestedMap(x=tf.constant(rng.normal(size=(n, d)), tf.float32),
                      labels=tf.constant(rng.integers(0, 10, n), tf.int32))
    pipes = {}
    for mode in modes:
        pipes[mode] = pipelining_layer.PipeliningLayer.Params().Set(
            name="pipe", layers=layers, num_cells=num_cells,
            num_micro_batches=num_micro_batches, remat=mode,
            input_shapes=NestedMap(x=tf.TensorShape([n, d]), labels=tf.TensorShape([n]))
        ).Instantiate()
    weight_bytes = sum(v.shape.num_elements() * v.dtype.size
                       for v in next(iter(pipes.values())).vars.Flatten() if v.trainable)
    result = {"config": dict(layers=num_layers, cells=num_cells,
                             micro_batches=num_micro_batches, batch=n, width=d),
              "layer_activation_bytes": n * d * 4, "peak_bytes": {},
              "weight_bytes": weight_bytes, "grad_bytes": weight_bytes, "activation_bytes": {}}
    for mode, pipe in pipes.items():
        def step(batch, pipe=pipe):
            with fprop_context.fprop_context(training=True):
                out, grads = pipe.FPropAndGrads(pipe.theta, batch)
            return out.loss, grads.Flatten()

        step = tf.function(step, autograph=False)
        step(batch)  # Trace and warm up outside the measured window.
        tf.config.experimental.reset_memory_stats("CPU:0")
        baseline = tf.config.experimental.get_memory_info("CPU:0")["current"]
        outputs = step(batch)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        del outputs
        result["peak_bytes"][mode] = peak - baseline
        result["activation_bytes"][mode] = max(peak - baseline - weight_bytes, 0)
    return result


def measure() -> dict:
    return measure_peaks(FLAGS.num_layers, FLAGS.num_cells, FLAGS.num_micro_batches,
                         FLAGS.batch_size, FLAGS.width, list(FLAGS.modes), FLAGS.bias,
                         FLAGS.inter_op_threads)


def main(argv: list[str]) -> None:
    del argv
    print(json.dumps(measure()))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
