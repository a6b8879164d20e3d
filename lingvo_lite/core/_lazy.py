"""Lazy re-exports for the packages' public names (PEP 562).

A package lists `name -> module` and gets a module `__getattr__` that imports the module on
first use, so `import lingvo_lite` stays cheap (TensorFlow loads only when a name that needs it
is used) and packages never import each other at import time (no cycles).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__: list[str] = []


def exporter(package: str, exports: Mapping[str, str],
             namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, resolving `exports[name]` on first access."""

    def get_attribute(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module)
        # A module exports itself (`fprop_context`: `lingvo_lite.core.fprop_context`), anything
        # else by name.
        value = imported if module.rsplit(".", 1)[-1] == name else getattr(imported, name)
        namespace[name] = value  # Later lookups skip __getattr__.
        return value

    def list_names() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return get_attribute, list_names
