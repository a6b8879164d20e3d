"""Runs one benchmark figure in this process and prints its result as one JSON line.

`run_all.py` starts one worker per figure with the environment (oneDNN, BFC allocator) and
the device / thread flags set before TensorFlow starts:

    python bench/worker.py --figure=speedup --model=transformer --devices=2 --intra=1 --inter=2

Figures: speedup, speedup_serial, single_device, microbatch_cost, overhead, remat_cost,
memory, fits, partition, data_parallel, cross_process.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_lib  # noqa: E402
from absl import app, flags  # noqa: E402

flags.DEFINE_string("figure", None, "Which figure to run.")
flags.DEFINE_string("model", "transformer", "Benchmark model (bench_lib.model).")
flags.DEFINE_integer("devices", 2, "Logical CPU devices.")
flags.DEFINE_integer("intra", 1, "Intra-op threads.")
flags.DEFINE_integer("inter", 2, "Inter-op threads.")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16"], "T values.")
flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (the median is reported).")
flags.DEFINE_integer("iters", 2, "Steps per timing sample.")
flags.DEFINE_bool("profile", False, "speedup: also profile one step per T (bubble figure).")
flags.DEFINE_bool("quick", False, "Smaller shapes.")
flags.DEFINE_float("budget_mib", 48.0, "fits: memory budget per device (MiB).")
FLAGS = flags.FLAGS


def _ts() -> list[int]:
    return [int(t) for t in FLAGS.micro_batches]


def _summary(samples: dict[str, list[float]]) -> dict:
    return {name: {"median_s": bench_lib.median(v), "samples_s": v}
            for name, v in samples.items()}


# ---------------------------------------------------------------------------------------------


def fig_speedup() -> dict:
    """K=2 at every T (default remat) and K=1 T=1 without remat, timed side by side."""
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    steps, pipes = {}, {}
    for t in _ts():
        pipe = bench_lib.make_pipeline(layers, shapes, 2, t, "except_last")
        steps[f"K2_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
        pipes[t] = pipe
    one = bench_lib.make_pipeline(layers, shapes, 1, 1, "never")
    steps["K1_T1_one_core"] = (bench_lib.pipeline_train_step(one)[0], batch)
    samples = bench_lib.interleaved(steps, FLAGS.rounds, FLAGS.iters)
    out = {"model": FLAGS.model, "times": _summary(samples),
           "partition": pipes[_ts()[0]].partition.report()}
    if FLAGS.profile:
        out["profiles"] = {t: _profile_step(steps[f"K2_T{t}"][0], batch) for t in _ts()}
    return out


def fig_speedup_serial() -> dict:
    """Accelerator emulation: every device runs one op at a time (`serial_devices`).

    For each remat policy, K=2 at every T against naive model parallelism (K=2, T=1)
    with the same policy, so per-micro-batch work is equal and the ideal is 2T/(T+1).
    K=1 on one serial device at every T (no recomputation) measures the total work W(T)
    the pipeline spreads over its devices, so the bubble can be separated from what
    micro-batching itself costs. Also naive K=2, T=1 without serial devices: how many
    cores the shared inter-op pool lets the sequential baseline use.
    """
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    steps = {}
    for remat in ("never", "always", "except_last"):
        for t in _ts():
            pipe = bench_lib.make_pipeline(layers, shapes, 2, t, remat, serial_devices=True)
            steps[f"serial_{remat}_K2_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    for t in _ts():
        pipe = bench_lib.make_pipeline(layers, shapes, 1, t, "never", serial_devices=True)
        steps[f"work_never_K1_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    shared = bench_lib.make_pipeline(layers, shapes, 2, 1, "never")
    steps["shared_never_K2_T1"] = (bench_lib.pipeline_train_step(shared)[0], batch)
    return {"model": FLAGS.model,
            "times": _summary(bench_lib.interleaved(steps, FLAGS.rounds, FLAGS.iters))}


def _profile_step(fn, batch) -> dict:
    """Captures 3 steps with the TF profiler; the breakdown of each, and the middle one's boxes."""
    from lingvo_lite.analysis import trace_analysis

    step_events, logdir = bench_lib.profiled_steps(fn, batch, 3)
    steps = [trace_analysis.compute_breakdown(evs, 2).as_scalars(prefix="") for evs in step_events]
    return {"steps": steps, "logdir": logdir}


def fig_single_device() -> dict:
    """K=1, T=1, no remat: one device using every core given by --intra/--inter."""
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    pipe = bench_lib.make_pipeline(layers, shapes, 1, 1, "never")
    samples = bench_lib.interleaved(
        {"K1_T1": (bench_lib.pipeline_train_step(pipe)[0], batch)}, FLAGS.rounds, FLAGS.iters)
    return {"model": FLAGS.model, "times": _summary(samples)}


def fig_overhead() -> dict:
    """PipeliningLayer at K=1, T=1, no remat vs the same model as a plain tape step."""
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    pipe = bench_lib.make_pipeline(layers, shapes, 1, 1, "never")
    plain_model = bench_lib.make_pipeline(layers, shapes, 1, 1, "never")
    steps = {"pipeline": (bench_lib.pipeline_train_step(pipe)[0], batch),
             "plain": (bench_lib.plain_train_step(plain_model)[0], batch)}
    return {"model": FLAGS.model,
            "times": _summary(bench_lib.interleaved(steps, FLAGS.rounds, FLAGS.iters))}


def fig_remat_cost() -> dict:
    """Throughput with each remat mode at K=1, T=1 and at K=2, T=4."""
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    steps = {}
    for k, t in ((1, 1), (2, 4)):
        for mode in ("never", "except_last", "always"):
            pipe = bench_lib.make_pipeline(layers, shapes, k, t, mode)
            steps[f"K{k}_T{t}_{mode}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    return {"model": FLAGS.model,
            "times": _summary(bench_lib.interleaved(steps, FLAGS.rounds, FLAGS.iters))}


def fig_microbatch_cost() -> dict:
    """Diagnostic: what micro-batching costs without any parallelism (K=1, no remat)."""
    layers, shapes, make_batch = bench_lib.model(FLAGS.model, FLAGS.quick)
    batch = make_batch()
    steps = {}
    for t in _ts():
        pipe = bench_lib.make_pipeline(layers, shapes, 1, t, "never")
        steps[f"K1_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    return {"model": FLAGS.model,
            "times": _summary(bench_lib.interleaved(steps, FLAGS.rounds, FLAGS.iters))}


def fig_memory() -> dict:
    """BFC peaks, split into weights / grads+optimizer / activations, per remat mode and T."""
    import remat_memory

    out = {}
    for t in _ts():
        out[t] = remat_memory.measure_peaks(
            num_layers=16, num_cells=2, num_micro_batches=t, batch_size=2048, width=64,
            modes=["never", "except_last", "always"], bias=True)
    return {"by_T": out}


def _cell_peak(num_blocks: int, num_micro: int, remat: str) -> dict:
    """Absolute per-device bytes of one cell of `num_blocks` Transformer blocks.

    A K=1 pipeline with remat='always' (the cell recomputes, like every cell but the last
    one of a GPipe pipeline) holds what one device of a balanced K-cell pipeline holds: its
    weights, gradients and optimizer slots, its input boundary for all T micro-batches, and
    one micro-batch's activations while it recomputes and back-propagates.
    """
    import tensorflow as tf

    layers, shapes, make_batch = bench_lib.transformer(num_blocks, 16, 128, 128, 512, 4)
    batch = make_batch()
    pipe = bench_lib.make_pipeline(layers, shapes, 1, num_micro, remat)
    fn, variables, slots = bench_lib.pipeline_train_step(pipe)
    float(fn(batch))
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    float(fn(batch))
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    weights = sum(v.shape.num_elements() * 4 for v in variables)
    inputs = sum(x.shape.num_elements() * x.dtype.size for x in batch.Flatten())
    return {"blocks": num_blocks, "weights": weights, "slots": weights, "inputs": inputs,
            "transient": peak - before, "total": 2 * weights + inputs + peak - before,
            "params": weights // 4}


def fig_fits() -> dict:
    """Largest Transformer (blocks of D=128) whose per-device peak fits the budget."""
    budget = int(FLAGS.budget_mib * 2**20)
    configs = {"naive (K=1, T=1, no remat)": (1, "never"),
               "pipeline cell (T=8, remat)": (8, "always")}
    out = {"budget_bytes": budget, "configs": {}}
    for label, (t, remat) in configs.items():
        measured = {}

        def total(n, t=t, remat=remat, measured=measured):
            if n not in measured:
                measured[n] = _cell_peak(n, t, remat)
            return measured[n]["total"]

        a, b = total(1), total(2)
        per_block = max(b - a, 1)
        guess = max(1, int((budget - (a - per_block)) // per_block))
        n = guess
        while n > 1 and total(n) > budget:
            n -= 1
        while total(n + 1) <= budget and n < guess + 3:
            n += 1
        fits = total(n) <= budget
        out["configs"][label] = {"max_blocks": n if fits else 0, "per_block_bytes": per_block,
                                 "measurements": measured}
    return out


def fig_partition() -> dict:
    """Cost-model imbalance of every registered model's pipelines at K = 2, 4, 8."""
    from lingvo_lite.pipeline import pipelining_layer
    from lingvo_lite.tasks import model_registry
    from lingvo_lite.training import model_config

    model_registry.add_model_package("model_params")  # As trainer.py does.
    rows = []
    for name in model_registry.list_models():
        try:
            task_p = model_registry.get_params(name).Task()
            pipelines = list(model_config.iter_pipelining_params(task_p))
        except Exception as e:  # A model others are still writing: report, do not fail.
            rows.append({"model": name, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        if not pipelines:
            rows.append({"model": name, "error": "no PipeliningLayer"})
        for path, pp in pipelines:
            row = {"model": name, "pipeline": path, "num_layers": len(pp.layers),
                   "method": pp.partition_method, "cost": pp.partition_cost}
            for k in (2, 4, 8):
                if k > len(pp.layers):
                    row[f"K{k}"] = None
                    continue
                q = pp.Copy().Set(num_cells=k)
                if q.partition_method == "explicit":
                    q.Set(partition_method="min_max", split_points=None)
                try:
                    part = pipelining_layer.PipeliningLayer.ComputePartition(q)
                    row[f"K{k}"] = part.imbalance
                    row[f"K{k}_sizes"] = list(part.cell_sizes)
                except Exception as e:
                    row[f"K{k}"] = f"error: {e}"[:120]
            rows.append(row)
    return {"rows": rows}


def fig_data_parallel() -> dict:
    import scaleout

    return scaleout.data_parallel(FLAGS.model, FLAGS.quick, FLAGS.rounds, FLAGS.iters)


def fig_cross_process() -> dict:
    import scaleout

    return scaleout.cross_process(FLAGS.model, FLAGS.quick, FLAGS.rounds, FLAGS.iters,
                                  FLAGS.intra, FLAGS.inter)


FIGURES = {"speedup": fig_speedup, "speedup_serial": fig_speedup_serial,
           "microbatch_cost": fig_microbatch_cost,
           "single_device": fig_single_device, "overhead": fig_overhead,
           "remat_cost": fig_remat_cost, "memory": fig_memory, "fits": fig_fits,
           "partition": fig_partition, "data_parallel": fig_data_parallel,
           "cross_process": fig_cross_process}


def main(argv) -> None:
    del argv
    if FLAGS.figure not in FIGURES:
        raise SystemExit(f"--figure={FLAGS.figure!r}; use one of {sorted(FIGURES)}.")
    bench_lib.setup(FLAGS.devices, FLAGS.intra, FLAGS.inter)
    result = FIGURES[FLAGS.figure]()
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    app.run(main)
