"""A lean non-reentrant checkpoint for the plain eager case (NOTE [Lean checkpoint]).

NOTE [Lean checkpoint]
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` runs about twenty Python
    calls for each tensor a segment saves (a holder and its weak reference, a metadata dict
    under ``no_grad`` for its determinism check, a handle and a weak-keyed dict entry per
    graph task, internal asserts) and a few dozen per call (device inference over a pytree,
    autocast, device-context, fx and dynamo state captured for the replay). A small
    transformer layer saves ~40 tensors: ~1,000 calls a layer-step, which was the whole
    difference between ``auto_checkpoint`` and HF's ``gradient_checkpointing_enable`` (both
    on torch's checkpoint) on tiny configs.

    This module keeps the same contract with saved-tensor hooks of its own, for the case
    that is nearly every eager training step (:func:`lean_applies`): grad enabled, no
    saved-tensor hooks active (the user's ``save_on_cpu``, another checkpoint's), no
    torch-function mode (``with torch.device(...)``), no proxy or fx tracing, inputs on one
    CPU or CUDA device, torch's global ``set_checkpoint_early_stop``/debug switches unset,
    and a torch that can tell whether saved-tensor hooks are active (2.8 and later:
    :data:`LEAN_AVAILABLE`). Everything else (and op policies, nested segments, compiling)
    goes to torch's ``checkpoint``, so composition with those stays torch's.

    NOTE [Lean on CUDA, once compared]
        The lean path was written for CPU and CUDA, but it has not run on a GPU since its
        RNG stash, autocast replay and device handling changed (2026-12-05), and a
        difference there would be a silent wrong gradient. So segments whose inputs are on
        CUDA take torch's ``checkpoint`` until ``tests/test_cuda.py``'s
        ``test_lean_checkpoint_on_cuda_equals_torchs`` (dropout RNG, autocast, a backward
        that retains the graph and runs twice, a backward to the input only; run by
        ``.ci/gpu``) has passed on a GPU; then ``"cuda"`` joins :data:`LEAN_DEVICES`.

    What it keeps of torch's semantics:

    - *Replay on first unpack*, once per backward (graph task): the forward's saved tensors
      become holders; the first unpack replays the function under a pack hook that fills
      every live holder with its recomputed tensor, detached (the replay's own graph must
      not hold its outputs: a node that saves its output would hold itself through
      ``grad_fn``, a cycle only the garbage collector frees), and each unpack takes its
      tensor out, so it is freed as soon as autograd is done with it.
    - *Early stop*: the replay stops once it has saved as many tensors as the forward did.
    - *Repeated and partial backwards* (``retain_graph=True``, ``autograd.grad`` on part of
      the graph): a holder is only used in the backward whose replay filled it; an empty
      one, or one filled in another backward, replays again, as torch's checkpoint does per
      graph task. Otherwise a tensor left over by a partial backward would be used after an
      optimizer step without the replay, whose mutation guard would have refused it (found
      in review). Holders whose part of the graph was freed before backward are skipped,
      as torch's weak holders are. The replay holds a lock, so device threads of one
      backward never replay the same call at once.
    - *RNG and autocast*: when the caller says the function may draw random numbers, the
      CPU RNG state (and that of the CUDA device of the inputs) is stashed in the forward
      and restored in a forked RNG for the replay; the replay runs under the forward's
      autocast state for CUDA and the CPU, whatever the inputs' device and whatever the
      backward's state (a segment handed CPU tensors may run on the GPU: found in review).
    - *Errors*: a replay that saves fewer tensors, or one of another shape, dtype or device
      than the forward did (torch's default determinism check), raises torch's
      ``CheckpointError`` with the counts or the position, after the replay has run, so
      the function's own ``try`` cannot catch it.

    Not kept: torch raises when one saved tensor is unpacked twice in one backward (a
    custom Function reading ``ctx.saved_tensors`` twice); the lean one replays again.
    Segments given tensors on several devices go to torch's checkpoint. Untested: compiled
    autograd (the replay is dynamo-disabled, as torch's is, the hooks are not), and a
    selective checkpoint of the model's own inside a lean segment, which torch 2.14 sees
    under a user's saved-tensor hooks (it warns).

    The contract is tested as a pair in ``tests/test_lean_checkpoint.py``: the same
    function under torch's checkpoint and this one gives bitwise equal gradients in every
    scenario above, holds the same bytes between forward and backward, and raises the same
    ``CheckpointError`` for a replay of another dtype or count.

    Input tensors modified in place before the replay are the caller's to check (torch's
    checkpoint refuses them through its saved inputs): the segment call keeps their
    versions (NOTE [Segment inputs] in ``execution/runtime.py``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError

from autockpt.measure.sandbox import RngState

__all__ = ["LEAN_AVAILABLE", "LEAN_DEVICES", "lean_applies", "lean_checkpoint"]

_PROXY = torch._C._TorchDispatchModeKey.PROXY
LEAN_DEVICES: tuple[str, ...] = ("cpu",)
"""Devices whose segments may take the lean path (NOTE [Lean on CUDA, once compared])."""


def _hooks_reader() -> Callable[[bool], Any] | None:
    """torch's reader of the innermost active saved-tensor hooks, where this torch has it in
    the form used here (not before 2.8); without it the lean path never applies."""
    read = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        read(False) if read is not None else None
    except TypeError:
        return None
    return read


_TOP_HOOKS = _hooks_reader()
LEAN_AVAILABLE = _TOP_HOOKS is not None  # whether this torch can take the lean path at all
_graph_task: Callable[[], int] = torch._C._current_graph_task_id
# the flag torch's checkpoint reads; the public is_fx_tracing() logs a warning on every call
_FX_TRACING: Callable[[], bool] = getattr(torch.fx._symbolic_trace, "_get_is_fx_tracing", lambda: False)


def lean_applies(device_type: str) -> bool:
    """Whether a checkpoint whose inputs are on ``device_type`` may take the lean path now."""
    return (
        device_type in LEAN_DEVICES
        and _TOP_HOOKS is not None
        and torch.is_grad_enabled()
        and _TOP_HOOKS(False) is None
        and torch._C._len_torch_function_stack() == 0
        and torch._C._get_dispatch_mode(_PROXY) is None
        and not _FX_TRACING()
        and torch_checkpoint._enable_checkpoint_early_stop is None
        and torch_checkpoint._checkpoint_debug_enabled is None
    )


class _Holder:
    """What a saved tensor packs to: filled by a replay, emptied by its unpack."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None


class _EarlyStopError(Exception):
    """Raised by the replay's pack hook once every saved tensor is recomputed (early stop)."""


_Autocast = tuple[bool, torch.dtype, bool, torch.dtype, bool]


def _autocast_state() -> _Autocast:
    """Autocast on/off and dtype for CUDA and the CPU, and the cache switch: both device
    types whatever the inputs' (a segment given CPU tensors may move them to the GPU), as
    torch's checkpoint records them."""
    return (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


class _Frame:
    """One checkpointed call: its function and inputs, what its forward saved, and the
    state its replay restores."""

    __slots__ = (
        "args",
        "autocast",
        "count",
        "fn",
        "holders",
        "lock",
        "meta",
        "mismatch",
        "rng",
        "task",
    )

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.holders: list[weakref.ReferenceType[_Holder]] = []
        self.meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.count = 0  # tensors saved so far by the running replay
        self.rng: RngState | None = None  # the forward's RNG state, when the replay needs it
        self.autocast: _Autocast | None = _autocast_state() if _autocast_on() else None
        self.task = -2  # the graph task of the last replay (-1: unpacked outside a backward)
        self.mismatch: str | None = None  # the first saved tensor the last replay got wrong
        self.lock = threading.RLock()  # device threads of one backward may unpack at once

    def pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder()
        self.holders.append(weakref.ref(holder))
        self.meta.append((t.shape, t.dtype, t.device))
        return holder

    def unpack(self, holder: _Holder) -> torch.Tensor:
        t = holder.tensor
        if t is None or self.task != _graph_task():  # a tensor left by another backward is not reused
            with self.lock:
                t = holder.tensor
                if t is None or self.task != _graph_task():
                    self.replay()
                    t = holder.tensor
            if t is None:
                raise CheckpointError(
                    "torch.utils.checkpoint: A different number of tensors was saved during the original "
                    f"forward and recomputation.\nNumber of tensors saved during forward: "
                    f"{len(self.holders)}\nNumber of tensors saved during recomputation: {self.count}."
                )
        holder.tensor = None
        return t

    def repack(self, t: torch.Tensor) -> torch.Tensor:
        i = self.count  # below len(holders): the replay stops at the last one (early stop)
        self.count = i + 1
        if t.requires_grad:
            t = t.detach()
        holder = self.holders[i]()
        if holder is not None:
            if self.mismatch is None and (t.shape, t.dtype, t.device) != self.meta[i]:
                self.mismatch = (
                    f"tensor at position {i}:\nsaved metadata: {self.meta[i]}\n"
                    f"recomputed metadata: {(t.shape, t.dtype, t.device)}"
                )
            holder.tensor = t
        if i + 1 == len(self.holders):
            raise _EarlyStopError
        return t

    def replay(self) -> None:
        """Run the function again, filling every live holder; errors after it has run, so the
        function's own code cannot catch them."""
        self.count = 0
        self.mismatch = None
        self.task = _graph_task()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.repack, _identity), torch.enable_grad():
                if self.rng is None and self.autocast is None and not _autocast_on():
                    _run_without_dynamo(self.fn, *self.args)
                else:
                    self._replay_in_state()
        except _EarlyStopError:
            pass
        if self.mismatch is not None:
            raise CheckpointError(
                "torch.utils.checkpoint: Recomputed values for the following tensors have different "
                f"metadata than during the forward pass.\n{self.mismatch}"
            )

    def _replay_in_state(self) -> None:
        """The replay under the forward's RNG and autocast state."""
        on, dtype, cpu_on, cpu_dtype, cache = self.autocast or _autocast_state()
        if self.autocast is None:
            on = cpu_on = False
        with (
            torch.random.fork_rng(
                devices=self.rng.devices if self.rng else (), enabled=self.rng is not None, device_type="cuda"
            ),
            torch.autocast("cuda", enabled=on, dtype=dtype, cache_enabled=cache),
            torch.autocast("cpu", enabled=cpu_on, dtype=cpu_dtype, cache_enabled=cache),
        ):
            if self.rng is not None:
                self.rng.restore()
            _run_without_dynamo(self.fn, *self.args)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@torch._disable_dynamo  # type: ignore[attr-defined]  # the public torch.compiler.disable imports dynamo eagerly
def _run_without_dynamo(fn: Callable[..., Any], *args: Any) -> Any:
    """The replay, never traced by compiled autograd (as torch's own replay)."""
    return fn(*args)


def lean_checkpoint(
    fn: Callable[..., Any], args: Sequence[torch.Tensor], *, device_type: str, preserve_rng_state: bool
) -> Any:
    """``checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=...)`` where
    :func:`lean_applies` admits it; ``args`` are tensors on one device, of ``device_type``."""
    frame = _Frame(fn, tuple(args))
    if preserve_rng_state:
        cuda = device_type == "cuda" and torch.cuda.is_initialized()
        frame.rng = RngState(sorted({t.get_device() for t in args}) if cuda else ())
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args)
