"""The budget DP's hottest step: offering one checkpointed segment's ways to cross it.

For a segment ``[s, t)`` every point of the front at ``s`` (held bytes, recompute) meets
every way to keep ops in it (room, bytes added, recompute added): with op choices that is
millions of pairs on HF GPT-2. Offered one by one they took most of a plan's 20 s; with
numpy they are first reduced in one vectorised pass (NOTE in :func:`offer_segment`), to the
same front and back-pointers (``test_numpys_offers_plan_exactly_as_pure_python``).
"""

from __future__ import annotations

from typing import Any

NUMPY: Any
try:
    import numpy as NUMPY  # noqa: N812
except ImportError:  # the pure-Python offers are exact too, only slower on large fronts
    NUMPY = None

__all__ = ["NUMPY", "VECTOR_FROM", "Point", "Way", "as_arrays", "offer", "offer_segment"]

Point = tuple[float, int, bool, int, Any]
"""A front entry: (recompute, previous position, previous flag, previous held, segment)."""

# one way to end a checkpointed segment: (room for held bytes, bytes added, recompute added, segment)
Way = tuple[int, int, float, Any]
VECTOR_FROM = 512  # (point, way) pairs from which numpy reduces them first


def offer(
    target: dict[int, Point], held: int, cost: float, prev: int, prev_flag: bool, prev_held: int, seg: Any
) -> None:
    """Keep the cheaper way to reach ``held``; ties go to the earlier start (deterministic)."""
    old = target.get(held)
    if old is None or cost < old[0] or (cost == old[0] and (prev, prev_flag) < (old[1], old[2])):
        target[held] = (cost, prev, prev_flag, prev_held, seg)


def as_arrays(costed: list[tuple[int, float]]) -> tuple[Any, Any] | None:
    """A position's (held, recompute) points as numpy arrays, when numpy is there and the
    front is large enough to pay for them."""
    if NUMPY is None or len(costed) * 2 < VECTOR_FROM:
        return None
    held = NUMPY.fromiter((h for h, _ in costed), dtype=NUMPY.int64, count=len(costed))
    cost = NUMPY.fromiter((c for _, c in costed), dtype=NUMPY.float64, count=len(costed))
    return held, cost


def offer_segment(
    target: dict[int, Point],
    costed: list[tuple[int, float]],
    arrays: tuple[Any, Any] | None,
    batch: list[Way],
    s: int,
    kept: bool,
) -> None:
    """Offer every (point, way) pair that fits its room to ``target``, as the budget DP offers one.

    With many pairs, numpy first drops every pair whose recompute is no lower than that of
    a pair holding no more bytes and offered before it (in held order, offer order on equal
    held). The DP's pruning would drop those from ``target`` whatever else it holds, and among the
    pairs left at one held value each is lower than the one before, so the front and its
    back-pointers come out as without numpy.
    """
    if arrays is not None:
        held_a, cost_a = arrays
        counts = [int(NUMPY.searchsorted(held_a, room, side="right")) for room, *_ in batch]
        if sum(counts) >= VECTOR_FROM:
            _reduced(target, costed, held_a, cost_a, batch, counts, s, kept)
            return
    for room, extra, delta, seg in batch:
        for held, cost in costed:  # offer() inlined: the hottest loop, millions of pairs
            if held > room:
                break
            at, total = held + extra, cost + delta
            old = target.get(at)
            if old is None or total < old[0] or (total == old[0] and (s, kept) < (old[1], old[2])):
                target[at] = (total, s, kept, held, seg)


def _reduced(
    target: dict[int, Point],
    costed: list[tuple[int, float]],
    held_a: Any,
    cost_a: Any,
    batch: list[Way],
    counts: list[int],
    s: int,
    kept: bool,
) -> None:
    """``offer_segment``'s numpy path (see there)."""
    np = NUMPY
    way = np.repeat(np.arange(len(batch)), counts)
    starts = np.cumsum([0, *counts[:-1]])
    point = np.arange(len(way)) - np.repeat(starts, counts)
    at = np.concatenate([held_a[:c] + extra for c, (_, extra, _, _) in zip(counts, batch)])
    total = np.concatenate([cost_a[:c] + delta for c, (_, _, delta, _) in zip(counts, batch)])
    # each way's pairs are already sorted by held (a position's front is), so a stable sort
    # merges runs; in that order a pair survives only below the least recompute before it
    order = np.argsort(at, kind="stable")
    least = total[order]
    falls = np.ones(len(order), dtype=bool)
    falls[1:] = least[1:] < np.minimum.accumulate(least)[:-1]
    picked = order[falls]
    segs = [way_[3] for way_ in batch]
    for a, c, w, p in zip(
        at[picked].tolist(), total[picked].tolist(), way[picked].tolist(), point[picked].tolist()
    ):
        offer(target, a, c, s, kept, costed[p][0], segs[w])
