"""The count-based planners: ``"none"``, ``"sqrt"`` and a fixed number of segments.

``"sqrt"`` follows Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost":
with ``k`` segments of ``n / k`` stages each, the peak holds about ``k`` segment inputs
plus one segment's activations, ``k + n / k``, which is smallest for ``k = sqrt(n)``.
Without measured bytes we use ``k = ceil(sqrt(n))`` and split by stage count (sizes
differ by at most one, the larger segments first); with the dry run's bytes the rule is
applied to bytes (:func:`sqrt_planner`). ``"none"`` and a fixed count run in O(n).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from autockpt.plan import Segment
from autockpt.planners.cost_model import dry_run_costs, predict
from autockpt.planners.registry import PlanRequest, StageCost, register_planner, segments_from_sizes

__all__ = [
    "balanced_sizes",
    "estimated_peak",
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
    one segment's activations ``A / k`` is smallest near ``k = sqrt(A / b)`` (which is
    ``sqrt(n)`` when every stage saves about its input), and the segments are balanced by
    saved bytes. Then each boundary may move by up to half a segment to the stage whose
    input is smallest, so an expansion MLP keeps its narrow tensors rather than its 4x-wide
    ones (nearest wins ties, then the earlier).

    Stages cannot be split, so the continuous optimum can miss: the counts ``1..2 sqrt(A/b)``
    are all tried and the split with the least :func:`estimated_peak` wins (ties go to the
    count nearest ``ceil(sqrt(A / b))``), scored by the cost model on the dry run's bytes
    (NOTE [One cost model] in ``planners/cost_model.py``). O(n^1.5) with bytes, O(n)
    without.
    """
    n = request.n_stages
    sizes = balanced_sizes(n, sqrt_segment_count(n))
    if request.input_bytes is None:
        return segments_from_sizes(sizes, n, where="sqrt")
    inputs, saved = request.input_bytes, request.saved_bytes
    if saved is None or n == 1 or sum(saved) <= 0 or sum(inputs[1:]) <= 0:
        bounds = [0, *snap_boundaries(sizes, inputs), n]
        return segments_from_sizes([b - a for a, b in itertools.pairwise(bounds)], n, where="sqrt")
    best = math.ceil(math.sqrt(sum(saved) * (n - 1) / sum(inputs[1:])))
    costs = dry_run_costs(inputs, saved)
    candidates = []
    for k in range(1, min(n, 2 * best) + 1):
        bounds = [0, *snap_boundaries(_byte_sizes(saved, k), inputs, saved), n]
        candidates.append((estimated_peak(bounds, costs), abs(k - best), k, bounds))
    bounds = min(candidates)[3]
    return segments_from_sizes([b - a for a, b in itertools.pairwise(bounds)], n, where="sqrt")


def estimated_peak(bounds: Sequence[int], costs: Sequence[StageCost]) -> int:
    """Peak of the single-level plan starting segments at ``bounds`` (all but the last
    checkpointed) under the cost model, with ``costs`` from :func:`dry_run_costs`."""
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    return predict(segments_from_sizes(sizes, bounds[-1], where="sqrt"), costs, loss_bytes=0).peak_bytes


def _byte_sizes(saved: Sequence[int], k: int) -> list[int]:
    """Sizes of ``k`` segments that hold about equal saved bytes (each at least one stage)."""
    n, total = len(saved), sum(saved)
    cum = list(itertools.accumulate(saved))  # cum[i] = bytes saved by stages 0..i
    starts: list[int] = []
    for j in range(1, k):
        p = bisect.bisect_left(cum, total * j / k) + 1
        p = max(p, starts[-1] + 1 if starts else 1)
        starts.append(min(p, n - (k - j)))
    bounds = [0, *starts, n]
    return [b - a for a, b in itertools.pairwise(bounds)]


def snap_boundaries(
    sizes: list[int], input_bytes: tuple[int, ...], saved_bytes: tuple[int, ...] | None = None
) -> list[int]:
    """Start stages of segments 2..k, each moved within half a segment to the narrowest input.

    Among equally narrow inputs the stage that saves the most starts the segment: inside a
    recomputed segment a stage's backward runs on top of everything the stages before it
    saved again, so the heaviest stage (an attention block's scores) should come first.
    O(n): every stage is a candidate for at most two boundaries.
    """
    heavy = saved_bytes or (0,) * len(input_bytes)
    n, k = sum(sizes), len(sizes)
    reach = max(min(sizes) // 2, saved_bytes is not None)
    ideal = list(itertools.accumulate(sizes))[:-1]
    out: list[int] = []
    prev = 0
    for i, p in enumerate(ideal):
        lo = max(prev + 1, p - reach)
        hi = min(p + reach, n - (k - 1 - i))
        best = min(range(lo, hi + 1), key=lambda j: (input_bytes[j], -heavy[j], abs(j - p), j))
        out.append(best)
        prev = best
    return out


register_planner("none", none_planner)
register_planner("sqrt", sqrt_planner)
