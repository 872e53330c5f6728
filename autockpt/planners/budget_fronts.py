"""The budget DP's fronts: per position, the (held bytes, recompute) points worth extending.

The exact budget DP (:mod:`autockpt.planners.budget`) reaches each position of the chain
with many plans of its prefix; of those only the Pareto front matters, each point the
least recompute at its held bytes, with a back-pointer to the item that reached it. A
:class:`Front` is that front, its points in held order. :class:`Offers` collects every way
to reach one position (a front's points moved by one item, each with its own room) and
merges them into the next :class:`Front` once all are in.

NOTE [Fronts merged once]
    The DP used to offer each (point, item) pair to a dict, one Python call per pair: some
    400 000 pairs and 0.3-0.6 s on a 56-stage convnet (torchvision's mnasnet), several of
    its training steps. Collected as arrays and merged once per position (a stable sort by
    held bytes then recompute, and a running minimum), the same front takes a few
    vectorised passes. Ties resolve as the pairs were offered (earlier start, then its
    plain item before its checkpoints, then the order of the ways and points), as the dict
    resolved them, so plans and back-pointers are those of the pure-Python merge, which
    serves when numpy is missing (``test_numpys_offers_plan_exactly_as_pure_python``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

NUMPY: Any
try:
    import numpy as NUMPY  # noqa: N812
except ImportError:  # the pure-Python merge is exact too, only slower on large fronts
    NUMPY = None

__all__ = ["NUMPY", "Back", "Front", "Offers", "Way", "start"]

Back = tuple[int, bool, int, Any]
"""A point's back-pointer: (previous position, previous flag, previous held, the item)."""

Way = tuple[int, int, float, Any]
"""One way to take an item: (room for the held bytes before it, bytes it adds to them,
recompute it adds, the item)."""


@dataclass
class Front:
    """A position's Pareto front: held bytes ascending, recompute strictly descending, and
    ``back``, a point's back-pointer by its index (read only on the way back)."""

    held: Any  # int64 numpy array; a list of ints without numpy
    cost: Any  # float64 numpy array; a list of floats without numpy
    back: Callable[[int], Back]

    def __len__(self) -> int:
        return len(self.held)

    def fitting(self, room: int) -> int:
        """How many points hold at most ``room`` bytes."""
        if NUMPY is not None:
            return int(NUMPY.searchsorted(self.held, room, side="right"))
        return bisect.bisect_right(self.held, room)

    def back_of(self, held: int) -> Back:
        """The back-pointer of the point holding ``held`` bytes."""
        i = self.fitting(held) - 1
        assert i >= 0 and int(self.held[i]) == held, held
        return self.back(i)


def start() -> Front:
    """The front before the first stage: nothing held, nothing recomputed."""
    return _front([0], [0.0], [(-1, True, 0, None)])


def _front(held: list[int], cost: list[float], back: list[Back]) -> Front:
    if NUMPY is None:
        return Front(held, cost, back.__getitem__)
    return Front(
        NUMPY.array(held, dtype=NUMPY.int64), NUMPY.array(cost, dtype=NUMPY.float64), back.__getitem__
    )


@dataclass
class _Part:
    """Offered points of one front, each moved by one of ``ways``: arrays (or lists) of the
    new held bytes and recompute, the source point's held bytes, and which way."""

    held: Any
    cost: Any
    source: Any
    way: Any  # None: all by ways[0]
    prev: int
    prev_flag: bool
    ways: list[Any]


class Offers:
    """Every way offered into one position, merged into its :class:`Front` at the end."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []

    def add(self, front: Front, prev: int, prev_flag: bool, ways: Sequence[Way]) -> None:
        """Offer each point of ``front`` (the front at position ``prev``, flag ``prev_flag``)
        by each way whose room it fits, in this order of ways, then points."""
        counts = [front.fitting(room) for room, *_ in ways]
        if not any(counts):
            return
        items = [item for *_, item in ways]
        if NUMPY is None:
            held = [h + extra for c, (_, extra, _, _) in zip(counts, ways) for h in front.held[:c]]
            cost = [x + delta for c, (_, _, delta, _) in zip(counts, ways) for x in front.cost[:c]]
            source = [h for c in counts for h in front.held[:c]]
            way = [w for w, c in enumerate(counts) for _ in range(c)]
            self.parts.append(_Part(held, cost, source, way, prev, prev_flag, items))
            return
        np = NUMPY
        if len(ways) == 1:  # one way: a slice of a front is a front already
            c = counts[0]
            _, extra, delta, _ = ways[0]
            src = front.held[:c]
            self.parts.append(_Part(src + extra, front.cost[:c] + delta, src, None, prev, prev_flag, items))
            return
        held = np.concatenate([front.held[:c] + extra for c, (_, extra, _, _) in zip(counts, ways)])
        cost = np.concatenate([front.cost[:c] + delta for c, (_, _, delta, _) in zip(counts, ways)])
        source = np.concatenate([front.held[:c] for c in counts])
        way = np.repeat(np.arange(len(ways)), counts)
        keep = _front_of(held, cost)  # many ways (op choices): reduce now, memory stays small
        self.parts.append(_Part(held[keep], cost[keep], source[keep], way[keep], prev, prev_flag, items))

    def merge(self) -> Front:
        """The front of every offer: per held bytes the least recompute, ties to the first
        offered; then only points that recompute less than every point holding less."""
        if not self.parts:
            return _front([], [], [])
        if NUMPY is None:
            return self._merge_lists()
        np = NUMPY
        held = np.concatenate([p.held for p in self.parts])
        cost = np.concatenate([p.cost for p in self.parts])
        keep = _front_of(held, cost)
        sizes = [len(p.held) for p in self.parts]
        part_of = np.repeat(np.arange(len(self.parts)), sizes)[keep]
        local = (np.arange(len(held)) - np.repeat(np.cumsum([0, *sizes[:-1]]), sizes))[keep]
        parts = self.parts

        def back(j: int) -> Back:
            p, i = parts[int(part_of[j])], int(local[j])
            return p.prev, p.prev_flag, int(p.source[i]), p.ways[0 if p.way is None else int(p.way[i])]

        return Front(held[keep], cost[keep], back)

    def _merge_lists(self) -> Front:
        points = [
            (h, c, p.prev, p.prev_flag, s, p.ways[w])
            for p in self.parts
            for h, c, s, w in zip(p.held, p.cost, p.source, p.way)
        ]
        points.sort(key=lambda q: (q[0], q[1]))  # stable: ties stay in offer order
        held: list[int] = []
        cost: list[float] = []
        back: list[Back] = []
        for h, c, prev, flag, s, item in points:
            if not cost or c < cost[-1]:  # at equal held the first is the cheapest: sorted
                held.append(h)
                cost.append(c)
                back.append((prev, flag, s, item))
        return Front(held, cost, back.__getitem__)


def _front_of(held: Any, cost: Any) -> Any:
    """Indices, in held order, of the points that recompute less than every point holding
    less; at equal held bytes only the cheapest, the first given among equals."""
    np = NUMPY
    if not len(held):
        return np.zeros(0, dtype=np.int64)
    # the parts are runs already sorted by held: the stable sort (timsort) merges them
    order = np.argsort(held, kind="stable")
    h, c = held[order], cost[order]
    starts = np.flatnonzero(np.concatenate(([True], h[1:] != h[:-1])))
    least = np.minimum.reduceat(c, starts)  # per held value
    sizes = np.diff(np.append(starts, len(h)))
    cheapest = np.flatnonzero(c == np.repeat(least, sizes))
    first = cheapest[np.searchsorted(cheapest, starts)]  # the first cheapest of each held value
    falls = np.ones(len(starts), dtype=bool)
    falls[1:] = least[1:] < np.minimum.accumulate(least)[:-1]
    return order[first[falls]]
