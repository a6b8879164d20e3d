"""Child process of serial_devices_test.py: K=4, T=8 with serial devices, eagerly and traced.

Run as a script, it configures its own devices and thread pools (8 logical CPUs, 2 inter-op
threads: TensorFlow's default on the 2-core machine where issue 12 deadlocked), runs the
pipeline for each remat mode eagerly (FPropAndGrads and FProp) and traced (FPropAndGrads),
and prints one JSON line with the largest differences from the unpipelined model's loss and
gradients (one plain GradientTape). Its parent kills it if it hangs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lingvo_lite.core import devices  # noqa: E402

devices.configure_logical_cpus(8, inter_op_threads=int(sys.argv[1]) if len(sys.argv) > 1 else 2)

import numpy as np  # noqa: E402
import pipeline_models as pt  # noqa: E402
import tensorflow as tf  # noqa: E402

from lingvo_lite.core import fprop_context  # noqa: E402


def _rel(want, got) -> float:
    want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.max(np.abs(want - got)) / max(np.max(np.abs(want)), 1e-30))


def main() -> None:
    batch = pt.make_batch()
    ref_pipe = pt.make_pipeline(pt.mlp_layers())
    ref_loss, ref_grads = pt.reference_loss_and_grads(ref_pipe, batch, 3)
    with fprop_context.fprop_context(training=False):
        ref_eval = pt.composite.chain_fprop(ref_pipe.layers, ref_pipe.theta.layers, batch).loss
    result = {}
    for remat in ("always", "except_last"):
        pipe = pt.make_pipeline(pt.mlp_layers(), 4, 8, remat, serial_devices=True)
        for graph in (False, True):
            loss, grads = pt.pipeline_loss_and_grads(pipe, batch, 3, graph=graph)
            name = f"{remat}/{'traced' if graph else 'eager'}"
            result[name] = max([_rel(ref_loss, loss)]
                               + [_rel(r, g) for r, g in zip(ref_grads, grads)])
        result[f"{remat}/eager_fprop"] = _rel(ref_eval, pipe.FProp(pipe.theta, batch).loss)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    tf.get_logger().setLevel("ERROR")
    main()
