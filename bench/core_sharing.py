"""What sharing cores costs a chain of ops: one alone, two on two cores, two on one core.

    python bench/core_sharing.py            # ~90 s on 2 cores

Section 12c's time model lets K serial devices time-share the host's cores for free (n > C
running actions each at C/n of their speed). This measures how far that holds for two
single-threaded processes running the same `tf.function`: a dense layer's forward, input and
weight gradients and the add into a gradient sum, 8 times per call. `weight`: the
weight-heavy benchmark's layer (2048x2048, 8 rows: memory-bound); `compute`: 512x512 on 512
rows (the weights stay in cache). Prints each process's median call time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {"weight": (8, 2048), "compute": (512, 512)}


def worker(kind: str, seconds: float, core: int) -> None:
    os.sched_setaffinity(0, {core})
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rows, dim = SHAPES[kind]
    w = tf.Variable(tf.random.normal([dim, dim]))
    total = tf.Variable(tf.zeros([dim, dim]))
    x, dy = tf.random.normal([rows, dim]), tf.random.normal([rows, dim])

    @tf.function
    def chain():
        for _ in range(8):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.matmul(x, w)
            dx, dw = tape.gradient(y, [x, w], dy)
            total.assign_add(dw)
        return tf.reduce_sum(dx)

    float(chain())
    times, end = [], time.time() + seconds
    while time.time() < end:
        start = time.perf_counter()
        float(chain())
        times.append(time.perf_counter() - start)
    print(json.dumps({"median_ms": 1e3 * statistics.median(times)}))


def run(kind: str, cores: list[int], seconds: float) -> list[float]:
    """Median call times of one process per entry of `cores`, all started together."""
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--worker={kind}",
                               f"--core={c}", f"--seconds={seconds}"],
                              stdout=subprocess.PIPE, text=True) for c in cores]
    return [json.loads(p.communicate()[0].strip().splitlines()[-1])["median_ms"]
            for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=15.0)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.seconds, args.core)
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit("core_sharing needs 2 cores.")
    for kind in SHAPES:
        alone = run(kind, cores[:1], args.seconds)[0]
        two_cores = run(kind, cores[:2], args.seconds)
        one_core = run(kind, [cores[0]] * 2, args.seconds)
        print(f"{kind}: alone {alone:.1f} ms; two on two cores "
              f"{', '.join(f'{t:.1f}' for t in two_cores)} ms "
              f"({max(two_cores) / alone:.2f}x); two on one core "
              f"{', '.join(f'{t:.1f}' for t in one_core)} ms "
              f"({max(one_core) / alone:.2f}x, time-sharing alone: 2x)")


if __name__ == "__main__":
    main()
