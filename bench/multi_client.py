"""Chief traffic and throughput: single-client vs multi-client trainer.py on 127.0.0.1 (issue 37).

For N = 2 and 3 tasks (one replica of a K=1 pipeline per task, R = N, global batch 48, T=2),
each mode runs `trainer.py` in N processes with their own TF_CONFIG and measures, over the
same window of steps once the run is warm:
- bytes in and out of the chief per step: the byte counters the kernel keeps for each TCP
  socket (`ss -tinp`: `bytes_received`, `bytes_acked`), summed over the sockets the chief's
  PID owns whose other end is another process, read before and after the window. On
  loopback every task shares the `lo` interface, so interface counters (/proc/net/dev)
  cannot tell the chief's bytes from the others'; per-socket counters can, and they count
  payload bytes (no headers) once per direction. The sockets are gRPC's long-lived
  connections, open for the whole window;
- the chief's step-time share: the chief's CPU time (utime + stime, /proc/<pid>/stat) over
  the window's wall time, and its share of all tasks' CPU time;
- throughput: examples per second of the N processes, and of one process training the same
  global batches with the same R x K mesh on N logical devices (no TF_CONFIG).
The model: a 3-layer MLP (512 -> 256 -> 256 -> 10) on synthetic inputs of 512 floats, so one
replica's input shard (16 or 24 examples x 2 KiB) is of the order of its gradients (~0.8 MiB).

Run: .venv/bin/python bench/multi_client.py  (writes bench/separate/18_multi_client.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lingvo_lite.core import hyperparams  # noqa: E402
from lingvo_lite.core.nested_map import NestedMap  # noqa: E402
from lingvo_lite.tasks import base_input_generator, model_registry  # noqa: E402
from tests import testdata_models  # noqa: E402

INPUT_DIM, HIDDEN, CLASSES, BATCH = 512, 256, 10, 48
WARMUP, WINDOW = 60, 200  # Steps before the window, steps in it.
MAX_STEPS = 100000  # The run is stopped (by PID) after the window.


class WideInput(base_input_generator.BaseInputGenerator):
    """NestedMap(x=[B, 512] float32, labels=[B] int32), seeded."""

    def _build_examples(self) -> tf.data.Dataset:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(1024, INPUT_DIM)).astype(np.float32)
        labels = rng.integers(0, CLASSES, size=1024).astype(np.int32)
        return tf.data.Dataset.from_tensor_slices({"x": x, "labels": labels})


@model_registry.register
class WideMlp(testdata_models.TinyMlp):
    """TinyMlp with 512 inputs, 256 hidden units and a global batch of 48."""

    def Train(self) -> hyperparams.Params:
        return WideInput.Params().Set(name="train", batch_size=BATCH, shuffle_buffer_size=1024)

    def Task(self) -> hyperparams.InstantiableParams:
        p = super().Task()
        fc0, fc1, loss = p.network.layers
        fc0.proj.Set(input_dim=INPUT_DIM, output_dim=HIDDEN)
        fc1.proj.Set(input_dim=HIDDEN, output_dim=HIDDEN)
        loss.softmax.Set(input_dim=HIDDEN, num_classes=CLASSES)
        p.network.input_shapes = NestedMap(x=tf.TensorShape([BATCH, INPUT_DIM]),
                                           labels=tf.TensorShape([BATCH]))
        p.train.Set(max_steps=MAX_STEPS, save_interval_steps=0, summary_interval_steps=0,
                    eval_interval_steps=0, log_interval_steps=20)
        return p


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def socket_bytes(pid: int) -> tuple[int, int]:
    """(bytes received, bytes sent and acknowledged) over the TCP sockets of `pid` whose other
    end is another process (single-client: the chief's client also talks to its own task's
    server over loopback; those bytes never leave the process and are not counted)."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    sockets = []  # (local address, peer address, received, sent)
    owner = None
    for line in text.splitlines():
        if not line.startswith(("\t", " ")):
            fields = line.split()
            owner = (fields[3], fields[4]) if f"pid={pid}," in line else None
            continue
        if owner is not None:
            received = int((re.search(r"bytes_received:(\d+)", line) or [0, 0])[1])
            sent = int((re.search(r"bytes_acked:(\d+)", line) or [0, 1])[1]) - 1
            sockets.append((*owner, received, max(sent, 0)))
    mine = {local for local, _, _, _ in sockets}
    outside = [(r, s) for _, peer, r, s in sockets if peer not in mine]
    return sum(r for r, _ in outside), sum(s for _, s in outside)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Run:
    """N trainer processes (N=1: no TF_CONFIG) reporting progress lines."""

    def __init__(self, logdir: str, n: int, flags: list[str]) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
        where = [f"127.0.0.1:{p}" for p in _free_ports(n)]
        self.procs, self.logs = [], []
        for i in reversed(range(n)):
            task_env = dict(env)
            if n > 1:
                task_env["TF_CONFIG"] = json.dumps({"cluster": {"worker": where},
                                                    "task": {"type": "worker", "index": i}})
            log = open(f"{logdir}.task{i}.log", "w")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "trainer.py"),
                 "--model=bench.multi_client.WideMlp", f"--logdir={logdir}", *flags],
                cwd=ROOT, env=task_env, stdout=log, stderr=subprocess.STDOUT))
        self.procs.reverse()
        self.chief_log = f"{logdir}.task0.log"

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with open(self.chief_log) as f:
                text = f.read()
            if re.search(rf"^step {step}/", text, flags=re.M):
                return
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"no step {step} in {self.chief_log}:\n{text[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in self.logs:
            log.close()


def measure(logdir: str, n: int, flags: list[str]) -> dict:
    run = Run(logdir, n, flags)
    try:
        run.wait_for_step(WARMUP)
        chief = run.procs[0].pid
        before = (time.perf_counter(), socket_bytes(chief), [cpu_seconds(p.pid)
                                                              for p in run.procs])
        run.wait_for_step(WARMUP + WINDOW)
        after = (time.perf_counter(), socket_bytes(chief), [cpu_seconds(p.pid)
                                                             for p in run.procs])
    finally:
        run.stop()
    seconds = after[0] - before[0]
    cpu = [b - a for a, b in zip(before[2], after[2])]
    return {"bytes_in": (after[1][0] - before[1][0]) / WINDOW,
            "bytes_out": (after[1][1] - before[1][1]) / WINDOW,
            "step_ms": 1000 * seconds / WINDOW, "chief_cpu_share": cpu[0] / seconds,
            "chief_of_all_cpu": cpu[0] / max(sum(cpu), 1e-9),
            "examples_per_s": BATCH * WINDOW / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/bench_multi_client")
    parser.add_argument("--no_record", action="store_true")
    parser.add_argument("--from_json", help="Re-render a results.json of an earlier run.")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    common = ["--num_cells=1", "--num_micro_batches=2", "--intra_op_threads=1"]
    results = {}
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    for n in () if args.from_json else (2, 3):
        for mode in ("single_client", "multi_client", "one_process"):
            name = f"{mode}_n{n}"
            logdir = os.path.join(args.workdir, name)
            subprocess.run(["rm", "-rf", logdir])
            flags = common + [f"--num_replicas={n}"]
            if mode != "one_process":
                flags.append(f"--cluster_mode={mode}")
            results[name] = measure(logdir, 1 if mode == "one_process" else n, flags)
            print(name, {k: round(v, 3) for k, v in results[name].items()}, flush=True)
    if not args.from_json:
        with open(os.path.join(args.workdir, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    body = render(results)
    print("\n".join(body))
    if not args.no_record:
        path = os.path.join(ROOT, "bench", "separate", "18_multi_client.md")
        now = datetime.datetime.now(datetime.timezone.utc)
        load = tuple(round(x, 2) for x in os.getloadavg())
        title = "18. Multi-client vs single-client: the chief's traffic and throughput (issue 37)"
        with open(path, "w") as f:
            f.write("\n".join([
                f"## {title}", "",
                f"Recorded {now:%Y-%m-%d %H:%M} UTC by its own script on {os.cpu_count()} "
                f"cores (Python {platform.python_version()}); load average at the end {load}.",
                "", *body, "", "Reproduce: `.venv/bin/python bench/multi_client.py`"]) + "\n")
        print(f"Wrote {path}")


def _kib(x: float) -> str:
    return f"{x / 1024:,.1f}"


# Bytes of one replica's gradients (float32) plus the loss weight packed with them: what one
# ring all-reduce moves; each member sends and receives 2 (N-1) / N times that per step.
GRADIENT_BYTES = 4 * (INPUT_DIM * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * CLASSES
                      + CLASSES + 1)


def ring_share(n: int) -> float:
    return 2 * (n - 1) / n * GRADIENT_BYTES


def render(results: dict) -> list[str]:
    body = ["| N | mode | chief in (KiB/step) | chief out (KiB/step) | in + out beyond the ring "
            "share (KiB/step) | step (ms) | chief CPU / wall | chief / all tasks' CPU | "
            "examples/s | vs one process |", "|---|---|---|---|---|---|---|---|---|---|"]
    beyond = {}
    for n in (2, 3):
        one = results[f"one_process_n{n}"]
        for mode in ("single_client", "multi_client", "one_process"):
            r = results[f"{mode}_n{n}"]
            traffic = ["-", "-", "-"]
            if mode != "one_process":
                beyond[mode, n] = r["bytes_in"] + r["bytes_out"] - 2 * ring_share(n)
                traffic = [_kib(r["bytes_in"]), _kib(r["bytes_out"]), _kib(beyond[mode, n])]
            body.append(f"| {n} | {mode.replace('_', '-')} | {' | '.join(traffic)} | "
                        f"{r['step_ms']:.1f} | {r['chief_cpu_share']:.0%} | "
                        f"{r['chief_of_all_cpu']:.0%} | {r['examples_per_s']:,.0f} | "
                        f"{r['examples_per_s'] / one['examples_per_s']:.2f}x |")
    total = {m: (results[f"{m}_n3"]["bytes_in"] + results[f"{m}_n3"]["bytes_out"])
             / max(results[f"{m}_n2"]["bytes_in"] + results[f"{m}_n2"]["bytes_out"], 1)
             for m in ("single_client", "multi_client")}
    grow = {m: beyond[m, 3] - beyond[m, 2] for m in ("single_client", "multi_client")}
    met = grow["multi_client"] <= 0.01 * GRADIENT_BYTES
    body += ["", f"The ring share: a ring all-reduce of the {GRADIENT_BYTES / 1024:,.1f} KiB of "
             "gradients makes every member, the chief included, send and receive 2 (N-1) / N "
             f"times that ({_kib(ring_share(2))} KiB each way at N=2, {_kib(ring_share(3))} "
             "KiB at N=3): bounded by twice the gradients whatever N, and the same for every "
             f"task. The chief's total traffic N=3 over N=2: single-client "
             f"{total['single_client']:.2f}x, multi-client {total['multi_client']:.2f}x (the "
             "ring's 4/3); beyond the ring share, N=2 -> 3 adds "
             f"{_kib(grow['single_client'])} KiB/step in single-client mode (the third "
             "replica's input and the step's remote dispatch) and "
             f"{_kib(grow['multi_client'])} KiB/step in multi-client mode (the small "
             "all-reduce of the loss and metrics, itself a ring, and per-collective framing). "
             "So the chief's traffic is bounded in multi-client mode (it tends to twice the "
             "gradients) but not constant from N=2 to 3: the ring's 2 (N-1) / N.", "",
             "The chief's share of all tasks' CPU time falls towards 1/N in multi-client mode "
             f"({results['multi_client_n2']['chief_of_all_cpu']:.0%} at N=2, "
             f"{results['multi_client_n3']['chief_of_all_cpu']:.0%} at N=3) and stays higher "
             "in single-client mode "
             f"({results['single_client_n2']['chief_of_all_cpu']:.0%}, "
             f"{results['single_client_n3']['chief_of_all_cpu']:.0%}), where the chief reads "
             "every replica's input and dispatches every cell. Times were measured under "
             "other jobs' load (see the load average above): one process took "
             f"{results['one_process_n2']['step_ms']:.1f} ms per step with R=2 and "
             f"{results['one_process_n3']['step_ms']:.1f} ms with R=3 on the same global "
             "batch, so compare modes within a row group, not across; the byte counts are "
             "exact.", "",
             "Target: multi-client, N=2 -> 3 on loopback: the chief's traffic per step beyond "
             "the ring all-reduce share every task carries grows by less than 1% of the "
             f"gradients (the issue's goal, traffic not growing with N, read for a ring) | "
             f"{grow['multi_client'] / 1024:+,.1f} KiB/step "
             f"({grow['multi_client'] / GRADIENT_BYTES:.1%}) | **{'met' if met else 'missed'}**",
             "",
             f"WideMlp (512 -> {HIDDEN} -> {HIDDEN} -> {CLASSES}), global batch {BATCH}, one "
             "replica of a K=1 pipeline per task (R = N), T=2, intra-op threads 1; "
             f"{WINDOW} steps measured after {WARMUP}; all tasks on one 2-core machine over "
             "127.0.0.1 (N processes share 2 cores: the throughput column measures overhead, "
             "not scaling). Bytes: the kernel's per-socket counters (`ss -tinp`: "
             "bytes_received, bytes_acked) summed over the chief's TCP sockets to other "
             "processes; CPU: /proc/<pid>/stat."]
    return body


if __name__ == "__main__":
    main()
