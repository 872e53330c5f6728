"""What selective checkpointing's per-op dispatch costs, measured once per device.

A segment that keeps some ops' outputs runs under torch's selective checkpointing, which
sends every op of the segment through a Python dispatch mode and a policy call, in the
forward and again in the recompute. On a 2-core CPU that costs tens of microseconds per op
(about 12 us measured here on tiny ops, 16-53 us on an HF GPT-2 block's own ops), about
what the kept ops save on small models, so the planner counts it (NOTE [Selective
dispatch cost]).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from autockpt.measure.sandbox import CHECKPOINT_OPTIONS

__all__ = ["selective_dispatch_ms"]

_OPS = 200  # ops per timed run: long enough to dwarf the checkpoint's own fixed cost
_RUNS = 7  # the least of these is taken: interruptions only ever add time


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(_OPS):
        x = x * 1.0001
    return x


@functools.cache
def _measured(device: str) -> float:
    x = torch.ones(8, device=device, requires_grad=True)
    selective = functools.partial(create_selective_checkpoint_contexts, _recompute_everything)

    def run(context_fn: Any) -> float:
        best = float("inf")
        for _ in range(_RUNS + 1):  # the first run warms up
            start = time.perf_counter()
            out = checkpoint(_chain, x, **CHECKPOINT_OPTIONS, context_fn=context_fn)
            out.sum().backward()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            best = min(best, time.perf_counter() - start)
        return best

    plain, through_policy = run(noop_context_fn), run(selective)
    return max(0.0, (through_policy - plain) * 1e3 / _OPS)


def selective_dispatch_ms(device: torch.device) -> float:
    """Milliseconds selective checkpointing adds per op of a checkpointed segment, forward
    and recompute together: the least of several timed runs of 200 tiny ops, through a
    policy that recomputes everything, less the same runs checkpointed plainly. The host's
    cost, so on a GPU it matters as far as the step waits for the host. 0 on the meta device."""
    if device.type == "meta":
        return 0.0
    return _measured(str(device))
