"""Timing a stage: forward, backward and the tail a recompute skips; nominal times on meta.

NOTE [The tail a recompute skips]: torch's non-reentrant checkpoint stops a recompute once
it has saved again every tensor the first forward saved, and autograd saves an op's inputs
before the op runs. So the part of a segment's last stage that runs after its last save
never runs again; :func:`stage_times` times it with a saved-tensor hook (``tail``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autockpt.measure.tensors import detached, requiring_grad, storage_bytes, tensors_in

__all__ = [
    "NOMINAL_BYTES_PER_MS",
    "NOMINAL_FLOPS_PER_MS",
    "Clock",
    "StageRun",
    "nominal_times",
    "stage_times",
]

StageRun = Callable[[Any], Any]
"""What is measured: a stage, or anything else that maps the value before to the value after."""


# Nominal speeds for meta profiles: relative stage costs are what the planner needs.
NOMINAL_FLOPS_PER_MS = 1e9  # 1 TFLOP/s
NOMINAL_BYTES_PER_MS = 1e9  # 1 TB/s


def nominal_times(
    stage: StageRun, x: Any, params: list[nn.Parameter], grads_as_given: bool
) -> tuple[float, float]:
    """Forward and backward "ms" of a meta stage from its FLOPs and output bytes.

    Nothing runs on a meta tensor, so there is no time to measure; FLOPs (matmuls and
    convolutions, from ``FlopCounterMode``) at a nominal 1 TFLOP/s, plus writing the output
    at a nominal 1 TB/s so that elementwise stages are not free, rank recompute costs well
    enough for the planner. Absolute figures mean nothing.
    """
    from torch.utils.flop_counter import FlopCounterMode

    inputs, _ = requiring_grad(x, as_given=grads_as_given)
    with FlopCounterMode(display=False) as fwd_counter:
        out = stage(inputs)
    outs = [t for t in tensors_in(out) if t.requires_grad]
    moved = storage_bytes(tensors_in(out)) / NOMINAL_BYTES_PER_MS
    with FlopCounterMode(display=False) as bwd_counter:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    for p in params:
        p.grad = None
    fwd = fwd_counter.get_total_flops() / NOMINAL_FLOPS_PER_MS + moved
    bwd = bwd_counter.get_total_flops() / NOMINAL_FLOPS_PER_MS + 2 * moved
    return fwd, bwd


class Clock:
    """Milliseconds between marks: ``perf_counter`` on CPU, CUDA events on a GPU (whose
    kernels run asynchronously, so host time would measure only the launches)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def between(self, other: Clock, k: int) -> float:
        """Milliseconds from ``other``'s last mark to this clock's mark ``k``."""
        if self.cuda:
            self.marks[k].synchronize()
            return float(other.marks[-1].elapsed_time(self.marks[k]))
        return float((self.marks[k] - other.marks[-1]) * 1e3)

    def spans(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]


def stage_times(
    stage: StageRun,
    x: Any,
    params: list[nn.Parameter],
    repeats: int,
    device: torch.device,
    grads_as_given: bool,
    warm_up: bool = True,
) -> tuple[float, float, float, Any]:
    """Median forward, backward and tail ms over ``repeats`` runs, after one warm-up run
    (``warm_up``; leave it out for a stage that has just run forward and backward), and the
    last run's output (detached: the next stage's input).

    The tail is the forward's time after it saved its last tensor for backward: what a
    recompute ending with this stage skips (NOTE [The tail a recompute skips])."""
    fwd, bwd, tail = [], [], []
    out: Any = None
    skip = 1 if warm_up else 0
    for i in range(max(1, repeats) + skip):
        inputs, _ = requiring_grad(x, as_given=grads_as_given)
        clock = Clock(device)
        last_save = Clock(device)

        def pack(t: torch.Tensor, _last: Clock = last_save) -> torch.Tensor:
            _last.marks[:] = []
            _last.mark()
            return t

        clock.mark()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(inputs)
        clock.mark()
        outs = [t for t in tensors_in(out) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        clock.mark()
        f, b = clock.spans()
        if i >= skip:  # a stage's first run allocates lazily and creates kernels
            fwd.append(f)
            bwd.append(b)
            # nothing saved: the recompute stops before this stage (counted as all of it)
            tail.append(clock.between(last_save, 1) if last_save.marks else f)
        for p in params:
            p.grad = None
    return (
        statistics.median(fwd),
        statistics.median(bwd),
        min(statistics.median(tail), statistics.median(fwd)),
        detached(out),
    )
