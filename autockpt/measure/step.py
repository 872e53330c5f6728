"""One measured training step: forward, loss, backward, under :func:`track_memory`.

``verify`` runs it on the unwrapped and the checkpointed model and compares what it
returns; ``auto_checkpoint(..., check=True)`` uses :func:`measure_step` to hold a plan to its
budget. Both leave the model exactly as it was (``autockpt.measure.sandbox.preserved``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autockpt.measure.losses import LossFn, training_step
from autockpt.measure.memory import MemoryStats, track_memory
from autockpt.measure.sandbox import preserved, recomputing
from autockpt.measure.tensors import device_of, requiring_grad, static_bytes

__all__ = ["StepResult", "measure_step", "run_step"]


@dataclass
class StepResult:
    """What one step produced (by name: outputs, input and parameter gradients, buffers),
    and its memory."""

    tensors: dict[str, torch.Tensor | None]
    memory: MemoryStats


def run_step(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    *,
    input_grads: bool = True,
    where: str = "verify",
    count_tensors: bool = True,
) -> StepResult:
    """One training step of ``model`` as it is now, measured.

    With ``input_grads``, floating-point positional inputs are made to require gradients (on
    copies), so their gradients can be compared; without, the inputs are used as given.
    ``count_tensors=False`` measures at allocator level only, with no dispatch mode (under which
    ``torch.compile`` runs the model uncompiled).
    """
    device = device_of(model, [list(args), kwargs or {}])
    inputs: list[Any] = list(args)
    leaves: list[tuple[str, torch.Tensor]] = []
    if input_grads:
        for i, arg in enumerate(args):
            inputs[i], made = requiring_grad(arg)
            leaves += [(f"{i}" if len(made) == 1 else f"{i}.{j}", leaf) for j, leaf in enumerate(made)]
    with track_memory(device, tensors=count_tensors) as mem:
        out = training_step(model, inputs, kwargs, loss_fn, where=where)
    tensors: dict[str, torch.Tensor | None] = {}
    for i, t in enumerate(tree_leaves(out)):  # numbered as the output's leaves, None included
        if isinstance(t, torch.Tensor):
            tensors[f"output {i}"] = t.detach()
    for name, leaf in leaves:
        tensors[f"grad of input {name}"] = leaf.grad
    for name, p in model.named_parameters():
        tensors[f"grad of {name}"] = p.grad
    for name, b in model.named_buffers():
        tensors[f"buffer {name}"] = b.detach().clone()
    return StepResult(tensors, mem)


def measure_step(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None, loss_fn: LossFn | None = None
) -> int:
    """Allocator-level peak of one training step of ``model`` as it is now, parameters,
    buffers and inputs included; the model is left exactly as it was. The inputs are used as
    they are: unlike :func:`verify`, no input gradient is computed unless one is asked for.
    The steps are not training steps: :func:`autockpt.is_recomputing` is true in them, so
    hooks that count positions skip them as they skip a dry run."""
    with preserved(model, [list(args), kwargs]) as fresh, recomputing():
        fresh()
        run_step(model, args, kwargs, loss_fn, input_grads=False, count_tensors=False)  # warm-up
        fresh()
        step = run_step(model, args, kwargs, loss_fn, input_grads=False, count_tensors=False)
    return static_bytes(model, [list(args), kwargs]) + step.memory.peak_bytes
