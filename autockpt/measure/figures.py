"""Drawing support shared by the trade-off and the memory timeline: matplotlib on demand.

matplotlib is optional (the ``plot``, ``bench`` and ``dev`` extras); only drawing needs it,
so it is imported when a figure is made, with the Agg back end (files, no display).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["pyplot", "save"]


def pyplot(who: str) -> Any:
    """``matplotlib.pyplot`` on the Agg back end; ``who`` names the caller in the error."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(f"{who} needs matplotlib: pip install matplotlib (or autockpt[plot])") from err
    return plt


def save(fig: Any, path: str | Path, formats: Iterable[str]) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix in ``formats``, close it; the files written."""
    out = [Path(path).with_suffix(f".{fmt}") for fmt in formats]
    for file in out:
        fig.savefig(file, dpi=120)
    pyplot("saving a figure").close(fig)
    return out
