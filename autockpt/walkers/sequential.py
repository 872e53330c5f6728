"""The sequential walker: an ``nn.Sequential`` of any depth, as one chain of leaf modules.

Nested Sequentials (plain ones, without hooks or a custom ``forward``) are flattened. It
iterates the Sequential's own entries, so a module instance listed twice is run twice, as
``Sequential.forward`` does (``children()`` would drop the repeat).
"""

from __future__ import annotations

from torch import nn

from autockpt.chain import Unit
from autockpt.errors import AutockptError

__all__ = ["is_sequential_model", "sequential_units"]

INSTALLED_MARK = "_autockpt_forward"
"""Attribute set on the forwards autockpt installs, so walkers can see through them."""


def _is_plain_sequential(module: nn.Module) -> bool:
    """A Sequential whose forward is ``Sequential.forward`` and that has no hooks."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return False
    if "forward" in module.__dict__ and not _is_ours(module.__dict__["forward"]):
        return False
    return not (module._forward_hooks or module._forward_pre_hooks)


def _is_ours(obj: object) -> bool:
    return getattr(obj, INSTALLED_MARK, False) is True


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
