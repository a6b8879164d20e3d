"""What TensorFlow does not do for a cluster: start-up faults, and single-client liveness.

TensorFlow's coordination service (process_group.py) keeps a multi-client cluster alive, but
it exists only once every task's TensorFlow has started and joined it. Before that, a task
whose port is taken, two processes given the same task index, or tasks whose TF_CONFIG lists
differ (another leader) would only meet its registration timeout (120 s).
So trainer.py claims its address before TensorFlow loads: every task answers small UDP
messages on its port number (`Channel`): pings carrying its TF_CONFIG list, and 'abort' from
a task that cannot start; a mismatch ends both sides in one line within a second. In
multi-client mode the channel is closed (`close_channel`) once the coordination service is
up and the tasks agreed: a running task has one open port, its gRPC server's. With UDP
filtered, these start-up faults fall back to the registration timeout.

In single-client mode (one client drives every task's devices with remote ops, not
collectives) TensorFlow offers no liveness: there is no coordination service, its peer health
check raises InternalError for the client's local collectives, and a step blocked on a stopped
task is ended neither by `CancellationManager.start_cancel` nor by `abort_collective_ops`
(bench/single_client_probe.py). There the channel compares the trainer.py commands (`set_mode`;
multi-client tasks compare them through the coordination service) and is closed once the tasks
told each other their modes (`close_when_agreed`); then `Watchdog` calls a task lost when its
TensorFlow server has not answered a gRPC GetStatus call for LOST_AFTER_S (dead, or stopped:
a stopped process's kernel still accepts TCP connections), over the gRPC port: a running task
has one open port. The single client then ends its process with one line (`exit_now`: its
blocked step cannot be interrupted otherwise); a serving task just returns.

Example (task 0 of two; it ends with one line if task 1 stops):

    config = cluster_spec.Cluster(("127.0.0.1:2222", "127.0.0.1:2223"), task_index=0)
    channel = heartbeats.open_channel(config, program="train.py")   # Before TensorFlow.
    ...  # Start the task's TensorFlow server.
    heartbeats.Watchdog(config, [1], lambda t, address: heartbeats.exit_now(
        f"train.py: error: lost task {t} ({address})")).start()
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from lingvo_lite.distributed.cluster_spec import AddressInUseError, Cluster, check_port_free

__all__ = ["Channel", "Watchdog", "channel", "close_channel", "close_when_agreed",
           "exit_now", "open_channel", "server_answers"]

LOST_AFTER_S = 10.0  # A task silent this long is lost (as the coordination service's timeout).
HEARTBEAT_INTERVAL_S = 1.0
MAX_COMMAND_BYTES = 16384  # Flags longer than this travel as a digest.
ABORT_ACK_TIMEOUT_S = 20.0  # How long a task that failed to start keeps telling the others.


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class Channel:
    """This task's heartbeats: a UDP socket on its port number, pinging and answering peers.

    Messages are JSON: {"kind": ping | pong | abort | ack | duplicate, "index": sender's task
    index, "addresses": sender's TF_CONFIG list, "pid", "command", "mode", "reason"}. Each
    task pings every other task every HEARTBEAT_INTERVAL_S and answers every ping with a pong,
    so `last_answer(t)` is when task t last proved that its process runs. A ping or pong whose
    TF_CONFIG differs from this task's, or that claims this task's own index, ends the process
    (`exit_now`) with one line; so does an abort (a peer that could not start).
    """

    def __init__(self, config: Cluster, sock: socket.socket, command: list[str] | None = None,
                 program: str = "trainer.py") -> None:
        self.config = config
        self.program = program
        self._sock = sock
        self._answers: dict[int, float] = {}
        self._modes: dict[int, str] = {}
        if command is not None and len(json.dumps(command)) > MAX_COMMAND_BYTES:
            # Long overrides: a digest keeps every heartbeat in one datagram.
            digest = hashlib.sha256(json.dumps(command).encode()).hexdigest()[:16]
            command = [f"(flags with sha256 {digest})"]
        self._acks: set[int] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._message = {"index": config.task_index, "addresses": list(config.addresses),
                         "pid": os.getpid(), "command": command, "mode": None}
        threading.Thread(target=self._receive, name="cluster-heartbeat-rx", daemon=True).start()
        threading.Thread(target=self._ping_loop, name="cluster-heartbeat-tx",
                         daemon=True).start()

    def peers(self) -> list[int]:
        return [t for t in range(len(self.config.addresses)) if t != self.config.task_index]

    def last_answer(self, task: int) -> float | None:
        """time.monotonic() of task's last pong, None if it never answered."""
        with self._lock:
            return self._answers.get(task)

    def set_mode(self, mode: str) -> None:
        """This task's cluster mode, once chosen: commands are compared between tasks whose
        modes differ or are both 'single_client' (multi-client tasks compare them through the
        coordination service)."""
        with self._lock:
            self._message = dict(self._message, mode=mode)

    def peer_mode(self, task: int) -> str | None:
        """The cluster mode task last reported, None if not yet (`set_mode`)."""
        with self._lock:
            return self._modes.get(task)

    def _send(self, kind: str, address: tuple[str, int] | str, **extra) -> None:
        target = split_address(address) if isinstance(address, str) else address
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
        error = f"{self.program}: error:"
        other = _other(self.program)
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
            if kind == "probe":  # `who_serves` from a process that could not bind our port.
                self._send("pong", sender)
                continue
            if kind == "ack":
                with self._lock:
                    self._acks.add(index)
                continue
            if kind == "abort":
                self._send("ack", sender)
                exit_now(f"{error} task {index} ({where}) of the cluster could not start: "
                         f"{message.get('reason')} Fix it, then rerun every process.")
            if kind == "duplicate":
                exit_now(f"{error} another {other} (PID {pid}) was started as task {index} "
                         f"({where}) too: two processes have TF_CONFIG task index {index}; "
                         "give each process its own index, then rerun every process.")
            if addresses != list(self.config.addresses):
                if kind == "ping":
                    self._send("pong", sender)  # Lets the sender report the mismatch too.
                exit_now(mismatch_message(self.config, index, addresses, pid, self.program))
            if index == self.config.task_index:
                if kind == "ping":
                    self._send("duplicate", sender)
                exit_now(f"{error} another {other} (PID {pid}) also runs as task {index} "
                         f"({where}): two processes have TF_CONFIG task index {index}; give "
                         "each process its own index, then rerun every process.")
            theirs, ours = message.get("command"), self._message["command"]
            modes = {message.get("mode"), self._message.get("mode")}
            if None not in modes and modes != {"multi_client"} and theirs is not None \
                    and ours is not None and theirs != ours:
                if kind == "ping":
                    self._send("pong", sender)  # Lets the sender report the mismatch too.
                exit_now(command_mismatch_message(self.config, index, ours, theirs))
            with self._lock:
                if message.get("mode") is not None:
                    self._modes[index] = str(message.get("mode"))
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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # Wakes the receiving thread (Linux).
        except OSError:
            pass
        self._sock.close()


def _other(program: str) -> str:
    return "trainer" if program == "trainer.py" else "process"


def mismatch_message(config: Cluster, index: int, addresses: list[str], pid: object,
                     program: str = "trainer.py") -> str:
    return (f"{program}: error: TF_CONFIG differs between the processes: this one (task "
            f"{config.task_index}) lists {list(config.addresses)}, task {index} (PID {pid}) "
            f"lists {addresses}; give every process the same 'cluster' list and its own "
            "'task' index, then rerun every process.")


def command_mismatch_message(config: Cluster, index: int, ours: list[str],
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


def close_channel() -> None:
    """Closes this process's channel (its UDP socket and threads), if any."""
    global _channel
    if _channel is not None:
        _channel.close()
        _channel = None


def open_channel(config: Cluster, command: list[str] | None = None,
                 program: str = "trainer.py") -> Channel:
    """Claims this task's address (UDP and TCP port P) and starts its heartbeats.

    `command` (e.g. trainer.py's flags, sorted) travels in the heartbeats: a task whose
    command differs is refused on both sides with one line.

    Raises:
      AddressInUseError: the port is taken (the message names who holds it, when it is a task).
    """
    global _channel, _stderr_fd
    if _stderr_fd is None:
        _stderr_fd = os.dup(2)
    address = config.addresses[config.task_index]
    _, port = split_address(address)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("", port))
    except OSError as e:
        sock.close()
        holder = who_serves(address)
        if holder is not None and holder.get("index") == config.task_index:
            _tell_duplicate(address, config)
            raise AddressInUseError(
                f"TF_CONFIG task {config.task_index} ({address}) is already served by another "
                f"{_other(program)} (PID {holder.get('pid')}): two processes have task index "
                f"{config.task_index}; give each process its own index, then rerun every "
                "process.") from None
        if holder is not None and holder.get("addresses") != list(config.addresses):
            raise AddressInUseError(mismatch_message(config, holder.get("index"),
                                                holder.get("addresses"), holder.get("pid"),
                                                program)) from None
        raise AddressInUseError(
            f"TF_CONFIG task {config.task_index}'s address {address}: UDP port {port} (this "
            f"task's heartbeats, beside gRPC's TCP port {port}) is in use by another program "
            f"({e.strerror}); free it or give this task another port in every process's "
            "TF_CONFIG.") from None
    _channel = Channel(config, sock, command, program)
    check_port_free(config)
    return _channel


def who_serves(address: str, timeout: float = 2.0) -> dict | None:
    """Pings `address` from a fresh socket: the answering task's message, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.sendto(json.dumps({"kind": "probe", "index": -1, "addresses": [],
                                    "pid": os.getpid()}).encode(), split_address(address))
            data, _ = sock.recvfrom(65536)
            return json.loads(data.decode())
        except (OSError, ValueError):
            return None


def _tell_duplicate(address: str, config: Cluster) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(json.dumps({"kind": "duplicate", "index": config.task_index,
                                    "addresses": list(config.addresses),
                                    "pid": os.getpid()}).encode(), split_address(address))
        except OSError:
            pass


def reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def server_answers(address: str, timeout: float = 2.0) -> bool:
    """Whether the TensorFlow server at `address` answers a gRPC GetStatus call in time.

    The RPC TensorFlow's own peer health check sends (`check_collective_ops_peer_health`,
    unavailable to a single client): a dead task refuses it at once, a stopped one (SIGSTOP,
    a hung host) lets it time out although its kernel still accepts the TCP connection.
    """
    import grpc

    try:
        with grpc.insecure_channel(address) as rpc_channel:  # GetStatusRequest is empty.
            rpc_channel.unary_unary("/tensorflow.WorkerService/GetStatus",
                                    request_serializer=lambda _: b"",
                                    response_deserializer=lambda data: data)(
                None, timeout=timeout)
        return True
    except grpc.RpcError:
        return False


class Watchdog:
    """Calls `on_lost(task, address)` when another task's TensorFlow server has not answered
    (`server_answers`, over its gRPC port) for `lost_after_s`; single-client mode.

    A task is first given `start_timeout_s` to come up. `on_lost` runs on the watchdog's thread;
    it must end the process (a step waiting on the lost task cannot be interrupted otherwise:
    bench/single_client_probe.py).
    """

    def __init__(self, config: Cluster, tasks: list[int], on_lost: Callable[[int, str], None],
                 lost_after_s: float = LOST_AFTER_S, start_timeout_s: float = 0.0) -> None:
        self._config, self._tasks, self._on_lost = config, tasks, on_lost
        self._lost_after_s, self._start_timeout_s = lost_after_s, start_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_seen = {t: time.monotonic() + self._start_timeout_s for t in self._tasks}
        while not self._stop.wait(1.0):
            for t in self._tasks:
                address = self._config.addresses[t]
                if server_answers(address):
                    last_seen[t] = time.monotonic()
                elif time.monotonic() - last_seen[t] > self._lost_after_s:
                    if not self._stop.is_set():
                        self._on_lost(t, address)
                    return


def close_when_agreed(tasks: list[int], timeout_s: float = 10.0) -> None:
    """Closes this process's channel once each of `tasks` has told its mode (so the commands
    were compared; a mismatch has ended the process), or after `timeout_s` (bounded)."""
    beats = channel()
    if beats is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(beats.peer_mode(t) is None for t in tasks):
        time.sleep(0.2)
    time.sleep(2 * HEARTBEAT_INTERVAL_S)  # Our own mode reaches them too.
    close_channel()


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
