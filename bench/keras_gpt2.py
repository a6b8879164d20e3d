"""Keras path (issues 36 and 47, item 5): K=1 overhead; keras-hub GPT-2 and Llama pipelined on
serial devices.

1. Framework overhead: one `train_on_batch` step of `PipelinedModel` at K=1, T=1,
   remat='never' against the plain `keras.Sequential` (as bench/keras_overhead.py's part 1:
   same layers, weights, optimizer and batch, interleaved rounds), and the op types the
   pipelined step's graph has beyond the plain one's. Goal: at most 1.05x.
2. keras-hub GPT2CausalLM and LlamaCausalLM (built from configs, random weights) as
   functional `PipelinedModel`s on serial logical devices (`serial_devices=True`: each device
   runs one op at a time, like an accelerator): K=2 against K=1 at the same T, for T in
   {1, 4, 8}, timed side by side in interleaved rounds (the speedup: the median of the
   rounds' paired ratios, as this machine's speed drifts over a run). The bubble-only
   bound of K=2 over K=1 at the same T (same micro-batches, same recomputation) is
   2T/(T+1). The time K=2 loses against half of K=1's is broken down: the bubble
   ((T+1)/(2T) of the K=1 step instead of 1/2), the imbalance (the larger cell's share of
   the cost model's FLOPs instead of 1/2 over T+1 slots) and the rest (per-micro-batch
   dispatch and the transfers across the cut).

Run (2 logical devices, intra-op 1, inter-op 2, TF_ENABLE_ONEDNN_OPTS=1 as set below):

    .venv/bin/python bench/keras_gpt2.py --rounds=30 --iters=1 --record
    .venv/bin/python bench/keras_gpt2.py --quick      # tiny sizes: checks that it runs

`--record` writes bench/separate/17_keras_gpt2.md (the tables and the `Target:` lines).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from typing import Any

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"  # Before TensorFlow is imported; both sides alike.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_lib  # noqa: E402

SEPARATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "separate")
COMMAND = ".venv/bin/python bench/keras_gpt2.py --rounds=30 --iters=1 --record"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Tiny sizes, 1 round: a smoke run.")
    parser.add_argument("--rounds", type=int, default=30, help="Interleaved timing rounds.")
    parser.add_argument("--iters", type=int, default=1, help="Steps per timing sample.")
    parser.add_argument("--overhead_rounds", type=int, default=30, help="Part 1 rounds.")
    parser.add_argument("--overhead_iters", type=int, default=10, help="Part 1 steps/sample.")
    parser.add_argument("--batch", type=int, default=32, help="GPT-2 batch size.")
    parser.add_argument("--seq_len", type=int, default=128, help="GPT-2 sequence length.")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 transformer blocks.")
    parser.add_argument("--hidden", type=int, default=128, help="GPT-2 hidden size.")
    parser.add_argument("--vocab", type=int, default=256, help="GPT-2 vocabulary size.")
    parser.add_argument("--micro_batches", default="1,4,8", help="T values.")
    parser.add_argument("--families", default="gpt2,llama", help="keras-hub families timed.")
    parser.add_argument("--record", action="store_true",
                        help="Write bench/separate/17_keras_gpt2.md.")
    return parser.parse_args()


def _overhead(args: argparse.Namespace) -> tuple[dict[str, list[float]], str]:
    """Part 1's samples (seconds per step, per round) and the op types the pipelined step's
    graph has more or fewer of than the plain one's."""
    import collections

    import keras
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.keras import PipelinedModel

    def sequential() -> keras.Sequential:
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((args.mlp_width,))]
                                + [keras.layers.Dense(args.mlp_width, activation="relu")
                                   for _ in range(args.mlp_layers)]
                                + [keras.layers.Dense(10)])

    models = {"keras_sequential": sequential(),
              "pipelined_K1_T1": PipelinedModel(sequential(), num_cells=1,
                                                num_micro_batches=1, remat="never")}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.mlp_width)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch).astype(np.int32)
    ops = {}
    for name, model in models.items():
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.train_on_batch(x, y)  # Builds the optimizer's slots.
        graph = tf.function(lambda a, b, m=model: m.train_step((a, b)), autograph=False
                            ).get_concrete_function(tf.constant(x), tf.constant(y)).graph
        ops[name] = collections.Counter(op.type for op in graph.get_operations())
    more = ops["pipelined_K1_T1"] - ops["keras_sequential"]
    fewer = ops["keras_sequential"] - ops["pipelined_K1_T1"]
    diff = (f"{sum(ops['keras_sequential'].values())} ops in the plain step's graph, "
            f"{sum(ops['pipelined_K1_T1'].values())} in the pipelined one's (MatMul "
            f"{ops['keras_sequential']['MatMul']} and {ops['pipelined_K1_T1']['MatMul']}); "
            f"the pipelined step has more {dict(sorted(more.items()))} and fewer "
            f"{dict(sorted(fewer.items()))}")
    steps = {name: (lambda batch, m=model: m.train_on_batch(*batch), (x, y))
             for name, model in models.items()}
    return bench_lib.interleaved(steps, args.rounds, args.iters), diff


def _causal_lm(family: str, args: argparse.Namespace) -> Any:
    """A keras-hub causal LM of `family` at the benchmark's sizes (no dropout)."""
    import keras_hub

    from model_params.keras_gpt2 import gpt2_causal_lm

    if family == "gpt2":
        return gpt2_causal_lm(args.vocab, args.seq_len, num_layers=args.layers,
                              hidden_dim=args.hidden, num_heads=4)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=args.vocab, num_layers=args.layers, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=args.hidden, intermediate_dim=4 * args.hidden)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _measured_share(model: Any, batch: tuple[Any, Any]) -> float:
    """The larger cell's share of the cells' busy time (the summed durations of each cell's
    ops over 2 profiled steps). `model` runs without serial devices: the profiler does not
    see the ops of functions on TensorFlow's single-threaded executor."""
    import shutil

    from lingvo_lite.analysis import trace_analysis

    for _ in range(2):
        model.train_on_batch(*batch)
    steps, logdir = bench_lib.profiled_steps(lambda b: model.train_on_batch(*b), batch, 3)
    shutil.rmtree(logdir, ignore_errors=True)
    busy = [0, 0]
    for events in steps[1:]:  # The first profiled step also pays the profiler's start.
        for event in events:
            key = (None if event.op_type in trace_analysis.BOOKKEEPING_OPS
                   else trace_analysis.classify_op(event.name))
            if key is not None:
                busy[key[0]] += event.end_ns - event.start_ns
    return max(busy) / sum(busy)


def _lm_steps(family: str, args: argparse.Namespace
              ) -> tuple[dict[str, float], dict[int, float], str, dict[int, float],
                         dict[int, float]]:
    """Median seconds per step by 'K{k}_T{t}', the speedup of K=2 over K=1 at each T (median
    of the rounds' ratios), the K=2 partition's description, and the larger cell's share at
    each T: of the cost model's FLOPs, and of the cells' measured busy time."""
    import keras
    import numpy as np

    from lingvo_lite.keras import PipelinedModel

    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(1, args.vocab, (args.batch, args.seq_len)).astype("int32"),
         "padding_mask": np.ones((args.batch, args.seq_len), "int32")}
    y = rng.integers(0, args.vocab, (args.batch, args.seq_len)).astype("int32")
    shapes = {"token_ids": (args.seq_len,), "padding_mask": (args.seq_len,)}
    def pipelined(k: int, t: int, serial: bool) -> Any:
        keras.utils.set_random_seed(0)
        model = PipelinedModel(
            _causal_lm(family, args), input_shape=shapes, num_cells=k, num_micro_batches=t,
            remat="except_last", serial_devices=serial, cost_batch_size=args.batch)
        model.compile(optimizer=keras.optimizers.SGD(1e-3, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    steps, largest, measured = {}, {}, {}
    for t in (int(v) for v in args.micro_batches.split(",")):
        measured[t] = _measured_share(pipelined(2, t, serial=False), (x, y))
        for k in (1, 2):
            model = pipelined(k, t, serial=True)
            steps[f"K{k}_T{t}"] = (lambda batch, m=model: m.train_on_batch(*batch), (x, y))
            if k == 2:
                part = model.pipeline.partition
                largest[t] = max(part.cell_shares)
                cut = model.pipeline.params.layers[part.cell_layer_ranges[0][1] - 1].name
                partition = (f"the K=2 cut follows `{cut}`; the cells' shares of the cost "
                             f"model's FLOPs: {', '.join(f'{s:.0%}' for s in part.cell_shares)}")
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    speedups = {t: bench_lib.paired_ratio(samples, f"K1_T{t}", f"K2_T{t}") for t in largest}
    return ({name: bench_lib.median(values) for name, values in samples.items()}, speedups,
            partition, largest, measured)


def _lm_table(family: str, args: argparse.Namespace) -> tuple[list[str], str]:
    """The family's table and breakdown lines, and its `Target:` line."""
    title = {"gpt2": "GPT2CausalLM", "llama": "LlamaCausalLM (4 query heads, 2 key-value heads)"}
    times, speedups, partition, largest, measured = _lm_steps(family, args)
    body = ["", f"keras-hub {title[family]} from a config ({args.layers} blocks, hidden "
            f"{args.hidden}, vocabulary {args.vocab}, sequence {args.seq_len}, batch "
            f"{args.batch}) as a functional PipelinedModel, remat 'except_last', serial "
            f"devices, momentum SGD; interleaved rounds ({args.rounds} x {args.iters} steps; "
            "the speedup is the median of each round's K=1 / K=2 ratio, taken seconds apart, "
            "the ms columns are medians over rounds); "
            f"{partition}.", "",
            "| T | K=1 ms | K=2 ms | speedup | bound 2T/(T+1) | share of the bound | larger "
            "cell's busy share | lost to the bubble ms | to imbalance ms | the rest ms |",
            "|---" * 10 + "|"]
    shares = {}
    for t in (int(v) for v in args.micro_batches.split(",")):
        one, speedup = times[f"K1_T{t}"], speedups[t]
        two = one / speedup  # K=2's time at the paired speedup (the median K=2 is beside it).
        bound = 2 * t / (t + 1)
        shares[t] = (speedup, bound)
        bubble = one * (t + 1) / (2 * t)  # Balanced cells, T+1 slots of one micro-batch.
        # The larger cell (busy share b) sets the pace: T of its slots, plus one of the other's.
        b = measured[t]
        imbalanced = one * (b * t + (1 - b)) / t
        body.append(f"| {t} | {one * 1e3:.1f} | {times[f'K2_T{t}'] * 1e3:.1f} | {speedup:.2f}x "
                    f"| {bound:.2f}x | {speedup / bound:.1%} | {b:.1%} | "
                    f"{(bubble - one / 2) * 1e3:.1f} | {(imbalanced - bubble) * 1e3:.1f} | "
                    f"{(two - imbalanced) * 1e3:.1f} |")
    speedups = "/".join(f"{s:.2f}x" for s, _ in shares.values())
    bounds = "/".join(f"{b:.2f}x" for _, b in shares.values())
    ts = "/".join(str(t) for t in shares)
    met = [t for t in shares if t >= 4]
    verdict = ("**met**" if met and all(shares[t][0] / shares[t][1] >= 0.95 for t in met)
               else "**missed**")
    target = (f"Target: keras-hub {family} K=2 over K=1 on serial devices at T={ts} at least "
              f"95% of the bubble-only bound {bounds} at T>=4 | {speedups} ("
              + ", ".join(f"{shares[t][0] / shares[t][1]:.1%} at T={t}" for t in met)
              + f") | {verdict}")
    return body, target


def main() -> None:
    args = _args()
    if args.quick:
        args.rounds, args.iters, args.overhead_iters = 1, 1, 2
        args.batch, args.seq_len, args.layers, args.hidden, args.vocab = 8, 16, 2, 16, 32
        args.micro_batches = "1,4"
    bench_lib.setup(2, 1, 2)
    overhead_args = argparse.Namespace(
        rounds=args.overhead_rounds, iters=args.overhead_iters, mlp_layers=8, mlp_width=512,
        batch=64)
    if args.quick:
        overhead_args.rounds, overhead_args.mlp_layers, overhead_args.mlp_width = 1, 2, 16
    samples, op_diff = _overhead(overhead_args)
    overhead = {name: bench_lib.median(v) for name, v in samples.items()}
    fastest = {name: min(v) for name, v in samples.items()}
    ratio = bench_lib.paired_ratio(samples, "pipelined_K1_T1", "keras_sequential")
    best_ratio = fastest["pipelined_K1_T1"] / fastest["keras_sequential"]
    body = ["Part 1: one `train_on_batch` step of `PipelinedModel` at K=1, T=1, remat='never' "
            "vs the same plain `keras.Sequential` (8 Dense 512 layers, batch 64, momentum SGD), "
            f"interleaved rounds ({overhead_args.rounds} x {overhead_args.iters} steps); the "
            "target's ratio is the median of the rounds' paired ratios (each round's two "
            "samples taken a fraction of a second apart); the fastest round is the one least "
            "disturbed by other processes.", "",
            "| step | median ms | ratio | fastest round ms | ratio |", "|---|---|---|---|---|"]
    body += [f"| {name} | {overhead[name] * 1e3:.2f} | "
             f"{overhead[name] / overhead['keras_sequential']:.3f} | {fastest[name] * 1e3:.2f} | "
             f"{fastest[name] / fastest['keras_sequential']:.3f} |" for name in overhead]
    body += ["", f"Where the rest goes: {op_diff}."]
    targets = []
    for family in args.families.split(","):
        lines, target = _lm_table(family, args)
        body += lines
        targets.append(target)
    body += ["", "The breakdown: K=2 ideally takes half the K=1 step; the bubble adds "
             "(T+1)/(2T) - 1/2 of it; the imbalance: with the larger cell busy a share b of "
             "both cells' time (measured: the summed durations of each cell's ops in 2 "
             "profiled K=2 steps, run without serial devices as the profiler does not see "
             "inside the single-threaded executor's functions), the step takes T slots of "
             "it plus one of the other, (bT + 1 - b)/T of the K=1 step; the rest is what "
             "neither explains (per-micro-batch dispatch, the transfers across the cut, the "
             "machine's drift)."]
    verdict = "**met**" if ratio <= 1.05 else "**missed**"
    body += ["", f"Target: PipelinedModel K=1, T=1 train_on_batch within 1.05x of the plain "
             f"keras.Sequential | {ratio:.3f}x (paired; fastest rounds {best_ratio:.3f}x) | "
             f"{verdict}",
             *targets]
    print("\n".join(body))
    print(json.dumps({"overhead_s": overhead, "args": vars(args)}))
    if args.record:
        now = datetime.datetime.now(datetime.timezone.utc)
        load = tuple(round(v, 2) for v in os.getloadavg())
        text = ["## 17. Keras: K=1 overhead and keras-hub GPT-2 and Llama pipelined "
                "(issues 36, 47)", "",
                f"Recorded {now:%Y-%m-%d %H:%M} UTC by its own script on {os.cpu_count()} "
                f"cores (Python {platform.python_version()}, TF_ENABLE_ONEDNN_OPTS=1); load "
                f"average at the end {load}.", "", *body, "", f"Reproduce: `{COMMAND}`"]
        with open(os.path.join(SEPARATE, "17_keras_gpt2.md"), "w") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
