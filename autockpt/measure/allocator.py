"""Allocator sessions: every allocation and free on a device, as a list of byte deltas.

Both devices answer the same question the same way. On CPU the deltas are the profiler's
memory events (read through the low-level ``torch._C._autograd`` profiler API, which skips
the expensive post-processing of ``torch.profiler.profile``); on CUDA they are the caching
allocator's trace (``torch.cuda.memory._record_memory_history``), the same record PyTorch's
memory viewer draws. Sessions nest: a session opened inside another sees its own events, and
the outer one sees them too. A :func:`AllocatorSession.mark` leaves a marker (``MARK``) in
the list, so one session can be cut into windows (``autockpt.measure.memory.Windows``).
Every delta comes with the time it happened (``AllocatorSession.times``), for a curve of
memory through time (``autockpt.measure.timeline``).

Nothing here resets a statistic: ``torch.cuda.max_memory_allocated`` and
``reset_peak_memory_stats`` stay the caller's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from autockpt.errors import AutockptError

__all__ = ["MARK", "AllocatorSession", "open_session"]

MARK: None = None
"""What a marker looks like in a list of deltas."""

_MARK_BYTES = 7919  # a CPU marker allocation: an odd prime no real tensor is likely to have


class AllocatorSession:
    """One open window on a device's allocator; :meth:`close` returns its deltas."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.deltas: list[int | None] = []
        self.times: list[float] = []  # ms on the device's event clock, one per delta

    def mark(self) -> None:
        """Leave a marker in this session's deltas (and in those of enclosing sessions)."""
        self.recorder.mark()

    def close(self) -> list[int | None]:
        """End the session; its byte deltas in order, ``MARK`` where :meth:`mark` was called."""
        self.recorder.close(self)
        return self.deltas


class _Recorder:
    """The open sessions of one device, innermost last."""

    def __init__(self) -> None:
        self.open: list[AllocatorSession] = []

    def start(self, *, collect: bool = True) -> AllocatorSession:
        if self.open:
            self._deliver(final=False)
        else:
            # garbage from before the session must not be freed inside it, where its size
            # may be unknown or stale (see autockpt.measure.memory); a caller that collected
            # everything once, up front, asks for the young generations only (cheap)
            gc.collect() if collect else gc.collect(1)
        session = AllocatorSession(self)
        self.open.append(session)
        self._begin()
        return session

    def close(self, session: AllocatorSession) -> None:
        if session not in self.open:
            raise AutockptError("track_memory: this allocator session is closed already.")
        self._deliver(final=self.open[0] is session)  # closing the outermost ends them all
        while self.open and self.open[-1] is not session:  # an inner one left open: close it too
            self.open.pop()
        self.open.pop()
        if self.open:
            self._begin()

    def _deliver(self, *, final: bool) -> None:
        """Hand the events recorded since the last change of nesting to every open session.

        Every change of nesting ends a recording interval, so all markers of an interval were
        left by the session innermost during it: only that session keeps them.
        """
        events = self._end(final=final)
        plain = [e for e in events if e[1] is not MARK]
        for session in self.open[:-1]:
            session.deltas.extend(d for _, d in plain)
            session.times.extend(t for t, _ in plain)
        if self.open:
            self.open[-1].deltas.extend(d for _, d in events)
            self.open[-1].times.extend(t for t, _ in events)

    def mark(self) -> None:
        raise NotImplementedError

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self, *, final: bool) -> list[tuple[float, int | None]]:
        """Stop recording; ``(ms, delta)`` since :meth:`_begin`. ``final``: no session stays open."""
        raise NotImplementedError


class _CpuRecorder(_Recorder):
    """CPU allocations from the profiler's memory events.

    The profiler cannot run twice, so a nested session stops the running one, hands its
    events to every open session and starts again. A profiler the caller runs cannot be
    shared; that is refused with a clear message.
    """

    def __init__(self) -> None:
        super().__init__()
        self._config: Any = None

    def start(self, *, collect: bool = True) -> AllocatorSession:
        if not self.open and torch._C._autograd._profiler_enabled():
            raise AutockptError(
                "track_memory: a torch profiler is already running, and CPU allocator events "
                "cannot be recorded twice. Pass allocator=False to track_memory, or stop the profiler."
            )
        return super().start(collect=collect)

    def mark(self) -> None:
        torch.empty(_MARK_BYTES, dtype=torch.uint8)

    def _begin(self) -> None:
        from torch._C import _autograd
        from torch._C._profiler import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            RecordScope,
            _ExperimentalConfig,
        )

        activities = {ProfilerActivity.CPU}
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        with _quiet_stderr():
            _autograd._prepare_profiler(config, activities)
            # memory events are reported whatever the scopes, and op events (scope FUNCTION)
            # are not wanted: recording them made a measured step ~1.5x slower and each stop
            # of the profiler ~20 ms longer for a few thousand ops
            try:
                _autograd._enable_profiler(config, activities, {RecordScope.USER_SCOPE})  # type: ignore[call-arg]
            except TypeError:  # pragma: no cover - a torch without scopes: every op recorded
                _autograd._enable_profiler(config, activities)

    def _end(self, *, final: bool) -> list[tuple[float, int | None]]:
        from torch._C import _autograd

        with _quiet_stderr():
            result = _autograd._disable_profiler()
        cpu = torch._C._autograd.DeviceType.CPU
        # memory events are the ones with bytes (user scopes have none), read once per event
        events = [
            (e.start_ns(), nbytes)
            for e in result.events()
            if (nbytes := int(getattr(e, "nbytes")())) and e.device_type() == cpu  # noqa: B009
        ]
        events.sort(key=lambda e: e[0])  # stable: same-time events keep their recorded order
        out: list[tuple[float, int | None]] = []
        for ns, nbytes in events:
            if nbytes == _MARK_BYTES:
                out.append((ns / 1e6, MARK))
            elif nbytes != -_MARK_BYTES:
                out.append((ns / 1e6, nbytes))
        return out


class _CudaRecorder(_Recorder):
    """CUDA allocations from the caching allocator's memory history.

    History is process-wide: it is switched on (without stack traces) when the first CUDA
    session of any device opens, unless the caller records it already, and switched off
    when the last one closes, only if we switched it on. A session reads its device's trace
    entries added since it began: ``alloc`` adds a block's size, ``free_requested`` takes it
    away (the moment ``memory_allocated`` drops). A marker is a tiny allocation kept alive
    until the session ends, so it is the last allocation of its address in the trace (the
    caching allocator reuses small addresses all the time; an earlier block at the same
    address was freed before the marker took it).
    """

    open_sessions = 0  # across every CUDA recorder: history is per process
    owns_history = False

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._begun_at = 0
        self._marks: set[int] = set()  # addresses of the live markers
        self._live: list[torch.Tensor] = []  # the markers, kept alive until the session ends

    def mark(self) -> None:
        self._marks.add(self._mark_allocation())

    def _mark_allocation(self) -> int:
        """Allocate a tiny block and keep it alive; its address marks the trace."""
        t = torch.empty(1, dtype=torch.uint8, device=self.device)
        self._live.append(t)
        return int(t.untyped_storage().data_ptr())

    def _trace(self) -> list[dict[str, Any]]:
        traces = torch.cuda.memory._snapshot(self.device)["device_traces"]
        index = self.device.index or 0
        return list(traces[index]) if index < len(traces) else []

    def start(self, *, collect: bool = True) -> AllocatorSession:
        if not self.open:
            cls = _CudaRecorder
            if cls.open_sessions == 0:
                recording = getattr(torch._C, "_cuda_isHistoryEnabled", lambda: False)  # not in every torch
                if not recording():
                    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
                    cls.owns_history = True
            cls.open_sessions += 1
        return super().start(collect=collect)

    def _begin(self) -> None:
        torch.cuda.synchronize(self.device)
        self._begun_at = len(self._trace())

    def _end(self, *, final: bool) -> list[tuple[float, int | None]]:
        torch.cuda.synchronize(self.device)
        entries = [e for e in self._trace()[self._begun_at :] if e.get("action") in _COUNTED]
        deltas = cuda_deltas(entries, self._marks)
        # entries carry their time in microseconds where the torch version records it
        times = [float(e.get("time_us", i)) / 1e3 for i, e in enumerate(entries)]
        if final:
            self._marks, self._live = set(), []
            cls = _CudaRecorder
            cls.open_sessions -= 1
            if cls.open_sessions == 0 and cls.owns_history:
                torch.cuda.memory._record_memory_history(enabled=None)
                cls.owns_history = False
        return list(zip(times, deltas, strict=True))


def cuda_deltas(entries: list[dict[str, Any]], marks: set[int]) -> list[int | None]:
    """Byte deltas of CUDA allocator trace entries; the last allocation of each address in
    ``marks`` (a live marker) becomes ``MARK``."""
    last_alloc = {e.get("addr"): i for i, e in enumerate(entries) if e.get("action") == "alloc"}
    markers = {last_alloc[a] for a in marks if a in last_alloc}
    out: list[int | None] = []
    for i, e in enumerate(entries):
        action, size = e.get("action"), int(e.get("size", 0))
        if i in markers:
            out.append(MARK)
        elif action == "alloc":
            out.append(size)
        elif action == "free_requested":
            out.append(-size)
    return out


_COUNTED = ("alloc", "free_requested")  # the trace actions that change allocated bytes

_RECORDERS: dict[str, _Recorder] = {}


def open_session(device: torch.device, *, collect: bool = True) -> AllocatorSession:
    """Start recording ``device``'s allocator (``cpu`` or ``cuda[:i]``) until ``close()``.

    The garbage collector runs first (``collect``: a full collection, which walks every
    Python object, ~0.1 s after importing torch; else the young generations only, for
    callers that run many sessions and collected once before the first).

    Raises:
        AutockptError: on CPU, a profiler the caller started is running.
        ValueError: another device type.
    """
    if device.type == "cpu":
        recorder = _RECORDERS.setdefault("cpu", _CpuRecorder())
    elif device.type == "cuda":
        dev = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        recorder = _RECORDERS.setdefault(str(dev), _CudaRecorder(dev))
    else:
        raise ValueError(f"allocator sessions measure 'cpu' or 'cuda' memory, not {str(device)!r}.")
    return recorder.start(collect=collect)


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
