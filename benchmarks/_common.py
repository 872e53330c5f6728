"""Shared set-up for the benchmarks: a quiet, repeatable CPU, and side-by-side timing."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def setup() -> None:
    """Re-run under glibc settings that keep freed memory, flush denormals, print both.

    Without the malloc settings, glibc returns large blocks to the OS after every step and
    step times swing up to tenfold; deep chains with default init produce denormals in
    backward, which are slow on x86.
    """
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
    torch.set_flush_denormal(True)
    settings = ", ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {settings}, flush_denormal=True")


def interleaved_medians(fns: Sequence[Callable[[], None]], repeats: int) -> list[float]:
    """Median seconds of each function, run in turn ``repeats`` times after one warm-up."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


class SequentialCheckpoint(nn.Module):
    """Runs a Sequential through torch's ``checkpoint_sequential`` with ``k`` segments."""

    def __init__(self, body: nn.Sequential, k: int) -> None:
        super().__init__()
        self.body, self.k = body, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint_sequential(self.body, self.k, x, use_reentrant=False)
