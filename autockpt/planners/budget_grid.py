"""The budget DP on a grid of held bytes, for chains longer than ``EXACT_UP_TO`` stages,
and what both of the budget planner's DPs share: how long a checkpointed segment may be,
and merging neighbouring plain segments. See :mod:`autockpt.planners.budget` for the
problem; the grid is described in :func:`solve_on_grid`.
"""

from __future__ import annotations

import math
from typing import Any

from autockpt.plan import Segment
from autockpt.planners.cost_model import CostModel

__all__ = ["EXACT_UP_TO", "longest_segment", "max_segment", "merge_plain", "solve_on_grid"]

EXACT_UP_TO = 64
RESOLUTION = 128  # grid cells per budget


def max_segment(n: int) -> int:
    """Longest checkpointed segment considered: all of them when exact, else 4 sqrt(n)."""
    return n if n <= EXACT_UP_TO else max(16, 4 * math.isqrt(n))


def longest_segment(model: CostModel, s: int) -> int:
    """One past the last stage a checkpointed segment starting at ``s`` may end at."""
    n = len(model.c)
    span = max_segment(n) if model.spans is None else min(model.spans[s], max_segment(n))
    return s + span


def solve_on_grid(model: CostModel, budget: int) -> tuple[Segment, ...] | None:
    """The same DP on a grid of held bytes, vectorised with numpy.

    Each grid cell keeps the least-recompute path whose held bytes fall in it, with those
    bytes exact: every budget check is exact, and the grid only decides which paths are
    merged. (Rounding each item's bytes up to the grid instead, 128 items of 1/120 of the
    budget each counted twice their size, and a 0.9 budget on a 128-stage chain got 8x the
    recompute of the exact plan.)
    """
    import numpy as np

    costs = model.c
    n = len(costs)
    quantum = max(1, math.ceil(budget / RESOLUTION))
    nb = budget // quantum + 1
    cost = np.full((2, n + 1, nb), np.inf)
    held = np.zeros((2, n + 1, nb), dtype=np.int64)  # the exact bytes of each cell's path
    prev_pos = np.full((2, n + 1, nb), -1, dtype=np.int64)
    prev_flag = np.zeros((2, n + 1, nb), dtype=np.int8)
    prev_bucket = np.zeros((2, n + 1, nb), dtype=np.int64)
    prev_ck = np.zeros((2, n + 1, nb), dtype=np.int8)
    cost[1, 0, 0] = 0.0  # the chain's input is held already: it is a static byte

    def relax(src: tuple[Any, Any, Any], fits: int, add: int, dst_flag: int,
              t: int, extra: float, s: int, src_flag: int, ck: int) -> None:  # fmt: skip
        """Extend the source paths holding at most ``fits`` bytes by an item holding ``add``."""
        cells, src_held, src_cost = src
        k = int(np.searchsorted(src_held, fits, side="right"))  # held grows with the cell
        if k == 0:
            return
        cells, new_held, new_cost = cells[:k], src_held[:k] + add, src_cost[:k] + extra
        target = new_held // quantum
        # Cells are a grid step wide, so at most two neighbouring sources share a target
        # cell: keep the cheaper (on a tie, the first, which holds fewer bytes).
        keep = np.ones(k, dtype=bool)
        same = target[1:] == target[:-1]
        keep[1:] &= ~(same & (new_cost[:-1] <= new_cost[1:]))
        keep[:-1] &= ~(same & (new_cost[:-1] > new_cost[1:]))
        cells, new_held, new_cost, target = cells[keep], new_held[keep], new_cost[keep], target[keep]
        dst_cost, dst_held = cost[dst_flag, t, target], held[dst_flag, t, target]
        better = (new_cost < dst_cost) | ((new_cost == dst_cost) & (new_held < dst_held))
        if not better.any():
            return
        target = target[better]
        cost[dst_flag, t, target] = new_cost[better]
        held[dst_flag, t, target] = new_held[better]
        prev_pos[dst_flag, t, target] = s
        prev_flag[dst_flag, t, target] = src_flag
        prev_bucket[dst_flag, t, target] = cells[better]
        prev_ck[dst_flag, t, target] = ck

    for s in range(n):
        for flag in (0, 1):
            finite = np.nonzero(np.isfinite(cost[flag, s]))[0]
            if finite.size == 0:
                continue
            src = (finite, held[flag, s, finite], cost[flag, s, finite])
            lowest = int(src[1][0])
            local = model.plain_local(s, bool(flag))
            if lowest + local <= budget:
                add = model.held(s, bool(flag))
                relax(src, budget - max(local, add), add, int(costs[s].keeps_output), s + 1, 0.0, s, flag, 0)
            add = model.checkpoint_held(s, bool(flag))
            longest = longest_segment(model, s)
            for t, (local, ms) in enumerate(model.checkpoint_locals(s, bool(flag)), start=s + 1):
                if lowest + local > budget or t > longest:
                    break
                relax(src, budget - max(local, add), add, 0, t, ms, s, flag, 1)
    ends = [
        (cost[f, n, b], held[f, n, b], b, f)
        for f in (0, 1)
        for b in np.nonzero(np.isfinite(cost[f, n]))[0]
        if held[f, n, b] + model.loss(bool(f)) <= budget
    ]
    if not ends:
        return None
    _, _, end_bucket, end_flag = min(ends)
    segments: list[Segment] = []
    pos, f, b = n, int(end_flag), int(end_bucket)
    while pos > 0:
        s = int(prev_pos[f, pos, b])
        segments.append(Segment(s, pos, bool(prev_ck[f, pos, b])))
        pos, f, b = s, int(prev_flag[f, pos, b]), int(prev_bucket[f, pos, b])
    return merge_plain(segments[::-1])


def merge_plain(segments: list[Segment]) -> tuple[Segment, ...]:
    """The segments with neighbouring plain ones joined (plain segments keep no ops)."""
    out: list[Segment] = []
    for seg in segments:
        if out and not seg.checkpoint and not out[-1].checkpoint:  # plain ones keep no ops
            out[-1] = Segment(out[-1].start, seg.stop, False)
        else:
            out.append(seg)
    return tuple(out)
