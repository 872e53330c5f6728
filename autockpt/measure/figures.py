"""Drawing support shared by the trade-off and the memory timeline: matplotlib on demand.

matplotlib is optional (the ``plot``, ``bench`` and ``dev`` extras); only drawing needs it,
so it is imported when a figure is made. Figures are made with matplotlib's object API
(``matplotlib.figure.Figure``), not pyplot: pyplot keeps every figure it made until it is
closed (past 20 it warns) and choosing a back end for it would change the caller's; a
``Figure`` is freed with its last reference, saves itself to files and shows in notebooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["finish_figure", "new_figure", "save"]


def new_figure(who: str, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """A new matplotlib figure with one axes; ``who`` names the caller in the error."""
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"{who} needs matplotlib: pip install matplotlib (or autockpt[plot])") from err
    fig = Figure(figsize=figsize)
    return fig, fig.subplots()


def finish_figure(fig: Any, ax: Any, *, xlabel: str, ylabel: str, title: str) -> Any:
    """Label the axes, put the legend to the right of the plot, lay out; returns ``fig``."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def save(fig: Any, path: str | Path, formats: Iterable[str]) -> list[Path]:
    """Write ``fig`` as ``path`` with each suffix in ``formats``; the files written."""
    out = [Path(path).with_suffix(f".{fmt}") for fmt in formats]
    for file in out:
        fig.savefig(file, dpi=120)
    return out
