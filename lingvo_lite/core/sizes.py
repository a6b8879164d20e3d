"""Byte sizes as users write them ('16GiB', '512MiB', '8GB') and as the planner prints them.

>>> parse_size("16GiB"), parse_size("512MiB"), parse_size("8GB"), parse_size("1.5KiB")
(17179869184, 536870912, 8000000000, 1536)
>>> format_bytes(3 * 2**29)
'1.50 GiB'
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str = "plan_memory_per_device") -> int:
    """Bytes from '16GiB', '512MiB', '8GB', '1.5GiB' or a plain number of bytes.

    Raises a ValueError naming `--<flag>` for anything else (`RunOptions.validate` reports it
    as a UsageError).
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"--{flag}={text!r} is not a size; write e.g. 16GiB, 512MiB or 8GB.")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()]
    if value < 1:
        raise ValueError(f"--{flag}={text!r} must be at least 1 byte, e.g. 16GiB.")
    return int(value)


def format_bytes(n: float) -> str:
    """'1.50 GiB', '12.0 MiB', '3.0 KiB', '17 B'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


__all__ = ["parse_size", "format_bytes"]
