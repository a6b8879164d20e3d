"""Training over several processes and hosts: the cluster from `TF_CONFIG`.

Every process runs the same `trainer.py` command with its own `TF_CONFIG`, the environment
variable `tf.distribute`'s cluster resolvers read:

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 0}}'

Every task serves its devices with a TensorFlow gRPC server. Task 0, the chief, is also the one
client: it builds the model, reads the input, places replica r's cell k on a device of the
cluster (`placement='cluster'`), runs the steps (activations cross hosts as TensorFlow's own
send/receive, gradients are all-reduced with collective ops), and alone writes checkpoints,
summaries and params.txt. The other tasks serve until the chief is gone.

The R x K devices of the mesh are spread evenly, replica-major, over the tasks: with N tasks each
task offers D = R*K/N devices, and device i is device i % D of task i // D. So R=2, K=2 on two
tasks puts one whole replica on each host (the common case: data parallelism across hosts), and
R=1, K=2 on two tasks puts one cell on each (a model too big for one host's devices).

Faults never hang: each side watches the others' ports; a task that cannot be reached for
`LOST_AFTER_S` seconds ends the run with one line naming it (exit status 1), and re-running
every process resumes from the chief's last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping

from lingvo_lite.training.options import UsageError

__all__: list[str] = []

JOB = "worker"
LOST_AFTER_S = 15.0  # A task unreachable this long is lost (the whole run stops within ~20 s).
CHIEF_START_TIMEOUT_S = 120.0  # How long a worker waits for the chief to come up.


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """The tasks of the cluster (task 0 is the chief) and this process's index."""

    addresses: tuple[str, ...]
    task_index: int

    @property
    def num_tasks(self) -> int:
        return len(self.addresses)

    @property
    def is_chief(self) -> bool:
        return self.task_index == 0

    def devices_per_task(self, num_devices: int) -> int:
        """D: the mesh's devices each task offers; UsageError when they do not split evenly."""
        if num_devices % self.num_tasks:
            raise UsageError(
                f"TF_CONFIG names {self.num_tasks} tasks but the mesh has {num_devices} devices "
                "(--num_replicas x --num_cells), which do not split evenly over them; make "
                f"num_replicas x num_cells a multiple of {self.num_tasks}.")
        return num_devices // self.num_tasks

    def device(self, index: int, devices_per_task: int, device_type: str = "CPU") -> str:
        task, local = divmod(index, devices_per_task)
        return f"/job:{JOB}/replica:0/task:{task}/device:{device_type}:{local}"


def from_environment(environ: Mapping[str, str] | None = None) -> ClusterConfig | None:
    """The cluster of `TF_CONFIG`; None when unset or naming a single task.

    Raises:
      UsageError: TF_CONFIG is malformed, names an address twice, or its task is out of range.
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    example = ('e.g. TF_CONFIG=\'{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, '
               '"task": {"type": "worker", "index": 0}}\'')
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"TF_CONFIG is not valid JSON ({e}); {example}.") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise UsageError(f"TF_CONFIG has no 'cluster' object; {example}.")
    cluster, task = config["cluster"], config.get("task", {})
    jobs = set(cluster) - {"chief", JOB}
    if jobs:
        raise UsageError(f"TF_CONFIG: job(s) {sorted(jobs)} are not supported; list every task "
                         f"under 'worker' (task 0 is the chief), or use 'chief' + 'worker'.")
    addresses = list(cluster.get("chief", [])) + list(cluster.get(JOB, []))
    if len(cluster.get("chief", [])) > 1:
        raise UsageError("TF_CONFIG: the 'chief' job has more than one task; it has exactly one.")
    if not addresses or not all(isinstance(a, str) and ":" in a for a in addresses):
        raise UsageError(f"TF_CONFIG: every task needs a 'host:port' address; {example}.")
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise UsageError(f"TF_CONFIG names {repeated[0]} more than once; each task needs its own "
                         "host:port.")
    if not isinstance(task, dict) or task.get("type") not in ("chief", JOB) \
            or isinstance(task.get("index"), bool) or not isinstance(task.get("index"), int):
        raise UsageError(f"TF_CONFIG: 'task' must be {{\"type\": \"worker\", \"index\": i}}; "
                         f"{example}.")
    offset = len(cluster.get("chief", [])) if task["type"] == JOB else 0
    count = len(cluster.get(task["type"], []))
    if not 0 <= task["index"] < count:
        raise UsageError(f"TF_CONFIG: task index {task['index']} is out of range for the "
                         f"{count} '{task['type']}' task(s).")
    if len(addresses) == 1:
        return None
    return ClusterConfig(tuple(addresses), offset + task["index"])


def start_server(config: ClusterConfig, devices_per_task: int) -> None:
    """Serves this task's devices (D logical CPUs) to the chief; the chief also connects.

    The chief's client is not one of the tasks: it joins the cluster as TensorFlow's default
    'localhost' job, beside the server of task 0 in the same process. (Connected as task 0
    itself, collectives between its devices and other tasks' never resolve their group.)
    """
    import tensorflow as tf

    spec = tf.train.ClusterSpec({JOB: list(config.addresses)})
    session_config = tf.compat.v1.ConfigProto(device_count={"CPU": devices_per_task})
    _servers.append(tf.distribute.Server(spec, job_name=JOB, task_index=config.task_index,
                                         protocol="grpc", config=session_config, start=True))
    if config.is_chief:
        from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver

        tf.config.experimental_connect_to_cluster(
            SimpleClusterResolver(spec, rpc_layer="grpc"), make_master_device_default=False)


_servers: list = []  # Servers live as long as the process.


def reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


class Watchdog:
    """Checks every second that the other tasks' servers answer; calls `on_lost` if one does not.

    `on_lost(task_index, address)` runs on the watchdog's thread; it must end the process
    (a step waiting on a lost task cannot be interrupted otherwise).
    """

    def __init__(self, config: ClusterConfig, tasks: list[int],
                 on_lost: Callable[[int, str], None], lost_after_s: float = LOST_AFTER_S,
                 start_timeout_s: float = 0.0) -> None:
        self._config = config
        self._tasks = tasks
        self._on_lost = on_lost
        self._lost_after_s = lost_after_s
        self._start_timeout_s = start_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        now = time.monotonic()
        # A task is first given start_timeout_s to come up, then lost_after_s at every outage.
        last_seen = {t: now + self._start_timeout_s for t in self._tasks}
        while not self._stop.wait(1.0):
            for t in self._tasks:
                address = self._config.addresses[t]
                if reachable(address):
                    last_seen[t] = time.monotonic()  # Seen once: the start-up grace is over.
                elif time.monotonic() - last_seen[t] > self._lost_after_s:
                    if not self._stop.is_set():
                        self._on_lost(t, address)
                    return


def exit_now(message: str, status: int = 1) -> None:
    """Prints one line and ends the process at once (threads blocked in TensorFlow included)."""
    print(message, file=sys.stderr, flush=True)
    os._exit(status)
