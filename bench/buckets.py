"""Length buckets vs padding to the longest: tokens/s of the registered Transformer's layers.

    .venv/bin/python bench/buckets.py            # records BENCHMARKS.md figure 15
    .venv/bin/python bench/buckets.py --no_record

Sentence lengths are drawn from a log-normal distribution (median 20 tokens, a long tail cut at
128), as WMT's are, deterministically (seed 0). The same sentences are trained on twice, side by
side in one process: padded to 128 in batches of 16 (the fixed-shape way), and in 4 length
buckets (32, 64, 96, 128) with batches of 64, 32, 20 and 16 (about 2,048 positions each), each
batch holding the next sentences of its bucket. Model: mt.TransformerSmall's layers (2+2
layers, D=128, FFN 256, 4 heads, vocabulary 512), K=2 cells on 2 serial logical devices, T=4,
remat 'except_last', forward and backward of each batch (no optimizer). Reported: positions/s
(padding included), real tokens/s, the share of padding, and the first call of every shape a
run can meet (trace + graph optimisation + one run): 1 padded, 4 with buckets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

MAX_LENGTH = 128
LENGTHS = (16, 32, 64, 128)
SIZES = (128, 64, 32, 16)
PADDED_BATCH = 16
NUM_SENTENCES = 640


def sentence_lengths(n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = np.exp(rng.normal(np.log(18), 0.7, size=n)).astype(int) + 2
    return np.clip(lengths, 3, MAX_LENGTH)


def batches(lengths, bucketed: bool):
    """(batch size, padded length, real tokens) of each batch, in stream order."""
    import numpy as np

    if not bucketed:
        return [(PADDED_BATCH, MAX_LENGTH, int(lengths[i:i + PADDED_BATCH].sum()))
                for i in range(0, len(lengths) - PADDED_BATCH + 1, PADDED_BATCH)]
    bucket_of = np.searchsorted(np.asarray(LENGTHS), lengths, side="left")
    out, windows = [], {b: [] for b in range(len(LENGTHS))}
    for length, b in zip(lengths, bucket_of):
        windows[b].append(int(length))
        if len(windows[b]) == SIZES[b]:
            out.append((SIZES[b], LENGTHS[b], sum(windows[b])))
            windows[b] = []
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no_record", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(2, 1, 2)
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.pipeline import pipelining_layer
    from tasks.mt import input_generator, layers

    shapes = input_generator.bucket_shapes(LENGTHS, SIZES)
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers.transformer_layers(512, 128, 256, 4, 2, 2),
        num_cells=2, num_micro_batches=4, remat="except_last", serial_devices=True,
        input_shapes=shapes[-1], random_seed=1).Instantiate()

    @tf.function(autograph=False)
    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss + tf.add_n([tf.reduce_sum(g) for g in grads.Flatten() if g is not None])

    rng = np.random.default_rng(1)

    def make(batch: int, length: int) -> NestedMap:
        ids = tf.constant(rng.integers(4, 512, size=(batch, length)), tf.int32)
        zeros = tf.zeros([batch, length])
        return NestedMap(src_ids=ids, src_paddings=zeros, tgt_ids=ids, tgt_paddings=zeros,
                         tgt_labels=ids, tgt_weights=tf.ones([batch, length]))

    lengths = sentence_lengths(NUM_SENTENCES)
    # The first call of each shape a run can meet: trace, graph optimisation and one run.
    first_call = {}
    for name, shapes_of_run in (("padded", [(PADDED_BATCH, MAX_LENGTH)]),
                                ("buckets", list(zip(SIZES, LENGTHS)))):
        first_call[name] = 0.0
        for b, n in shapes_of_run:
            start = time.perf_counter()
            float(step(make(b, n)))
            first_call[name] += time.perf_counter() - start
    results = {"padded": [], "buckets": []}
    for _ in range(args.rounds):
        for name, bucketed in (("padded", False), ("buckets", True)):
            plan = batches(lengths, bucketed)
            inputs = [make(b, n) for b, n, _ in plan]
            start = time.perf_counter()
            for x in inputs:
                float(step(x))
            results[name].append(time.perf_counter() - start)
    rows = []
    for name, bucketed in (("padded", False), ("buckets", True)):
        plan = batches(lengths, bucketed)
        seconds = statistics.median(results[name])
        positions = sum(b * n for b, n, _ in plan)
        real = sum(r for _, _, r in plan)
        rows.append((name, len(plan), len({(b, n) for b, n, _ in plan}), seconds, positions,
                     real, first_call[name]))
    body = ["| input | batches | shapes met | seconds | positions/s | real tokens/s | padding | "
            "first calls of every shape (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, n, k, seconds, positions, real, first in rows:
        body.append(f"| {name} | {n} | {k} | {seconds:.1f} | {positions / seconds:,.0f} | "
                    f"{real / seconds:,.0f} | {1 - real / positions:.0%} | {first:.1f} |")
    speedup = (rows[1][5] / rows[1][3]) / (rows[0][5] / rows[0][3])
    body += ["", f"Real tokens/s with buckets over padding to {MAX_LENGTH}: **{speedup:.2f}x** "
             f"(the bucketed pass trains on {rows[1][5]:,} of the padded pass's {rows[0][5]:,} "
             "real tokens: each bucket's last, incomplete batch waits for more sentences). "
             f"First calls of the {len(LENGTHS)} bucket shapes (each traced once per run) "
             f"against the padded run's one: {rows[1][6]:.1f} s vs {rows[0][6]:.1f} s.", "",
             f"Target: length buckets train more real tokens/s than padding to the longest "
             f"(Transformer, K=2, T=4, serial devices) | {speedup:.2f}x | "
             f"**{'met' if speedup > 1 else 'missed'}**", "",
             f"{NUM_SENTENCES} sentences, log-normal lengths (median 20, clipped to 3..128); "
             f"median of {args.rounds} rounds per input, the two inputs alternating; 2 cores "
             "shared with whatever else the machine ran."]
    print("\n".join(body))
    if not args.no_record:
        import report

        path = report.record_separate(
            "15_length_buckets", "15. Length buckets vs padding to the longest (issue 38)", body,
            ".venv/bin/python bench/buckets.py")
        print(f"Wrote {path}")


if __name__ == "__main__":
    main()
