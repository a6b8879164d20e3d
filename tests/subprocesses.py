"""Helpers for tests that start processes: they stop only what they started, by PID."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen]) -> None:
    """Kills each process still running, then reaps it (and drains its pipes)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
