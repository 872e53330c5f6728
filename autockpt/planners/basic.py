"""The count-based planners: ``"none"``, ``"sqrt"`` and a fixed number of segments.

``"sqrt"`` follows Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost":
with ``k`` segments of ``n / k`` stages each, the peak holds about ``k`` segment inputs
plus one segment's activations, ``k + n / k``, which is smallest for ``k = sqrt(n)``.
We use ``k = ceil(sqrt(n))`` and split by stage count (sizes differ by at most one, the
larger segments first). Each planner runs in O(n).
"""

from __future__ import annotations

import math

from autockpt.plan import Segment
from autockpt.planners.registry import PlanRequest, register_planner, segments_from_sizes

__all__ = ["balanced_sizes", "none_planner", "sqrt_planner", "sqrt_segment_count", "uniform_plan"]


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
    """``ceil(sqrt(n))`` segments balanced by stage count."""
    n = request.n_stages
    return uniform_plan(n, sqrt_segment_count(n))


register_planner("none", none_planner)
register_planner("sqrt", sqrt_planner)
