"""Runs that leave no trace: dry runs, profiles, verification steps and recomputes.

autockpt runs a model's code more often than the user does: a dry run to find in-place
modules, a profile to measure stages, two steps to verify, and every recompute in
backward. None of them may change what the user observes: buffers (BatchNorm statistics),
the RNG stream, parameter ``.grad``, the forwards installed on the model, or hooks that
count calls. This module owns that promise: :func:`dry_run_state` around an extra forward,
:func:`preserved` around whole training steps, and :func:`is_recomputing` for hooks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autockpt.tensors import tensors_in

__all__ = [
    "BufferState",
    "buffer_slots",
    "dry_run_state",
    "install_buffer_clones",
    "is_recomputing",
    "preserved",
    "recomputing",
    "reinstall_buffers",
]

_local = threading.local()


def is_recomputing() -> bool:
    """Whether the current thread is inside a forward that autockpt runs a second time.

    That is a recompute in backward, or the one-time dry run that looks for in-place
    modules. Hooks and stateful code use it to act once per step.

    Examples:
        >>> import autockpt, torch
        >>> calls = []
        >>> def hook(module, args, out):
        ...     if not autockpt.is_recomputing():
        ...         calls.append(1)
        >>> autockpt.is_recomputing()
        False
    """
    return getattr(_local, "depth", 0) > 0


class recomputing:  # noqa: N801 (used as a function: ``with recomputing():``)
    """Mark the block as a second run of a forward for :func:`is_recomputing`.

    A class rather than a generator context manager: it wraps every recompute, and this
    costs a quarter of the time."""

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1


BufferState = list[tuple[nn.Module, str, "torch.Tensor | None"]]


def buffer_slots(model: nn.Module) -> BufferState:
    """Every buffer slot of ``model`` with the tensor it holds now."""
    return [(m, n, t) for m in model.modules() for n, t in m._buffers.items()]


def install_buffer_clones(slots: BufferState) -> None:
    """Put private copies of the recorded buffers in place; the originals stay untouched."""
    for module, name, t in slots:
        module._buffers[name] = t.clone() if t is not None else None


def reinstall_buffers(slots: BufferState) -> None:
    """Put the recorded buffer objects back."""
    for module, name, t in slots:
        module._buffers[name] = t


def _cuda_devices(x: Any) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors_in(x) if t.is_cuda})


@contextlib.contextmanager
def dry_run_state(model: nn.Module, x: Any) -> Iterator[None]:
    """Run a block as an invisible extra forward: buffers, RNG and counters untouched.

    Buffers are swapped for clones and put back, the RNG of the CPU and of every CUDA
    device that ``x`` or the model lives on is forked, and :func:`is_recomputing` is true
    inside.
    """
    slots = buffer_slots(model)
    devices = _cuda_devices([x, *model.parameters()])
    install_buffer_clones(slots)
    try:
        with torch.random.fork_rng(devices=devices), recomputing():
            yield
    finally:
        reinstall_buffers(slots)


def _instance_forwards(model: nn.Module) -> list[tuple[nn.Module, bool, Any]]:
    return [(m, "forward" in m.__dict__, m.__dict__.get("forward")) for m in model.modules()]


@contextlib.contextmanager
def preserved(model: nn.Module, inputs: Any = ()) -> Iterator[Callable[[], None]]:
    """Keep everything a training step changes; yield a function that resets to the start.

    Kept and put back at exit: every instance ``forward`` on the model and its submodules
    (so checkpointing installed inside, on the root or on blocks, leaves nothing behind),
    buffers, parameter ``.grad`` and the RNG of the CPU and of the CUDA devices the model
    and ``inputs`` live on. ``fresh()`` puts buffer copies, no gradients and the starting RNG
    state in place, so every step inside starts from the same state.
    """
    forwards = _instance_forwards(model)
    slots = buffer_slots(model)
    grads = [(p, p.grad) for p in model.parameters()]
    devices = _cuda_devices([inputs, *model.parameters()])
    cpu_rng = torch.get_rng_state()
    cuda_rng = [torch.cuda.get_rng_state(d) for d in devices]

    def reset_rng() -> None:
        torch.set_rng_state(cpu_rng)
        for d, state in zip(devices, cuda_rng):
            torch.cuda.set_rng_state(state, d)

    def fresh() -> None:
        install_buffer_clones(slots)
        for p, _ in grads:
            p.grad = None
        reset_rng()

    try:
        yield fresh
    finally:
        for module, had, forward in forwards:
            module.__dict__.pop("forward", None)
            if had:
                module.__dict__["forward"] = forward
        reinstall_buffers(slots)
        for p, g in grads:
            p.grad = g
        reset_rng()
