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

    def relax(src: tuple[Any, Any, Any], fits: Any, add: int, dst_flag: int,
              ts: Any, extra: Any, s: int, src_flag: int, ck: int) -> None:  # fmt: skip
        """Extend the source paths by an item holding ``add``, once per row: row ``r`` ends
        at position ``ts[r]``, takes the sources holding at most ``fits[r]`` bytes and adds
        ``extra[r]`` ms. Rows end at different positions, so they never share a cell."""
        cells, src_held, src_cost = src
        k = np.searchsorted(src_held, fits, side="right")  # held grows with the cell
        width = int(k.max(initial=0))
        if width == 0:
            return
        cells, new_held = cells[:width], src_held[:width] + add
        new_cost = src_cost[None, :width] + extra[:, None]
        target = new_held // quantum  # the same in every row, as ``add`` is
        valid = np.arange(width)[None, :] < k[:, None]  # per row, a prefix of the sources
        # Cells are a grid step wide, so at most two neighbouring sources share a target
        # cell: keep the cheaper (on a tie, the first, which holds fewer bytes).
        pair = (target[1:] == target[:-1])[None, :] & valid[:, 1:]
        first_wins = new_cost[:, :-1] <= new_cost[:, 1:]
        keep = valid.copy()
        keep[:, 1:] &= ~(pair & first_wins)
        keep[:, :-1] &= ~(pair & ~first_wins)
        rows = ts[:, None]
        dst_cost, dst_held = cost[dst_flag][rows, target], held[dst_flag][rows, target]
        better = keep & ((new_cost < dst_cost) | ((new_cost == dst_cost) & (new_held[None, :] < dst_held)))
        r, j = np.nonzero(better)
        if r.size == 0:
            return
        t, cell = ts[r], target[j]
        cost[dst_flag, t, cell] = new_cost[r, j]
        held[dst_flag, t, cell] = new_held[j]
        prev_pos[dst_flag, t, cell] = s
        prev_flag[dst_flag, t, cell] = src_flag
        prev_bucket[dst_flag, t, cell] = cells[j]
        prev_ck[dst_flag, t, cell] = ck

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
                one = np.array([budget - max(local, add)])
                relax(src, one, add, int(costs[s].keeps_output), np.array([s + 1]), np.zeros(1), s, flag, 0)
            add = model.checkpoint_held(s, bool(flag))
            longest = longest_segment(model, s)
            fits: list[int] = []
            extra: list[float] = []
            for t, (local, ms) in enumerate(model.checkpoint_locals(s, bool(flag)), start=s + 1):
                if lowest + local > budget or t > longest:
                    break
                fits.append(budget - max(local, add))
                extra.append(ms)
            if fits:  # every checkpointed segment [s, t) at once
                ts = np.arange(s + 1, s + 1 + len(fits))
                relax(src, np.array(fits), add, 0, ts, np.array(extra), s, flag, 1)
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
