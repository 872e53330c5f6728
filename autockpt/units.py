"""Bytes as people write and read them: ``budget=`` arguments in, ``"1.50 MiB"`` out.

Torch-free, so planners, plans and the command line share one reading and one spelling of
byte counts."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget: object, *, unwrapped_bytes: int, where: str) -> int:
    """Bytes for a budget given as an int, ``"2GiB"``/``"512MB"``, or a fraction in (0, 1].

    A fraction is of ``unwrapped_bytes``, the unwrapped model's peak for one training step
    with parameters, buffers and inputs included.

    Raises:
        TypeError: not an int, float or str.
        ValueError: not positive, a fraction above 1, or an unknown unit.
    """
    fix = "Use bytes (an int), a string such as '2GiB' or '512MB', or a fraction in (0, 1]."
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"{where}: budget={budget!r} is a {type(budget).__name__}. {fix}")
    if isinstance(budget, int):
        value = budget
    elif isinstance(budget, float):
        if not 0 < budget <= 1:
            raise ValueError(f"{where}: budget={budget!r} is a float outside (0, 1]. {fix}")
        value = int(budget * unwrapped_bytes)
    else:
        match = _PATTERN.match(budget)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{where}: cannot read budget={budget!r}. {fix}")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{where}: budget={budget!r} is not positive. {fix}")
    return value


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``"1.50 MiB"``.

    Examples:
        >>> format_bytes(1536 * 1024)
        '1.50 MiB'
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
