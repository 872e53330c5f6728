"""Walkers: find the chain of stages a model's forward runs through.

The sequential walker handles ``nn.Sequential`` of any depth: nested Sequentials (plain
ones, without hooks or a custom ``forward``) are flattened into one chain of leaf
modules. It iterates the Sequential's own entries, so a module instance listed twice is
run twice, as ``Sequential.forward`` does (``children()`` would drop the repeat).

NOTE [In-place boundaries]
    A segment boundary must never sit in front of a module that modifies its input in
    place (``ReLU(inplace=True)``, ``x.add_()``): the checkpoint keeps that input to
    replay the segment, and the mutation would corrupt it. We find such modules twice:
    statically (an ``inplace=True`` attribute) and by a dry run that watches tensor
    version counters (:func:`probe_units`). A module found either way is fused
    with its predecessor into one stage, so planners only ever see safe boundaries.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from autockpt.errors import AutockptError

__all__ = ["Chain", "DryRun", "Stage", "Unit", "build_chain", "probe_units", "sequential_units"]


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
    """

    name: str
    fn: Callable[[Any], Any]
    modules: tuple[nn.Module, ...]
    kind: str
    mutates_input: bool = False
    pure: bool = True

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


def _is_plain_sequential(module: nn.Module) -> bool:
    """A Sequential whose forward is ``Sequential.forward`` and that has no hooks."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return False
    if "forward" in module.__dict__ and not _is_ours(module.__dict__["forward"]):
        return False
    return not (module._forward_hooks or module._forward_pre_hooks)


def _is_ours(obj: object) -> bool:
    return getattr(obj, "_autockpt_forward", False) is True


def is_sequential_model(model: nn.Module) -> bool:
    """Whether the sequential walker applies to ``model`` (hooks on the root are fine)."""
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


def sequential_units(model: nn.Module, *, where: str = "sequential walker") -> tuple[Unit, ...]:
    """The leaf modules ``model(x)`` calls, in order, nested plain Sequentials flattened.

    Raises:
        AutockptError: ``model`` is not an ``nn.Sequential`` with the stock forward.
    """
    if not is_sequential_model(model):
        raise AutockptError(
            f"{where}: {type(model).__name__} is not an nn.Sequential; only Sequential models "
            f"can be walked so far. Put its layers in an nn.Sequential."
        )
    units: list[Unit] = []
    _flatten(model, "", units)
    return tuple(units)


def _flatten(seq: nn.Module, prefix: str, out: list[Unit]) -> None:
    for name, module in seq._modules.items():
        if module is None:
            continue
        path = f"{prefix}{name}"
        if _is_plain_sequential(module):
            _flatten(module, path + ".", out)
        else:
            out.append(Unit.of_module(path, module))


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


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


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


def probe_units(units: Sequence[Unit], x: Any) -> DryRun:
    """Dry-run ``units`` on ``x``: find inputs modified in place, and measure every input.

    Index ``j`` is returned when running any unit ``i >= j`` changes the version counter
    of unit ``j``'s input (directly or through a view of the same storage). The run keeps
    only tensors that share storage with the current value, so it needs about one
    activation of memory, not the whole forward pass. Gradients stay enabled (so modules
    take their training paths) but the graph is cut after every unit.

    The caller restores buffers and RNG around this call.
    """
    unsafe: set[int] = set()
    sizes: list[int] = []
    watched: list[tuple[int, torch.Tensor, int]] = []  # (unit index, tensor, version)
    value = _clone(x)  # never mutate the caller's input
    for i, unit in enumerate(units):
        inputs = _tensors(value)
        keys = {_storage_key(t) for t in inputs}
        sizes.append(sum({_storage_key(t): t.untyped_storage().nbytes() for t in inputs}.values()))
        watched = [w for w in watched if _storage_key(w[1]) in keys]
        watched.extend((i, t, t._version) for t in inputs)
        value = _detach(unit.fn(value))
        for j, t, version in watched:
            if t._version != version:
                unsafe.add(j)
        watched = [(j, t, t._version) for j, t, _ in watched]
    return DryRun(frozenset(unsafe), tuple(sizes), _saved_bytes(units, x))


def _saved_bytes(units: Sequence[Unit], x: Any) -> tuple[int, ...]:
    """Bytes each unit saves for backward (its input included when it keeps it).

    A second pass, because autograd only saves what a gradient needs: every floating input
    is made a fresh non-leaf that requires grad (a copy, so aliasing is not watched here).
    """
    out: list[int] = []
    value = _detach(x)
    for unit in units:
        value = tree_map_only(torch.Tensor, _grad_copy, value)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[_storage_key(t)] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = unit.fn(value)
        params = {_storage_key(p) for m in unit.modules for p in m.parameters()}
        out.append(sum(n for k, n in saved.items() if k not in params))
        value = _detach(result)
    return tuple(out)


def _grad_copy(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return (t.detach().requires_grad_() * 1) if t.numel() else t
    return t


def _detach(x: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach(), x)


def _clone(x: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), x)
