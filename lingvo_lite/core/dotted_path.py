"""Dotted paths such as `a.b[0].c`, shared by `Params` and `NestedMap`."""

from __future__ import annotations

import re

__all__: list[str] = []

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def split(path: str, what: str, error: type[Exception], index: str = r"[^\[\]]*",
          ) -> list[tuple[str, str]]:
    """Splits `a.b[0].c` into [('attr', 'a'), ('attr', 'b'), ('index', '0'), ('attr', 'c')].

    `index` is the regular expression an index may match (Params: any dict key or list
    position; NestedMap: integers only). A path that is not a non-empty str, or a segment that
    does not parse, raises `error` naming `what` (e.g. 'param name').

    >>> split("a.b[0].c", "path", ValueError)
    [('attr', 'a'), ('attr', 'b'), ('index', '0'), ('attr', 'c')]
    """
    if not isinstance(path, str) or not path:
        raise error(f"{what[0].upper()}{what[1:]} must be a non-empty str like 'a.b[0].c', "
                    f"got {path!r}.")
    segment_re = re.compile(rf"^({_NAME})((?:\[{index}\])*)$")
    index_re = re.compile(rf"\[({index})\]")
    tokens: list[tuple[str, str]] = []
    for seg in path.split("."):
        m = segment_re.match(seg)
        if not m:
            raise error(f"Malformed {what} {path!r} (segment {seg!r}); expected e.g. 'a.b[0].c'.")
        tokens.append(("attr", m.group(1)))
        tokens.extend(("index", i.strip()) for i in index_re.findall(m.group(2)))
    return tokens
