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

A lost task never hangs the others, by TensorFlow's own machinery, configured as the strategy
configures it: `initialize` starts TensorFlow's coordination service (led by task 0; one port
per task, the gRPC server's). Every task sends it heartbeats; a task silent for
HEARTBEAT_TIMEOUT_S (dead, or stopped with SIGSTOP) is reported to every other task, whose
collectives are then aborted: a step waiting on the lost task raises (UnavailableError, or
DeadlineExceededError when the leader itself is lost) instead of waiting forever, and a
collective with a dead task fails at once. The program then leaves through its normal exit
path; `lost_task` names the task from the error (`watch=True` does it for an uncaught error:
one line, exit status 1). `initialize` returns when every task has joined (bounded by
START_TIMEOUT_S) and the tasks' TF_CONFIG lists agree (`agree_on`, the service's key-value
store). A task that ends normally is not waited for: it is reported lost only to a task that
still needs it in a collective (bench/coordination_probe.py --finish_first).

Example (every task of the cluster runs these lines with its own `index`):

    group = process_group.initialize(["127.0.0.1:2222", "127.0.0.1:2223"], index=0,
                                     num_logical_cpus=2)   # this task's devices
    pipe = PipeliningLayer.Params().Set(..., num_replicas=1).Instantiate()
    # FPropAndReplicaGrads now sums gradients over both tasks' replicas.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence

from lingvo_lite.distributed.cluster_spec import (
    JOB,
    Cluster,
    ClusterSpecError,
    check_port_free,
    is_peer_error,
    lost_task_message,
    parse_tf_config,
)

__all__ = ["agree_on", "current", "from_tf_config", "initialize", "lost_task", "wait_for_all"]

PROGRAM = "lingvo_lite"  # The prefix of this module's one-line errors.
HEARTBEAT_TIMEOUT_S = 10.0  # The coordination service's: a task silent this long is lost.
START_TIMEOUT_S = 120.0  # How long `initialize` waits for every task to join.
_KEY_PREFIX = "lingvo_lite"

_current: Cluster | None = None


def current() -> Cluster | None:
    """The group `initialize` set up in this process, or None (a single process)."""
    return _current


def initialize(addresses: Sequence[str], index: int, num_logical_cpus: int | None = None,
               intra_op_threads: int | None = None,
               inter_op_threads: int | None = None,
               watch: bool = True) -> Cluster:
    """Starts this task's collective server and the coordination service; before any TF op.

    The task's devices must be configured first (the server takes them as they are then), so
    the logical CPUs and thread pools are set here, like `devices.configure_logical_cpus`.
    Returns when every task has joined and their TF_CONFIG lists agree.

    Args:
      addresses: 'host:port' of every task, the same list in every process.
      index: this process's task index (0: the chief, which also leads the groups and the
        coordination service).
      num_logical_cpus: logical CPU devices of this task (None: TensorFlow's one CPU).
      intra_op_threads, inter_op_threads: thread-pool sizes (None: TensorFlow's).
      watch: an uncaught error of a lost peer ends the program with one line naming the
        task instead of a traceback (trainer.py reports its own).

    Raises:
      RuntimeError: TensorFlow already ran an op (collectives can no longer be configured),
        this task's port is taken, or a task did not join within START_TIMEOUT_S.
      ClusterSpecError: `index` is out of range, or the tasks' TF_CONFIG lists differ.
    """
    global _current
    group = Cluster(tuple(addresses), index)
    if _current is not None:
        if _current != group:
            raise RuntimeError(f"process_group.initialize was already called with {_current}.")
        return _current
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
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
            collective_leader=group.task_name(0),
            scoped_allocator_enabled_ops=("CollectiveReduce",),
            device_filters=(f"/job:{JOB}/task:{index}",))
    except RuntimeError:
        raise RuntimeError(
            "process_group.initialize must run before TensorFlow executes any op (as "
            "MultiWorkerMirroredStrategy must be created first); call it at program start, "
            "before configure_logical_cpus and before building a model.") from None
    check_port_free(group)
    # As MultiWorkerMirroredStrategy does (collective_all_reduce_strategy.py): the service's
    # heartbeats replace its Python health-check thread.
    ctx.configure_coordination_service(
        service_type="standalone", service_leader=group.task_name(0),
        heartbeat_timeout_in_ms=int(HEARTBEAT_TIMEOUT_S * 1000),
        cluster_register_timeout_in_ms=int(START_TIMEOUT_S * 1000),
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(
            name=JOB, num_tasks=group.num_tasks)])
    if watch:
        _watch_uncaught_errors(group)
    spec = tf.train.ClusterSpec({JOB: list(group.addresses)})
    try:
        ctx.enable_collective_ops(tensorflow_server_pb2.ServerDef(
            cluster=spec.as_cluster_def(), default_session_config=ctx.config, job_name=JOB,
            task_index=index, protocol="grpc", port=int(group.address.rpartition(":")[2])))
    except tf.errors.OpError as e:
        raise RuntimeError(
            f"task {index} of the cluster {list(group.addresses)}: not every task joined "
            f"within {START_TIMEOUT_S:.0f} s ({_first_line(e)}); start every task, each with "
            "its own TF_CONFIG index and the same list.") from None
    _current = group
    differ = agree_on("tf_config", json.dumps(list(group.addresses)))
    if differ:
        task, theirs = next(iter(differ.items()))
        raise ClusterSpecError(
            f"TF_CONFIG differs between the processes: this one (task {index}) lists "
            f"{list(group.addresses)}, task {task} lists {json.loads(theirs)}; give every "
            "process the same 'cluster' list and its own 'task' index, then rerun every "
            "process.")
    return group


def from_tf_config(environ: Mapping[str, str] | None = None,
                   **device_options: int | bool | None) -> Cluster | None:
    """`initialize` from the `TF_CONFIG` environment variable (as tf.distribute reads it).

    None when TF_CONFIG is unset or names one task. `device_options` are `initialize`'s
    keyword arguments (num_logical_cpus, ..., watch).

    Raises:
      cluster_spec.ClusterSpecError: TF_CONFIG is malformed (one line; as trainer.py's).
    """
    cluster = parse_tf_config(environ)
    if cluster is None:
        return None
    return initialize(cluster.addresses, cluster.task_index, **device_options)


def agree_on(name: str, value: str, timeout_s: float = START_TIMEOUT_S) -> dict[int, str]:
    """Every task's `value` for `name`, through the coordination service's key-value store.

    Each task publishes its value and reads every other task's (waiting up to `timeout_s`
    for it). Returns {task: its value} for the tasks whose value differs from this one's
    (empty: all agree). Every task sees the same differences, so each refuses on its side.
    """
    from tensorflow.python.eager import context

    group = _require()
    ctx = context.context()
    ctx.set_config_key_value(f"{_KEY_PREFIX}/{name}/{group.task_index}", value)
    differ = {}
    for t in group.peers:
        theirs = ctx.get_config_key_value(f"{_KEY_PREFIX}/{name}/{t}",
                                          timeout_in_ms=int(timeout_s * 1000))
        if theirs != value:
            differ[t] = theirs
    # The leader (task 0) hosts the store: a task that refuses leaves only once every task
    # has read it (measured: task 1's read failed with UnavailableError when task 0 refused
    # and exited first).
    wait_for_all(f"read/{name}", timeout_s)
    return differ


def wait_for_all(name: str, timeout_s: float) -> bool:
    """A barrier of the coordination service: True when every task reached it in time."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    _require()
    try:
        context.context().wait_at_barrier(f"{_KEY_PREFIX}/{name}", int(timeout_s * 1000))
    except tf.errors.OpError:
        return False
    return True


def lost_task(error: BaseException, cluster: Cluster | None = None) -> tuple[int | None, str]:
    """(the lost task, why) for an error a lost peer caused (`cluster_spec.is_peer_error`).

    Read from TensorFlow's message (the task a failed collective names, the unhealthy task the
    coordination service reports, the leader whose heartbeats failed); else the first peer
    that fails TensorFlow's peer health check (`check_collective_ops_peer_health`).
    """
    group = cluster or _require()
    text = " ".join(str(getattr(error, "message", error)).split())
    named = [int(t) for t in re.findall(r"/job:\w+/replica:\d+/task:(\d+)", text)
             if int(t) != group.task_index and int(t) < group.num_tasks]
    if named and "stopped sending heartbeats" in text:
        return named[0], (f"it sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f} s (dead or "
                          "stopped)")
    if named:
        return named[0], "it is gone (a collective with it failed)"
    if "CoordinationService" in text and not group.is_chief:
        return 0, (f"it leads the coordination service, which did not answer for "
                   f"{HEARTBEAT_TIMEOUT_S:.0f} s (dead or stopped)")
    from tensorflow.python.eager import context

    for t in group.peers:
        try:
            context.context().check_collective_ops_peer_health(group.task_name(t),
                                                               timeout_in_ms=2000)
        except Exception:  # noqa: BLE001 -- any failure: this peer does not answer.
            return t, "it does not answer TensorFlow's peer health check"
    return None, f"a collective failed ({text[:200]})"


def _require() -> Cluster:
    if _current is None:
        raise RuntimeError("process_group.initialize has not been called in this process.")
    return _current


def _first_line(error: BaseException) -> str:
    return " ".join(str(getattr(error, "message", error)).split())[:200]


def _watch_uncaught_errors(group: Cluster) -> None:
    """An uncaught error of a lost peer: one line naming the task (exit status 1), no traceback.

    The interpreter then exits as usual (atexit handlers and `finally` blocks have run).
    """
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback) -> None:
        if not is_peer_error(value):
            previous_hook(kind, value, traceback)
            return
        task, why = lost_task(value, group)
        print(lost_task_message(group, task, why, "rerun every task.", PROGRAM),
              file=sys.stderr, flush=True)

    sys.excepthook = excepthook
