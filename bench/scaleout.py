"""Scale-out figures (issue 13): data-parallel scaling, and what crossing a process costs.

Two figures, each run by `worker.py` in a fresh process:

* `data_parallel`: R=2 replicas vs R=1 at a fixed per-replica batch, on serial logical devices
  (one op at a time per device, like accelerators), timed side by side. Also R=1, K=2 on the
  same two devices and the same global batch: data vs pipeline parallelism.
* `cross_process`: a second process on 127.0.0.1 serves one device over TensorFlow's gRPC
  runtime (what `trainer.py` does from TF_CONFIG). The same step is timed with the second cell
  (or replica) on the other process vs on a second device of this process, and the bytes that
  cross the process boundary per step are read from the kernel's TCP counters (`ss -ti`) next
  to the bytes the tensors that must cross add up to.

The second process is started here, and stopped here by PID:

    python bench/scaleout.py --serve --addresses=127.0.0.1:P0,127.0.0.1:P1 --index=1
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_lib  # noqa: E402

JOB = "worker"


# ---------------------------------------------------------------------------------------------
# Steps.


def replica_train_step(pipe, learning_rate: float = 1e-3, momentum: float = 0.9):
    """A compiled data-parallel step: `FPropAndReplicaGrads`, then momentum SGD per replica."""
    import tensorflow as tf

    from lingvo_lite.core import fprop_context

    thetas = pipe.replica_thetas(pipe.theta)
    variables = [[v for v in th.Flatten() if isinstance(v, tf.Variable) and v.trainable]
                 for th in thetas]
    slots = [bench_lib._momentum_slots(vs) for vs in variables]

    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndReplicaGrads(thetas, batch)
        for theta, g, vs, ss in zip(thetas, grads, variables, slots):
            by_ref = {v.ref(): x for v, x in zip(theta.Flatten(), g.Flatten())
                      if isinstance(v, tf.Variable)}
            bench_lib._apply(vs, ss, [by_ref[v.ref()] for v in vs], learning_rate, momentum)
        return out.loss

    return tf.function(step, autograph=False)


def _pipe(layers, shapes, num_replicas: int, num_cells: int, num_micro_batches: int,
          placement, serial: bool):
    return bench_lib.make_pipeline(layers, shapes, num_cells, num_micro_batches, "except_last",
                                   num_replicas=num_replicas, placement=placement,
                                   serial_devices=serial)


def _summary(samples: dict[str, list[float]]) -> dict:
    return {name: {"median_s": bench_lib.median(v), "samples_s": v}
            for name, v in samples.items()}


# ---------------------------------------------------------------------------------------------
# Figure: data-parallel scaling in one process.


def data_parallel(model: str, quick: bool, rounds: int, iters: int,
                  num_micro_batches: int = 4) -> dict:
    """R=1 (batch B, one device) vs R=2 (batch 2B, two devices) vs R=1, K=2 (batch 2B)."""
    layers, shapes, make_batch = bench_lib.model(model, quick)
    layers2, shapes2, make_batch2 = bench_lib.model(model, quick, batch_multiple=2)
    batch, batch2 = make_batch(), make_batch2()
    steps = {
        "R1_K1": (replica_train_step(_pipe(layers, shapes, 1, 1, 1, "cpu", True)), batch),
        "R2_K1": (replica_train_step(_pipe(layers2, shapes2, 2, 1, 1, "cpu", True)), batch2),
        f"R1_K2_T{num_micro_batches}": (replica_train_step(
            _pipe(layers2, shapes2, 1, 2, num_micro_batches, "cpu", True)), batch2),
    }
    samples = bench_lib.interleaved(steps, rounds, iters)
    weights = sum(v.shape.num_elements() * v.dtype.size
                  for v in bench_lib.make_pipeline(layers, shapes, 1, 1, "never").vars.Flatten())
    return {"model": model, "per_replica_batch": _batch_size(batch),
            "weight_bytes": weights, "times": _summary(samples)}


def _batch_size(batch) -> int:
    return int(batch.Flatten()[0].shape[0])


# ---------------------------------------------------------------------------------------------
# Figure: crossing a process boundary over loopback gRPC.


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_server(addresses: list[str], index: int, num_devices: int, intra: int, inter: int):
    """This process serves task `index` of the cluster with `num_devices` CPU devices."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": num_devices},
                                      intra_op_parallelism_threads=intra,
                                      inter_op_parallelism_threads=inter)
    spec = tf.train.ClusterSpec({JOB: addresses})
    return tf.distribute.Server(spec, job_name=JOB, task_index=index, protocol="grpc",
                                config=config, start=True)


def _wait_for(address: str, timeout_s: float = 60.0) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the benchmark's second process never served {address}")


def socket_bytes(pid: int) -> tuple[int, int] | None:
    """(bytes sent, bytes received) over the TCP connections of process `pid` to others.

    From the kernel's per-connection counters (`ss -tinp`: bytes_acked, bytes_received);
    connections between two sockets of the process itself are left out. None without `ss`.
    """
    try:
        text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    entries, current = [], None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            fields = line.split()
            owner = re.search(r"pid=(\d+)", line)
            current = {"local": fields[-3] if owner else fields[-2],
                       "peer": fields[-2] if owner else fields[-1],
                       "pid": int(owner.group(1)) if owner else None}
            entries.append(current)
        elif current is not None:
            for key in ("bytes_acked", "bytes_received"):
                found = re.search(rf"{key}:(\d+)", line)
                current[key] = int(found.group(1)) if found else 0
    mine = [e for e in entries if e["pid"] == pid]
    own_ports = {e["local"] for e in mine}
    sent = sum(e.get("bytes_acked", 0) for e in mine if e["peer"] not in own_ports)
    received = sum(e.get("bytes_received", 0) for e in mine if e["peer"] not in own_ports)
    return sent, received


def _tensor_bytes(tree) -> int:
    return sum(x.shape.num_elements() * x.dtype.size for x in tree.Flatten())


def cross_process(model: str, quick: bool, rounds: int, iters: int, intra: int, inter: int,
                  num_micro_batches: int = 4, byte_steps: int = 5) -> dict:
    """Cell 1 (or replica 1) in another process vs on this process's second device."""
    import tensorflow as tf
    from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

    from lingvo_lite.core.nested_map import NestedMap

    addresses = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", f"--addresses={','.join(addresses)}",
         "--index=1", "--devices=1", f"--intra={intra}", f"--inter={inter}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _keep = start_server(addresses, 0, 2, intra, inter)  # noqa: F841 (lives with us)
        _wait_for(addresses[1])
        tf.config.experimental_connect_to_cluster(
            SimpleClusterResolver(tf.train.ClusterSpec({JOB: addresses}), rpc_layer="grpc"),
            make_master_device_default=False)
        here = [f"/job:{JOB}/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
        there = f"/job:{JOB}/replica:0/task:1/device:CPU:0"
        layers, shapes, make_batch = bench_lib.model(model, quick)
        batch = make_batch()
        t = num_micro_batches
        variants = {
            "pipeline_one_process": (1, 2, t, here),
            "pipeline_two_processes": (1, 2, t, [here[0], there]),
            "replicas_one_process": (2, 1, 1, here),
            "replicas_two_processes": (2, 1, 1, [here[0], there]),
        }
        steps, pipes = {}, {}
        for name, (r, k, mb, placement) in variants.items():
            pipes[name] = _pipe(layers, shapes, r, k, mb, placement, serial=False)
            steps[name] = (replica_train_step(pipes[name]), batch)
        samples = bench_lib.interleaved(steps, rounds, iters)
        measured = {}
        for name in ("pipeline_two_processes", "replicas_two_processes"):
            fn = steps[name][0]
            float(fn(batch))
            before = socket_bytes(child.pid)
            for _ in range(byte_steps):
                float(fn(batch))
            after = socket_bytes(child.pid)
            if before is not None and after is not None:
                measured[name] = {"to_other_process": (after[1] - before[1]) / byte_steps,
                                  "from_other_process": (after[0] - before[0]) / byte_steps}
        boundary = pipes["pipeline_two_processes"].partition.cell_layer_ranges[0][1]
        boundary_bytes, boundary_float_bytes = _boundary_bytes(layers, shapes, boundary, batch)
        grads = sum(v.shape.num_elements() * v.dtype.size
                    for v in pipes["replicas_two_processes"].vars.Flatten() if v.trainable)
        shard = NestedMap(batch).Transform(lambda x: x[: x.shape[0] // 2])
        analytic = {
            "pipeline_two_processes": {
                "to_other_process": boundary_bytes,
                "from_other_process": boundary_float_bytes,
                "what": "activations at the cell boundary forward (with the labels they "
                        "carry), their gradient backward",
            },
            "replicas_two_processes": {
                # A ring all-reduce over R members sends 2 (R-1)/R of the summed bytes each
                # way: the gradients plus the replica's loss weight (float32).
                "to_other_process": _tensor_bytes(shard) + (grads + 4),
                "from_other_process": grads + 4,
                "what": "the replica's input shard, then a 2-member ring all-reduce of the "
                        "gradients (each side sends 2 (R-1)/R = 1 x their bytes)",
            },
        }
        return {"model": model, "num_micro_batches": t, "times": _summary(samples),
                "bytes_measured": measured, "bytes_analytic": analytic,
                "gradient_bytes": grads, "byte_steps": byte_steps,
                "ss_available": bool(measured)}
    finally:
        child.kill()
        child.wait()


def _boundary_bytes(layers, shapes, boundary: int, batch) -> tuple[int, int]:
    """(all, floating-point) bytes of the tensors entering layer `boundary` for one mini-batch.

    Shapes come from the layers' FPropMeta; dtypes from the batch's fields of the same name.
    """
    from lingvo_lite.core import base_layer
    from lingvo_lite.core.nested_map import NestedMap

    in_shapes = (base_layer.to_shape(shapes),)
    for lp in layers[:boundary]:
        in_shapes = lp.cls.FPropMeta(lp, *in_shapes).out_shapes
    dtypes = dict(NestedMap(batch).Transform(lambda x: x.dtype).FlattenItems())
    total = floats = 0
    for key, shape in in_shapes[0].FlattenItems():
        dtype = dtypes[key]
        total += shape.num_elements() * dtype.size
        floats += shape.num_elements() * dtype.size if dtype.is_floating else 0
    return total, floats


# ---------------------------------------------------------------------------------------------
# BENCHMARKS.md section.


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def render(results: dict) -> list[str]:
    """Section 8 of BENCHMARKS.md from the `data_parallel` and `cross_process` results."""
    lines = ["## 8. Scale-out: data-parallel replicas, and crossing a process boundary", ""]
    dp = results.get("data_parallel")
    if dp and "times" in dp:
        t = dp["times"]
        b = dp["per_replica_batch"]
        one, two = t["R1_K1"]["median_s"], t["R2_K1"]["median_s"]
        pipe_name = next(n for n in t if n.startswith("R1_K2"))
        pipe = t[pipe_name]["median_s"]
        micro = pipe_name.split("_T")[1]
        lines += [
            "### 8a. Data-parallel scaling on serial logical devices (transformer)", "",
            "Each device runs one op at a time (`serial_devices=True`, intra-op 1): two "
            "devices stand in for two accelerators on this machine's two cores. Weak scaling: "
            f"every replica keeps {b} sequences; R=2 trains {2 * b} per step, its gradients "
            "summed by one collective all-reduce per cell.", "",
            "| config | devices | global batch | median step | sequences/s | vs R=1 |",
            "|---|---|---|---|---|---|",
            f"| R=1, K=1 | 1 | {b} | {_ms(one)} | {b / one:.1f} | 1.00x |",
            f"| R=2, K=1 | 2 | {2 * b} | {_ms(two)} | {2 * b / two:.1f} | "
            f"{2 * one / two:.2f}x (ideal 2.00x) |",
            f"| R=1, K=2, T={micro} (pipeline, same devices and batch) | 2 | {2 * b} | "
            f"{_ms(pipe)} | {2 * b / pipe:.1f} | {2 * one / pipe:.2f}x |", "",
            f"Scaling efficiency of R=2: {one / two:.0%} of ideal. On the same two devices "
            f"and global batch, data parallelism is {pipe / two:.2f}x the pipeline's "
            f"throughput for this model, whose weights ({_mib(dp['weight_bytes'])}) fit one "
            "device: GPipe's "
            "pipeline is for the models that do not, and R x K combines the two.", "",
            f"Reproduce: `{dp['command']}`", ""]
    elif dp:
        lines += ["8a (data_parallel) failed: " + str(dp.get("error", "no result")), ""]
    cp = results.get("cross_process")
    if cp and "times" in cp:
        t = cp["times"]
        micro = cp["num_micro_batches"]
        rows = [("pipeline", f"R=1, K=2, T={micro}", 2 * micro),
                ("replicas", "R=2, K=1", None)]
        lines += [
            "### 8b. Crossing a process boundary over loopback gRPC", "",
            "A second process on 127.0.0.1 serves one CPU device through TensorFlow's gRPC "
            "runtime (what `trainer.py` does from `TF_CONFIG`). The same step runs with cell "
            "1 (or replica 1) there, and with it on a second device of this process; timed "
            "side by side. Bytes are what the kernel counted on the second process's TCP "
            f"connections (`ss -ti`) over {cp['byte_steps']} steps, next to the bytes of the "
            "tensors that must cross.", "",
            "| layout | one process | two processes | extra per step | per crossing |",
            "|---|---|---|---|---|"]
        for key, label, crossings in rows:
            a = t[f"{key}_one_process"]["median_s"]
            c = t[f"{key}_two_processes"]["median_s"]
            per = f"{(c - a) / crossings * 1e3:.1f} ms ({crossings} boundary crossings)" \
                if crossings else "-"
            lines.append(f"| {label} | {_ms(a)} | {_ms(c)} ({c / a:.2f}x) | "
                         f"{(c - a) * 1e3:+.0f} ms | {per} |")
        lines += ["", "| layout | direction | measured per step | tensors that must cross | "
                  "measured / tensors |", "|---|---|---|---|---|"]
        for key, label, _ in rows:
            name = f"{key}_two_processes"
            measured = cp.get("bytes_measured", {}).get(name)
            analytic = cp["bytes_analytic"][name]
            for direction, text in (("to_other_process", "to process 2"),
                                    ("from_other_process", "from process 2")):
                want = analytic[direction]
                got = measured[direction] if measured else None
                lines.append(f"| {label} | {text} | {_mib(got) if got else 'not measured'} | "
                             f"{_mib(want)} | {got / want:.2f}x |" if got else
                             f"| {label} | {text} | not measured (no `ss`) | {_mib(want)} | - |")
        lines += ["", "Tensors that must cross: " + "; ".join(
            f"{label}: {cp['bytes_analytic'][f'{key}_two_processes']['what']}"
            for key, label, _ in rows) + f". Gradients: {_mib(cp['gradient_bytes'])}.", "",
            "What is above the tensors is gRPC framing and the runtime's per-step requests "
            "(the step is launched on the remote task, each transfer is one RecvTensor call); "
            "it grows with the number of transfers, i.e. with T. This figure found a bug "
            "(fixed): a gradient division without a device put cell 1's weight gradients on "
            "the default device, so they crossed to process 1 and back every step (4x the "
            "tensors' bytes, measured, before the fix).", "",
            f"Reproduce: `{cp['command']}`", ""]
    elif cp:
        lines += ["8b (cross_process) failed: " + str(cp.get("error", "no result")), ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve one task of the benchmark's cluster.")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--addresses", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--intra", type=int, default=1)
    parser.add_argument("--inter", type=int, default=2)
    args = parser.parse_args()
    bench_lib.setup(1, args.intra, args.inter)
    server = start_server(args.addresses.split(","), args.index, args.devices, args.intra,
                          args.inter)
    server.join()


if __name__ == "__main__":
    main()
