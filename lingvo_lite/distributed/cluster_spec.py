"""The cluster: its tasks from `TF_CONFIG`, parsed once and strictly; what a lost peer is.

Every process of a multi-host run reads the same cluster from its `TF_CONFIG` (the variable
`tf.distribute`'s cluster resolvers read), with its own task:

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 0}}'

`parse_tf_config` turns it into a `Cluster` (None for no TF_CONFIG or a single task) or refuses
it with a one-line `ClusterSpecError`. The job name, the TensorFlow errors that mean a peer was
lost, and the line that names a lost task are defined here and nowhere else; trainer.py (both
cluster modes), the pipeline runtime and the Keras adapter use them. This module imports no
TensorFlow until `peer_errors` is called.

>>> cluster = parse_tf_config({"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:2222", '
...     '"127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}'})
>>> cluster.num_tasks, cluster.task_index, cluster.is_chief
(2, 1, False)
>>> cluster.device(3, devices_per_task=2)
'/job:worker/replica:0/task:1/device:CPU:1'
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Mapping

__all__ = ["AddressInUseError", "Cluster", "ClusterSpecError", "JOB", "PEER_ERROR_NAMES",
           "check_port_free", "is_peer_error", "lost_task_message", "parse_tf_config",
           "peer_errors"]

JOB = "worker"  # Every task is a worker; task 0 (or TF_CONFIG's 'chief') is the chief.

# TensorFlow's errors of a step whose peer task died or stopped: a collective or remote op
# that failed at once (Unavailable, Aborted, Cancelled, Internal) or was aborted by the
# coordination service's heartbeat timeout or the peer health check (DeadlineExceeded).
PEER_ERROR_NAMES = ("UnavailableError", "AbortedError", "CancelledError",
                    "DeadlineExceededError", "InternalError")

_EXAMPLE = ('e.g. TF_CONFIG=\'{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, '
            '"task": {"type": "worker", "index": 0}}\'')


class ClusterSpecError(ValueError):
    """TF_CONFIG (or the cluster given) cannot be used; the one-line message says why."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The tasks of a cluster ('host:port', task 0 is the chief) and this process's index."""

    addresses: tuple[str, ...]
    task_index: int

    def __post_init__(self) -> None:
        if not 0 <= self.task_index < len(self.addresses):
            raise ClusterSpecError(f"task index {self.task_index} is out of range for "
                                   f"{len(self.addresses)} tasks.")

    @property
    def num_tasks(self) -> int:
        return len(self.addresses)

    # The names process groups use (one task is one process).
    num_processes = num_tasks

    @property
    def index(self) -> int:
        return self.task_index

    @property
    def is_chief(self) -> bool:
        return self.task_index == 0

    @property
    def address(self) -> str:
        """This task's 'host:port'."""
        return self.addresses[self.task_index]

    @property
    def peers(self) -> list[int]:
        """The other tasks' indices."""
        return [t for t in range(self.num_tasks) if t != self.task_index]

    def task_name(self, task: int) -> str:
        """TensorFlow's name of a task, e.g. '/job:worker/replica:0/task:1'."""
        return f"/job:{JOB}/replica:0/task:{task}"

    def devices_per_task(self, num_devices: int) -> int:
        """D: the mesh's devices each task offers; ClusterSpecError when they do not split."""
        if num_devices % self.num_tasks:
            raise ClusterSpecError(
                f"TF_CONFIG names {self.num_tasks} tasks but the mesh has {num_devices} devices "
                "(--num_replicas x --num_cells), which do not split evenly over them; make "
                f"num_replicas x num_cells a multiple of {self.num_tasks}.")
        return num_devices // self.num_tasks

    def device(self, index: int, devices_per_task: int, device_type: str = "CPU") -> str:
        """Device `index` of the mesh: device index % D of task index // D."""
        task, local = divmod(index, devices_per_task)
        return f"{self.task_name(task)}/device:{device_type}:{local}"


def parse_tf_config(environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster of `TF_CONFIG`; None when it is unset or names a single task.

    The tasks are the 'chief' job's (at most one) then the 'worker' job's.

    Raises:
      ClusterSpecError: TF_CONFIG is malformed, names an address twice, has other jobs, or its
        task is out of range (one line, with an example).
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(f"TF_CONFIG is not valid JSON ({e}); {_EXAMPLE}.") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterSpecError(f"TF_CONFIG has no 'cluster' object; {_EXAMPLE}.")
    cluster, task = config["cluster"], config.get("task", {})
    jobs = set(cluster) - {"chief", JOB}
    if jobs:
        raise ClusterSpecError(
            f"TF_CONFIG: job(s) {sorted(jobs)} are not supported; list every task under "
            "'worker' (task 0 is the chief), or use 'chief' + 'worker'.")
    chief, workers = cluster.get("chief", []), cluster.get(JOB, [])
    if not isinstance(chief, list) or not isinstance(workers, list):
        raise ClusterSpecError(f"TF_CONFIG: each job is a list of 'host:port'; {_EXAMPLE}.")
    if len(chief) > 1:
        raise ClusterSpecError("TF_CONFIG: the 'chief' job has more than one task; it has "
                               "exactly one.")
    addresses = list(chief) + list(workers)
    if not addresses or not all(isinstance(a, str) and ":" in a for a in addresses):
        raise ClusterSpecError(f"TF_CONFIG: every task needs a 'host:port' address; {_EXAMPLE}.")
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ClusterSpecError(f"TF_CONFIG names {repeated[0]} more than once; each task needs "
                               "its own host:port.")
    if not isinstance(task, dict) or task.get("type") not in ("chief", JOB) \
            or isinstance(task.get("index"), bool) or not isinstance(task.get("index"), int):
        raise ClusterSpecError(
            f"TF_CONFIG: 'task' must be {{\"type\": \"worker\", \"index\": i}}; {_EXAMPLE}.")
    offset = len(chief) if task["type"] == JOB else 0
    count = len(cluster.get(task["type"], []))
    if not 0 <= task["index"] < count:
        raise ClusterSpecError(f"TF_CONFIG: task index {task['index']} is out of range for the "
                               f"{count} '{task['type']}' task(s).")
    if len(addresses) == 1:
        return None
    return Cluster(tuple(addresses), offset + task["index"])


def peer_errors() -> tuple[type[BaseException], ...]:
    """The TensorFlow exception classes of `PEER_ERROR_NAMES` (imports TensorFlow)."""
    import tensorflow as tf

    return tuple(getattr(tf.errors, name) for name in PEER_ERROR_NAMES)


def is_peer_error(error: BaseException) -> bool:
    """Whether `error` is one a lost peer causes (by class name: no TensorFlow import)."""
    return type(error).__name__ in PEER_ERROR_NAMES


def lost_task_message(cluster: Cluster, task: int | None, reason: str, advice: str,
                      program: str = "trainer.py") -> str:
    """The one line that names a lost task, e.g.

    'trainer.py: error: task 0 lost task 1 (127.0.0.1:2223) of the cluster: <reason>; <advice>'
    ('... task 1 lost the chief, task 0 (...) ...' for the chief; 'an unknown task' if None).
    """
    if task is None or not 0 <= task < cluster.num_tasks:
        whom = "a task (unknown which)"
    else:
        whom = ("the chief, task 0" if task == 0 else f"task {task}") + \
            f" ({cluster.addresses[task]})"
    return (f"{program}: error: task {cluster.task_index} lost {whom} of the cluster: "
            f"{reason}; {advice}")


class AddressInUseError(RuntimeError):
    """This task's port is taken; the message says by whom and how to fix it."""


def check_port_free(cluster: Cluster) -> None:
    """Raises AddressInUseError (one line) if this task's TCP port is held by another
    program."""
    port = int(cluster.address.rpartition(":")[2])
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict.
    try:
        probe.bind(("", port))
    except OSError as e:
        raise AddressInUseError(
            f"TF_CONFIG task {cluster.task_index}'s address {cluster.address} is in use by "
            f"another program (TCP port {port}: {e.strerror}); free it or give this task "
            "another port in every process's TF_CONFIG.") from None
    finally:
        probe.close()
