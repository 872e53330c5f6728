"""The block walker: for models fx cannot trace, checkpoint their repeated blocks.

Data-dependent control flow or HF-style wrappers defeat tracing, but such models are
almost always a stack of identical blocks (transformer layers, residual blocks) held in a
``ModuleList`` or ``Sequential``. Each block becomes one stage and is checkpointed on its
own, by giving the block object an instance ``forward`` (as ``auto_checkpoint`` does for
the root; ``autockpt.execution.forward.BlockForward``), so no module is wrapped or
renamed. The rest of the model runs as written.

Which blocks: among all groups of two or more same-class children of one ``ModuleList`` or
``Sequential`` (all children of a ``ModuleList`` whose children all have submodules, whatever
their classes: a list of layers run in a loop, such as wav2vec2's feature convolutions whose
first layer differs), the groups holding the most parameters are taken first, skipping groups
inside or around a block already taken. A module with no submodules (a ``Linear``, a
``LayerNorm``: two heads or two norms side by side) is never a block: it keeps its input
for backward anyway, so a checkpoint around it alone saves nothing and costs a recompute.
Nor is a ``ModuleList`` or ``ModuleDict``, which is never called (a list of stages, each a
list of blocks, as timm's Twins has): the blocks inside it are the candidates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from autockpt.walkers.chain import Unit
from autockpt.walkers.sequential import INSTALLED_MARK

__all__ = ["BlockCall", "block_unit", "find_blocks"]


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model`` with their paths, in registration order."""
    groups: list[list[tuple[str, nn.Module]]] = []
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [
            (f"{path}.{name}" if path else name, child)
            for name, child in container.named_children()
            if not isinstance(child, _NOT_CALLED)
        ]
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for item in children:
            by_class.setdefault(type(item[1]), []).append(item)
        layers = isinstance(container, nn.ModuleList) and all(_composite([c]) for c in children)
        candidates = [children] if layers else list(by_class.values())
        groups.extend(g for g in candidates if len(g) >= 2 and _weight(g) > 0 and _composite(g))
    groups.sort(key=lambda g: (-_weight(g), -len(g)))
    taken: list[tuple[str, nn.Module]] = []
    for group in groups:
        if any(_related(p, q) for p, _ in group for q, _ in taken):
            continue
        taken.extend(group)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(taken, key=lambda item: order[item[0]])


# containers that have no forward: their children are called, never they (twins' stages)
_NOT_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _composite(group: list[tuple[str, nn.Module]]) -> bool:
    return any(True for _ in group[0][1].children())


def _weight(group: list[tuple[str, nn.Module]]) -> int:
    return sum(p.numel() for _, m in group for p in m.parameters())


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


class BlockCall:
    """Runs one block's own forward on ``(args, kwargs)``, bypassing autockpt's."""

    def __init__(self, block: nn.Module, original: Callable[..., Any] | None) -> None:
        self.block = block
        self.original = original

    def __call__(self, carry: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        args, kwargs = carry
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.block).forward(self.block, *args, **kwargs)


def block_unit(name: str, block: nn.Module) -> Unit:
    """A unit for one block; its in-place behavior is not probed (see docs/design.md)."""
    previous = block.__dict__.get("forward")
    if getattr(previous, INSTALLED_MARK, False):  # planned again: call what was there before us
        call = getattr(previous, "call", None)
        previous = call.original if isinstance(call, BlockCall) else None
    return Unit(name, BlockCall(block, previous), (block,), type(block).__name__, hooks_outside=(block,))
