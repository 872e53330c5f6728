"""The loss a training step ends with, as autockpt measures and verifies it.

A budget covers the whole step, and the loss runs at the step's busiest moment: after the
forward, with every saved activation alive. What it needs there depends on the loss: a
weighted sum needs a weight and a gradient the size of the output, ``out.square().mean()``
three temporaries, a language model's cross-entropy a copy of its logits. So the loss is
an argument (``loss_fn``) wherever memory is planned or measured, and without one every
place uses the same stand-in, :func:`default_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autockpt.measure.memory import Windows
from autockpt.measure.sandbox import dry_run_state
from autockpt.measure.tensors import device_of, requiring_grad

__all__ = ["LossFn", "default_loss", "measure_loss", "step_loss", "training_step"]

LossFn = Callable[[Any], torch.Tensor]
"""Maps the model's output (whatever its forward returns) to a scalar to call ``backward`` on,
e.g. ``lambda logits: F.cross_entropy(logits, labels)``."""


def default_loss(out: Any) -> torch.Tensor:
    """A fixed random weighting of every floating-point output that requires gradients.

    Every output element gets a gradient, and the same weights (seed 0) are drawn on every
    call, so two steps compare bitwise. On the meta device the weights are meta tensors.
    """
    gen = torch.Generator().manual_seed(0)
    total: torch.Tensor | None = None
    for t in tree_leaves(out):
        if not (isinstance(t, torch.Tensor) and t.requires_grad):
            continue
        if t.device.type == "meta":
            w = torch.empty(t.shape, dtype=t.dtype, device="meta")
        else:
            w = torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device)
        term = (t * w).sum()
        total = term if total is None else total + term
    if total is None:
        device = next((t.device for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        return torch.zeros((), device=device)
    return total


def step_loss(out: Any, loss_fn: LossFn | None, *, where: str) -> torch.Tensor:
    """``loss_fn(out)``, or :func:`default_loss` without one; checks that it is a scalar."""
    loss = default_loss(out) if loss_fn is None else loss_fn(out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise ValueError(
            f"{where}: loss_fn must return a scalar tensor (the loss you call backward on), got {got}. "
            f"Reduce it, e.g. lambda out: F.cross_entropy(out, labels)."
        )
    return loss


def training_step(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    loss_fn: LossFn | None,
    *,
    where: str,
    after_forward: Callable[[Any], None] | None = None,
    before_backward: Callable[[], None] | None = None,
) -> Any:
    """One training step as every measurement runs it: forward, the loss, its backward.

    The loss is dropped before returning (its graph is gone), the output is returned.
    ``after_forward(out)`` and ``before_backward()`` let a caller mark or read the step
    between its phases (a block profile's windows).
    """
    out = model(*args, **(kwargs or {}))
    if after_forward is not None:
        after_forward(out)
    loss = step_loss(out, loss_fn, where=where)
    if before_backward is not None:
        before_backward()
    if loss.requires_grad:
        loss.backward()
    return out


def measure_loss(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], loss_fn: LossFn | None, *, where: str
) -> int:
    """Bytes the loss needs on top of the model's output (``Profile.loss_bytes``).

    The output comes from one forward under ``no_grad`` (buffers and RNG untouched) and is
    made a leaf, so only the loss's own tensors and the output's gradient are counted.
    """
    device = device_of(model, [list(args), kwargs])
    with dry_run_state(model, [list(args), kwargs]), torch.no_grad():
        out = model(*args, **kwargs)
    out, _ = requiring_grad(out)
    with Windows(device, collect=False) as windows:  # the young generations: ~0.2 s less
        windows.mark()
        loss = step_loss(out, loss_fn, where=where)
        if loss.requires_grad:
            loss.backward()
        del loss
        windows.mark()
    return windows.result[1][0]
