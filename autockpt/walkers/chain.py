"""The chain a model is cut into: units, stages and the rules that group them.

A :class:`Unit` is the smallest piece a walker finds (a module, a range of traced graph
nodes, a repeated block); a :class:`Stage` is units that must run together; a
:class:`Chain` is the stages in execution order. Planners see only stages, so every rule
about where a boundary may not go is applied here, once, for every walker.

NOTE [In-place boundaries]
    A segment boundary must never sit in front of a module that modifies its input in
    place (``ReLU(inplace=True)``, ``x.add_()``): the checkpoint keeps that input to
    replay the segment, and the mutation would corrupt it. We find such modules twice:
    statically (an ``inplace=True`` attribute, or a traced in-place op) and by a dry run that
    watches tensor version counters (``autockpt.measure.dry_run``). A unit found either way
    is fused with its predecessor into one stage, so planners only ever see safe boundaries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from autockpt.errors import AutockptError

__all__ = ["Chain", "DryRun", "Stage", "Unit", "build_chain", "chain_from_names"]


@dataclass(frozen=True, eq=False)
class Unit:
    """The smallest piece of a chain: a callable from the value before it to the value after.

    Attributes:
        name: where it sits in the model (a module path such as ``"layer1.0"``).
        fn: the callable; for the sequential walker the module itself.
        modules: the modules it calls (their buffers are replayed, their types tell
            whether it may draw random numbers).
        kind: a short description (module class names).
        mutates_input: known to modify its input in place (no boundary in front).
        pure: all work outside ``modules`` is known to draw no random numbers.
        reads: modules whose own parameters and buffers the unit reads without calling
            them (``self.alpha`` in a block's code, fx ``get_attr``). Only their own tensors
            belong to the unit, not their submodules': those may run in another segment,
            which changes their buffers after this one's forward.
        hooks_outside: modules whose forward hooks do not run inside the unit's call, so
            the mutation guard leaves them out: a block's own (its ``__call__`` runs around
            the checkpoint) and those a graph trace went through (never called).
        names_root: the module whose qualified names name the unit's modules (a traced
            model), or ``None``: they are named from the unit's own name.

    The execution layer reads these fields, never the walker's types.
    """

    name: str
    fn: Callable[[Any], Any]
    modules: tuple[nn.Module, ...]
    kind: str
    mutates_input: bool = False
    pure: bool = True
    reads: tuple[nn.Module, ...] = ()
    hooks_outside: tuple[nn.Module, ...] = ()
    names_root: nn.Module | None = None

    def parameters(self) -> list[nn.Parameter]:
        """The parameters the unit uses: all of ``modules``' and ``reads``' own ones."""
        return [
            *(p for m in self.modules for p in m.parameters()),
            *(p for m in self.reads for p in m.parameters(recurse=False)),
        ]

    @classmethod
    def of_module(cls, name: str, module: nn.Module) -> Unit:
        """A unit that calls one module (hooks included)."""
        return cls(name, module, (module,), type(module).__name__, getattr(module, "inplace", False) is True)


@dataclass(frozen=True, eq=False)
class Stage:
    """Consecutive units that always run together (a boundary between them is unsafe)."""

    units: tuple[Unit, ...]

    @property
    def name(self) -> str:
        """Unit names joined by ``+``."""
        return "+".join(u.name for u in self.units)

    @property
    def kind(self) -> str:
        """Unit module classes joined by ``+``."""
        return "+".join(u.kind for u in self.units)

    def __call__(self, x: Any) -> Any:
        for unit in self.units:
            x = unit.fn(x)
        return x


@dataclass(frozen=True, eq=False)
class Chain:
    """The stages of a model in execution order, and how they were found."""

    walker: str
    stages: tuple[Stage, ...]
    first_unit_unsafe: bool = False  # the first module modifies the model's input in place
    input_bytes: tuple[int, ...] | None = None  # per stage, from a dry run
    saved_bytes: tuple[int, ...] | None = None  # per stage, from a dry run

    @property
    def names(self) -> tuple[str, ...]:
        """Stage names, in order."""
        return tuple(s.name for s in self.stages)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Stage kinds, in order."""
        return tuple(s.kind for s in self.stages)

    @property
    def units(self) -> tuple[Unit, ...]:
        """All units, in order."""
        return tuple(u for s in self.stages for u in s.units)


@dataclass(frozen=True)
class DryRun:
    """What running the units once taught us.

    Attributes:
        unsafe: unit indices whose input got modified in place (no boundary in front).
        input_bytes: per unit, bytes of the distinct storages of its input, i.e. what a
            checkpoint starting there would keep alive.
        saved_bytes: per unit, bytes it saves for backward (parameters excluded), i.e. what
            checkpointing it drops.
    """

    unsafe: frozenset[int]
    input_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...] = ()


def build_chain(walker: str, units: Sequence[Unit], probe: DryRun | None = None) -> Chain:
    """Group ``units`` into stages, fusing each unit at an unsafe boundary with the one before.

    Args:
        walker: name of the walker that found the units.
        units: leaf units in execution order.
        probe: the dry run's findings, if one ran. Units that declare ``inplace=True`` are
            unsafe boundaries in any case.
    """
    bad = set(probe.unsafe if probe else ()) | {j for j, u in enumerate(units) if u.mutates_input}
    groups: list[list[Unit]] = []
    starts: list[int] = []
    for j, unit in enumerate(units):
        if groups and j in bad:
            groups[-1].append(unit)
        else:
            groups.append([unit])
            starts.append(j)
    return Chain(
        walker,
        tuple(Stage(tuple(g)) for g in groups),
        first_unit_unsafe=0 in bad,
        input_bytes=tuple(probe.input_bytes[j] for j in starts) if probe else None,
        saved_bytes=tuple(sum(probe.saved_bytes[a:b]) for a, b in itertools.pairwise([*starts, len(units)]))
        if probe and probe.saved_bytes
        else None,
    )


def chain_from_names(walker: str, units: Sequence[Unit], stage_names: Sequence[str]) -> Chain:
    """Group ``units`` into the stages a plan names (``"3+4"`` fuses units 3 and 4).

    Raises:
        AutockptError: the names do not describe these units in order.
    """
    by_order = [u.name for u in units]
    wanted = [n for name in stage_names for n in name.split("+")]
    if wanted != by_order:
        raise AutockptError(
            f"Plan.apply: the plan's stages {list(stage_names)} do not match the model's "
            f"modules {by_order}. Make the plan for this model with autockpt.make_plan(model)."
        )
    stages, pos = [], 0
    for name in stage_names:
        count = len(name.split("+"))
        stages.append(Stage(tuple(units[pos : pos + count])))
        pos += count
    return Chain(walker, tuple(stages))
