"""ZeRO-1 (`--shard_optimizer_state`): optimizer-slot bytes and peak memory per device, sharded
vs not, measured and predicted.

One gRPC worker process per device (`device_memory.Cluster`: each has its own BFC allocator, so
devices are told apart). For each configuration (R replicas x K cells of a dense stack, Adam)
and each of unsharded / sharded, per device:

* slot bytes: the bytes of the optimizer slot variables placed on the device (their shapes);
* resident: the device's allocator bytes in use after the training steps, minus before the
  pipeline was built (weights, slots, collective tokens);
* peak: the median over `device_memory.MEASURED_STEPS` steps of the device's peak in a step
  above that same baseline (forward, backward, all-reduce, update, all-gather);
* predicted slot bytes: `planner.predict_memory(..., shard_optimizer_state=...)`;
* step time: the median over interleaved rounds (unsharded, sharded, unsharded, ...) of the
  mean time of a few steps, each waiting for every weight update.

    python bench/zero1.py            # writes bench/separate/19_zero1.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

CONFIGS = ((2, 2), (4, 1))  # (R, K): 4 devices each.
LAYERS, WIDTH, BATCH = 4, 512, 16
MIB = 1 << 20


def measure(cluster, num_replicas: int, num_cells: int, sharded: bool) -> dict:
    """Per-device slot bytes, resident and peak bytes of a few training steps."""
    import gc

    import bench_lib
    import device_memory
    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.tasks import optimizers, sharded_optimizer

    layers, shapes, make_batch = bench_lib.mlp(LAYERS, BATCH, WIDTH)
    gc.collect()
    time.sleep(0.2)
    before = [m["current"] for m in cluster.memory_info()]
    num_devices = num_replicas * num_cells
    pipe = bench_lib.make_pipeline(layers, shapes, num_cells, 1, "never",
                                   placement=cluster.devices(num_devices),
                                   num_replicas=num_replicas)
    thetas = pipe.replica_thetas(pipe.theta)
    variables = [[v for v in th.Flatten() if isinstance(v, tf.Variable) and v.trainable]
                 for th in thetas]
    opt = optimizers.Adam.Params().Instantiate()
    if sharded:
        zero = sharded_optimizer.ShardedOptimizer(opt, variables)
        slots = zero.slot_variables()
    else:
        opt.create_slots([v for row in variables for v in row])
        slots = list(opt.slot_variables().values())

    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndReplicaGrads(thetas, batch)
        pairs = [[(x, v) for v, x in zip(theta.Flatten(), g.Flatten())
                  if isinstance(v, tf.Variable) and v.trainable]
                 for theta, g in zip(thetas, grads)]
        if sharded:
            zero.apply(pairs, tf.constant(1e-3))
        else:
            opt.apply([gv for ps in pairs for gv in ps], tf.constant(1e-3))
        return out.loss

    fn = tf.function(step, autograph=False)
    sync = tf.function(lambda: device_memory.sum_of_weights(variables), autograph=False)
    batch = make_batch()
    float(fn(batch))
    float(sync())
    per_step = []
    for _ in range(device_memory.MEASURED_STEPS):
        cluster.reset_peaks()
        float(fn(batch))
        float(sync())
        per_step.append([m["peak"] - b for m, b in zip(cluster.memory_info(), before)])
    resident = [m["current"] - b for m, b in zip(cluster.memory_info(), before)]
    devices = cluster.devices(num_devices)
    slot_bytes = [0] * num_devices
    for v in slots:
        index = tf.DeviceSpec.from_string(v.device).task
        slot_bytes[index] += v.shape.num_elements() * v.dtype.size

    def run_step() -> None:
        fn(batch)
        float(sync())

    return {"slot_bytes": slot_bytes, "resident": resident[:num_devices],
            "peak": [int(statistics.median(d)) for d in zip(*per_step)][:num_devices],
            "devices": devices, "run_step": run_step}


def step_times(runs: dict, rounds: int = 5, steps: int = 5) -> dict:
    """Median over interleaved rounds of the mean seconds per step, for each entry of `runs`."""
    times: dict = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                run["run_step"]()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def predicted_slot_bytes(num_replicas: int, num_cells: int, sharded: bool) -> list[int]:
    import bench_lib

    from lingvo_lite.analysis import memory_model, planner
    from lingvo_lite.pipeline import pipelining_layer
    from lingvo_lite.tasks import optimizers

    layers, shapes, _ = bench_lib.mlp(LAYERS, BATCH, WIDTH)
    p = pipelining_layer.PipeliningLayer.Params().Set(
        name="pipe", layers=layers, num_cells=num_cells, num_micro_batches=1, remat="never",
        input_shapes=shapes, num_replicas=num_replicas)
    mem = planner.predict_memory(p, num_cells, num_replicas, 1, "gpipe", "never",
                                 memory_model.optimizer_slots(optimizers.Adam.Params()),
                                 shard_optimizer_state=sharded)
    return [m.optimizer_slots for m in mem]


def _mib(x: float) -> str:
    return f"{x / MIB:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "separate", "19_zero1.md"))
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import device_memory

    rows, summary, ratios = [], [], []
    with device_memory.Cluster(4) as cluster:
        for r, k in CONFIGS:
            got = {s: measure(cluster, r, k, s) for s in (False, True)}
            want = {s: predicted_slot_bytes(r, k, s) for s in (False, True)}
            seconds = step_times(got)
            for d in range(r * k):
                cell = d % k
                plain, zero = got[False], got[True]
                rows.append(
                    f"| R={r}, K={k} | {d} (replica {d // k}, cell {cell}) | "
                    f"{_mib(plain['slot_bytes'][d])} | {_mib(zero['slot_bytes'][d])} | "
                    f"{zero['slot_bytes'][d] / plain['slot_bytes'][d]:.3f} | "
                    f"{_mib(want[False][cell])} / {_mib(want[True][cell])} | "
                    f"{_mib(plain['resident'][d])} / {_mib(zero['resident'][d])} | "
                    f"{_mib(plain['peak'][d])} / {_mib(zero['peak'][d])} |")
            ratio = sum(got[True]["slot_bytes"]) / sum(got[False]["slot_bytes"])
            ratios.append((r, k, ratio))
            saved = (sum(got[False]["resident"]) - sum(got[True]["resident"])) / (r * k)
            summary.append(f"R={r}, K={k}: slot bytes per device sharded / unsharded = "
                           f"{ratio:.3f} (1/R = {1 / r:.3f}); resident bytes per device "
                           f"{saved / MIB:.2f} MiB lower on average; peak per device "
                           f"{statistics.mean(got[False]['peak']) / MIB:.2f} -> "
                           f"{statistics.mean(got[True]['peak']) / MIB:.2f} MiB (mean); "
                           f"step {seconds[False] * 1e3:.1f} -> {seconds[True] * 1e3:.1f} ms "
                           f"({seconds[True] / seconds[False]:.2f}x).")
    body = [
        f"A stack of {LAYERS} dense {WIDTH}x{WIDTH} tanh layers and a softmax (batch {BATCH}, "
        "T=1, remat never), Adam (2 weight-sized slots and a step count per weight), one gRPC "
        "worker process per device (its own BFC allocator), unsharded vs "
        "`--shard_optimizer_state`. Slot bytes: the slot variables on the device. Resident: "
        "allocator bytes in use after the steps, above the worker's bytes before the pipeline "
        f"was built. Peak: median over {device_memory.MEASURED_STEPS} steps of the step's "
        "peak above the same baseline. "
        "Predicted: planner.predict_memory's optimizer_slots (unsharded / sharded). Step: the "
        "median of 5 interleaved rounds of 5 steps over loopback gRPC, each step waiting for "
        "every weight update (the machine's other jobs add noise: see the load).",
        "",
        "| mesh | device | slot MiB unsharded | slot MiB sharded | ratio | predicted slot MiB "
        "| resident MiB (unsharded / sharded) | peak MiB (unsharded / sharded) |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "", *summary, "",
        "Target: ZeRO-1 optimizer-slot bytes per device at most 1/R of unsharded (Adam, "
        + ", ".join(f"R={r} K={k}" for r, k, _ in ratios) + ") | "
        + " / ".join(f"{x:.3f}x" for _, _, x in ratios) + " | **"
        + ("met" if all(x <= 1 / r + 0.01 for r, _, x in ratios) else "missed") + "**"]
    now = datetime.datetime.now(datetime.timezone.utc)
    load = tuple(round(x, 2) for x in os.getloadavg())
    text = ["## 19. ZeRO-1: optimizer-slot memory per device, sharded vs not (issue 37)", "",
            f"Recorded {now:%Y-%m-%d %H:%M} UTC by its own script on {os.cpu_count()} cores "
            f"(Python {platform.python_version()}); load average at the end {load}.", "",
            *body, "", "Reproduce: `.venv/bin/python bench/zero1.py`"]
    with open(args.out, "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(text))


if __name__ == "__main__":
    main()
