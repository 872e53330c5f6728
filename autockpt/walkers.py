"""Choosing a walker: sequential, then graph, then blocks, or the one the caller forces."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autockpt.blocks import block_unit, find_blocks
from autockpt.errors import AutockptError
from autockpt.graph import GraphProgram, trace_units
from autockpt.walk import Unit, is_sequential_model, sequential_units

__all__ = ["WALKERS", "Walked", "walk"]

WALKERS = ("sequential", "graph", "blocks")


@dataclass(frozen=True, eq=False)
class Walked:
    """The units a walker found, and why earlier walkers were passed over."""

    walker: str
    units: tuple[Unit, ...]
    program: GraphProgram | None = None
    notes: tuple[str, ...] = ()


def walk(model: nn.Module, mode: str | None, *, where: str) -> Walked:
    """Find the model's units with the forced walker, or the first one that applies.

    Raises:
        ValueError: ``mode`` is not a walker name.
        AutockptError: no walker applies (the message gives each one's reason).
    """
    if mode is not None and mode not in WALKERS:
        names = ", ".join(map(repr, WALKERS))
        raise ValueError(f"{where}: mode={mode!r} is not a walker. Use one of {names}.")
    reasons: list[str] = []
    for name in [mode] if mode else WALKERS:
        if name == "sequential":
            if is_sequential_model(model):
                return Walked("sequential", sequential_units(model, where=where), notes=tuple(reasons))
            reasons.append(f"sequential walker: {type(model).__name__} is not an nn.Sequential")
        elif name == "graph":
            try:
                program, units = trace_units(model)
            except Exception as err:  # fx raises many kinds of errors for untraceable code
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                reasons.append(f"graph walker: torch.fx could not trace it ({type(err).__name__}: {first})")
            else:
                return Walked("graph", units, program, tuple(reasons))
        else:
            blocks = find_blocks(model)
            if blocks:
                units = tuple(block_unit(path, block) for path, block in blocks)
                return Walked("blocks", units, notes=tuple(reasons))
            reasons.append("block walker: no ModuleList or Sequential holds two blocks of one class")
    raise AutockptError(f"{where}: cannot walk {type(model).__name__}. " + "; ".join(reasons) + ".")
