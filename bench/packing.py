"""Packing vs length buckets vs padding to the longest: tokens/s of the Transformer's layers.

    .venv/bin/python bench/packing.py             # prints the table
    .venv/bin/python bench/packing.py --record    # also records it beside BENCHMARKS.md

The sentences, model and pipeline of bench/buckets.py (log-normal lengths with median 20 cut at
128, seed 0; mt.TransformerSmall's layers, K=2 on 2 serial logical devices, T=4, remat
'except_last', forward and backward, no optimizer), trained three ways side by side in one
process: padded to 128 in batches of 16; in bench/buckets.py's 4 length buckets; and packed
(tasks/mt/packing.py: consecutive sentences share a row of 128 while they fit, segment ids
keep them apart) in batches of 16 rows. Reported: positions/s (padding included), real
tokens/s and the share of padding.
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
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import buckets as bucket_bench  # noqa: E402  (bench/buckets.py: the same sentences)

ROWS = 16


def packed_rows(lengths) -> list[list[int]]:
    """The sentence lengths of each packed row (greedy next-fit, as ParallelTextInput.pack)."""
    from tasks.mt import packing

    return [[int(lengths[i]) for i in row] for row in packing._rows(
        lengths, lengths, bucket_bench.MAX_LENGTH, bucket_bench.MAX_LENGTH)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
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

    n = bucket_bench.MAX_LENGTH
    shapes = input_generator.bucket_shapes(bucket_bench.LENGTHS, bucket_bench.SIZES)
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers.transformer_layers(512, 128, 256, 4, 2, 2),
        num_cells=2, num_micro_batches=4, remat="except_last", serial_devices=True,
        input_buckets=shapes + [layers.input_shapes(ROWS, n, n, packed=True)],
        input_shapes=layers.input_shapes(ROWS, n, n, packed=True), random_seed=1).Instantiate()

    @tf.function(autograph=False)
    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss + tf.add_n([tf.reduce_sum(g) for g in grads.Flatten() if g is not None])

    rng = np.random.default_rng(1)

    def make(batch: int, length: int, rows: list[list[int]] | None = None) -> NestedMap:
        ids = tf.constant(rng.integers(4, 512, size=(batch, length)), tf.int32)
        zeros = tf.zeros([batch, length])
        out = NestedMap(src_ids=ids, src_paddings=zeros, tgt_ids=ids, tgt_paddings=zeros,
                        tgt_labels=ids, tgt_weights=tf.ones([batch, length]))
        if rows is None:
            return out
        seg, pos = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
        for r, row in enumerate(rows):
            start = 0
            for s, size in enumerate(row, start=1):
                seg[r, start:start + size], pos[r, start:start + size] = s, np.arange(size)
                start += size
        pads = tf.constant((seg == 0).astype(np.float32))
        out.update(src_paddings=pads, tgt_paddings=pads, tgt_weights=1.0 - pads)
        for side in ("src", "tgt"):
            out[f"{side}_segment_ids"] = tf.constant(seg)
            out[f"{side}_segment_pos"] = tf.constant(pos)
        return out

    lengths = bucket_bench.sentence_lengths(bucket_bench.NUM_SENTENCES)
    rows = packed_rows(lengths)
    packed = [rows[i:i + ROWS] for i in range(0, len(rows) - ROWS + 1, ROWS)]
    plans = {"padded": bucket_bench.batches(lengths, False),
             "buckets": bucket_bench.batches(lengths, True),
             "packed": [(ROWS, n, sum(map(sum, b))) for b in packed]}
    inputs = {"padded": [make(b, m) for b, m, _ in plans["padded"]],
              "buckets": [make(b, m) for b, m, _ in plans["buckets"]],
              "packed": [make(ROWS, n, b) for b in packed]}
    for batches in inputs.values():  # Every shape traced before timing.
        for b in {tuple(x.src_ids.shape): x for x in batches}.values():
            float(step(b))
    results = {name: [] for name in plans}
    for _ in range(args.rounds):
        for name, batches in inputs.items():
            start = time.perf_counter()
            for x in batches:
                float(step(x))
            results[name].append(time.perf_counter() - start)
    body = ["| input | batches | seconds | positions/s | real tokens/s | padding |",
            "|---|---|---|---|---|---|"]
    real_rate = {}
    for name, plan in plans.items():
        seconds = statistics.median(results[name])
        positions = sum(b * m for b, m, _ in plan)
        real = sum(r for _, _, r in plan)
        real_rate[name] = real / seconds
        body.append(f"| {name} | {len(plan)} | {seconds:.1f} | {positions / seconds:,.0f} | "
                    f"{real / seconds:,.0f} | {1 - real / positions:.0%} |")
    body += ["", f"Real tokens/s over padding to {n}: packed **"
             f"{real_rate['packed'] / real_rate['padded']:.2f}x**, buckets "
             f"{real_rate['buckets'] / real_rate['padded']:.2f}x (packed rows: "
             f"{len(lengths) / len(rows):.1f} sentences each on average).", "",
             f"{bucket_bench.NUM_SENTENCES} sentences, log-normal lengths (median 20, clipped "
             f"to 3..{n}); median of {args.rounds} rounds per input, the inputs alternating; 2 "
             "cores shared with whatever else the machine ran."]
    print("\n".join(body))
    if args.record:
        import report

        path = report.record_separate(
            "packing", "Packing vs length buckets vs padding (issue 38)", body,
            ".venv/bin/python bench/packing.py --record")
        print(f"Wrote {path}")


if __name__ == "__main__":
    main()
