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
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.measure.tensors import tensors_in

__all__ = [
    "CHECKPOINT_OPTIONS",
    "BufferSlot",
    "RngState",
    "buffer_slots",
    "dry_run_state",
    "is_recomputing",
    "preserved",
    "private_copies",
    "put_buffers",
    "read_buffers",
    "recomputing",
]

_local = threading.local()

# NOTE [Saved-tensor hooks around a checkpoint]
#     (The options autockpt passes to every call of torch's checkpoint, in profiles too.)
#     A user's saved_tensors_hooks around the step (save_on_cpu, an offloading or packing hook)
#     should see every tensor kept until backward. Inside a checkpointed segment autograd
#     keeps only the segment's inputs, and the hooks see those as ever; what an op policy
#     keeps is held by the checkpoint itself, outside autograd, and torch routes it through
#     the user's hooks only when asked (respect_saved_tensors_hooks=True: left unset it keeps
#     the old bypass and warns while a hook is in scope, and torch means to flip the default).
#     autockpt asks, at every call of torch's checkpoint, so a policy's kept outputs are
#     offloaded like everything else in eager runs. Under torch.compile torch leaves kept
#     tensors to the compiled graph and the argument changes nothing. A torch without the
#     argument (before 2.14) keeps the bypass.
CHECKPOINT_OPTIONS: dict[str, Any] = {"use_reentrant": False}
if "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters:
    CHECKPOINT_OPTIONS["respect_saved_tensors_hooks"] = True


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


BufferSlot = tuple[nn.Module, str]


def buffer_slots(modules: Iterable[nn.Module]) -> tuple[BufferSlot, ...]:
    """Every (module, buffer name) slot of ``modules``, each once."""
    seen: set[tuple[int, str]] = set()
    out: list[BufferSlot] = []
    for module in modules:
        for name in module._buffers:
            key = (id(module), name)
            if key not in seen:
                seen.add(key)
                out.append((module, name))
    return tuple(out)


def read_buffers(slots: Sequence[BufferSlot]) -> list[torch.Tensor | None]:
    """The tensor in each slot now."""
    return [module._buffers.get(name) for module, name in slots]


def put_buffers(slots: Sequence[BufferSlot], tensors: Iterable[torch.Tensor | None]) -> None:
    """Put ``tensors`` in the slots, in order."""
    for (module, name), t in zip(slots, tensors):
        module._buffers[name] = t


def private_copies(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A clone of each tensor, one per distinct tensor, so that a buffer registered in two
    modules stays one tensor in the copies too."""
    clones = {id(t): t for t in tensors if t is not None}
    clones = {k: t.clone() for k, t in clones.items()}
    return [clones[id(t)] if t is not None else None for t in tensors]


class RngState:
    """The RNG state of the CPU (unless ``cpu=False``) and of the given CUDA devices, as it
    is now; :meth:`restore` puts it back, as often as needed."""

    __slots__ = ("cpu", "cuda", "devices")

    def __init__(self, devices: Sequence[int] = (), *, cpu: bool = True) -> None:
        self.devices = tuple(devices)
        self.cpu = torch.get_rng_state() if cpu else None
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]

    def restore(self) -> None:
        """Set the recorded states again."""
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for d, state in zip(self.devices, self.cuda):
            torch.cuda.set_rng_state(state, d)


def _cuda_devices(x: Any) -> list[int]:
    return sorted({t.device.index or 0 for t in tensors_in(x) if t.is_cuda})


@contextlib.contextmanager
def dry_run_state(model: nn.Module, x: Any) -> Iterator[None]:
    """Run a block as an invisible extra forward: buffers, RNG and counters untouched.

    Buffers are swapped for clones and put back, the RNG of the CPU and of every CUDA
    device that ``x`` or the model lives on is forked, and :func:`is_recomputing` is true
    inside.
    """
    slots = buffer_slots(model.modules())
    live = read_buffers(slots)
    rng = RngState(_cuda_devices([x, *model.parameters()]))
    put_buffers(slots, private_copies(live))
    try:
        with recomputing():
            yield
    finally:
        put_buffers(slots, live)
        rng.restore()


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
    slots = buffer_slots(model.modules())
    live = read_buffers(slots)
    grads = [(p, p.grad) for p in model.parameters()]
    rng = RngState(_cuda_devices([inputs, *model.parameters()]))

    def fresh() -> None:
        put_buffers(slots, private_copies(live))
        for p, _ in grads:
            p.grad = None
        rng.restore()

    try:
        yield fresh
    finally:
        for module, had, forward in forwards:
            module.__dict__.pop("forward", None)
            if had:
                module.__dict__["forward"] = forward
        put_buffers(slots, live)
        for p, g in grads:
            p.grad = g
        rng.restore()
