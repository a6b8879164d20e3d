"""A holder for objects Keras must not track as a model's attributes."""

from __future__ import annotations

from typing import Any

__all__: list[str] = []


class Untracked:
    """Holds objects Keras must not track (their variables are tracked elsewhere)."""

    def __init__(self, **items: Any) -> None:
        self.__dict__.update(items)
