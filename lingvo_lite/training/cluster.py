"""Training over several processes and hosts: the cluster from `TF_CONFIG`.

Every process runs the same `trainer.py` command with its own `TF_CONFIG`, the environment
variable `tf.distribute`'s cluster resolvers read:

    TF_CONFIG='{"cluster": {"worker": ["host0:2222", "host1:2222"]},
                "task": {"type": "worker", "index": 0}}'

This module is the single-client mode (`--cluster_mode=single_client`, and `auto` when a
replica's cells must span tasks); the default when every replica fits on one task is
multi-client (`multi_client.py`: every task a client of its own replicas), which reuses the
heartbeats below. In single-client mode every task serves its devices with a TensorFlow gRPC
server, and task 0, the chief, is also the one client: it builds the model, reads the input,
places replica r's cell k on a device of the cluster (`placement='cluster'`), runs the steps
(activations cross hosts as TensorFlow's own send/receive, gradients are all-reduced with
collective ops), and alone writes checkpoints, summaries and params.txt. The other tasks serve
until the chief is gone.

The R x K devices of the mesh are spread evenly, replica-major, over the tasks: with N tasks each
task offers D = R*K/N devices, and device i is device i % D of task i // D. So R=2, K=2 on two
tasks puts one whole replica on each host (the common case: data parallelism across hosts), and
R=1, K=2 on two tasks puts one cell on each (a model too big for one host's devices).

Faults never hang. Besides its gRPC server (TCP port P of its address) every task answers
heartbeats on UDP port P (`Channel`, started before TensorFlow is imported): every second it
sends each other task a ping carrying its TF_CONFIG, and answers theirs. So
- a task that does not answer for `LOST_AFTER_S` seconds is lost, whether dead or alive but
  stuck (SIGSTOP, a hung host: its kernel still accepts TCP connections, a TCP probe would
  call it alive); the run ends with one line naming it (exit status 1), and re-running every
  process resumes from the chief's last checkpoint;
- a task whose TF_CONFIG lists other tasks (a mismatched address or task count), or two
  processes given the same task index, are refused on both sides with one line;
- a task that cannot start (its port taken, a bad flag) tells the others, which end with one
  line naming it, instead of waiting for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
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
HEARTBEAT_INTERVAL_S = 1.0
MAX_COMMAND_BYTES = 16384  # Flags longer than this travel as a digest.
ABORT_ACK_TIMEOUT_S = 20.0  # How long a task that failed to start keeps telling the others.


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


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Channel:
    """This task's heartbeats: a UDP socket on its port number, pinging and answering peers.

    Messages are JSON: {"kind": ping | pong | abort | ack | duplicate, "index": sender's task
    index, "addresses": sender's TF_CONFIG list, "pid": ..., "reason": ...}. Each task pings
    every other task every HEARTBEAT_INTERVAL_S and answers every ping with a pong, so
    `last_answer(t)` is when task t last proved that its process runs. A ping or pong whose
    TF_CONFIG differs from this task's, or that claims this task's own index, ends the process
    (`exit_now`) with one line; so does an abort (a peer that could not start).
    """

    def __init__(self, config: ClusterConfig, sock: socket.socket,
                 command: list[str] | None = None) -> None:
        self.config = config
        self._sock = sock
        self._answers: dict[int, float] = {}
        self._states: dict[int, str] = {}
        if command is not None and len(json.dumps(command)) > MAX_COMMAND_BYTES:
            # Long overrides: a digest keeps every heartbeat in one datagram.
            digest = hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]
            command = [f"(flags with sha256 {digest})"]
        self._acks: set[int] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._message = {"index": config.task_index, "addresses": list(config.addresses),
                         "pid": os.getpid(), "command": command, "state": "running"}
        threading.Thread(target=self._receive, name="cluster-heartbeat-rx", daemon=True).start()
        threading.Thread(target=self._ping_loop, name="cluster-heartbeat-tx",
                         daemon=True).start()

    def peers(self) -> list[int]:
        return [t for t in range(self.config.num_tasks) if t != self.config.task_index]

    def last_answer(self, task: int) -> float | None:
        """time.monotonic() of task's last pong, None if it never answered."""
        with self._lock:
            return self._answers.get(task)

    def set_state(self, state: str) -> None:
        """What this task tells the others in its heartbeats, e.g. 'finished' (multi-client)."""
        with self._lock:
            self._message = dict(self._message, state=state)

    def ping_now(self) -> None:
        """Pings every other task at once (e.g. to tell a new state before exiting)."""
        for t in self.peers():
            self._send("ping", self.config.addresses[t])

    def peer_state(self, task: int) -> str | None:
        """The state task last reported ('running', 'finished'), None if never heard."""
        with self._lock:
            return self._states.get(task)

    def _send(self, kind: str, address: tuple[str, int] | str, **extra) -> None:
        target = _split(address) if isinstance(address, str) else address
        with self._lock:
            message = dict(self._message, kind=kind, **extra)
        data = json.dumps(message).encode()
        try:
            self._sock.sendto(data, target)
        except OSError:
            pass  # Unreachable host or an ICMP error: the peer counts as not answering.

    def _ping_loop(self) -> None:
        while not self._closed.wait(HEARTBEAT_INTERVAL_S):
            for t in self.peers():
                self._send("ping", self.config.addresses[t])

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data, sender = self._sock.recvfrom(65536)
                message = json.loads(data.decode())
                index, addresses = int(message["index"]), list(message["addresses"])
                kind = message["kind"]
            except (OSError, ValueError, KeyError, TypeError):
                if self._closed.is_set():
                    return
                continue
            pid = message.get("pid")
            where = (addresses[index] if 0 <= index < len(addresses) else f"{sender[0]}")
            if kind == "probe":  # `_who_serves` from a process that could not bind our port.
                self._send("pong", sender)
                continue
            if kind == "ack":
                with self._lock:
                    self._acks.add(index)
                continue
            if kind == "abort":
                self._send("ack", sender)
                exit_now(f"trainer.py: error: task {index} ({where}) of the cluster could not "
                         f"start: {message.get('reason')} Fix it, then rerun every process.")
            if kind == "duplicate":
                exit_now(f"trainer.py: error: another trainer (PID {pid}) was started as task "
                         f"{index} ({where}) too: two processes have TF_CONFIG task index "
                         f"{index}; give each process its own index, then rerun every process.")
            if addresses != list(self.config.addresses):
                if kind == "ping":
                    self._send("pong", sender)  # Lets the sender report the mismatch too.
                exit_now(mismatch_message(self.config, index, addresses, pid))
            if index == self.config.task_index:
                if kind == "ping":
                    self._send("duplicate", sender)
                exit_now(f"trainer.py: error: another trainer (PID {pid}) also runs as task "
                         f"{index} ({where}): two processes have TF_CONFIG task index {index}; "
                         "give each process its own index, then rerun every process.")
            theirs, ours = message.get("command"), self._message["command"]
            if theirs is not None and ours is not None and theirs != ours:
                if kind == "ping":
                    self._send("pong", sender)  # Lets the sender report the mismatch too.
                exit_now(command_mismatch_message(self.config, index, ours, theirs))
            with self._lock:
                self._states[index] = str(message.get("state"))
            if kind == "ping":
                self._send("pong", sender)
            elif kind == "pong":
                with self._lock:
                    self._answers[index] = time.monotonic()

    def abort(self, reason: str) -> None:
        """Tells every other task that this one cannot start; waits (bounded) for their acks."""
        deadline = time.monotonic() + ABORT_ACK_TIMEOUT_S
        while time.monotonic() < deadline:
            with self._lock:
                missing = [t for t in self.peers() if t not in self._acks]
            if not missing:
                return
            for t in missing:
                self._send("abort", self.config.addresses[t], reason=reason)
            time.sleep(0.5)

    def close(self) -> None:
        self._closed.set()
        self._sock.close()


def mismatch_message(config: ClusterConfig, index: int, addresses: list[str],
                     pid: object) -> str:
    return (f"trainer.py: error: TF_CONFIG differs between the processes: this one (task "
            f"{config.task_index}) lists {list(config.addresses)}, task {index} (PID {pid}) "
            f"lists {addresses}; give every process the same 'cluster' list and its own "
            "'task' index, then rerun every process.")


def command_mismatch_message(config: ClusterConfig, index: int, ours: list[str],
                             theirs: list[str]) -> str:
    only_ours = [f for f in ours if f not in theirs] or ["(none)"]
    only_theirs = [f for f in theirs if f not in ours] or ["(none)"]
    return (f"trainer.py: error: the trainer.py command differs between the processes: this "
            f"one (task {config.task_index}) has {' '.join(only_ours)}, task {index} has "
            f"{' '.join(only_theirs)}; run the same command (the same flags) in every process, "
            "each with its own TF_CONFIG, then rerun every process.")


_channel: Channel | None = None
_stderr_fd: int | None = None  # A copy of fd 2 taken by `open_channel`, for `exit_now`.


def channel() -> Channel | None:
    """The channel `open_channel` started in this process, if any."""
    return _channel


def open_channel(config: ClusterConfig, command: list[str] | None = None) -> Channel:
    """Claims this task's address (UDP and TCP port P) and starts its heartbeats.

    Called before TensorFlow is imported, so that a taken port or a second process with the
    same task index is found in a second, not after a gRPC traceback or a hang. `command`
    (trainer.py's flags, sorted) travels in the heartbeats: a task whose flags differ is
    refused on both sides with one line.

    Raises:
      UsageError: the port is taken (the message names who holds it, when it is a trainer).
    """
    global _channel, _stderr_fd
    if _stderr_fd is None:
        _stderr_fd = os.dup(2)
    address = config.addresses[config.task_index]
    host, port = _split(address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("", port))
    except OSError as e:
        sock.close()
        holder = _who_serves(address)
        if holder is not None and holder.get("index") == config.task_index:
            _tell_duplicate(address, config)
            raise UsageError(
                f"TF_CONFIG task {config.task_index} ({address}) is already served by another "
                f"trainer (PID {holder.get('pid')}): two processes have task index "
                f"{config.task_index}; give each process its own index, then rerun every "
                "process.") from None
        if holder is not None and holder.get("addresses") != list(config.addresses):
            raise UsageError(mismatch_message(config, holder.get("index"),
                                              holder.get("addresses"), holder.get("pid")))
        raise UsageError(
            f"TF_CONFIG task {config.task_index}'s address {address}: UDP port {port} (this "
            f"task's heartbeats, beside gRPC's TCP port {port}) is in use by another program "
            f"({e.strerror}); free it or give this task another port in every process's "
            "TF_CONFIG.") from None
    _channel = Channel(config, sock, command)
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict.
    try:
        probe.bind(("", port))
    except OSError as e:
        raise UsageError(
            f"TF_CONFIG task {config.task_index}'s address {address} is in use by another "
            f"program (TCP port {port}: {e.strerror}); free it or give this task another port "
            "in every process's TF_CONFIG.") from None
    finally:
        probe.close()
    return _channel


def _who_serves(address: str, timeout: float = 2.0) -> dict | None:
    """Pings `address` from a fresh socket: the answering trainer's message, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(json.dumps({"kind": "probe", "index": -1, "addresses": [],
                                    "pid": os.getpid()}).encode(), _split(address))
            data, _ = sock.recvfrom(65536)
            return json.loads(data.decode())
        except (OSError, ValueError):
            return None


def _tell_duplicate(address: str, config: ClusterConfig) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(json.dumps({"kind": "duplicate", "index": config.task_index,
                                    "addresses": list(config.addresses),
                                    "pid": os.getpid()}).encode(), _split(address))
        except OSError:
            pass


def announce_failure(message: str) -> None:
    """Setup failed in a task of a cluster: tell the others (bounded), so they do not wait."""
    if _channel is not None:
        _channel.abort(message.removeprefix("trainer.py: error: "))


def start_server(config: ClusterConfig, devices_per_task: int) -> None:
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
        heartbeats = channel()
        while not self._stop.wait(1.0):
            for t in self._tasks:
                address = self._config.addresses[t]
                answered = heartbeats.last_answer(t) if heartbeats is not None else None
                if answered is not None:
                    # It answers heartbeats: only they count (a stopped process's kernel still
                    # accepts TCP connections). Seen once: the start-up grace is over.
                    last_seen[t] = answered
                elif reachable(address):  # No heartbeat yet (e.g. UDP filtered): TCP.
                    last_seen[t] = time.monotonic()
                if time.monotonic() - last_seen[t] > self._lost_after_s:
                    if not self._stop.is_set():
                        self._on_lost(t, address)
                    return


_before_exit: list[Callable[[], None]] = []


def before_exit(fn: Callable[[], None]) -> None:
    """Registers `fn` (e.g. releasing the logdir lock) to run in `exit_now` before the exit."""
    _before_exit.append(fn)


def exit_now(message: str, status: int = 1) -> None:
    """Prints one line and ends the process at once (threads blocked in TensorFlow included).

    Runs what `before_exit` registered first (its errors are ignored: the process is ending).
    """
    for fn in _before_exit:
        try:
            fn()
        except Exception:  # noqa: BLE001 -- best effort on the way out.
            pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    if _stderr_fd is not None:
        # The terminal's stderr, also while trainer.py captures fd 2 (importing TensorFlow).
        os.write(_stderr_fd, (message + "\n").encode())
    else:
        print(message, file=sys.stderr, flush=True)
    os._exit(status)
