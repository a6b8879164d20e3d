"""ProgressBar: one line redrawn in place on a terminal, nothing on a file or pipe."""

from __future__ import annotations

import io

from lingvo_lite.core.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_line_redrawn_in_place_then_ended():
    out = _Terminal()
    with ProgressBar(4, "Timing layers", stream=out, width=8) as bar:
        for _ in range(4):
            bar.advance()
    frames = out.getvalue().split("\r")[1:]
    assert frames == ["Timing layers [........] 0/4", "Timing layers [##......] 1/4",
                      "Timing layers [####....] 2/4", "Timing layers [######..] 3/4",
                      "Timing layers [########] 4/4\n"]
    assert out.getvalue().count("\n") == 1


def test_quiet_when_not_a_terminal_and_never_past_the_total():
    out = io.StringIO()
    with ProgressBar(2, "x", stream=out) as bar:
        bar.advance(5)
    assert out.getvalue() == ""
    live = _Terminal()
    with ProgressBar(2, "x", stream=live, width=2) as bar:
        bar.advance(5)
    assert live.getvalue().endswith("x [##] 2/2\n")
