"""A one-line progress bar for slow phases of known length, quiet when not on a terminal.

On a terminal the bar redraws one line in place (`\\r`) and ends it when done; written to a
file or a pipe (a log, CI) it writes nothing, so logs keep only the phase's own lines.

>>> import io
>>> class Terminal(io.StringIO):
...     def isatty(self):
...         return True
>>> out = Terminal()
>>> with ProgressBar(2, "Timing layers", stream=out, width=4) as bar:
...     bar.advance()
...     bar.advance()
>>> out.getvalue().split("\\r")[-1]
'Timing layers [####] 2/2\\n'
>>> with ProgressBar(2, "quiet", stream=io.StringIO()) as bar:
...     bar.advance()
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """`total` steps of a phase called `label`; `advance()` after each (see the module doc)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None,
                 width: int = 30) -> None:
        self._total = max(int(total), 1)
        self._label = label
        self._stream = stream if stream is not None else sys.stderr
        self._width = width
        self._done = 0
        isatty = getattr(self._stream, "isatty", None)
        self._live = bool(isatty and isatty())

    def __enter__(self) -> ProgressBar:
        self._draw()
        return self

    def advance(self, steps: int = 1) -> None:
        self._done = min(self._done + steps, self._total)
        self._draw()

    def _draw(self) -> None:
        if not self._live:
            return
        filled = self._width * self._done // self._total
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r{self._label} [{bar}] {self._done}/{self._total}")
        self._stream.flush()

    def __exit__(self, *exc: Any) -> None:
        if self._live:
            self._stream.write("\n")
            self._stream.flush()
