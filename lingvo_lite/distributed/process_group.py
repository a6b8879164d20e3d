"""Several processes, one data-parallel mesh: TensorFlow's collectives across a cluster.

In multi-client training every process (task) of a cluster runs the same program as its
own client: it builds its own R_local replicas of the pipeline on its own devices and sums
cell k's gradients with the other tasks' replicas through collective all-reduces whose group
spans the cluster (group_size = R_local x num_processes). This is the mechanism of
`tf.distribute.MultiWorkerMirroredStrategy`: the eager context runs a gRPC server of the
cluster (`enable_collective_ops`), task 0 resolves the collective groups (the leader), and
every process derives the same group and instance keys because it builds the same model in
the same order (collectives.py).

`initialize` must run before TensorFlow executes its first op, like the strategy's
constructor; then `current()` tells every PipeliningLayer built afterwards how many
processes share its mesh and which one this is.

A lost task never hangs the others: `initialize` also starts this task's heartbeats (UDP on
its port number, `heartbeats.py`, as trainer.py's tasks). A task that stops answering for
LOST_AFTER_S (dead, or stopped with SIGSTOP) ends every other task with one line naming it and
exit status 1, even while they wait inside a collective; so does a failed collective whose
peer is gone. A task that ends normally says 'finished' at interpreter exit, so tasks that
finish at slightly different times end with their own status.

Example (every task of the cluster runs these lines with its own `index`):

    group = process_group.initialize(["127.0.0.1:2222", "127.0.0.1:2223"], index=0,
                                     num_logical_cpus=2)   # this task's devices
    pipe = PipeliningLayer.Params().Set(..., num_replicas=1).Instantiate()
    # FPropAndReplicaGrads now sums gradients over both tasks' replicas.
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Mapping, Sequence

from lingvo_lite.distributed import heartbeats as heartbeats_lib
from lingvo_lite.distributed.cluster_spec import (
    JOB,
    Cluster,
    is_peer_error,
    lost_task_message,
    parse_tf_config,
)

__all__ = ["current", "from_tf_config", "initialize"]

PROGRAM = "lingvo_lite"  # The prefix of this module's one-line errors.


_current: Cluster | None = None


def current() -> Cluster | None:
    """The group `initialize` set up in this process, or None (a single process)."""
    return _current


def initialize(addresses: Sequence[str], index: int, num_logical_cpus: int | None = None,
               intra_op_threads: int | None = None,
               inter_op_threads: int | None = None,
               heartbeats: bool = True) -> Cluster:
    """Starts this task's collective server; call before any TensorFlow op runs.

    The task's devices must be configured first (the server takes them as they are then), so
    the logical CPUs and thread pools are set here, like `devices.configure_logical_cpus`.

    Args:
      addresses: 'host:port' of every task, the same list in every process.
      index: this process's task index (0: the chief, which also leads the groups).
      num_logical_cpus: logical CPU devices of this task (None: TensorFlow's one CPU).
      intra_op_threads, inter_op_threads: thread-pool sizes (None: TensorFlow's).
      heartbeats: watch the other tasks (module docstring); skipped when this process already
        runs heartbeats (trainer.py watches its tasks itself).

    Raises:
      RuntimeError: TensorFlow already ran an op (collectives can no longer be configured),
        or this task's port is taken (heartbeats.AddressInUseError).
      ValueError: `index` is out of range.
    """
    global _current
    addresses = tuple(addresses)
    group = Cluster(addresses, index)  # ClusterSpecError (a ValueError) if out of range.
    if _current is not None:
        if _current != group:
            raise RuntimeError(f"process_group.initialize was already called with {_current}.")
        return _current
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    ctx = context.context()
    try:
        if num_logical_cpus:
            tf.config.set_logical_device_configuration(
                tf.config.list_physical_devices("CPU")[0],
                [tf.config.LogicalDeviceConfiguration()] * num_logical_cpus)
        if intra_op_threads:
            tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
        if inter_op_threads:
            tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
        ctx.configure_collective_ops(
            collective_leader=f"/job:{JOB}/replica:0/task:0",
            scoped_allocator_enabled_ops=("CollectiveReduce",),
            device_filters=(f"/job:{JOB}/task:{index}",))
    except RuntimeError:
        raise RuntimeError(
            "process_group.initialize must run before TensorFlow executes any op (as "
            "MultiWorkerMirroredStrategy must be created first); call it at program start, "
            "before configure_logical_cpus and before building a model.") from None
    if heartbeats and heartbeats_lib.channel() is None:
        _start_heartbeats(group)
    spec = tf.train.ClusterSpec({JOB: list(addresses)})
    port = int(addresses[index].rpartition(":")[2])
    ctx.enable_collective_ops(tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), default_session_config=ctx.config, job_name=JOB,
        task_index=index, protocol="grpc", port=port))
    _current = group
    return group


def from_tf_config(environ: Mapping[str, str] | None = None,
                   **device_options: int | None) -> Cluster | None:
    """`initialize` from the `TF_CONFIG` environment variable (as tf.distribute reads it).

    None when TF_CONFIG is unset or names one task. `device_options` are `initialize`'s
    keyword arguments (num_logical_cpus, ..., heartbeats).

    Raises:
      cluster_spec.ClusterSpecError: TF_CONFIG is malformed (one line; as trainer.py's).
    """
    cluster = parse_tf_config(environ)
    if cluster is None:
        return None
    return initialize(cluster.addresses, cluster.task_index, **device_options)


def _lost_message(group: Cluster, task: int, address: str, what: str = "") -> str:
    beats = heartbeats_lib.channel()
    if not what and beats is not None and beats.last_answer(task) is None:
        what = f"it did not start within {heartbeats_lib.START_TIMEOUT_S:.0f} s"
    what = what or f"it stopped answering for {heartbeats_lib.LOST_AFTER_S:.0f} s"
    return lost_task_message(group, task, what, "rerun every task.", PROGRAM)


def _start_heartbeats(group: Cluster) -> None:
    """Heartbeats, the watch that ends this process when a peer is lost, and the exit hooks."""
    beats = heartbeats_lib.open_channel(group, program=PROGRAM)
    watch = heartbeats_lib.PeerWatch(
        group, lambda t, address: heartbeats_lib.exit_now(_lost_message(group, t, address)),
        start_timeout_s=heartbeats_lib.START_TIMEOUT_S).start()
    previous_hook = sys.excepthook
    failed: list[bool] = []

    def excepthook(kind, value, traceback) -> None:
        # A collective that failed because a peer died: name the peer (bounded), no traceback.
        failed.append(True)
        beats.set_state("failed")
        peer_error = is_peer_error(value)
        deadline = time.monotonic() + heartbeats_lib.LOST_AFTER_S + 5.0
        while time.monotonic() < deadline:
            for t in watch.peers:
                if watch.finished(t) and not peer_error:
                    continue  # E.g. this task's own error after a peer's normal end.
                address = group.addresses[t]
                if (not heartbeats_lib.reachable(address, timeout=0.5)
                        or watch.stale(t) > 3 * heartbeats_lib.HEARTBEAT_INTERVAL_S):
                    heartbeats_lib.exit_now(_lost_message(
                        group, t, address, "it is gone (a collective with it failed and it "
                        "no longer answers)"))
            if not peer_error:
                break  # This task's own error: checked once.
            time.sleep(1.0)
        previous_hook(kind, value, traceback)

    def finish() -> None:
        watch.stop()
        if not failed:
            beats.set_state(heartbeats_lib.FINISHED)
            beats.ping_now()

    sys.excepthook = excepthook
    atexit.register(finish)
