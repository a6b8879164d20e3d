"""SIGINT (Ctrl-C) and SIGTERM (preemption): stop at a step boundary, never in the middle.

A Python signal handler runs between any two bytecodes, so an exception raised from it (the
default `KeyboardInterrupt`) can land between fetching a batch and training on it, half-way
through counting a skipped update, or inside a checkpoint save. While training, `StopSignals`
therefore only records the signal; the loop checks `requested` before fetching the next batch,
where the weights and the input position belong together, and saves there. A second signal
during that save is recorded, reported after it and otherwise ignored.

Outside the training loop (start-up, setup: building the model, restoring, tracing) there is
nothing to save: `raise_on_signals` turns SIGTERM, like SIGINT, into an `Interrupted` exception so
the logdir lock is released on the way out.

Once the process is stopping -- the first signal raised `Interrupted`, or the training loop
received one -- later SIGINTs and SIGTERMs (an impatient second Ctrl-C) are only recorded in
`late_signals()`: an exception raised in the middle of releasing the lock or printing the final
message would leave a traceback and a held lock. SIGKILL still ends the process at once.

`maybe_signal_self` is a test-only hook (see its docstring).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__: list[str] = []

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Test-only: `point=SIGNAL[,point=SIGNAL...]`; see maybe_signal_self.
TEST_SIGNAL_ENV = "LINGVO_LITE_TEST_SIGNAL_AT"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM received outside the training loop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(signum: int) -> int:
    """The shell's convention for a process stopped by a signal: 128 + its number."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Stopping:
    """Process-wide: whether a stop signal was acted on, and the signals received after it."""

    active = False
    late: list[int] = []


def late_signals() -> list[int]:
    """Signals received (and ignored) while the process was already stopping.

    Example:
      >>> late_signals()  # After a second Ctrl-C while stopping: [signal.SIGINT].
      []
    """
    return list(_Stopping.late)


def _mark_stopping() -> None:
    _Stopping.active = True


@contextlib.contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    if not _in_main_thread():  # Python only allows handlers in the main thread.
        yield
        return
    previous = {s: signal.signal(s, handler) for s in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _raise_once(signum: int, frame: FrameType | None) -> None:
    if _Stopping.active:
        _Stopping.late.append(signum)
        return
    _mark_stopping()
    raise Interrupted(signum)


@contextlib.contextmanager
def raise_on_signals(reset: bool = False) -> Iterator[None]:
    """SIGINT and SIGTERM raise `Interrupted` while inside (the default SIGTERM kills).

    Only the first signal raises; later ones are recorded (see the module docstring). `reset`
    starts a new invocation: forgets an earlier stop and its late signals.

    Example:
      >>> with raise_on_signals(reset=True):
      ...     pass  # Ctrl-C here raises Interrupted(signal.SIGINT) once.
    """
    if reset:
        _Stopping.active = False
        _Stopping.late = []
    with _handlers(_raise_once):
        yield


def raise_on_signals_for_process() -> None:
    """`raise_on_signals` for the rest of the process, for an entry point (trainer.py) to call
    first: a signal during interpreter shutdown is then noted too, not a traceback.

    Example (the first statement of a script's `if __name__ == "__main__":`):
      >>> raise_on_signals_for_process()
    """
    if _in_main_thread():
        for s in HANDLED_SIGNALS:
            signal.signal(s, _raise_once)


class StopSignals:
    """Records SIGINT/SIGTERM while entered instead of raising; see the module docstring.

    Nothing is printed from the handler: it may run inside a print to the same stream.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._context: contextlib.AbstractContextManager | None = None

    @property
    def requested(self) -> int | None:
        """The first signal received, or None."""
        return self.received[0] if self.received else None

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    def __enter__(self) -> StopSignals:
        self._context = _handlers(self._record)
        self._context.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.received:
            # Stopping: the handler restored below (raise_on_signals') now only records.
            _mark_stopping()
        self._context.__exit__(*exc_info)


def maybe_signal_self(point: str) -> None:
    """Test-only: sends this process the signal `$LINGVO_LITE_TEST_SIGNAL_AT` names for `point`.

    Points are `start` (trainer.py parsed its flags, TensorFlow is not imported yet),
    `interrupted` (the first signal is being reported), `setup` (the trainer restored its
    checkpoint, the step is not traced yet), `fetched:<step>` (the batch for that step was just
    fetched), `saving:<step>` (TensorFlow wrote checkpoint <step>, its manifest is not yet
    written) and `stopped` (the loop saved after a stop signal; summaries and lock are not yet
    closed). `SIGSTOP` pauses the trainer there (tests change its environment, then send
    SIGCONT). The tests use this to land a signal at an exact moment; it does nothing unless the
    variable is set.
    """
    spec = os.environ.get(TEST_SIGNAL_ENV)
    if not spec:
        return
    for item in spec.split(","):
        where, _, name = item.partition("=")
        if where.strip() == point:
            os.kill(os.getpid(), getattr(signal, name.strip()))
