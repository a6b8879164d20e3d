"""Shared pieces of the benchmarks: process set-up, benchmark models, train steps, timing.

Every benchmark runs in a fresh process (see `run_all.py`) because logical devices, thread
pools, the BFC allocator and oneDNN can only be chosen before TensorFlow starts. Import this
module, call `setup()` first, and only then touch TensorFlow.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def setup(num_devices: int, intra_op_threads: int, inter_op_threads: int) -> None:
    """Configures logical CPUs and thread pools; must run before any TensorFlow op."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(num_devices, intra_op_threads, inter_op_threads)


# ---------------------------------------------------------------------------------------------
# Models. Each builder returns (layer params, input shapes, batch maker).


def _transformer_block_cls():
    import tensorflow as tf

    from lingvo_lite.core import base_layer, hyperparams, layer_memory
    from lingvo_lite.layers import attention, feedforward, normalization

    class TransformerBlock(base_layer.BaseLayer):
        """Pre-LN self-attention with residual, then a pre-LN feed-forward with residual."""

        @classmethod
        def Params(cls) -> hyperparams.InstantiableParams:
            p = super().Params()
            p.Define("model_dim", 0, "Depth D.")
            p.Define("hidden_dim", 0, "Feed-forward hidden depth.")
            p.Define("num_heads", 1, "Attention heads.")
            return p

        @staticmethod
        def _children(p):
            return dict(
                ln=normalization.LayerNorm.Params().Set(input_dim=p.model_dim),
                atten=attention.MultiHeadedAttention.Params().Set(
                    input_dim=p.model_dim, num_heads=p.num_heads),
                ffn=feedforward.FeedForwardLayer.Params().Set(
                    input_dim=p.model_dim, hidden_dim=p.hidden_dim))

        def __init__(self, params):
            super().__init__(params)
            for name, child in self._children(self.params).items():
                self.CreateChild(name, child)

        def FProp(self, theta, x):
            h = self.ln.FProp(theta.ln, x)
            x = x + self.atten.FProp(theta.atten, h, h, h)
            return self.ffn.FProp(theta.ffn, x)

        @classmethod
        def FPropMeta(cls, p, x_shape):
            shape = base_layer.to_shape(x_shape)
            flops, params = float(shape.num_elements()), 0
            metas = []
            for name, child in cls._children(p).items():
                args = (shape,) * (3 if name == "atten" else 1)
                metas.append(child.cls.FPropMeta(child, *args))
                flops += metas[-1].flops
                params += metas[-1].num_params
            # The residual adds keep nothing: the children's tensors are all.
            return base_layer.fprop_meta(flops, shape, params, tf.float32,
                                         memory=layer_memory.composite(metas))

    return TransformerBlock


def transformer(num_blocks: int, batch: int, seq: int, dim: int, hidden: int, heads: int,
                num_classes: int = 32):
    """A Transformer encoder stack on random [B, S, D] inputs with per-token labels."""
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.layers import losses, structural

    block = _transformer_block_cls()
    layers = [structural.FieldLayer.Params().Set(
        name=f"block_{i}", field="x", sub=block.Params().Set(
            name="block", model_dim=dim, hidden_dim=hidden, num_heads=heads))
        for i in range(num_blocks)]
    layers.append(structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"], sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=dim, num_classes=num_classes)))
    shapes = NestedMap(x=tf.TensorShape([batch, seq, dim]), labels=tf.TensorShape([batch, seq]))

    def make_batch(seed: int = 0):
        rng = np.random.default_rng(seed)
        return NestedMap(x=tf.constant(rng.normal(size=(batch, seq, dim)), tf.float32),
                         labels=tf.constant(rng.integers(0, num_classes, (batch, seq)), tf.int32))

    return layers, shapes, make_batch


def mlp(num_layers: int, batch: int, width: int, num_classes: int = 10, bias: bool = True):
    """Dense tanh layers of one width (weight-heavy when width >> batch)."""
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.layers import dense, losses, structural

    layers = [structural.FieldLayer.Params().Set(
        name=f"dense_{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
            name="proj", input_dim=width, output_dim=width, activation="TANH", has_bias=bias))
        for i in range(num_layers)]
    layers.append(structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"], sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=width, num_classes=num_classes)))
    shapes = NestedMap(x=tf.TensorShape([batch, width]), labels=tf.TensorShape([batch]))

    def make_batch(seed: int = 0):
        rng = np.random.default_rng(seed)
        return NestedMap(x=tf.constant(rng.normal(size=(batch, width)), tf.float32),
                         labels=tf.constant(rng.integers(0, num_classes, batch), tf.int32))

    return layers, shapes, make_batch


def amoebanet(batch: int, image_size: int, filters: int, num_normal_cells: int):
    """AmoebaNet-D (tasks/image) with a CIFAR stem on random images."""
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core.nested_map import NestedMap
    from tasks.image import amoebanet as amoeba

    net = amoeba.AmoebaNetParams().Set(
        variant="D", num_normal_cells=num_normal_cells, filters=filters, image_size=image_size,
        num_channels=3, num_classes=10, stem_type="cifar", stem_filters=filters,
        drop_path_keep_prob=1.0, dropout_keep_prob=1.0, aux_head_weight=0.0)
    layers = amoeba.amoebanet_layers(net)
    shapes = amoeba.input_shapes(net, batch)

    def make_batch(seed: int = 0):
        rng = np.random.default_rng(seed)
        return NestedMap(
            image=tf.constant(rng.normal(size=(batch, image_size, image_size, 3)), tf.float32),
            label=tf.constant(rng.integers(0, 10, batch), tf.int32))

    return layers, shapes, make_batch


def mt_transformer(batch: int, length: int, num_layers: int, dropout_prob: float,
                   vocab: int = 512):
    """The registered Transformer's layers (tasks/mt: embedding, encoder and decoder layers,
    softmax) on random token ids, the last two positions of every sentence padded."""
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core.nested_map import NestedMap
    from tasks.mt import layers as mt

    layers = mt.transformer_layers(vocab, 128, 512, 4, num_layers, num_layers,
                                   dropout_prob=dropout_prob)
    shapes = NestedMap({k: tf.TensorShape([batch, length]) for k in (
        "src_ids", "src_paddings", "tgt_ids", "tgt_paddings", "tgt_labels", "tgt_weights")})

    def make_batch(seed: int = 0):
        rng = np.random.default_rng(seed)
        paddings = np.zeros((batch, length), np.float32)
        paddings[:, -2:] = 1.0

        def ids():
            return tf.constant(rng.integers(1, vocab, (batch, length)), tf.int32)

        return NestedMap(src_ids=ids(), src_paddings=tf.constant(paddings), tgt_ids=ids(),
                         tgt_paddings=tf.constant(paddings), tgt_labels=ids(),
                         tgt_weights=tf.constant(1.0 - paddings))

    return layers, shapes, make_batch


def model(name: str, quick: bool = False, batch_multiple: int = 1):
    """The named benchmark configuration (see BENCHMARKS.md for why each is sized so).

    `batch_multiple` scales the batch (data-parallel figures keep the per-replica batch).
    """
    m = batch_multiple
    if name == "transformer":  # Compute-heavy: long sequences, attention + FFN.
        return transformer(8, 16 * m, 256 if not quick else 128, 128, 512, 4)
    if name == "transformer_small":  # For overhead / remat cost figures at K=1.
        return transformer(4, 8 * m, 128, 128, 512, 4)
    if name == "amoebanet":
        return amoebanet(32 * m, 32, 32, 1) if not quick else amoebanet(16 * m, 16, 16, 1)
    if name == "weight_heavy":  # 2048x2048 dense layers on a small batch.
        return mlp(4, 64 * m, 2048)
    if name == "mt_transformer":  # tasks/mt's layers: 2 + 2 layers, 128 tokens, dropout 0.1.
        return mt_transformer(16 * m, 128 if not quick else 64, 2, 0.1)
    raise ValueError(f"Unknown benchmark model {name!r}.")


# ---------------------------------------------------------------------------------------------
# Steps.


def make_pipeline(layers, shapes, num_cells: int, num_micro_batches: int, remat: str,
                  **kwargs):
    from lingvo_lite.pipeline import pipelining_layer

    return pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=num_cells, num_micro_batches=num_micro_batches,
        remat=remat, input_shapes=shapes, random_seed=1, **kwargs).Instantiate()


def _momentum_slots(variables):
    import tensorflow as tf

    slots = []
    for v in variables:
        with tf.device(v.device):
            slots.append(tf.Variable(tf.zeros_like(v), trainable=False))
    return slots


def pipeline_train_step(pipe, learning_rate: float = 1e-3, momentum: float = 0.9):
    """A compiled step: pipelined forward/backward, then momentum-SGD on each weight's device."""
    import tensorflow as tf

    from lingvo_lite.core import fprop_context

    variables = [v for v in pipe.vars.Flatten() if v.trainable]
    slots = _momentum_slots(variables)

    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        by_ref = {v.ref(): g for v, g in zip(pipe.theta.Flatten(), grads.Flatten())
                  if isinstance(v, tf.Variable)}
        _apply(variables, slots, [by_ref[v.ref()] for v in variables], learning_rate, momentum)
        return out.loss

    return tf.function(step, autograph=False), variables, slots


def _apply(variables, slots, grads, learning_rate, momentum):
    import tensorflow as tf

    for v, s, g in zip(variables, slots, grads):
        with tf.device(v.device):
            s.assign(momentum * s + g)
            v.assign_sub(learning_rate * s)


def plain_train_step(pipe, learning_rate: float = 1e-3, momentum: float = 0.9):
    """The same model and update as a plain tf.function + GradientTape (no pipeline code)."""
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.layers import composite

    variables = [v for v in pipe.vars.Flatten() if v.trainable]
    slots = _momentum_slots(variables)

    def step(batch):
        with fprop_context.fprop_context(training=True):
            with tf.GradientTape() as tape:
                out = composite.chain_fprop(pipe.layers, pipe.theta.layers, batch)
            grads = tape.gradient(out.loss, variables)
        _apply(variables, slots, grads, learning_rate, momentum)
        return out.loss

    return tf.function(step, autograph=False), variables, slots


# ---------------------------------------------------------------------------------------------
# Timing.


def time_calls(fn: Callable, arg, iters: int) -> float:
    """Mean seconds per call over `iters` calls (results fetched, so the work is done)."""
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(arg)
    float(out)
    return (time.perf_counter() - start) / iters


def interleaved(steps: dict[str, tuple[Callable, object]], rounds: int, iters: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Per variant, `rounds` samples of seconds/step, taken in interleaved rounds.

    Interleaving (A B C A B C ...) exposes every variant to the same background load, so
    ratios between them are fair even on a shared machine.
    """
    for fn, arg in steps.values():
        for _ in range(warmup):
            float(fn(arg))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, (fn, arg) in steps.items():
            samples[name].append(time_calls(fn, arg, iters))
    return samples


def profiled_steps(fn: Callable, arg, num_steps: int = 3) -> tuple[list[list], str]:
    """Runs `fn(arg)` num_steps times under the TF profiler; each step's op events (one list
    per step, see lingvo_lite.analysis.trace_analysis) and the trace's logdir."""
    import tempfile

    import tensorflow as tf

    from lingvo_lite.analysis import trace_analysis

    logdir = tempfile.mkdtemp(prefix="bench_profile_")
    tf.profiler.experimental.start(logdir)
    for i in range(num_steps):
        with tf.profiler.experimental.Trace(trace_analysis.STEP_TRACE_NAME, step_num=i, _r=1):
            float(fn(arg))
    tf.profiler.experimental.stop()
    spaces = trace_analysis.load_xspaces(logdir)
    events = trace_analysis.op_events(spaces)
    return ([trace_analysis.events_in(events, start, end)
             for _, start, end in trace_analysis.step_windows(spaces)], logdir)


def median(values) -> float:
    return float(statistics.median(values))


def paired_ratio(samples: dict[str, list[float]], numerator: str, denominator: str) -> float:
    """Median over rounds of numerator's sample / denominator's sample of the same round.

    Samples of one round of `interleaved` were taken seconds apart, so their ratio cancels
    what drifts over a run (this machine's speed swings by 15-30% over tens of seconds with
    nothing else running: GPT-2 K=1 steps measured between 456 and 640 ms in one process).
    """
    return median([a / b for a, b in zip(samples[numerator], samples[denominator])])


# ---------------------------------------------------------------------------------------------
# Cluster probes: task processes started, watched and stopped by the probe scripts.


def free_port() -> int:
    """A TCP port of 127.0.0.1 free at the moment of the call."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProbeTasks:
    """Task processes `python -c script <spec as JSON>`, started in the order of `specs`
    ({task index: spec}), their output lines kept with the time each was read.

    Only these processes are stopped (`stop`), by PID.
    """

    def __init__(self, script: str, specs: dict[int, dict], log_level: str = "2") -> None:
        import json
        import subprocess
        import threading

        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=log_level)
        self.procs: dict[int, subprocess.Popen] = {}
        self.lines: dict[int, list[tuple[float, str]]] = {}
        for index, spec in specs.items():
            proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(spec)], env=env,
                                    text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.procs[index], self.lines[index] = proc, []

            def read(proc=proc, lines=self.lines[index]) -> None:
                for line in proc.stdout:
                    lines.append((time.monotonic(), line.rstrip()))
            threading.Thread(target=read, daemon=True).start()

    def wait_for(self, index: int, text: str, timeout_s: float = 240) -> None:
        """Waits until task `index` prints `text`; exits with its last lines if it ends or
        the time is up first."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for _, line in self.lines[index]):
            if time.monotonic() > deadline or self.procs[index].poll() is not None:
                print("\n".join(line for _, line in self.lines[index][-30:]))
                raise SystemExit(f"task {index} never printed {text!r}")
            time.sleep(0.05)

    def wait(self, index: int, timeout_s: float) -> int | None:
        """Task `index`'s exit status, or None if it still runs after `timeout_s`."""
        import subprocess

        try:
            return self.procs[index].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def print_since(self, index: int, since: float, label: str) -> None:
        """Task `index`'s lines read from half a second before `since`, step events left out,
        each with its time after `since`."""
        for at, text in self.lines[index]:
            if at >= since - 0.5 and "EVENT step" not in text:
                print(f"  {label} +{at - since:6.1f} s  {text[:240]}")

    def stop(self) -> None:
        """Kills the tasks still running (continued first, if stopped)."""
        import signal

        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
