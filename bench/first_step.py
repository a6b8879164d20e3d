"""Start-up vs micro-batches: the first training step's time and graph size as T grows.

    python bench/first_step.py                       # this checkout, the issue 14 table
    python bench/first_step.py --baseline=/path/to/an/older/checkout

Model: a stack of L dense layers (width 64, tanh) and a softmax loss, N=64 examples, K cells on
K logical CPU devices (serial_devices=True: the accelerator emulation), remat 'always'. For each
(L, K, T) a fresh process builds the pipeline and times the first call of the traced training
step (trace + graph optimisation + one run), then the median of later steps, and counts the
ops of the step's graph including every function body. Each configuration runs unrolled (one
call per action) and with `micro_batch_loop=True` (the micro-batches in a tf.while_loop), and
with --baseline also against the other checkout's `lingvo_lite`, alternating, so the columns are
measured side by side; each is the median of --repeats fresh processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIGS = [(32, 4, 1), (32, 4, 8), (32, 4, 32), (128, 8, 1), (128, 8, 8), (128, 8, 32)]
WIDTH, BATCH = 64, 64


def worker(args: argparse.Namespace) -> dict:
    sys.path.insert(0, args.code_root)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from lingvo_lite.core import devices

    devices.configure_logical_cpus(args.cells, 1, args.cells)
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.core.nested_map import NestedMap
    from lingvo_lite.layers import dense, losses, structural
    from lingvo_lite.pipeline import pipelining_layer

    layers = [structural.FieldLayer.Params().Set(
        name=f"p{i}", field="x", sub=dense.ProjectionLayer.Params().Set(
            name="proj", input_dim=WIDTH, output_dim=WIDTH, activation="TANH"))
        for i in range(args.layers)]
    layers.append(structural.FieldsLayer.Params().Set(
        name="loss", fields=["x", "labels"], sub=losses.SoftmaxCrossEntropyLayer.Params().Set(
            name="xent", input_dim=WIDTH, num_classes=10)))
    pipe = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=args.cells, num_micro_batches=args.micro_batches,
        remat="always", partition_method="uniform", serial_devices=True,
        random_seed=1)
    if args.loop:
        pipe.Set(micro_batch_loop=True)
    pipe = pipe.Instantiate()
    rng = np.random.default_rng(0)
    batch = NestedMap(x=tf.constant(rng.normal(size=(BATCH, WIDTH)), tf.float32),
                      labels=tf.constant(rng.integers(0, 10, size=BATCH), tf.int32))

    @tf.function(autograph=False)
    def step(batch):
        with fprop_context.fprop_context(training=True, step_seed=1):
            out, grads = pipe.FPropAndGrads(pipe.theta, batch)
        return out.loss, grads.Flatten()

    start = time.perf_counter()
    float(step(batch)[0])
    first = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        float(step(batch)[0])
        times.append(time.perf_counter() - start)
    graph_def = step.get_concrete_function(batch).graph.as_graph_def()
    ops = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    return {"first_s": first, "step_s": statistics.median(times), "ops": ops}


def run(code_root: str, layers: int, cells: int, micro_batches: int, steps: int,
        loop: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", f"--code_root={code_root}",
           f"--layers={layers}", f"--cells={cells}", f"--micro_batches={micro_batches}",
           f"--steps={steps}"] + (["--loop"] if loop else [])
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=code_root)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code_root", default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--cells", type=int, default=4)
    parser.add_argument("--micro_batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="Steps timed after the first.")
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3,
                        help="Fresh processes per configuration and variant (medians).")
    parser.add_argument("--baseline", default=None,
                        help="Another checkout's root, measured side by side.")
    parser.add_argument("--configs", default=",".join(f"{a}x{b}x{c}" for a, b, c in CONFIGS),
                        help="L x K x T triples, comma-separated.")
    parser.add_argument("--record", action="store_true",
                        help="Write the table into BENCHMARKS.md (bench/separate/).")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    variants = {"this": (ROOT, False), "loop": (ROOT, True)}
    if args.baseline:
        variants["baseline"] = (os.path.abspath(args.baseline), False)
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    rows = []
    for layers, cells, micro in configs:
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (root, loop) in variants.items():
                runs[name].append(run(root, layers, cells, micro, args.steps, loop))
        results = {name: {key: statistics.median(r[key] for r in results_of)
                          for key in ("first_s", "step_s", "ops")}
                   for name, results_of in runs.items()}
        rows.append(((layers, cells, micro), results))
        print(json.dumps({"L": layers, "K": cells, "T": micro, **results}), flush=True)
    table = _table(rows, bool(args.baseline))
    print("\n" + "\n".join(table))
    if args.record:
        sys.path.insert(0, HERE)
        import report

        body = [
            "A stack of L dense layers (width 64) and a softmax loss, N=64, K cells on K serial "
            "logical CPU devices, remat 'always', GPipe's schedule. First step: the first call "
            "of the traced training step (trace + graph optimisation + one run), each "
            f"configuration in a fresh process, median of {args.repeats}; vs T=1: that time over "
            "the same variant's at T=1 (issue 14's goal: at most 2x at T=32); step: median of "
            "later steps; graph ops: the step's graph plus every function body. Unrolled: one "
            "call of a cell's traced function per action (2KT calls); loop: "
            "`micro_batch_loop=True`, the micro-batches in two tf.while_loops (2K calls). "
            "Baseline: the code before issue 14 (commit b2f3317), every layer traced per "
            "micro-batch.", "", *table, "",
            "Reading: with the loop, the first step at T=32 stays within 2x of T=1 (issue 14's "
            "goal; the unrolled executor's grows with its 2KT call sites, each traced and "
            "optimised). The loop's step matches the unrolled one where cells do real work "
            "(L=128, K=8) and is slower where each call is ~0.1 ms of work (L=32, K=4, T=8): "
            "each iteration's control flow, a few ops per loop variable and device, is then "
            "comparable to the cells' own."]
        command = "python bench/first_step.py" + (
            " --baseline=<a checkout of b2f3317>" if args.baseline else "") + " --record"
        print(report.record_separate("11_first_step", "11. Start-up vs micro-batches: cells "
                                     "traced once (issue 14)", body, command))


def _table(rows: list, baseline: bool) -> list[str]:
    """Per configuration: first step, its ratio to T=1, step time and graph size per variant."""
    first_at_one = {(layers, cells): r for (layers, cells, micro), r in rows if micro == 1}

    def versus_one(layers: int, cells: int, name: str, value: float) -> str:
        one = first_at_one.get((layers, cells))
        return f"{value / one[name]['first_s']:.2f}x" if one else "-"

    names = (["baseline"] if baseline else []) + ["this", "loop"]
    label = {"baseline": "baseline", "this": "unrolled", "loop": "loop"}
    header = ("| L | K | T | " + " | ".join(f"first step ({label[n]})" for n in names) + " | "
              + " | ".join(f"vs T=1 ({label[n]})" for n in names) + " | "
              + " | ".join(f"step ({label[n]})" for n in names) + " | "
              + " | ".join(f"graph ops ({label[n]})" for n in names) + " |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for (layers, cells, micro), r in rows:
        lines.append(
            f"| {layers} | {cells} | {micro} | "
            + " | ".join(f"{r[n]['first_s']:.1f} s" for n in names) + " | "
            + " | ".join(versus_one(layers, cells, n, r[n]["first_s"]) for n in names) + " | "
            + " | ".join(f"{r[n]['step_s'] * 1e3:.1f} ms" for n in names) + " | "
            + " | ".join(f"{int(r[n]['ops']):,}" for n in names) + " |")
    return lines


if __name__ == "__main__":
    main()
