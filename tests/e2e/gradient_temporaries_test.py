"""Declared gradient temporaries (`backward_temporary_bytes`) against TensorFlow's allocations.

Each case runs in a child process with TensorFlow's BFC allocator on the CPU (the only way
`get_memory_info` reports peaks there) and one inter-op thread: one layer's forward and
gradient in one `tf.function`, from its input and an output gradient. What the step allocates
at its peak beyond the activations the layer saves (its declared `saved_activation_bytes`,
checked exactly against the gradient graphs in transformer_saved_bytes_test.py) and the
gradients it returns (input and weights) is the layer's gradient temporaries. The median of
three steps is compared with the declaration within 20%. Within a process the steps repeat
exactly; between processes the peak moved by up to 4 MiB (attention, 16 x 256 tokens), so the
cases are those whose temporaries are large (14 and 28 MiB declared). A composite layer
declares its largest sub-layer's temporaries, the least its backward needs: the registered
Transformer's encoder layer (16 x 256 tokens, no dropout; 28 MiB declared) measured 27.8 MiB in
one process and 42-44 MiB in two others. Composites are checked where they run, on pipelines
(BENCHMARKS.md 9 and 9e, tests/e2e/memory_model_test.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

TOLERANCE = 0.20

_CHILD = r"""
import json, os, statistics, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
from lingvo_lite.core import base_layer, fprop_context, layer_memory
from lingvo_lite.layers import attention

case = json.loads(sys.argv[1])
B, S, D = case["batch"], case["length"], 128
p = attention.MultiHeadedAttention.Params().Set(
    name="atten", input_dim=D, num_heads=4, atten_dropout_prob=case["dropout"])
layer = p.Instantiate()
shape = tf.TensorShape([B, S, D])
meta = p.cls.FPropMeta(p, shape, shape, shape)
x = tf.random.stateless_normal([B, S, D], seed=[1, 2])
theta = layer.theta
dy = tf.random.stateless_normal([B, S, D], seed=[3, 4])

@tf.function(autograph=False)
def step(x, dy):
    with tf.GradientTape() as tape:
        tape.watch(x)
        with fprop_context.fprop_context(training=True, step_seed=1):
            y = layer.FProp(theta, x, x, x)
        loss = tf.reduce_sum(y * dy)
    return tape.gradient(loss, [x] + theta.Flatten())

returned = sum(t.shape.num_elements() * t.dtype.size for t in step(x, dy))
excess = []
for _ in range(3):
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    grads = step(x, dy)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    del grads
    excess.append(peak - before - layer_memory.saved_activation_bytes(meta) - returned)
print(json.dumps({"measured": statistics.median(excess),
                  "declared": layer_memory.backward_temporary_bytes(meta)}))
"""


def _measure(case: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(case)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [
    # Self-attention without dropout: two float32 probability tensors at the softmax's
    # gradient, less the context and V already freed.
    dict(batch=16, length=256, dropout=0.0),
    dict(batch=8, length=256, dropout=0.0),
], ids=lambda c: f"attention-{c['batch']}x{c['length']}")
def test_declared_temporaries_match_the_allocator(case):
    result = _measure(case)
    measured, declared = result["measured"], result["declared"]
    assert abs(declared - measured) <= TOLERANCE * measured, (
        f"{case}: declared {declared} B, measured {measured} B")
