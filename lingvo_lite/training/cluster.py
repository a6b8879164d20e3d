"""Training over several processes and hosts: the cluster from `TF_CONFIG`.

Every process runs the same `trainer.py` command with its own `TF_CONFIG`, the environment
variable `tf.distribute`'s cluster resolvers read:

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 0}}'

This module is the single-client mode (`--cluster_mode=single_client`, and `auto` when a
replica's cells must span tasks); the default when every replica fits on one task is multi-
client (`multi_client.py`: every task a client of its own replicas), which uses the start-up
channel below and then TensorFlow's coordination service. In single-client mode every task
serves its devices with a TensorFlow gRPC server, and task 0, the chief, is also the one client:
it builds the model, reads the input, places replica r's cell k on a device of the cluster
(`placement='cluster'`), runs the steps (activations cross hosts as TensorFlow's own
send/receive, gradients are all-reduced with collective ops), and alone writes checkpoints,
summaries and params.txt. The other tasks serve until the chief is gone.

The R x K devices of the mesh are spread evenly, replica-major, over the tasks: with N tasks each
task offers D = R*K/N devices, and device i is device i % D of task i // D. So R=2, K=2 on two
tasks puts one whole replica on each host (the common case: data parallelism across hosts), and
R=1, K=2 on two tasks puts one cell on each (a model too big for one host's devices).

Faults never hang. Here TensorFlow offers no liveness of its own (no coordination service in
this mode; `check_collective_ops_peer_health` raises InternalError for the client's local
collectives; a step blocked on a stopped task is not ended by `CancellationManager.start_cancel`
nor `abort_collective_ops`: bench/single_client_probe.py), so distributed/heartbeats.py does it:
- before TensorFlow is imported every task answers small UDP messages on its port number
  (`Channel`): a task whose TF_CONFIG lists other tasks, two processes given the same task
  index, a task that cannot start (its port taken, a bad flag) or whose flags differ is refused
  on both sides with one line, in seconds; the channel is closed once the tasks agreed;
- then the `Watchdog` calls a task lost when its TensorFlow server has not answered a gRPC
  GetStatus call for `LOST_AFTER_S` seconds (dead, or alive but stuck: SIGSTOP, a hung host,
  whose kernel still accepts TCP connections); the run ends with one line naming it (exit
  status 1), and re-running every process resumes from the chief's last checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

from lingvo_lite.distributed import heartbeats

# The heartbeats live in distributed/heartbeats.py (Keras in a TF_CONFIG cluster uses them too).
from lingvo_lite.distributed.cluster_spec import (
    JOB,
    AddressInUseError,
    Cluster,
    ClusterSpecError,
    parse_tf_config,
)
from lingvo_lite.distributed.heartbeats import (  # noqa: F401 -- this module's names too.
    ABORT_ACK_TIMEOUT_S,
    HEARTBEAT_INTERVAL_S,
    LOST_AFTER_S,
    MAX_COMMAND_BYTES,
    Channel,
    Watchdog,
    before_exit,
    channel,
    close_when_agreed,
    command_mismatch_message,
    exit_now,
    mismatch_message,
    reachable,
)
from lingvo_lite.training.options import UsageError

__all__: list[str] = []

CHIEF_START_TIMEOUT_S = 120.0  # How long a worker waits for the chief to come up.


def from_environment(environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster of `TF_CONFIG` (`cluster_spec.parse_tf_config`); None for one task.

    Raises:
      UsageError: TF_CONFIG is malformed, names an address twice, or its task is out of range.
    """
    try:
        return parse_tf_config(environ)
    except ClusterSpecError as e:
        raise UsageError(str(e)) from None


def devices_per_task(config: Cluster, num_devices: int) -> int:
    """`Cluster.devices_per_task` as a UsageError (a flag to change)."""
    try:
        return config.devices_per_task(num_devices)
    except ClusterSpecError as e:
        raise UsageError(str(e)) from None


def open_channel(config: Cluster, command: list[str] | None = None) -> Channel:
    """Claims this task's address (UDP and TCP port P) and starts its heartbeats.

    Called before TensorFlow is imported, so that a taken port or a second process with the
    same task index is found in a second, not after a gRPC traceback or a hang. `command`
    (trainer.py's flags, sorted) travels in the heartbeats: a task whose flags differ is
    refused on both sides with one line.

    Raises:
      UsageError: the port is taken (the message names who holds it, when it is a trainer).
    """
    global _command
    _command = command
    try:
        return heartbeats.open_channel(config, command)
    except AddressInUseError as e:
        raise UsageError(str(e)) from None


_command: list[str] | None = None


def command() -> list[str] | None:
    """The trainer.py flags (sorted) `open_channel` was given: what every task must share."""
    return _command


def announce_failure(message: str) -> None:
    """Setup failed in a task of a cluster: tell the others (bounded), so they do not wait."""
    if channel() is not None:
        channel().abort(message.removeprefix("trainer.py: error: "))


def start_server(config: Cluster, devices_per_task: int) -> None:
    """Serves this task's devices (D logical CPUs) to the chief; the chief also connects.

    The chief's client is not one of the tasks: it joins the cluster as TensorFlow's default
    'localhost' job, beside the server of task 0 in the same process. (Connected as task 0
    itself, collectives between its devices and other tasks' never resolve their group.)
    """
    import tensorflow as tf

    spec = tf.train.ClusterSpec({JOB: list(config.addresses)})
    session_config = tf.compat.v1.ConfigProto(device_count={"CPU": devices_per_task})
    try:
        _servers.append(tf.distribute.Server(spec, job_name=JOB, task_index=config.task_index,
                                             protocol="grpc", config=session_config,
                                             start=True))
    except (tf.errors.OpError, RuntimeError) as e:  # E.g. its port was taken meanwhile.
        reason = " ".join(str(getattr(e, "message", e)).split())[:300]
        raise UsageError(
            f"TF_CONFIG task {config.task_index} could not serve at "
            f"{config.addresses[config.task_index]}: {reason}; free the port or give this task "
            "another one in every process's TF_CONFIG.") from None
    if config.is_chief:
        from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

        tf.config.experimental_connect_to_cluster(
            SimpleClusterResolver(spec, rpc_layer="grpc"), make_master_device_default=False)


_servers: list = []  # Servers live as long as the process.
