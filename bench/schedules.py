"""Schedules side by side: gpipe, 1f1b, interleaved, zero_bubble; batched weight gradients.

    python bench/schedules.py                      # the recorded run (~10 min on 2 cores)
    python bench/schedules.py --quick              # smaller shapes, fewer T and rounds

Two figures, each in a fresh process with K logical CPU devices (intra-op 1, inter-op K):

- `speedup`: on serial devices (the accelerator emulation), every schedule at every T, timed in
  interleaved rounds against naive model parallelism (gpipe, T=1). Each configuration is also
  profiled, on the shared pool (TensorFlow's single-threaded executor, which serial devices use,
  emits no per-op profiler events): the measured mean idle fraction of the devices during the
  pipelined phase stands next to the schedule's theoretical bubble (its unit-time timeline's
  idle share). interleaved puts 2 cells on each device (virtual_stages=2); zero_bubble's W
  re-runs the cell's forward.
- `weight_heavy`: 4 dense 2048x2048 layers on a batch of 64, gpipe with per-micro-batch vs batched
  weight gradients, against naive model parallelism, on serial devices and on the shared pool.

All numbers in a figure come from one process, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_lib  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1))


def _idle_per_device(events, virtual_stages: int, num_devices: int) -> float:
    """Mean over devices of their idle share of the pipelined phase (first to last cell op)."""
    from lingvo_lite.pipeline import trace_analysis

    breakdown = trace_analysis.compute_breakdown(events, num_devices * virtual_stages,
                                                 virtual_stages)
    return statistics.mean(breakdown.device_idle_in_pipeline)


def _profile(fn, batch, virtual_stages: int, num_devices: int, steps: int = 3) -> float:
    return statistics.median(
        _idle_per_device(events, virtual_stages, num_devices)
        for events in bench_lib.profiled_steps(fn, batch, steps)[0])


def fig_speedup(args: argparse.Namespace) -> dict:
    from lingvo_lite.pipeline import schedule

    k = args.devices
    layers, shapes, make_batch = bench_lib.model(args.model, args.quick)
    batch = make_batch()
    remat = "except_last"
    steps, meta = {}, {}
    naive = bench_lib.make_pipeline(layers, shapes, k, 1, remat, serial_devices=True)
    steps["naive"] = (bench_lib.pipeline_train_step(naive)[0], batch)
    for t in args.micro_batches:
        for name, v in SCHEDULES:
            if name == "interleaved" and (t % k or len(layers) < k * v):
                continue
            pipe = bench_lib.make_pipeline(layers, shapes, k * v, t, remat, schedule=name,
                                           virtual_stages=v, serial_devices=True)
            key = f"{name}_T{t}"
            steps[key] = (bench_lib.pipeline_train_step(pipe)[0], batch)
            meta[key] = dict(schedule=name, T=t, v=v, theory=schedule.make_schedule(
                name, k * v, t, v).bubble_fraction())
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    # TensorFlow's single-threaded executor (serial devices) emits no per-op profiler events,
    # so the idle time is measured on the shared-pool variant of each configuration.
    for key, m in meta.items():
        pipe = bench_lib.make_pipeline(layers, shapes, k * m["v"], m["T"], remat,
                                       schedule=m["schedule"], virtual_stages=m["v"])
        fn = bench_lib.pipeline_train_step(pipe)[0]
        float(fn(batch))
        m["idle"] = _profile(fn, batch, m["v"], k)
    return {"model": args.model, "devices": k,
            "median_s": {n: bench_lib.median(s) for n, s in samples.items()}, "meta": meta}


def fig_weight_heavy(args: argparse.Namespace) -> dict:
    layers, shapes, make_batch = bench_lib.model("weight_heavy", args.quick)
    batch = make_batch()
    k = args.devices
    steps = {}
    for serial in (True, False):
        tag = "serial" if serial else "shared"
        naive = bench_lib.make_pipeline(layers, shapes, k, 1, "never", serial_devices=serial)
        steps[f"{tag}_naive"] = (bench_lib.pipeline_train_step(naive)[0], batch)
        for t in args.micro_batches:
            for mode in ("per_micro_batch", "batched"):
                pipe = bench_lib.make_pipeline(layers, shapes, k, t, "except_last",
                                               serial_devices=serial, weight_gradients=mode)
                steps[f"{tag}_{mode}_T{t}"] = (bench_lib.pipeline_train_step(pipe)[0], batch)
    samples = bench_lib.interleaved(steps, args.rounds, args.iters)
    return {"devices": k, "median_s": {n: bench_lib.median(s) for n, s in samples.items()}}


def _run_worker(figure: str, args: argparse.Namespace, **extra) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), f"--worker={figure}",
           f"--devices={args.devices}", f"--rounds={args.rounds}", f"--iters={args.iters}",
           "--micro_batches=" + ",".join(str(t) for t in args.micro_batches)]
    cmd += ["--quick"] if args.quick else []
    cmd += [f"--{name}={value}" for name, value in extra.items()]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _speedup_table(result: dict) -> list[str]:
    naive = result["median_s"]["naive"]
    lines = [f"### {result['model']} (K={result['devices']} devices, serial)", "",
             "| schedule | T | median step | speedup vs naive MP | measured mean idle "
             "(shared pool) | theoretical bubble |", "|---|---|---|---|---|---|",
             f"| naive MP (gpipe, T=1) | 1 | {naive * 1e3:.0f} ms | 1.00x | | |"]
    for key, m in result["meta"].items():
        step = result["median_s"][key]
        name = m["schedule"] + (f" (v={m['v']})" if m["v"] > 1 else "")
        lines.append(f"| {name} | {m['T']} | {step * 1e3:.0f} ms | {naive / step:.2f}x | "
                     f"{100 * m['idle']:.0f}% | {100 * m['theory']:.0f}% |")
    return lines


def _weight_heavy_table(result: dict, micro_batches: list[int]) -> list[str]:
    s = result["median_s"]
    lines = [f"### weight_heavy (K={result['devices']}): per-micro-batch vs batched weight "
             "gradients", "",
             "| devices | T | per_micro_batch | batched | per_micro_batch vs naive MP | "
             "batched vs naive MP |", "|---|---|---|---|---|---|"]
    for tag in ("serial", "shared"):
        naive = s[f"{tag}_naive"]
        for t in micro_batches:
            a, b = s[f"{tag}_per_micro_batch_T{t}"], s[f"{tag}_batched_T{t}"]
            lines.append(f"| {tag} | {t} | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | "
                         f"{naive / a:.2f}x | {naive / b:.2f}x |")
        lines.append(f"| {tag} | naive MP (T=1) | {naive * 1e3:.0f} ms | | 1.00x | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default="transformer")
    parser.add_argument("--models", default="transformer,amoebanet")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--micro_batches", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--record", action="store_true",
                        help="Write the tables into BENCHMARKS.md (bench/separate/).")
    args = parser.parse_args()
    args.micro_batches = [int(t) for t in str(args.micro_batches).split(",")]
    if args.worker:
        bench_lib.setup(args.devices * 2, 1, args.devices)
        figure = {"speedup": fig_speedup, "weight_heavy": fig_weight_heavy}[args.worker]
        print(json.dumps(figure(args)))
        return
    if args.quick:
        args.micro_batches, args.rounds, args.iters = [2, 4], 2, 1
    lines = []
    for model in args.models.split(","):
        result = _run_worker("speedup", args, model=model)
        print(json.dumps(result), flush=True)
        lines += _speedup_table(result) + [""]
    wh_args = argparse.Namespace(**vars(args))
    wh_args.micro_batches = [1] + args.micro_batches
    result = _run_worker("weight_heavy", wh_args)
    print(json.dumps(result), flush=True)
    lines += _weight_heavy_table(result, wh_args.micro_batches)
    print("\n".join(lines))
    if args.record:
        import report

        intro = [
            "Serial logical devices (the accelerator emulation), remat 'except_last', momentum "
            "SGD; naive MP = gpipe at T=1 on the same devices. interleaved: 2 cells per device "
            "(virtual_stages=2). zero_bubble: ZB-H1, whose W re-runs the cell's forward here. "
            "Theoretical bubble: the schedule's unit-time timeline (every action one tick). "
            "Measured idle: profiled on the shared pool (see the script's docstring).", ""]
        print(report.record_separate("12_schedules", "12. Schedules side by side, and batched "
                                     "weight gradients (issue 14)", intro + lines,
                                     "python bench/schedules.py --record"))


if __name__ == "__main__":
    main()
