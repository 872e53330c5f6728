"""Honest peak-memory measurement on CPU and CUDA.

Two figures, because they answer different questions:

* **Allocator level** (``peak_bytes``, the figure quoted to users): every allocation the
  process makes for the device during the block, op-internal workspaces included. On CPU
  it comes from the profiler's memory events, the only place that sees, for example, the
  ~175 MiB of oneDNN reorder buffers inside a convolution backward; on CUDA from the caching
  allocator's trace of allocations and frees (its memory history). Both are read as a list
  of byte deltas, so one piece of arithmetic (:class:`Windows`) serves both devices, and
  neither resets a statistic the user may be reading (``torch.cuda.max_memory_allocated``
  is never reset).
* **Tensor level** (``tensor_peak_bytes``): the storages of tensors created by aten ops
  during the block, counted while they are alive (a ``TorchDispatchMode`` with weak
  references on storages). This is what a planner reasons about, but it misses workspaces
  and cannot see into compiled code.

Both count bytes allocated *inside* the block above what was live at entry: parameters,
inputs and anything created before are not included. Windows nest: an inner
``track_memory`` measures its block and the outer one still sees everything. Python-level
tools such as ``tracemalloc`` see none of this and must not be used.

Known limit of the CPU allocator level: the profiler learns a block's size only when it
sees the allocation, and keeps sizes of blocks freed while no profiler runs. So when the
block frees a tensor created *before* it, that free is missed, or, if glibc reused an
address, counted with a stale size. Measure whole training steps (which free what they
allocate) after a warm-up, as the tests and benchmarks do; ``autockpt.profile`` uses one
session with markers for the same reason. Entering the outermost window runs the garbage
collector, so that objects already unreachable are not freed inside it (a flaky over-count
seen in long test runs before this was done).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autockpt.measure.allocator import MARK, AllocatorSession, open_session
from autockpt.measure.tensors import device_of, storage_key
from autockpt.plan import format_bytes

__all__ = ["MemoryStats", "StorageTracker", "Windows", "peak_and_net", "track_memory"]


@dataclass
class MemoryStats:
    """What :func:`track_memory` measured; filled in when the block exits.

    Attributes:
        device: the device measured.
        peak_bytes: allocator-level peak above the level at entry.
        allocated_bytes: allocator-level bytes still allocated at exit, above entry.
        tensor_peak_bytes: tensor-level peak (storages created in the block and alive).
        tensor_live_bytes: tensor-level bytes still alive at exit.
        tensor_peak_op: the aten op after which the tensor-level peak was reached.
    """

    device: torch.device
    peak_bytes: int = 0
    allocated_bytes: int = 0
    tensor_peak_bytes: int = 0
    tensor_live_bytes: int = 0
    tensor_peak_op: str = ""
    _tensor_level: bool = field(default=True, repr=False)
    _allocator_level: bool = field(default=True, repr=False)

    def __str__(self) -> str:
        parts = [f"device={self.device}"]
        if self._allocator_level:
            parts.append(f"peak={format_bytes(self.peak_bytes)} (allocator)")
        if self._tensor_level:
            parts.append(f"tensor peak={format_bytes(self.tensor_peak_bytes)}")
        return "MemoryStats(" + ", ".join(parts) + ")"


class StorageTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops on one device type while they live."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self._refs: dict[int, weakref.ref[Any]] = {}

    def _on_free(self, key: int, nbytes: int, _ref: object) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Outputs that alias an input (views, detach, in-place ops) allocate nothing, even when
        # the input's storage predates the block (a parameter seen for the first time).
        inputs = {storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            if storage_key(t) in inputs:
                continue
            st = t.untyped_storage()
            key = id(st)
            ref = self._refs.get(key)
            if ref is not None and ref() is st:
                continue
            nbytes = st.nbytes()
            self._refs[key] = weakref.ref(st, functools.partial(self._on_free, key, nbytes))
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
                self.peak_op = str(func)
        return out


def peak_and_net(deltas: list[int | None]) -> tuple[int, int]:
    """(peak, net) bytes of a list of allocation deltas; marks (``None``) are skipped."""
    live = peak = 0
    for nbytes in deltas:
        if nbytes is not None:
            live += nbytes
            peak = max(peak, live)
    return peak, live


class Windows:
    """(peak, net) bytes between :meth:`mark` calls, from one allocator session.

    One session with marks beats several sessions: the CPU profiler learns a block's size
    only when it sees the allocation, so a block allocated outside any session and freed
    inside one is missed (or, at a reused address, freed with a stale size). On the meta
    device nothing is allocated; there the windows count the storages of tensors created
    (:class:`StorageTracker`). ``result[k]`` is the window that ended at mark ``k``
    (``result[0]``, everything before the first mark, is ``(0, 0)``).
    """

    def __init__(self, device: torch.device, *, collect: bool = True) -> None:
        self.device = device
        self.collect = collect  # see open_session
        self.session: AllocatorSession | None = None
        self.tensors = StorageTracker("meta") if device.type == "meta" else None
        self.result: list[tuple[int, int]] = []
        self.marks = 0
        self._base = 0

    def __enter__(self) -> Windows:
        if self.tensors is not None:
            self.tensors.__enter__()
        else:
            self.session = open_session(self.device, collect=self.collect)
        return self

    def mark(self) -> int:
        """Cut a window here; returns ``k``, this mark's number: ``result[k]`` is the window
        ending here and ``result[k + 1]`` the one starting here."""
        self.marks += 1
        if self.session is not None:
            self.session.mark()
            return self.marks - 1
        assert self.tensors is not None
        live, peak = self.tensors.live, self.tensors.peak
        self.result.append((peak - self._base, live - self._base) if self.result else (0, 0))
        self._base = self.tensors.peak = live
        return self.marks - 1

    def __exit__(self, *exc: object) -> None:
        if self.session is not None:
            windows: list[list[int | None]] = [[]]
            for nbytes in self.session.close():
                if nbytes is MARK:
                    windows.append([])
                else:
                    windows[-1].append(nbytes)
            # windows[k] lies between marks k and k + 1; the one after the last mark is not a window
            self.result = [(0, 0), *(peak_and_net(w) for w in windows[1:-1])] if len(windows) > 1 else []
        if self.tensors is not None:
            self.tensors.__exit__(None, None, None)


def _resolve_device(device: str | torch.device | None, model: nn.Module | None, inputs: Any) -> torch.device:
    dev = device_of(model, inputs, device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"track_memory: device={str(dev)!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


class track_memory:  # noqa: N801  (a context manager used like a function, as torch's)
    """Measure peak memory of the enclosed block, at allocator and tensor level.

    Windows nest on both devices: an inner ``track_memory`` reports its own block, and the
    outer one still counts everything. No statistic is reset, so the caller's own
    ``torch.cuda.max_memory_allocated`` stays as it was.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; by default the device of ``inputs``,
            else of ``model``, else the CPU (whether CUDA is initialized plays no part).
        model: the model whose step is measured, to take the device from.
        inputs: its inputs (any nested structure of tensors), to take the device from.
        tensors: also count tensor storages (a dispatch mode; slows eager code, and
            torch.compile does not compile under it).
        allocator: also record the allocator level (on CPU through the profiler's memory
            events, so it cannot nest inside a ``torch.profiler`` the caller runs).

    ``with track_memory(...) as mem`` binds a :class:`MemoryStats`, filled in when the
    block exits.

    Examples:
        >>> import autockpt, torch
        >>> with autockpt.track_memory("cpu") as mem:
        ...     x = torch.ones(1024, 1024)
        >>> mem.peak_bytes >= 4 * 2**20 and mem.tensor_peak_bytes == 4 * 2**20
        True
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        model: nn.Module | None = None,
        inputs: Any = (),
        tensors: bool = True,
        allocator: bool = True,
    ) -> None:
        dev = _resolve_device(device, model, inputs)
        self.stats = MemoryStats(dev, _tensor_level=tensors, _allocator_level=allocator)
        self._tracker: StorageTracker | None = None
        self._session: AllocatorSession | None = None

    def __enter__(self) -> MemoryStats:
        if self.stats._allocator_level:
            self._session = open_session(self.stats.device)
        if self.stats._tensor_level:
            self._tracker = StorageTracker(self.stats.device.type)
            self._tracker.__enter__()
        return self.stats

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stats = self.stats
        if self._tracker is not None:
            self._tracker.__exit__(exc_type, exc, tb)
            stats.tensor_peak_bytes = self._tracker.peak
            stats.tensor_live_bytes = self._tracker.live
            stats.tensor_peak_op = self._tracker.peak_op
        if self._session is not None:
            stats.peak_bytes, stats.allocated_bytes = peak_and_net(self._session.close())
