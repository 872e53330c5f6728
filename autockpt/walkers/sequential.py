"""The sequential walker: an ``nn.Sequential`` of any depth, as one chain of leaf modules.

Nested Sequentials (plain ones, without hooks or a custom ``forward``) are flattened. It
iterates the Sequential's own entries, so a module instance listed twice is run twice, as
``Sequential.forward`` does (``children()`` would drop the repeat).

NOTE [Flattened containers]
    A flattened Sequential is never called: its leaves are. A hook registered on it after
    the walk would never run, and an output-changing one would leave the model training
    another function with no error. So the walk keeps the containers it flattened, and
    :func:`flattened_changed` tells the installed forward to walk again once one of them is
    no longer plain; the new walk keeps that container whole, as one unit, and its hooks
    run with it (inside the checkpoint, where the mutation guard watches them).
"""

from __future__ import annotations

from torch import nn

from autockpt.errors import AutockptError
from autockpt.walkers.chain import Unit
from autockpt.walkers.graph_nodes import has_hooks

__all__ = ["flattened_changed", "is_sequential_model", "sequential_units"]

INSTALLED_MARK = "_autockpt_forward"
"""Attribute set on the forwards autockpt installs, so walkers can see through them."""


def _is_plain_sequential(module: nn.Module) -> bool:
    """A Sequential whose forward is ``Sequential.forward`` and that has no hooks."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return False
    if "forward" in module.__dict__ and not _is_ours(module.__dict__["forward"]):
        return False
    return not has_hooks(module)


def _is_ours(obj: object) -> bool:
    return getattr(obj, INSTALLED_MARK, False) is True


def is_sequential_model(model: nn.Module) -> bool:
    """Whether the sequential walker applies to ``model`` (hooks on the root are fine)."""
    return isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward


def sequential_units(
    model: nn.Module, *, where: str = "sequential walker"
) -> tuple[tuple[Unit, ...], tuple[nn.Module, ...]]:
    """The leaf modules ``model(x)`` calls, in order, nested plain Sequentials flattened; and
    the Sequentials flattened (NOTE [Flattened containers]).

    Raises:
        AutockptError: ``model`` is not an ``nn.Sequential`` with the stock forward.
    """
    if not is_sequential_model(model):
        raise AutockptError(
            f"{where}: {type(model).__name__} is not an nn.Sequential; only Sequential models "
            f"can be walked so far. Put its layers in an nn.Sequential."
        )
    units: list[Unit] = []
    flattened: list[nn.Module] = []
    _flatten(model, "", units, flattened)
    return tuple(units), tuple(flattened)


def flattened_changed(flattened: tuple[nn.Module, ...]) -> bool:
    """Whether a container the walk flattened has since gained hooks or a forward of its own."""
    return not all(map(_is_plain_sequential, flattened))


def _flatten(seq: nn.Module, prefix: str, out: list[Unit], flattened: list[nn.Module]) -> None:
    for name, module in seq._modules.items():
        if module is None:
            continue
        path = f"{prefix}{name}"
        if _is_plain_sequential(module):
            flattened.append(module)
            _flatten(module, path + ".", out, flattened)
        else:
            out.append(Unit.of_module(path, module))
