"""Honest peak-memory measurement on CPU and CUDA.

Two figures, because they answer different questions:

* **Allocator level** (``peak_bytes``, the figure quoted to users): every allocation the
  process makes for the device during the block, op-internal workspaces included. On CUDA
  this is the caching allocator's ``max_memory_allocated``; on CPU it comes from the
  profiler's memory events, the only place that sees, for example, the ~175 MiB of
  oneDNN reorder buffers inside a convolution backward.
* **Tensor level** (``tensor_peak_bytes``): the storages of tensors created by aten ops
  during the block, counted while they are alive (a ``TorchDispatchMode`` with weak
  references on storages). This is what a planner reasons about, but it misses workspaces
  and cannot see into compiled code.

Both count bytes allocated *inside* the block above what was live at entry: parameters,
inputs and anything created before are not included. Python-level tools such as
``tracemalloc`` see none of this and must not be used.

Known limit of the CPU allocator level: the profiler learns a block's size only when it
sees the allocation, and keeps sizes of blocks freed while no profiler runs. So when the
block frees a tensor created *before* it, that free is missed, or, if glibc reused an
address, counted with a stale size. Measure whole training steps (which free what they
allocate) after a warm-up, as the tests and benchmarks do; ``autockpt.profile`` uses one
session with markers for the same reason. Entering the block runs the garbage collector,
so that objects already unreachable are not freed inside it (a flaky over-count seen in
long test runs before this was done).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autockpt.errors import AutockptError
from autockpt.plan import format_bytes

__all__ = ["MemoryStats", "track_memory"]


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


def _storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _StorageTracker(TorchDispatchMode):
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
        inputs = {_storage_id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            if _storage_id(t) in inputs:
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


class _CpuAllocatorEvents:
    """CPU allocations and frees, read from the profiler's memory events."""

    def __init__(self) -> None:
        if torch._C._autograd._profiler_enabled():
            raise AutockptError(
                "track_memory: a torch profiler (or another track_memory on CPU) is already "
                "running, and CPU allocator events cannot be recorded twice. Pass "
                "allocator=False to the inner track_memory."
            )
        from torch._C._profiler import ProfilerActivity

        self._activities = {ProfilerActivity.CPU}
        self._config = torch._C._profiler._ExperimentalConfig()

    def start(self) -> None:
        from torch._C import _autograd
        from torch._C._profiler import ProfilerConfig, ProfilerState

        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, self._config)
        # garbage from before the session must not be freed inside it, where its size may be
        # unknown or stale (see the module docstring)
        gc.collect()
        with _quiet_stderr():
            _autograd._prepare_profiler(config, self._activities)
            _autograd._enable_profiler(config, self._activities)

    def stop(self) -> tuple[int, int]:
        """Return (peak, net) CPU bytes allocated since :meth:`start`."""
        return _peak_and_net(self._deltas())

    def stop_windows(self) -> list[tuple[int, int]]:
        """(peak, net) of each window between :func:`mark` calls, in order.

        One session with marks beats several sessions: the profiler learns a block's size
        only when it sees the allocation, so a block allocated outside any session and freed
        inside one is missed (or, at a reused address, freed with a stale size).
        """
        windows: list[list[int]] = [[]]
        for nbytes in self._deltas():
            if nbytes == _MARK:
                windows.append([])
            elif nbytes != -_MARK:
                windows[-1].append(nbytes)
        return [_peak_and_net(w) for w in windows]

    def _deltas(self) -> list[int]:
        from torch._C import _autograd

        with _quiet_stderr():
            result = _autograd._disable_profiler()
        cpu = torch._C._autograd.DeviceType.CPU
        events = [
            (e.start_ns(), int(getattr(e, "nbytes")()))  # noqa: B009  (missing from torch's stubs)
            for e in result.events()
            if e.name() == "[memory]" and e.device_type() == cpu
        ]
        events.sort(key=lambda e: e[0])  # stable: same-time events keep their recorded order
        return [nbytes for _, nbytes in events]


_MARK = 7919  # bytes of a marker allocation; an odd prime no real tensor is likely to have


def mark() -> None:
    """Leave a marker in a CPU allocator session (see ``_CpuAllocatorEvents.stop_windows``)."""
    torch.empty(_MARK, dtype=torch.uint8)


def _peak_and_net(deltas: list[int]) -> tuple[int, int]:
    live = peak = 0
    for nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak, live


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler back end's start/stop chatter on file descriptor 2."""
    fd = 2  # the C++ side writes to the process's stderr, whatever sys.stderr is now
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        if torch.cuda.is_initialized():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"track_memory: device={str(dev)!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


class track_memory:  # noqa: N801  (a context manager used like a function, as torch's)
    """Measure peak memory of the enclosed block, at allocator and tensor level.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` picks the current CUDA
            device if CUDA is initialised, else the CPU.
        tensors: also count tensor storages (a dispatch mode; slows eager code, and
            torch.compile does not compile under it).
        allocator: also record the allocator level (on CPU through the profiler's memory
            events, so it cannot nest inside another profiler).

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
        tensors: bool = True,
        allocator: bool = True,
    ) -> None:
        self.stats = MemoryStats(_resolve_device(device), _tensor_level=tensors, _allocator_level=allocator)
        self._tracker: _StorageTracker | None = None
        self._cpu: _CpuAllocatorEvents | None = None
        self._cuda_base = 0

    def __enter__(self) -> MemoryStats:
        dev = self.stats.device
        if self.stats._allocator_level:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                self._cuda_base = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            else:
                self._cpu = _CpuAllocatorEvents()
                self._cpu.start()
        if self.stats._tensor_level:
            self._tracker = _StorageTracker(dev.type)
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
        if self._cpu is not None:
            stats.peak_bytes, stats.allocated_bytes = self._cpu.stop()
        elif stats._allocator_level:
            torch.cuda.synchronize(stats.device)
            stats.peak_bytes = torch.cuda.max_memory_allocated(stats.device) - self._cuda_base
            stats.allocated_bytes = torch.cuda.memory_allocated(stats.device) - self._cuda_base
