"""Walking a model: finding the chain of units its forward runs through.

Three walkers, tried in this order unless the caller forces one (``mode=``):
``sequential`` (an ``nn.Sequential``, nested ones flattened), ``graph`` (a ``torch.fx``
trace cut where one tensor crosses) and ``blocks`` (the repeated blocks of a model fx
cannot trace). A walker that does not apply says why; only the tracer's own failure moves
on to the next walker, so a bug in autockpt's cutting code raises instead of hiding behind
a fallback.

NOTE [One unit holds the blocks]
    A model whose blocks pass two values along (timm's PiT carries the class tokens beside
    the patch tokens) traces fine, but the graph walker cuts only where one tensor crosses,
    so all its blocks fall into one unit and nothing can be checkpointed (PiT: 6 units, one
    holding 223 modules, 1.00x). When one unit of the trace holds more than half of the
    model's leaf modules, and at least 90% of that unit is two or more of the blocks the
    block walker would find, the block walker, which checkpoints each block whatever it
    passes on, is taken instead (PiT: 3 stages checkpointed). Where the blocks make up less
    of it, the block walker would leave the rest of the unit plain and save less than the
    graph walker's other cuts: GoogLeNet with auxiliary heads (one unit from ``aux1`` to
    the end, half of it the branches' blocks) peaks at 68.5 MiB with the graph walker and
    85.0 MiB with the block walker (unwrapped 90.1). A forced ``mode='graph'`` keeps the
    graph walker always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from autockpt.errors import AutockptError
from autockpt.walkers.blocks import block_unit, find_blocks
from autockpt.walkers.chain import Unit
from autockpt.walkers.graph import GraphProgram, UntraceableError, none_pattern, trace_program, units_of
from autockpt.walkers.sequential import flattened_changed, is_sequential_model, sequential_units

__all__ = ["WALKERS", "Walked", "walk"]

WALKERS = ("sequential", "graph", "blocks")


@dataclass(frozen=True, eq=False)
class Walked:
    """The units a walker found, and why earlier walkers were passed over."""

    walker: str
    units: tuple[Unit, ...]
    program: GraphProgram | None = None
    notes: tuple[str, ...] = ()
    flattened: tuple[nn.Module, ...] = ()  # the sequential walker's (NOTE [Flattened containers])

    def stale(self) -> bool:
        """Whether a module the walk went through (replaced by its parts, so its own code and
        hooks never run) has since gained hooks: the model must be walked again."""
        if self.program is not None:
            return self.program.hooks_added()
        return flattened_changed(self.flattened)

    def entry_value(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, where: str) -> Any:
        """What the chain's first unit receives for a call ``model(*args, **kwargs)``.

        The sequential walker's chain takes the one input, the graph walker's the dict of
        inputs by placeholder, and the block walker's the call itself, ``(args, kwargs)``
        (its blocks see their inputs only while the model runs).

        Raises:
            TypeError: the inputs do not fit the model's forward.
        """
        if self.program is not None:
            return self.program.bind(args, kwargs)
        if self.walker == "blocks":
            return (args, kwargs)
        if len(args) != 1 or kwargs:
            given = f"{len(args)} positional" + (f" and keyword {sorted(kwargs)}" if kwargs else "")
            raise TypeError(
                f"{where}: an nn.Sequential takes one input, got {given} example inputs. "
                f"Pass example_inputs=(x,)."
            )
        return args[0]


def walk(
    model: nn.Module, mode: str | None, *, where: str, none_args: frozenset[str] | None = None
) -> Walked:
    """Find the model's units with the forced walker, or the first one that applies.

    ``none_args``: the forward's arguments the graph walker traces as ``None`` (by default
    those whose default is ``None``; NOTE [Optional arguments] in ``walkers/graph.py``).

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
                units, flattened = sequential_units(model, where=where)
                return Walked("sequential", units, notes=tuple(reasons), flattened=flattened)
            reasons.append(f"sequential walker: {type(model).__name__} is not an nn.Sequential")
        elif name == "graph":
            program = _trace(model, none_args, reasons)
            if program is not None:
                units = units_of(program)
                crowded = _crowded_unit(model, units) if mode is None else None
                if crowded is None:
                    return Walked("graph", units, program, tuple(reasons))
                reasons.append(  # NOTE [One unit holds the blocks]
                    f"graph walker: one piece, {crowded}, holds most of the model and its repeated "
                    f"blocks (more than one tensor passes between them)"
                )
        else:
            blocks = find_blocks(model)
            if blocks:
                units = tuple(block_unit(path, block) for path, block in blocks)
                return Walked("blocks", units, notes=tuple(reasons))
            reasons.append("block walker: no ModuleList or Sequential holds two blocks of one class")
    raise AutockptError(f"{where}: cannot walk {type(model).__name__}. " + "; ".join(reasons) + ".")


def _crowded_unit(model: nn.Module, units: tuple[Unit, ...]) -> str | None:
    """The name of a graph unit that holds most of the model and is nearly all repeated
    blocks, or None (NOTE [One unit holds the blocks])."""
    leaves = sum(1 for m in model.modules() if not any(True for _ in m.children()))
    for unit in units:
        inside = {id(m) for top in unit.modules for m in top.modules()}
        if 2 * len(inside) <= leaves:
            continue
        held = [b for _, b in find_blocks(model) if any(id(m) in inside for m in b.modules())]
        covered = sum(1 for b in held for m in b.modules() if id(m) in inside)
        return unit.name if len(held) >= 2 and covered >= BLOCKS_COVER * len(inside) else None
    return None


# the share of a crowded graph unit its blocks must make up for the block walker to be taken
BLOCKS_COVER = 0.9


def _trace(model: nn.Module, none_args: frozenset[str] | None, reasons: list[str]) -> GraphProgram | None:
    """The traced program, or None with the reason recorded. Without a call to go by, the
    optional arguments are traced as their ``None`` defaults, and if that fails, as given."""
    patterns = [none_args] if none_args is not None else [none_pattern(model, None, None), frozenset()]
    failure: UntraceableError | None = None
    for pattern in dict.fromkeys(patterns):
        try:
            return trace_program(model, pattern)
        except UntraceableError as err:
            failure = failure or err
    reasons.append(f"graph walker: torch.fx could not trace it ({failure})")
    return None
