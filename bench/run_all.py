"""Runs every benchmark figure (issues 6 and 13) and rewrites BENCHMARKS.md.

    python bench/run_all.py            # the recorded run (~15-25 min on 2 cores)
    python bench/run_all.py --quick    # smaller shapes, fewer T and rounds (~5 min)

Each figure runs in its own subprocess (`bench/worker.py`), configured before TensorFlow
starts: 2 logical CPU devices with intra-op 1 / inter-op 2 threads stand in for 2
accelerators (see ../shared/TF_NOTES.md), oneDNN on for every figure (both sides of every
comparison), the BFC allocator for the memory figures. Times are medians over interleaved
rounds, and every ratio compares variants measured side by side in the same process, except
"one device using both cores", which needs other thread settings and so runs in its own
process right before and after the pipeline (the median of both is used).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ONEDNN = "1"
PIPE_THREADS = dict(devices=2, intra=1, inter=2)
ONE_DEVICE_THREADS = dict(devices=1, intra=2, inter=2)


def _env(bfc: bool) -> dict:
    env = dict(os.environ)
    env["TF_ENABLE_ONEDNN_OPTS"] = ONEDNN
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if bfc:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    else:
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    return env


def run_worker(figure: str, threads: dict, bfc: bool = False, **flags) -> dict:
    """Runs one worker; returns its JSON result (or {'error': ...}) plus the command used."""
    args = [f"--figure={figure}"] + [f"--{k}={v}" for k, v in {**threads, **flags}.items()]
    cmd = [sys.executable, os.path.join(HERE, "worker.py")] + args
    shown = ("TF_ENABLE_ONEDNN_OPTS=1 " + ("TF_CPU_ALLOCATOR_USE_BFC=true " if bfc else "")
             + "python bench/worker.py " + " ".join(args))
    print(f"[{time.strftime('%H:%M:%S')}] {shown}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(bfc), cwd=ROOT)
    elapsed = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["command"] = shown
            result["wall_s"] = elapsed
            return result
    tail = "\n".join((proc.stderr or "").strip().splitlines()[-15:])
    print(f"  FAILED ({proc.returncode}):\n{tail}", flush=True)
    return {"error": f"exit {proc.returncode}: {tail}", "command": shown, "wall_s": elapsed}


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "tensorflow": importlib.metadata.version("tensorflow"),
            "load_start": os.getloadavg()}


def run(quick: bool) -> dict:
    ts = "1,2,4,8" if quick else "1,2,4,8,16"
    rounds = 3 if quick else 5
    common = dict(rounds=rounds, quick=str(quick).lower())
    results = {"quick": quick, "machine": machine(), "started": time.time()}
    for name in ("transformer", "amoebanet", "weight_heavy"):
        one_a = run_worker("single_device", ONE_DEVICE_THREADS, model=name, **common)
        pipe = run_worker("speedup", PIPE_THREADS, model=name, micro_batches=ts,
                          profile=str(name != "weight_heavy").lower(), **common)
        one_b = run_worker("single_device", ONE_DEVICE_THREADS, model=name, **common)
        results[f"speedup_{name}"] = {"pipeline": pipe, "one_device": [one_a, one_b]}
    results["speedup_serial"] = run_worker("speedup_serial", PIPE_THREADS, model="transformer",
                                           micro_batches=ts, rounds=3 if quick else 4,
                                           quick=str(quick).lower())
    results["overhead"] = run_worker("overhead", PIPE_THREADS, model="transformer_small",
                                     rounds=rounds + 2, iters=3, quick=str(quick).lower())
    results["remat_cost"] = run_worker("remat_cost", PIPE_THREADS, model="transformer_small",
                                       rounds=rounds, iters=3, quick=str(quick).lower())
    results["microbatch_cost"] = run_worker("microbatch_cost", PIPE_THREADS, model="transformer",
                                            micro_batches="1,8", **common)
    results["memory"] = run_worker("memory", PIPE_THREADS, bfc=True, micro_batches=ts)
    results["fits"] = run_worker("fits", PIPE_THREADS, bfc=True, budget_mib=48)
    results["partition"] = run_worker("partition", PIPE_THREADS)
    results["data_parallel"] = run_worker("data_parallel", PIPE_THREADS, model="transformer",
                                          **common)
    results["cross_process"] = run_worker("cross_process", PIPE_THREADS, model="transformer",
                                          **common)
    results["machine"]["load_end"] = os.getloadavg()
    results["finished"] = time.time()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smaller, faster run.")
    parser.add_argument("--from_json", help="Re-render BENCHMARKS.md from a saved results file.")
    parser.add_argument("--output", default=os.path.join(ROOT, "BENCHMARKS.md"),
                        help="BENCHMARKS.md to write; the details go to docs/benchmarks/.")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        results = run(args.quick)
        path = os.path.join(HERE, "results_quick.json" if args.quick else "results.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"Raw results: {path}")
    sys.path.insert(0, HERE)
    import report

    report.write_reports(report.render(results), os.path.dirname(os.path.abspath(args.output)))
    print(f"Wrote {args.output} and docs/benchmarks/")


if __name__ == "__main__":
    main()
