"""The count-based planners: ``"none"``, ``"sqrt"`` and a fixed number of segments.

``"sqrt"`` follows Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost":
with ``k`` segments of ``n / k`` stages each, the peak holds about ``k`` segment inputs
plus one segment's activations, ``k + n / k``, which is smallest for ``k = sqrt(n)``.
We use ``k = ceil(sqrt(n))`` and split by stage count (sizes differ by at most one, the
larger segments first). Each planner runs in O(n).
"""

from __future__ import annotations

import itertools
import math

from autockpt.plan import Segment
from autockpt.planners.registry import PlanRequest, register_planner, segments_from_sizes

__all__ = [
    "balanced_sizes",
    "none_planner",
    "snap_boundaries",
    "sqrt_planner",
    "sqrt_segment_count",
    "uniform_plan",
]


def balanced_sizes(n: int, k: int) -> list[int]:
    """``k`` sizes summing to ``n`` that differ by at most one, larger ones first."""
    if not 1 <= k <= n:
        raise ValueError(f"balanced_sizes: need 1 <= k <= n, got n={n}, k={k}.")
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def sqrt_segment_count(n: int) -> int:
    """``ceil(sqrt(n))`` segments, at least one."""
    return max(1, math.isqrt(n - 1) + 1) if n > 0 else 1


def uniform_plan(n: int, k: int) -> tuple[Segment, ...]:
    """``k`` balanced segments over ``n`` stages, all but the last checkpointed."""
    return segments_from_sizes(balanced_sizes(n, k), n, where="uniform_plan")


def none_planner(request: PlanRequest) -> tuple[Segment, ...]:
    """One plain segment: nothing is checkpointed."""
    return (Segment(0, request.n_stages, checkpoint=False),)


def sqrt_planner(request: PlanRequest) -> tuple[Segment, ...]:
    """Chen et al.'s sqrt rule: about ``sqrt(n)`` segments of equal cost.

    Without measurements: ``ceil(sqrt(n))`` segments balanced by stage count. After a dry
    run has measured each stage's saved bytes ``a_i`` and input bytes, the rule is applied to
    bytes, as in the paper's derivation: ``k`` kept segment inputs of mean size ``b`` plus
    one segment's activations ``A / k`` is smallest for ``k = sqrt(A / b)`` (which is
    ``sqrt(n)`` when every stage saves about its input), and the segments are balanced by
    saved bytes. Then each boundary may move by up to half a segment to the stage whose
    input is smallest, so an expansion MLP keeps its narrow tensors rather than its 4x-wide
    ones (nearest wins ties, then the earlier).
    """
    n = request.n_stages
    sizes = balanced_sizes(n, sqrt_segment_count(n))
    if request.input_bytes is None:
        return segments_from_sizes(sizes, n, where="sqrt")
    if request.saved_bytes is not None and n > 1:
        sizes = _byte_sizes(request.saved_bytes, request.input_bytes) or sizes
    starts = snap_boundaries(sizes, request.input_bytes)
    bounds = [0, *starts, n]
    return segments_from_sizes([b - a for a, b in itertools.pairwise(bounds)], n, where="sqrt")


def _byte_sizes(saved: tuple[int, ...], inputs: tuple[int, ...]) -> list[int] | None:
    """Segment sizes for ``k = ceil(sqrt(A / b))`` segments of equal saved bytes."""
    n, total = len(saved), sum(saved)
    boundary = sum(inputs[1:]) / (n - 1)
    if total <= 0 or boundary <= 0:
        return None
    k = min(n, max(1, math.ceil(math.sqrt(total / boundary))))
    cum = list(itertools.accumulate(saved))  # cum[i] = bytes saved by stages 0..i
    starts: list[int] = []
    for j in range(1, k):
        target = total * j / k
        p = next((i + 1 for i, c in enumerate(cum) if c >= target), n - 1)
        p = max(p, starts[-1] + 1 if starts else 1)
        starts.append(min(p, n - (k - j)))
    bounds = [0, *starts, n]
    return [b - a for a, b in itertools.pairwise(bounds)]


def snap_boundaries(sizes: list[int], input_bytes: tuple[int, ...]) -> list[int]:
    """Start stages of segments 2..k, each moved within half a segment to the narrowest input.

    O(n): every stage is a candidate for at most two boundaries.
    """
    n, k = sum(sizes), len(sizes)
    reach = min(sizes) // 2
    ideal = list(itertools.accumulate(sizes))[:-1]
    out: list[int] = []
    prev = 0
    for i, p in enumerate(ideal):
        lo = max(prev + 1, p - reach)
        hi = min(p + reach, n - (k - 1 - i))
        best = min(range(lo, hi + 1), key=lambda j: (input_bytes[j], abs(j - p), j))
        out.append(best)
        prev = best
    return out


register_planner("none", none_planner)
register_planner("sqrt", sqrt_planner)
