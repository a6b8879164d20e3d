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

or, for a registered model's first PipeliningLayer, one config per K:R:T:schedule:remat[:v]
(K cells, v of them per device with the interleaved schedule; prints {"peak_bytes": [[device
peaks of config 1], ...]}; `--model` and `--configs` may be repeated, in pairs, to measure
several models on one set of workers):

    python bench/device_memory.py measure --model=image.AmoebaNetDigits \
        --configs=2:1:4:1f1b:always,1:2:1:gpipe:never,4:1:4:interleaved:never:2

`peaks[k]` is the median over MEASURED_STEPS training steps of device k's peak in the step
(forward, backward and the update of `lingvo_lite.tasks.optimizers`, momentum SGD unless the
registered task names another) above what the worker held before the pipeline's variables were
created: weights, gradients, optimizer slots and every transient. Workers are started here and
stopped here by PID.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

JOB = "worker"
# Steps measured after the warm-up step; a device's peak is the median of their peaks. Which
# activations are alive at a device's peak also depends on when transfers complete (a receive
# runs as soon as its sender has produced, not in the receiving device's schedule order), so
# one step's peak moves from step to step, by up to ~25% at small scale under CPU contention;
# the median is what the schedule implies under ordinary timing.
MEASURED_STEPS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """`num_workers` single-device worker processes, and this process connected to them."""

    def __init__(self, num_workers: int, inter_op_threads: int = 1) -> None:
        self.num_workers = num_workers
        self.addresses = [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]
        self._inter = inter_op_threads
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> Cluster:
        # A port found free can be taken by another process before the worker binds it (other
        # tests start servers too): a worker that fails to start is retried on fresh ports.
        for attempt in range(3):
            failure = self._start_workers()
            if failure is None:
                break
            self.__exit__(None, None, None)
            if attempt == 2:
                raise RuntimeError(f"a memory worker failed to start: {failure}")
            self.addresses = [f"127.0.0.1:{_free_port()}" for _ in range(self.num_workers)]
        try:
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

    def _start_workers(self) -> str | None:
        """Starts the workers; None when all are ready, else the last lines of the failed one."""
        env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
        logs = []
        for i in range(self.num_workers):
            logs.append(tempfile.TemporaryFile("w+"))  # Not a pipe: a full pipe would block.
            self._procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), ",".join(self.addresses), str(i),
                 str(self._inter)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[-1], text=True,
                env=env))
        try:
            for proc, log in zip(self._procs, logs):
                if proc.stdout.readline().strip() != "ready":
                    proc.kill()
                    proc.communicate()
                    log.seek(0)
                    return " | ".join(log.read().strip().splitlines()[-3:]) or "no output"
            return None
        finally:
            for log in logs:
                log.close()

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

    def start_traces(self, logdir: str) -> None:
        """Each worker records its allocations (TensorFlow's profiler) under logdir/<task>."""
        for i, proc in enumerate(self._procs):
            self._ask(proc, f"trace_start {os.path.join(logdir, str(i))}")

    def stop_traces(self) -> None:
        for proc in self._procs:
            self._ask(proc, "trace_stop")

    def memory_info(self) -> list[dict[str, int]]:
        """Each worker's {'current': bytes, 'peak': bytes} since its last reset."""
        return [json.loads(self._ask(proc, "info")) for proc in self._procs]


def measure_step(cluster: Cluster, layers, shapes, make_batch, num_cells: int,
                 num_micro_batches: int, schedule: str, remat: str, num_replicas: int = 1,
                 optimizer=None, virtual_stages: int = 1,
                 trace_dir: str | None = None) -> list[int]:
    """Peak bytes of each of the R x K / v devices in one training step (module docstring; v:
    cells per device, interleaved); `optimizer` (lingvo_lite.tasks.optimizers params) defaults
    to SGD with momentum 0.9. With `trace_dir`, one more step runs with every worker recording its
    allocations under trace_dir/<device> (`memory_at_peak.py` reads them)."""
    import bench_lib

    def build(placement):
        return bench_lib.make_pipeline(layers, shapes, num_cells, num_micro_batches, remat,
                                       schedule=schedule, placement=placement,
                                       num_replicas=num_replicas,
                                       virtual_stages=virtual_stages)

    return _measure(cluster, build, make_batch(), num_cells // virtual_stages * num_replicas,
                    optimizer, trace_dir)


def _measure(cluster: Cluster, build, batch, num_devices: int, optimizer=None,
             trace_dir: str | None = None) -> list[int]:
    """Builds the pipeline on the cluster's first devices; each device's median peak over
    MEASURED_STEPS steps after a warm-up step.

    The step is `FPropAndReplicaGrads`, then `optimizer.apply` (lingvo_lite.tasks.optimizers, the
    trainer's update: slots beside each trainable weight).
    """
    import gc

    import tensorflow as tf

    from lingvo_lite.core import fprop_context
    from lingvo_lite.tasks import optimizers

    if optimizer is None:
        optimizer = optimizers.SGD.Params().Set(momentum=0.9)
    gc.collect()
    time.sleep(0.2)  # Remote handles of an earlier step are released asynchronously.
    before = [m["current"] for m in cluster.memory_info()]
    pipe = build(cluster.devices(num_devices))
    thetas = pipe.replica_thetas(pipe.theta)
    variables = [[v for v in th.Flatten() if isinstance(v, tf.Variable) and v.trainable]
                 for th in thetas]
    opt = optimizer.Instantiate()
    opt.create_slots([v for row in variables for v in row])

    def step(batch):
        with fprop_context.fprop_context(training=True):
            out, grads = pipe.FPropAndReplicaGrads(thetas, batch)
        grads_and_vars = []
        for theta, g in zip(thetas, grads):
            grads_and_vars += [(x, v) for v, x in zip(theta.Flatten(), g.Flatten())
                               if isinstance(v, tf.Variable) and v.trainable]
        opt.apply(grads_and_vars, tf.constant(1e-3))
        return out.loss

    # A step's loss comes back before its weight updates finish; a scalar that reads every
    # weight waits for them, so no step's updates overlap the next step's peak.
    sync = tf.function(lambda: sum_of_weights(variables), autograph=False)

    fn = tf.function(step, autograph=False)
    float(fn(batch))  # Trace and warm up outside the measured steps.
    float(sync())
    per_step = []
    for _ in range(MEASURED_STEPS):
        cluster.reset_peaks()
        float(fn(batch))
        float(sync())
        per_step.append([m["peak"] - b for m, b in zip(cluster.memory_info(), before)])
    peaks = [int(statistics.median(device)) for device in zip(*per_step)]
    if trace_dir is not None:
        cluster.start_traces(trace_dir)
        float(fn(batch))
        float(sync())
        cluster.stop_traces()
    return peaks[:num_devices]  # The pipeline is freed with this frame (next call: gc).


def sum_of_weights(variables):
    """One scalar reading every variable of `variables` (rows of tf.Variables), each summed on
    its own device: fetching it waits for every pending update of those weights."""
    import tensorflow as tf

    sums = []
    for row in variables:
        for v in row:
            with tf.device(v.device):
                sums.append(tf.reduce_sum(v))
    return tf.add_n(sums)


def random_batch(shapes, seed: int = 0):
    """A batch shaped like `shapes` (NestedMap of shapes): normal floats, zero integers, no
    padding (fields named `*paddings` 0, `*weights` 1)."""
    import numpy as np
    import tensorflow as tf

    from lingvo_lite.core import base_layer
    from lingvo_lite.core.nested_map import NestedMap

    rng = np.random.default_rng(seed)
    shapes = base_layer.to_shape(shapes)

    def one(shape, dtype, name=""):
        if name.endswith("paddings"):  # Every position real.
            return tf.zeros(shape.as_list(), dtype)
        if name.endswith("weights"):
            return tf.ones(shape.as_list(), dtype)
        if dtype.is_floating:
            return tf.constant(rng.normal(size=shape.as_list()), dtype)
        return tf.zeros(shape.as_list(), dtype)

    if isinstance(shapes, dict):
        return NestedMap({k: one(v, tf.int32 if k in _INT_FIELDS else tf.float32, k)
                          for k, v in shapes.items()})
    return one(shapes, tf.float32)


# Input fields that hold ids or labels (int32) in the registered models.
_INT_FIELDS = ("labels", "label", "ids", "src_ids", "tgt_ids", "tgt_labels")


def measure_model(cluster: Cluster, model: str, num_cells: int, num_replicas: int,
                  num_micro_batches: int, schedule: str, remat: str,
                  model_params_override: str = "", virtual_stages: int = 1) -> list[int]:
    """Per-device peaks of a registered model's (first) PipeliningLayer in one training step,
    updated by the task's optimizer (`virtual_stages` cells per device: interleaved)."""
    from lingvo_lite.tasks import model_registry
    from lingvo_lite.training import model_config, options

    model_registry.add_model_package("model_params")  # As trainer.py does.
    config = model_config.build_model_config(options.RunOptions(
        model=model, mode="inspect_model", model_params_override=model_params_override,
        num_cells=num_cells, num_replicas=num_replicas, num_micro_batches=num_micro_batches))
    _, pp = next(iter(model_config.iter_pipelining_params(config.task_params)))
    pp = pp.Copy().Set(schedule=schedule, remat=remat, name=pp.name or "network",
                       virtual_stages=virtual_stages)

    def build(placement):
        return pp.Copy().Set(placement=placement).Instantiate()

    return _measure(cluster, build, random_batch(pp.input_shapes),
                    num_cells // virtual_stages * num_replicas,
                    config.task_params.train.optimizer)


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
        elif command.startswith("trace_start "):
            tf.profiler.experimental.start(command.split(" ", 1)[1])
            print("ok", flush=True)
        elif command == "trace_stop":
            tf.profiler.experimental.stop()
            print("ok", flush=True)
    # stdin closed: the client is gone. gRPC's threads would keep the process alive.
    del server
    os._exit(0)


def _measure_main(argv: list[str]) -> None:
    """`python bench/device_memory.py measure --model=M --configs=K:R:T:schedule:remat[:v],...`
    (`--model` and `--configs` repeatable, in pairs).

    Prints one JSON line: {"peak_bytes": [[device peaks of config 1], ...]}, the configs of
    every model in the order given.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="device_memory.py measure")
    parser.add_argument("--model", required=True, action="append")
    parser.add_argument("--configs", required=True, action="append",
                        help="Comma-separated K:R:T:schedule:remat[:v], e.g. 2:1:4:1f1b:always "
                             "or 4:1:4:interleaved:never:2 (v cells per device).")
    parser.add_argument("--model_params_override", default="")
    args = parser.parse_args(argv)
    if len(args.model) != len(args.configs):
        parser.error("give one --configs for each --model")
    root = os.path.join(HERE, "..")
    if root not in sys.path:
        sys.path.insert(0, root)
    configs = []
    for model, texts in zip(args.model, args.configs):
        for text in texts.split(","):
            k, r, t, schedule, remat, *v = text.split(":")
            configs.append((model, int(k), int(r), int(t), schedule, remat,
                            int(v[0]) if v else 1))
    with Cluster(max(k // v * r for _, k, r, _, _, _, v in configs)) as cluster:
        peaks = [measure_model(cluster, model, k, r, t, schedule, remat,
                               args.model_params_override, v)
                 for model, k, r, t, schedule, remat, v in configs]
    print(json.dumps({"peak_bytes": peaks}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        _measure_main(sys.argv[2:])
    else:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        _serve(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]))
