"""One writer per log directory: `<logdir>/trainer.lock` held by the training process.

Two trainers in one logdir would interleave checkpoints and summaries, so training takes this lock
before restoring anything. The lock file is created atomically (`O_CREAT | O_EXCL`) and records the
owner's PID, hostname, the process's kernel start time and the wall-clock start time. Another
trainer refuses to start while the owner is alive. A lock left by a process that died (SIGKILL,
a crash, a reboot) is stale: on the same host, when that PID is no longer running -- or now belongs
to a process that started at another time (a reused PID) -- it is taken over with a note, so a
resume after a crash just works. Taking over is race-free: the staleness check and the removal
run under an exclusive `flock` of the logdir, so of any number of trainers racing for a stale
lock exactly one gets it. A lock from another host cannot be checked and must be removed by
hand; the error says so. Evaluation does not take the lock (it may run beside a trainer).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable

__all__: list[str] = []

LOCK_FILE = "trainer.lock"


class LogdirInUseError(ValueError):
    """Another live trainer holds the log directory."""


class LogdirNotWritableError(ValueError):
    """The log directory (or its parent, to create it) cannot be written.

    Example:
      >>> e = LogdirNotWritableError("/runs/a", PermissionError(13, "Permission denied", "/runs"))
      >>> str(e).startswith("--logdir=/runs/a: cannot write /runs (Permission denied); give")
      True
    """

    def __init__(self, logdir: str, error: OSError) -> None:
        path = error.filename or logdir
        reason = error.strerror or type(error).__name__
        if error.errno in (errno.EACCES, errno.EPERM):
            fix = (f"give your user write access (e.g. chmod u+w {path}) or choose another "
                   "--logdir")
        elif error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free disk space or choose a --logdir on another disk"
        else:
            fix = "choose another --logdir"
        super().__init__(f"--logdir={logdir}: cannot write {path} ({reason}); {fix}.")


def _proc_start_ticks(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22 (starttime); the command name (field 2) may contain spaces, so split after ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # Exists, owned by someone else.
    return True


def _owner_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "hostname": socket.gethostname(),
            "proc_start_ticks": _proc_start_ticks(pid),
            "start_time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "start_unix": time.time()}


def _is_stale(owner: dict) -> bool:
    """Whether the lock's owner is known to be gone (only decidable on this host)."""
    if owner.get("hostname") != socket.gethostname():
        return False
    pid = owner.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return True
    recorded = owner.get("proc_start_ticks")
    current = _proc_start_ticks(pid)
    return recorded is not None and current is not None and recorded != current


class LogdirLock:
    """The lock of one log directory; `acquire` takes it, `release` gives it back."""

    def __init__(self, logdir: str) -> None:
        self._logdir = logdir
        self.path = os.path.join(logdir, LOCK_FILE)
        self._record: dict | None = None
        self._created_logdir = False
        self.release_error: str | None = None  # Why `release` could not remove the lock.

    def acquire(self, note: Callable[[str], None] | None = None) -> None:
        """Takes the lock; a stale lock is replaced (reported through `note`).

        Raises:
          LogdirInUseError: a live trainer (or one on another host) holds the lock.
        """
        note = note or (lambda msg: None)
        if not os.path.isdir(self._logdir):
            try:
                os.makedirs(self._logdir)
            except OSError as e:
                raise LogdirNotWritableError(self._logdir, e) from None
            self._created_logdir = True
        record = _owner_record()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._remove_if_stale(note)
                continue
            except OSError as e:
                raise LogdirNotWritableError(self._logdir, e) from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:  # A full disk: leave no empty lock file behind.
                with contextlib.suppress(OSError):
                    os.remove(self.path)
                raise LogdirNotWritableError(self._logdir, e) from None
            self._record = record
            return
        raise LogdirInUseError(f"--logdir={self._logdir}: could not take the lock {self.path}; "
                               "another trainer keeps replacing it. Use a different --logdir.")

    def _remove_if_stale(self, note: Callable[[str], None]) -> None:
        """Removes the existing lock file if its owner is gone; refuses if it is alive.

        Race-free among trainers taking over the same stale lock: the check and the removal
        happen under an exclusive `flock` of the logdir itself, and the file removed is the
        one checked (same inode). Without that, two trainers could both judge the old lock
        stale, one remove it and create its own, and the other then remove that new lock and
        create a second one: two writers on one logdir. A trainer that creates the lock with
        O_EXCL meanwhile (no takeover) simply wins; the others then see a live owner.
        """
        try:
            dir_fd = os.open(self._logdir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise LogdirNotWritableError(self._logdir, e) from None
        try:
            try:
                fcntl.flock(dir_fd, fcntl.LOCK_EX)  # Released with the fd (also if we die).
            except OSError:
                pass  # A file system without flock (some network mounts): best effort.
            try:
                before = os.stat(self.path)
            except FileNotFoundError:
                return  # Gone meanwhile: retry the O_EXCL create.
            owner = self._read_owner()
            if owner is not None and not _is_stale(owner):
                self._refuse(owner)
            try:
                if os.stat(self.path).st_ino != before.st_ino:
                    return  # Replaced while we read it: look again.
            except FileNotFoundError:
                return
            what = (f"PID {owner.get('pid')} on {owner.get('hostname')}, started "
                    f"{owner.get('start_time')}" if owner else "unreadable")
            note(f"taking over the stale lock {self.path} ({what}: no longer running).")
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        finally:
            os.close(dir_fd)  # Also releases the flock.

    def _read_owner(self) -> dict | None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            # Unreadable: either being written right now, or garbage left by a crash.
            age = time.time() - os.path.getmtime(self.path) if os.path.exists(self.path) else 99
            if age < 5:
                raise LogdirInUseError(
                    f"--logdir={self._logdir} is being locked by another trainer right now "
                    f"({self.path}); use a different --logdir.") from None
            return None
        return owner if isinstance(owner, dict) else None

    def _refuse(self, owner: dict) -> None:
        where = owner.get("hostname")
        here = socket.gethostname()
        fix = ("stop it first, or use a different --logdir" if where == here else
               f"if no trainer runs on host {where} any more, delete {self.path}")
        raise LogdirInUseError(
            f"--logdir={self._logdir} is in use by another trainer (PID {owner.get('pid')} on "
            f"{where}, started {owner.get('start_time')}; lock file {self.path}): {fix}.")

    def release(self) -> None:
        """Removes the lock file if it is still ours; removes a logdir `acquire` created empty."""
        if self._record is None:
            return
        try:
            with open(self.path) as f:
                ours = json.load(f) == self._record
        except (OSError, ValueError):
            ours = False
        if ours:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            except OSError as e:  # E.g. write permission on the logdir lost mid-run.
                self.release_error = f"could not remove the lock {self.path} ({e.strerror})"
        self._record = None
        if self._created_logdir:
            self._created_logdir = False
            try:
                os.rmdir(self._logdir)  # Only succeeds when nothing else was written.
            except OSError:
                pass
