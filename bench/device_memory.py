"""Per-device peak memory of a pipelined training step: one process per device.

Logical CPU devices of one process share one BFC allocator (TF_NOTES.md), so their memory
cannot be told apart. Here every cell runs in its own process, a TensorFlow gRPC worker on
127.0.0.1 with `TF_CPU_ALLOCATOR_USE_BFC=true`, and each worker reports its own allocator's
`get_memory_info('CPU:0')` when asked on its stdin. The client process (this one) holds only
the input batch; boundary activations and their gradients really cross between processes, so
the received copies are counted where they land, as on accelerators.

    with device_memory.Cluster(4) as cluster:
        peaks = device_memory.measure_step(cluster, layers, shapes, make_batch, 4, 8,
                                           "gpipe", "except_last")

`peaks[k]` is device k's peak during one training step (momentum SGD, slots on each weight's
device) above what the worker held before the pipeline's variables were created: weights,
gradients, the momentum slot and every transient. Workers are started here and stopped here by
PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

JOB = "worker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`num_workers` single-device worker processes, and this process connected to them."""

    def __init__(self, num_workers: int, inter_op_threads: int = 2) -> None:
        self.num_workers = num_workers
        self.addresses = [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]
        self._inter = inter_op_threads
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Cluster:
        env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
        for i in range(self.num_workers):
            self._procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), ",".join(self.addresses), str(i),
                 str(self._inter)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=env))
        try:
            for proc in self._procs:
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a memory worker failed to start")
            import tensorflow as tf
            from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

            tf.config.experimental_connect_to_cluster(
                SimpleClusterResolver(tf.train.ClusterSpec({JOB: self.addresses}),
                                      rpc_layer="grpc"),
                make_master_device_default=False)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        self._procs = []

    def devices(self, num: int) -> list[str]:
        return [f"/job:{JOB}/replica:0/task:{i}/device:CPU:0" for i in range(num)]

    def _ask(self, proc: subprocess.Popen, command: str) -> str:
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().strip()

    def reset_peaks(self) -> None:
        for proc in self._procs:
            self._ask(proc, "reset")

    def memory_info(self) -> list[dict[str, int]]:
        """Each worker's {'current': bytes, 'peak': bytes} since its last reset."""
        return [json.loads(self._ask(proc, "info")) for proc in self._procs]


def measure_step(cluster: Cluster, layers, shapes, make_batch, num_cells: int,
                 num_micro_batches: int, schedule: str, remat: str) -> list[int]:
    """Peak bytes of each of the K devices in one training step (see the module docstring)."""
    import gc

    import bench_lib

    gc.collect()
    time.sleep(0.2)  # Remote handles of an earlier step are released asynchronously.
    before = [m["current"] for m in cluster.memory_info()]
    pipe = bench_lib.make_pipeline(layers, shapes, num_cells, num_micro_batches, remat,
                                   schedule=schedule, placement=cluster.devices(num_cells))
    fn, variables, slots = bench_lib.pipeline_train_step(pipe)
    batch = make_batch()
    float(fn(batch))  # Trace and warm up outside the measured step.
    cluster.reset_peaks()
    float(fn(batch))
    peaks = [m["peak"] - b for m, b in zip(cluster.memory_info(), before)]
    del fn, variables, slots, pipe
    gc.collect()
    return peaks[:num_cells]


def _serve(addresses: list[str], index: int, inter: int) -> None:
    """Worker: serves task `index`; answers 'reset' and 'info' on stdin (one line each)."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": 1}, intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=inter)
    server = tf.distribute.Server(tf.train.ClusterSpec({JOB: addresses}), job_name=JOB,
                                  task_index=index, protocol="grpc", config=config, start=True)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "reset":
            tf.config.experimental.reset_memory_stats("CPU:0")
            print("ok", flush=True)
        elif command == "info":
            print(json.dumps(tf.config.experimental.get_memory_info("CPU:0")), flush=True)
    del server


if __name__ == "__main__":
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    _serve(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]))
