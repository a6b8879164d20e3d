"""Weight-heavy layers: from how many rows per micro-batch pipelining them pays.

    python bench/weight_heavy_rows.py [--record]

Section 12's weight-heavy model (4 dense 2048x2048 layers) loses to naive model parallelism at
T=8 on its batch of 64, and section 12a shows why: 8 rows per micro-batch make every forward
and input-gradient matmul nearly as slow as one on 64 rows. This runs the same layers at larger
batches, T=8 on K=2 serial devices (the accelerator emulation), remat 'except_last', momentum
SGD, against naive model parallelism (gpipe, T=1) at the same batch, all timed in interleaved
rounds in one process: the crossover from which micro-batches hold enough rows for the pipeline
to win. Variants: gpipe with per-micro-batch and batched weight gradients
(`weight_gradients='batched'`), and zero_bubble (its W actions fill the drain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import bench_lib  # noqa: E402

BASE_BATCH = 64  # bench_lib's weight-heavy batch; --batches are multiples of it.
VARIANTS = (("gpipe", "per_micro_batch"), ("gpipe", "batched"), ("zero_bubble", None))


def measure(batches: list[int], num_micro_batches: int, devices: int, rounds: int,
            iters: int) -> dict[str, float]:
    """Median seconds per step of every (batch, variant), and of naive MP at each batch."""
    steps = {}
    for batch in batches:
        layers, shapes, make_batch = bench_lib.model("weight_heavy",
                                                     batch_multiple=batch // BASE_BATCH)
        data = make_batch()
        naive = bench_lib.make_pipeline(layers, shapes, devices, 1, "never", serial_devices=True)
        steps[f"b{batch}_naive"] = (bench_lib.pipeline_train_step(naive)[0], data)
        for schedule, weight_gradients in VARIANTS:
            extra = {"weight_gradients": weight_gradients} if weight_gradients else {}
            pipe = bench_lib.make_pipeline(layers, shapes, devices, num_micro_batches,
                                           "except_last", serial_devices=True,
                                           schedule=schedule, **extra)
            steps[f"b{batch}_{_name(schedule, weight_gradients)}"] = (
                bench_lib.pipeline_train_step(pipe)[0], data)
    samples = bench_lib.interleaved(steps, rounds, iters)
    return {name: bench_lib.median(s) for name, s in samples.items()}


def _bound(num_micro_batches: int, devices: int, pipeline_units: float | None = None) -> float:
    """Naive MP's step over the ideal pipeline's, in forward units (backward = 2)."""
    t = num_micro_batches
    if pipeline_units is None:  # remat 'except_last': all but the last forward re-run.
        pipeline_units = 3.0 + (t - 1) / t
    return devices * 3.0 / ((t + devices - 1) / t * pipeline_units)


def _name(schedule: str, weight_gradients: str | None) -> str:
    return schedule if weight_gradients is None else f"{schedule}_{weight_gradients}"


def table(medians: dict[str, float], batches: list[int], num_micro_batches: int) -> list[str]:
    names = [_name(s, w) for s, w in VARIANTS]
    lines = ["| batch | rows per micro-batch | naive MP (T=1) | "
             + " | ".join(f"{n} (T={num_micro_batches})" for n in names)
             + " | best vs naive MP |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    bests = []
    for batch in batches:
        naive = medians[f"b{batch}_naive"]
        times = [medians[f"b{batch}_{n}"] for n in names]
        cells = " | ".join(f"{t * 1e3:.0f} ms ({naive / t:.2f}x)" for t in times)
        best = naive / min(times)
        lines.append(f"| {batch} | {batch // num_micro_batches} | {naive * 1e3:.0f} ms | "
                     f"{cells} | **{best:.2f}x** |")
        bests.append((batch, best))
    winning = [b for b, best in bests if best >= 1.0]
    lines += ["", (f"Pipelining beats naive model parallelism from batch {winning[0]} "
                   f"({winning[0] // num_micro_batches} rows per micro-batch) in this run."
                   if winning else "Pipelining loses to naive model parallelism at every "
                   "batch of this run.")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,128,256,512",
                        help="Mini-batch sizes, multiples of 64.")
    parser.add_argument("--num_micro_batches", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--record", action="store_true",
                        help="Write the table into BENCHMARKS.md (bench/separate/).")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bad = [b for b in batches if b % BASE_BATCH or b % args.num_micro_batches]
    if bad:
        sys.exit(f"--batches: {bad} must be multiples of {BASE_BATCH} and of "
                 f"--num_micro_batches={args.num_micro_batches}.")
    bench_lib.setup(args.devices, 1, args.devices)
    medians = measure(batches, args.num_micro_batches, args.devices, args.rounds, args.iters)
    print(json.dumps(medians))
    lines = table(medians, batches, args.num_micro_batches)
    print("\n".join(lines))
    if args.record:
        import report

        intro = [
            f"4 dense 2048x2048 layers (section 12's weight-heavy model) at several batches, "
            f"T={args.num_micro_batches} on K={args.devices} serial logical CPU devices (one "
            "thread each), remat 'except_last', momentum SGD, against naive model parallelism "
            "(gpipe, T=1) at the same batch; medians of "
            f"{args.rounds} interleaved rounds of {args.iters} steps, all in one process. "
            "Speedup over naive MP in parentheses. The bound, with every micro-batch's "
            "matmuls as fast per row as the whole batch's: naive MP runs each device's "
            "forward and backward (3 units) one device after the other; the pipeline "
            "runs them on each device at once and re-runs "
            f"{args.num_micro_batches - 1} of the {args.num_micro_batches} forwards (remat "
            f"'except_last': 3 + {args.num_micro_batches - 1}/{args.num_micro_batches} units)"
            " over (T + K - 1) / T of the step, "
            f"{_bound(args.num_micro_batches, args.devices):.2f}x (without "
            f"re-materialisation {_bound(args.num_micro_batches, args.devices, 3.0):.2f}x).",
            ""]
        print(report.record_separate(
            "12b_weight_heavy_rows", "12b. Weight-heavy layers: the batch from which "
            "pipelining them pays (issue 14)", intro + lines,
            "python bench/weight_heavy_rows.py --record"))


if __name__ == "__main__":
    main()
