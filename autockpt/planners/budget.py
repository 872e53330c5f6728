"""The ``"budget"`` planner: least recompute time whose predicted peak fits a byte budget.

The figures are the cost model's (:mod:`autockpt.planners.cost_model`): a plan's peak is
the largest of ``H_j + local(item j)`` over its items, ``H_j`` the bytes held by the items
before item ``j``. This makes the problem a shortest path over positions with the held
bytes as a resource, in the spirit of Beaumont et al. 2019, "Optimal checkpointing for
heterogeneous chains" (restricted here to one level of checkpoints; nested plans can still
be given by hand).

Algorithm: dynamic programming over positions keeping, per position, the Pareto front of
(held bytes, recompute time), merged once every way to reach the position is offered
(:mod:`autockpt.planners.budget_fronts`; 30-80 ms on a 56-62 stage convnet). Exact for up
to 64 stages. Beyond that (when numpy is importable) the front is thinned to a grid of
1/128 of the budget: per grid cell, the least-recompute path whose held bytes fall in it,
its bytes kept exact so every budget check is exact; checkpointed segments are at most
4 sqrt(n) stages long, and all those starting at one position (after a plain or a
checkpointed item) are offered in one vectorised update. The optimum may then be missed
where a path with fewer bytes but more recompute was merged away in a cell.
Complexity O(n * L * G) for n stages, segments of at most L stages and G grid points;
1000 stages plan in about 0.7 s on 2 cores (``benchmarks/planner_scaling.py``).

Choosing ops too (``policy="auto"``, :attr:`PlanRequest.choose_ops`, profiles with ops, up
to 64 stages): each checkpointed segment ``[s, t)`` may keep any subset of the keepable ops
of its stages. Under the cost model a subset matters only through three numbers: the bytes
it keeps ``K``, those of them autograd does not save ``K_u``, and the recompute time it
saves ``M`` (:mod:`autockpt.planners.cost_model`). So per ``(s, t)`` only the subsets on the
Pareto front of (``K`` low, ``K_u`` low, ``M`` high) are candidates, built stage by stage as
a 0/1 knapsack, and the DP above takes each candidate as one more transition. Exact while a
front holds at most 64 points; beyond that, points whose ``K`` and ``K_u`` agree within 5%
(geometric buckets, independent of the budget, so more budget still never means more
recompute) are merged, keeping the largest ``M``. Complexity O(n * L * F * (P log F + m log F))
for fronts of F points, position fronts of P points and m keepable ops per stage (the op
fronts' filter bisects a staircase; with numpy, each segment's F * P (point, choice) pairs
are reduced to their front in one vectorised pass before the position's merge). Longer
chains are planned without choosing ops. HF GPT-2 (12 layers, 25 stages, position fronts of
up to 10^4 points): 0.6-0.9 s a plan.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import itertools
import math
from collections.abc import Sequence

from autockpt.errors import PlanInfeasibleError
from autockpt.plan import Segment, format_bytes
from autockpt.planners.budget_fronts import Front, Offers, start
from autockpt.planners.budget_grid import EXACT_UP_TO, longest_segment, merge_plain, solve_on_grid
from autockpt.planners.cost_model import CostModel, KeptOp, keepable_ops, predict
from autockpt.planners.registry import PlanRequest, StageCost, register_planner

__all__ = ["EXACT_UP_TO", "budget_planner", "min_feasible_budget"]

_FRONT_CAP = 64  # op choices per segment before near-equal ones are merged
_FRONT_RATIO = 1.05

# one way a checkpointed segment may keep ops: (K, K_u, M, the ops)
Option = tuple[int, int, float, tuple[KeptOp, ...]]
_NOTHING: Option = (0, 0, 0.0, ())


def _solve(
    costs: Sequence[StageCost],
    budget: int,
    loss_bytes: int | None = None,
    spans: Sequence[int] | None = None,
    choose_ops: bool = False,
    keep_only: Sequence[Sequence[bool]] | None = None,
    floor: int | None = None,
) -> tuple[Segment, ...] | None:
    """Least-recompute single-level plan with predicted peak <= budget, or None; with
    ``choose_ops`` (and at most 64 stages), each checkpointed segment's kept ops too; with
    ``keep_only``, every checkpointed segment keeps those ops. ``floor``: the chain's
    :func:`_min_peak_exact`, when the caller has it."""
    model = CostModel(costs, loss_bytes, spans)
    whole = (Segment(0, len(costs), False),)
    if predict(whole, costs, loss_bytes=loss_bytes).peak_bytes <= budget:
        return whole  # nothing recomputed: no plan does better (NOTE [Planner shortcuts])
    if (_min_peak_exact(model) if floor is None else floor) > budget:
        return None  # below the floor of any plan, on the grid too (NOTE [Planner shortcuts])
    if len(costs) > EXACT_UP_TO and importlib.util.find_spec("numpy") is not None:
        return solve_on_grid(model, budget)
    fixed = None if keep_only is None else [list(m) for m in keep_only]
    return _solve_exact(model, budget, choose_ops, fixed)  # exact; slow on long chains without numpy


# NOTE [Planner shortcuts]
#     The exact DP took 0.1-0.6 s on a 56-stage chain (torchvision's mobilenet_v2 at
#     64x64; 30-50 ms since its fronts are merged once), and two budgets need none of it: one the
#     unwrapped step fits (recomputing nothing is optimal) and one below the floor, which
#     ``_min_peak_exact`` finds in one backward pass (about 2% of the DP's time). Dropping
#     the points of the DP's fronts that cannot end within the budget (what is held plus
#     the floor of the stages after) is exact too, but saved nothing measurable there at
#     budgets between the floor and the unwrapped step, so it is not done.


def _fixed_fronts(model: CostModel, s: int, stop: int, keep_only: list[list[bool]]) -> list[list[Option]]:
    """Per ``t``, the one op choice of segment ``[s, t)`` a named policy makes."""
    fronts, option = [], _NOTHING
    for i in range(s, stop):
        timed = {k.index: k for k in keepable_ops(model.c[i], i)}
        last = {k.index: k for k in keepable_ops(model.c[i], i, last=True)}
        ending = option
        for j, o in enumerate(model.c[i].ops):
            if not (keep_only[i][j] and o.keepable):
                continue
            op = timed.get(j, KeptOp(i, j, o.op, o.out_bytes, 0 if o.saved else o.out_bytes, 0.0))
            option = _with(option, op)
            ending = _with(ending, last.get(j, dataclasses.replace(op, ms=0.0)))
        fronts.append([ending])
    return fronts


def _op_fronts(model: CostModel, s: int, stop: int) -> list[list[Option]]:
    """Per ``t`` in ``s+1 .. stop``, the candidate op choices of segment ``[s, t)``, the
    cheapest first (see the module docstring)."""
    fronts, front = [], [_NOTHING]
    for i in range(s, stop):
        ending = front  # the stage ends the segment: its output ops are no candidates
        for op in keepable_ops(model.c[i], i, last=True):
            ending = _pareto(ending + [_with(p, op) for p in ending])
        # keeping nothing pays no dispatch (NOTE [Selective dispatch cost]), so it stays a
        # candidate even where ops that hold no bytes dominate it
        fronts.append(ending if any(not p[3] for p in ending) else [_NOTHING, *ending])
        for op in keepable_ops(model.c[i], i):
            front = _pareto(front + [_with(p, op) for p in front])
    return fronts


def _with(option: Option, op: KeptOp) -> Option:
    k, u, m, ops = option
    return k + op.bytes, u + op.unsaved_bytes, m + op.ms, (*ops, op)


def _pareto(points: list[Option]) -> list[Option]:
    """The points no other holds as little (K and K_u) and saves as much (M) as; merged by
    near-equal bytes when more than ``_FRONT_CAP`` remain."""
    points.sort(key=lambda p: (p[0], p[1], -p[2]))
    kept: list[Option] = []
    # the kept points' 2-D front of (K_u low, M high) as a staircase: K_u ascending, M
    # strictly ascending, so the most M at K_u <= u sits just left of bisect_right(u); a
    # point is dominated when that M is at least its own (its K is no lower, by the order)
    stair_u: list[int] = []
    stair_m: list[float] = []
    for p in points:
        _, u, m, _ = p
        i = bisect.bisect_right(stair_u, u)
        if i and stair_m[i - 1] >= m:
            continue
        kept.append(p)
        j = bisect.bisect_left(stair_u, u)
        end = j
        while end < len(stair_u) and stair_m[end] <= m:  # now below the new step
            end += 1
        stair_u[j:end] = [u]
        stair_m[j:end] = [m]
    if len(kept) <= _FRONT_CAP:
        return kept
    buckets: dict[tuple[int, int], Option] = {}
    for p in kept:
        key = (_bucket(p[0]), _bucket(p[1]))
        if key not in buckets or p[2] > buckets[key][2]:
            buckets[key] = p
    return sorted(buckets.values(), key=lambda p: (p[0], p[1], -p[2]))


def _bucket(n: int) -> int:
    return 0 if n <= 0 else 1 + int(math.log(n) / math.log(_FRONT_RATIO))


def _solve_exact(
    model: CostModel, budget: int, choose_ops: bool = False, keep_only: list[list[bool]] | None = None
) -> tuple[Segment, ...] | None:
    """Pareto fronts of exact held bytes (small chains), each merged once all the ways to
    reach its position are offered (NOTE [Fronts merged once] in ``budget_fronts.py``).

    Items are plain tuples, ``(start, stop, checkpointed, option)``, until the way back.
    """
    costs = model.c
    n = len(costs)
    offers = {(i, k): Offers() for i in range(1, n + 1) for k in (False, True)}
    fronts: dict[tuple[int, bool], Front] = {(0, True): start(), (0, False): Offers().merge()}
    for s in range(n):
        if s:
            fronts.update({(s, k): offers.pop((s, k)).merge() for k in (False, True)})
        # selective checkpointing's dispatch over [s, s + j), paid by segments keeping ops
        dispatch = list(itertools.accumulate((c.sac_ms for c in costs[s:]), initial=0.0))
        for kept in (False, True):
            front = fronts[(s, kept)]
            if not len(front):
                continue
            lowest = int(front.held[0])
            plain = (
                budget - model.plain_local(s, kept),
                model.held(s, kept),
                0.0,
                (s, s + 1, False, _NOTHING),
            )
            offers[(s + 1, costs[s].keeps_output)].add(front, s, kept, [plain])
            new_held = model.checkpoint_held(s, kept)
            longest = min(longest_segment(model, s), n)
            options = (
                _op_fronts(model, s, longest)
                if choose_ops
                else _fixed_fronts(model, s, longest, keep_only)
                if keep_only is not None
                else None
            )
            for t, (fwd, bwd, ms) in enumerate(model.checkpoint_split(s, kept), start=s + 1):
                if lowest + max(fwd, bwd) > budget or t > longest:
                    break
                ways = [
                    # a segment keeping ops pays selective checkpointing's dispatch
                    (budget - max(fwd + k, bwd + ku), new_held + k, ms - saved + dispatch[t - s] * bool(ops),
                     (s, t, True, option))
                    for option in (options[t - s - 1] if options is not None else (_NOTHING,))
                    for k, ku, saved, ops in (option,)
                ]  # fmt: skip
                offers[(t, False)].add(front, s, kept, ways)
    fronts.update({(n, k): offers.pop((n, k)).merge() for k in (False, True)})
    ends = [
        (float(c), int(h), flag)
        for flag in (False, True)
        for h, c in zip(fronts[(n, flag)].held, fronts[(n, flag)].cost)
        if h + model.loss(flag) <= budget
    ]
    if not ends:
        return None
    _, held, flag = min(ends)
    segments: list[Segment] = []
    pos = n
    while pos > 0:
        prev, prev_flag, prev_held, (begin, stop, checkpointed, option) = fronts[(pos, flag)].back_of(held)
        segments.append(_segment(model, begin, stop, checkpointed, option))
        pos, flag, held = prev, prev_flag, prev_held
    return merge_plain(segments[::-1])


def _segment(model: CostModel, start: int, stop: int, checkpointed: bool, option: Option) -> Segment:
    """The segment, its kept ops named by their place among the segment's ops."""
    k, _, saved, ops = option
    if not ops:
        return Segment(start, stop, checkpointed)
    offsets = [0]
    for i in range(start, stop):
        offsets.append(offsets[-1] + len(model.c[i].ops))
    keep = tuple(
        f"{offsets[op.stage - start] + op.index}:{op.op}"
        for op in sorted(ops, key=lambda o: (o.stage, o.index))
    )
    return Segment(start, stop, checkpointed, keep=keep, kept_bytes=k, kept_ms=saved)


def min_feasible_budget(
    costs: Sequence[StageCost],
    *,
    loss_bytes: int | None = None,
    spans: Sequence[int] | None = None,
    keep_only: Sequence[Sequence[bool]] | None = None,
    floor: int | None = None,
) -> int:
    """The smallest budget any single-level plan fits (the planner's floor); with
    ``keep_only`` (a named policy), any plan whose checkpointed segments keep those ops.

    Up to 64 stages it is exact and found directly (:func:`_min_peak_exact`). Beyond that,
    or under a policy, it is the planner's: that exact floor when the planner reaches it
    (kept ops only add bytes, and the grid only drops paths, so it is a lower bound for
    both), else by bisection above it, to within 0.1% and rounded up. ``floor``: that exact
    floor, when the caller has it.
    """
    if floor is None:
        floor = _min_peak_exact(CostModel(costs, loss_bytes, spans))
    if keep_only is None and (len(costs) <= EXACT_UP_TO or importlib.util.find_spec("numpy") is None):
        return floor
    if _solve(costs, floor, loss_bytes, spans, keep_only=keep_only, floor=floor) is not None:
        return floor
    lo, hi = floor, predict((Segment(0, len(costs), False),), costs, loss_bytes=loss_bytes).peak_bytes
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        if _solve(costs, mid, loss_bytes, spans, keep_only=keep_only, floor=floor) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _min_peak_exact(model: CostModel) -> int:
    """The lowest predicted peak of any single-level plan, in one backward pass.

    Every item's events add what it holds to what the items before it hold, so a plan of
    the stages from position ``s`` on, started with ``h`` bytes held, peaks exactly ``h``
    higher than started with none. So ``floor[s, kept]`` (``kept``: the item before holds
    stage ``s``'s input), the lowest such peak from nothing held, is, from the end back,
    the least over the first item (stage ``s`` plain, or a checkpoint ``[s, t)``) of the
    larger of that item's own peak and what it holds plus the floor where it ends. O(n L)
    for segments of at most L stages. (It replaced a forward pass over Pareto fronts of
    (held, peak so far), which replaced a bisection running the planner twelve times.)
    """
    costs = model.c
    n = len(costs)
    floor = {(n, kept): model.loss(kept) for kept in (False, True)}
    for s in range(n - 1, -1, -1):
        longest = longest_segment(model, s)
        for kept in (False, True):
            after = floor[(s + 1, costs[s].keeps_output)]
            best = max(model.plain_local(s, kept), model.held(s, kept) + after)
            held = model.checkpoint_held(s, kept)
            for t, (local, _) in enumerate(model.checkpoint_locals(s, kept), start=s + 1):
                if t > longest:
                    break
                best = min(best, max(local, held + floor[(t, False)]))
            floor[(s, kept)] = best
    return floor[(0, True)]  # the chain's input is static: held before the first item


def budget_planner(request: PlanRequest) -> tuple[Segment, ...]:
    """Least predicted recompute time with predicted peak <= ``request.budget_bytes``.

    Raises:
        ValueError: the request has no costs or no budget.
        PlanInfeasibleError: no plan fits; the message names the smallest budget that does
            and the stage whose backward sets that floor.
    """
    if request.costs is None or request.budget_bytes is None:
        raise ValueError(
            "budget planner: needs measured stage costs and a budget. Call "
            "auto_checkpoint(model, budget='2GiB', example_inputs=(x,))."
        )
    budget = request.budget_bytes - request.static_bytes
    spans = request.checkpoint_spans
    exact_floor = _min_peak_exact(CostModel(request.costs, request.loss_bytes, spans))  # once: both need it
    plan = (
        _solve(
            request.costs, budget, request.loss_bytes, spans, request.choose_ops, request.keep_only,
            floor=exact_floor,
        )
        if budget > 0
        else None
    )  # fmt: skip
    if plan is None:
        floor = min_feasible_budget(
            request.costs, loss_bytes=request.loss_bytes, spans=spans, keep_only=request.keep_only,
            floor=exact_floor,
        )  # fmt: skip
        floor += request.static_bytes
        model = CostModel(request.costs, request.loss_bytes)
        whole = (Segment(0, request.n_stages, False),)
        unwrapped = (
            request.static_bytes + predict(whole, request.costs, loss_bytes=request.loss_bytes).peak_bytes
        )
        worst = max(range(request.n_stages), key=lambda i: request.costs[i].bwd_peak_bytes)  # type: ignore[index]
        raise PlanInfeasibleError(
            f"budget planner: no plan fits budget={format_bytes(request.budget_bytes)}; the smallest "
            f"achievable peak for this model and input is {format_bytes(floor)} (parameters and "
            f"inputs {format_bytes(request.static_bytes)} included; no plan goes below the backward "
            f"working set of stage {request.stage_names[worst]!r}, "
            f"{format_bytes(model.plain_local(worst, False))}; without checkpointing the step peaks "
            f"at {format_bytes(unwrapped)}). Raise the budget or reduce the batch size.",
            min_budget_bytes=floor,
            unwrapped_bytes=unwrapped,
        )
    return plan


register_planner("budget", budget_planner)
