"""The ``"budget"`` planner: least recompute time whose predicted peak fits a byte budget.

Cost model (per stage, measured by :func:`autockpt.profile`; see :class:`StageCost`). A
single-level plan is a sequence of items, each a plain stage or a checkpointed segment
whose recompute runs its stages plain. Every memory event of an item happens on top of
``H``, the bytes held by the items before it (a plain stage holds what it saved, a
checkpointed segment holds its input; a boundary tensor kept by both sides counts once),
so

    peak(plan) = max over items j of  H_j + local(item j)

where ``local`` depends only on the item's span (its forward, and in backward its recompute
plus the gradients of everything after it). Between forward and backward the loss runs
on top of everything held: the output and the loss's working bytes (its intermediates and
the output's gradient), which :func:`autockpt.profile` measures for the loss it is given
(``loss_bytes``); without a measurement, two tensors the size of the output are assumed.
The output itself stays alive through the backward, as a training loop's ``out`` variable
keeps it (``out = model(x); loss_fn(out).backward()``); a step written as one expression
frees it earlier and peaks up to one output lower than predicted.
The chain's input is one of the static bytes (with parameters and buffers) that every
budget includes, so the first item never counts it again.
This makes the problem a shortest path over positions with the held bytes as a resource,
in the spirit of Beaumont et al. 2019, "Optimal checkpointing for heterogeneous chains"
(restricted here to one level of checkpoints; nested plans can still be given by hand).

Algorithm: dynamic programming over positions keeping, per position, the Pareto front of
(held bytes, recompute time). Exact for up to 64 stages. Beyond that (when numpy is
importable) the held bytes live on a grid of 1/128 of the budget, rounded *up* so
predictions stay safe, checkpointed segments are at most 4 sqrt(n) stages long, and each
transition is one vectorised update; the optimum may then be missed by the rounding.
Complexity O(n * L * G) for n stages, segments of at most L stages and G grid points;
1000 stages plan in about a second on 2 cores (``benchmarks/planner_scaling.py``).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from autockpt.errors import PlanInfeasibleError
from autockpt.plan import Segment
from autockpt.planners.registry import PlanRequest, StageCost, register_planner
from autockpt.units import format_bytes

__all__ = [
    "Prediction",
    "StageCost",
    "assumed_loss_bytes",
    "budget_planner",
    "min_feasible_budget",
    "predict",
]

_EXACT_UP_TO = 64
_RESOLUTION = 128


def _max_segment(n: int) -> int:
    """Longest checkpointed segment considered: all of them when exact, else 4 sqrt(n)."""
    return n if n <= _EXACT_UP_TO else max(16, 4 * math.isqrt(n))


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of a plan under the cost model.

    ``peak_at`` says where the peak falls: ``(start, stop, phase)`` with phase
    ``"forward"`` or ``"backward"`` of plain stage ``start``, ``"recompute"`` for the
    recompute and backward of checkpointed segment ``[start, stop)``, or ``"loss"``
    (between forward and backward, ``start == stop ==`` the number of stages).
    """

    peak_bytes: int
    recompute_ms: float
    peak_at: tuple[int, int, str] = (0, 0, "loss")


def assumed_loss_bytes(costs: Sequence[StageCost]) -> int:
    """The loss's working bytes when none were measured: one intermediate the size of the
    output and the output's gradient (a weighted sum, an MSE against a target)."""
    return 2 * costs[-1].out_bytes if costs else 0


class _Model:
    """The cost model. ``kept`` says whether the item before holds the current input
    (a plain stage that keeps its output), so a boundary tensor is counted once."""

    def __init__(
        self, costs: Sequence[StageCost], loss_bytes: int | None = None, spans: Sequence[int] | None = None
    ) -> None:
        self.c = list(costs)
        n = len(costs)
        self.spans = list(spans) if spans is not None else None
        self.grads_after = [sum(c.grad_bytes for c in costs[i + 1 :]) for i in range(n)]
        self.loss_bytes = assumed_loss_bytes(costs) if loss_bytes is None else loss_bytes
        # the output stays alive through the whole backward: a training loop's ``out``
        # variable (``out = model(x); loss_fn(out).backward()``) still refers to it
        self.out = costs[-1].out_bytes if costs else 0

    def longest(self, s: int) -> int:
        """One past the last stage a checkpointed segment starting at ``s`` may end at."""
        span = (
            _max_segment(len(self.c)) if self.spans is None else min(self.spans[s], _max_segment(len(self.c)))
        )
        return s + span

    def loss(self, kept: bool) -> int:
        """What the loss adds to everything held: the output, unless the last plain stage
        holds it already, and the loss's working bytes."""
        return self.out * (not kept) + self.loss_bytes

    def held(self, i: int, kept: bool) -> int:
        """What plain stage ``i`` holds until its backward."""
        c = self.c[i]
        return c.kept_bytes + c.out_bytes * c.keeps_output + c.in_bytes * (c.keeps_input and not kept)

    def plain_local(self, i: int, kept: bool) -> int:
        c = self.c[i]
        fwd = c.in_bytes * (not kept) + c.fwd_peak_bytes
        out = self.out * (not (i == len(self.c) - 1 and c.keeps_output))  # unless held already
        bwd = self.held(i, kept) + c.out_bytes + c.bwd_peak_bytes + self.grads_after[i] + out
        return max(fwd, bwd)

    def checkpoint_locals(self, s: int, kept: bool) -> Iterator[tuple[int, float]]:
        """``(local, recompute ms)`` of segments ``[s, t)`` for t = s+1, s+2, ...

        Events of stage i inside the segment: its first forward (nothing saved), then its
        recompute forward and backward on top of what stages s..i-1 saved again.
        """
        local, ms, before = 0, 0.0, 0
        base = self.c[s].in_bytes * (not kept)
        inner_kept = True  # the segment's input is held by the checkpoint
        for i in range(s, len(self.c)):
            c = self.c[i]
            current = c.in_bytes if i > s else 0
            first = base + current + c.fwd_peak_bytes
            refwd = base + before + c.in_bytes * (not inner_kept) + c.fwd_peak_bytes + self.out
            held = self.held(i, inner_kept)
            rebwd = base + before + held + c.out_bytes + c.bwd_peak_bytes + self.grads_after[i] + self.out
            local, ms = max(local, first, refwd, rebwd), ms + c.fwd_ms
            before += held
            inner_kept = c.keeps_output
            yield local, ms

    def checkpoint_held(self, s: int, kept: bool) -> int:
        return self.c[s].in_bytes * (not kept)


def predict(
    segments: Sequence[Segment], costs: Sequence[StageCost], *, loss_bytes: int | None = None
) -> Prediction:
    """Peak bytes and recompute time of a single-level plan under the cost model.

    ``loss_bytes`` is the loss's working bytes (:attr:`autockpt.Profile.loss_bytes`);
    ``None`` assumes two tensors the size of the output. Nested segments are predicted as
    if their checkpointed segment recomputed plainly (an upper bound on their peak).
    """
    model = _Model(costs, loss_bytes)
    held, peak, recompute, kept = 0, 0, 0.0, True  # the chain's input is a static byte
    at: tuple[int, int, str] = (0, 0, "loss")
    for seg in segments:
        if seg.checkpoint:
            local, ms = next(
                v for t, v in enumerate(model.checkpoint_locals(seg.start, kept), start=seg.start + 1)
                if t == seg.stop
            )  # fmt: skip
            if held + local > peak:
                peak, at = held + local, (seg.start, seg.stop, "recompute")
            held += model.checkpoint_held(seg.start, kept)
            recompute += ms
            kept = False
        else:
            for i in range(seg.start, seg.stop):
                local = model.plain_local(i, kept)
                if held + local > peak:
                    fwd = costs[i].in_bytes * (not kept) + costs[i].fwd_peak_bytes
                    peak, at = held + local, (i, i + 1, "forward" if fwd == local else "backward")
                held += model.held(i, kept)
                kept = costs[i].keeps_output
    if held + model.loss(kept) > peak:
        peak, at = held + model.loss(kept), (len(costs), len(costs), "loss")
    return Prediction(peak, recompute, at)


def _solve(
    costs: Sequence[StageCost],
    budget: int,
    loss_bytes: int | None = None,
    spans: Sequence[int] | None = None,
) -> tuple[Segment, ...] | None:
    """Least-recompute single-level plan with predicted peak <= budget, or None."""
    model = _Model(costs, loss_bytes, spans)
    if len(costs) > _EXACT_UP_TO and importlib.util.find_spec("numpy") is not None:
        return _solve_dense(model, budget)
    return _solve_exact(model, budget)  # exact; slow on long chains without numpy


def _solve_dense(model: _Model, budget: int) -> tuple[Segment, ...] | None:
    """The same DP on a grid of held bytes (rounded up), vectorised with numpy."""
    import numpy as np

    costs = model.c
    n = len(costs)
    quantum = max(1, math.ceil(budget / _RESOLUTION))
    nb = budget // quantum + 1
    cost = np.full((2, n + 1, nb), np.inf)
    prev_pos = np.full((2, n + 1, nb), -1, dtype=np.int64)
    prev_flag = np.zeros((2, n + 1, nb), dtype=np.int8)
    prev_bucket = np.zeros((2, n + 1, nb), dtype=np.int64)
    prev_ck = np.zeros((2, n + 1, nb), dtype=np.int8)
    buckets = np.arange(nb)
    cost[1, 0, 0] = 0.0  # the chain's input is held already: it is a static byte

    def relax(
        src_flag: int, s: int, limit: int, shift: int, dst_flag: int, t: int, extra: float, ck: int
    ) -> None:
        stop = min(limit + 1, nb - shift)
        if stop <= 0:
            return
        src = cost[src_flag, s, :stop] + extra
        window = slice(shift, shift + stop)
        dst = cost[dst_flag, t, window]
        better = src < dst
        if better.any():
            dst[better] = src[better]
            prev_pos[dst_flag, t, window][better] = s
            prev_flag[dst_flag, t, window][better] = src_flag
            prev_bucket[dst_flag, t, window][better] = buckets[:stop][better]
            prev_ck[dst_flag, t, window][better] = ck

    for s in range(n):
        for flag in (0, 1):
            row = cost[flag, s]
            finite = np.nonzero(np.isfinite(row))[0]
            if finite.size == 0:
                continue
            lowest = int(finite[0]) * quantum
            local = model.plain_local(s, bool(flag))
            if lowest + local <= budget:
                shift = -(-model.held(s, bool(flag)) // quantum)
                relax(flag, s, (budget - local) // quantum, shift, int(costs[s].keeps_output), s + 1, 0.0, 0)
            shift = -(-model.checkpoint_held(s, bool(flag)) // quantum)
            longest = model.longest(s)
            for t, (local, ms) in enumerate(model.checkpoint_locals(s, bool(flag)), start=s + 1):
                if lowest + local > budget or t > longest:
                    break
                relax(flag, s, (budget - local) // quantum, shift, 0, t, ms, 1)
    ends = [
        (cost[f, n, b], b, f)
        for f in (0, 1)
        for b in np.nonzero(np.isfinite(cost[f, n]))[0]
        if b * quantum + model.loss(bool(f)) <= budget
    ]
    if not ends:
        return None
    _, end_bucket, end_flag = min(ends)
    segments: list[Segment] = []
    pos, f, b = n, int(end_flag), int(end_bucket)
    while pos > 0:
        s = int(prev_pos[f, pos, b])
        segments.append(Segment(s, pos, bool(prev_ck[f, pos, b])))
        pos, f, b = s, int(prev_flag[f, pos, b]), int(prev_bucket[f, pos, b])
    return _merge_plain(segments[::-1])


def _solve_exact(model: _Model, budget: int) -> tuple[Segment, ...] | None:
    """Pareto fronts of exact held bytes (small chains).

    The inner loops run ``len(costs)`` squared times the front sizes, so they are written for
    speed: plain tuples, ``(start, stop, checkpointed)``, become segments only on the way back.
    """
    costs = model.c
    n = len(costs)
    # front[(i, kept)]: {held: (recompute, previous position, previous flag, previous held, segment)}
    front: dict[tuple[int, bool], dict[int, tuple[float, int, bool, int, tuple[int, int, bool]]]] = {
        (i, k): {} for i in range(n + 1) for k in (False, True)
    }
    front[(0, True)][0] = (0.0, -1, True, 0, (0, 0, False))  # the chain's input is a static byte
    for s in range(n):
        for kept in (False, True):
            points = sorted(front[(s, kept)].items())
            if not points:
                continue
            lowest = points[0][0]
            plain = model.plain_local(s, kept)
            held_plain = model.held(s, kept)
            target = front[(s + 1, costs[s].keeps_output)]
            for held, (cost, *_rest) in points:
                if held + plain > budget:
                    break
                _offer(target, held + held_plain, cost, s, kept, held, (s, s + 1, False))
            new_held = model.checkpoint_held(s, kept)
            longest = model.longest(s)
            for t, (local, ms) in enumerate(model.checkpoint_locals(s, kept), start=s + 1):
                if lowest + local > budget or t > longest:
                    break
                target = front[(t, False)]
                seg = (s, t, True)
                room = budget - local
                for held, (cost, *_rest) in points:
                    if held > room:
                        break
                    _offer(target, held + new_held, cost + ms, s, kept, held, seg)
        for flag in (False, True):
            _prune(front[(s + 1, flag)])
    ends = [
        (v[0], h, flag)
        for flag in (False, True)
        for h, v in front[(n, flag)].items()
        if h + model.loss(flag) <= budget
    ]
    if not ends:
        return None
    _, held, flag = min(ends)
    segments: list[Segment] = []
    pos = n
    while pos > 0:
        _, prev, prev_flag, prev_held, (start, stop, checkpointed) = front[(pos, flag)][held]
        segments.append(Segment(start, stop, checkpointed))
        pos, flag, held = prev, prev_flag, prev_held
    return _merge_plain(segments[::-1])


def _offer(
    target: dict[int, tuple[float, int, bool, int, tuple[int, int, bool]]],
    held: int,
    cost: float,
    prev: int,
    prev_flag: bool,
    prev_held: int,
    seg: tuple[int, int, bool],
) -> None:
    """Keep the cheaper way to reach ``held``; ties go to the earlier start (deterministic)."""
    old = target.get(held)
    if old is None or cost < old[0] or (cost == old[0] and (prev, prev_flag) < (old[1], old[2])):
        target[held] = (cost, prev, prev_flag, prev_held, seg)


def _prune(points: dict[int, tuple[float, int, bool, int, tuple[int, int, bool]]]) -> None:
    """Drop points that hold more and recompute no less than another point."""
    best = math.inf
    for held in sorted(points):
        if points[held][0] >= best:
            del points[held]
        else:
            best = points[held][0]


def _merge_plain(segments: list[Segment]) -> tuple[Segment, ...]:
    out: list[Segment] = []
    for seg in segments:
        if out and not seg.checkpoint and not out[-1].checkpoint:
            out[-1] = Segment(out[-1].start, seg.stop, False)
        else:
            out.append(seg)
    return tuple(out)


def min_feasible_budget(
    costs: Sequence[StageCost], *, loss_bytes: int | None = None, spans: Sequence[int] | None = None
) -> int:
    """The smallest budget any single-level plan fits, by bisection on the planner."""
    lo, hi = 0, predict((Segment(0, len(costs), False),), costs, loss_bytes=loss_bytes).peak_bytes
    while hi - lo > max(1, hi // 1000):
        mid = (lo + hi) // 2
        if _solve(costs, mid, loss_bytes, spans) is None:
            lo = mid
        else:
            hi = mid
    return hi


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
    plan = _solve(request.costs, budget, request.loss_bytes, spans) if budget > 0 else None
    if plan is None:
        floor = min_feasible_budget(request.costs, loss_bytes=request.loss_bytes, spans=spans)
        floor += request.static_bytes
        model = _Model(request.costs, request.loss_bytes)
        worst = max(range(request.n_stages), key=lambda i: request.costs[i].bwd_peak_bytes)  # type: ignore[index]
        raise PlanInfeasibleError(
            f"budget planner: no plan fits budget={format_bytes(request.budget_bytes)}; the smallest "
            f"achievable peak for this model and input is {format_bytes(floor)} (parameters and "
            f"inputs {format_bytes(request.static_bytes)} included; no plan goes below the backward "
            f"working set of stage {request.stage_names[worst]!r}, "
            f"{format_bytes(model.plain_local(worst, False))}). Raise the budget or reduce the batch size.",
            min_budget_bytes=floor,
        )
    return plan


register_planner("budget", budget_planner)
