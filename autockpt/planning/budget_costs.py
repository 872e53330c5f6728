"""Budget plans: the measured costs a budget plan is made from, and the planner's answer
in the chain's stages.

:func:`budget_costs` profiles the model (once per model and input shapes) and turns
``budget=`` into bytes; :func:`budget_segments` runs the ``"budget"`` planner on that
profile, with a named policy's ops or ``policy="auto"``'s op choice (NOTE [Budgets under a
policy]), and maps a block-walked profile's segments back to the blocks.
:func:`autockpt.planning.prepare.build_plan` turns its answer into the Plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.errors import PlanInfeasibleError
from autockpt.measure.losses import LossFn
from autockpt.measure.model_profile import model_profile
from autockpt.measure.profile import Profile
from autockpt.plan import Plan, Segment, format_bytes, parse_budget
from autockpt.planners import PlanRequest, get_planner, run_planner
from autockpt.planners.budget import EXACT_UP_TO
from autockpt.planners.cost_model import predict
from autockpt.walkers import Walked
from autockpt.walkers.chain import Chain

__all__ = [
    "PLANNING_REPEATS",
    "BudgetCosts",
    "OpPolicy",
    "budget_costs",
    "budget_segments",
    "describe_peak",
    "policy_masks",
    "predict_plan",
]

OpPolicy = Callable[[Any], bool]  # execution.policies.OpPolicy; planning does not import execution


# NOTE [Planning repeats]
#     A budget plan needs each stage's bytes (exact from one run) and its time relative to
#     the others. Timing each stage once after a warm-up, instead of the median of three
#     that ``autockpt.profile`` reports, takes the profile from five runs of every stage to
#     three: the measuring part of ``auto_checkpoint(..., budget=...)`` then costs about
#     three training steps plus fixed overheads (goal: at most 10x one step).
PLANNING_REPEATS = 1


@dataclass(frozen=True)
class BudgetCosts:
    """What a budget plan is made from: the measured profile and the budget in bytes."""

    profile: Profile
    budget_bytes: int
    unwrapped_bytes: int
    loss_described: str
    keep_only: tuple[tuple[bool, ...], ...] | None = None  # a named policy's ops, per stage


# NOTE [Budgets under a policy]
#     A named policy keeps outputs the whole-segment cost model does not count, so a budget
#     plan made without them could run over its budget. With a budget, the profile lists
#     each stage's ops and the policy is asked about every one; the planner then counts,
#     in every checkpointed segment it considers, exactly the outputs the policy keeps, and
#     the plan names them (Segment.keep), so the runtime keeps what was predicted.


def policy_masks(prof: Profile, fn: OpPolicy) -> tuple[tuple[bool, ...], ...]:
    """Per stage, per op of the profile: whether ``fn`` keeps it (ops a policy may not keep,
    random ones included, are left out rather than refused: the runtime refuses them)."""
    return tuple(tuple(o.keepable and _asks(fn, o.op) for o in c.ops) for c in prof.costs)


def _asks(fn: OpPolicy, name: str) -> bool:
    namespace, op, overload = name.split(".", 2)
    packet = getattr(getattr(torch.ops, namespace), op)
    return bool(fn(getattr(packet, overload)))


def budget_costs(
    model: nn.Module,
    walked: Walked,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    budget: int | float | str,
    *,
    loss_fn: LossFn | None,
    where: str,
    ops: bool = False,
) -> BudgetCosts:
    """The profile (measured once per model, chain and input shapes) and the budget in bytes;
    ``ops``: with the op-level profile, for a planner that chooses ops."""
    prof = model_profile(
        model, walked, chain, args, kwargs, loss_fn=loss_fn, where=where, repeats=PLANNING_REPEATS, ops=ops
    )
    assert prof.loss_bytes is not None
    whole = (Segment(0, len(prof.costs), False),)
    unwrapped = prof.static_bytes + predict(whole, prof.costs, loss_bytes=prof.loss_bytes).peak_bytes
    return BudgetCosts(
        profile=prof,
        budget_bytes=parse_budget(budget, unwrapped_bytes=unwrapped, where=where),
        unwrapped_bytes=unwrapped,
        loss_described="loss_fn" if loss_fn is not None else "default, a weighted sum of the outputs",
    )


def budget_segments(
    chain: Chain, budget: BudgetCosts, where: str, notes: list[str]
) -> tuple[tuple[Segment, ...], dict[str, Any]]:
    """Segments of the least-recompute plan under the budget, in the chain's stages."""
    prof = budget.profile
    spans = prof.checkpoint_spans
    if chain.first_unit_unsafe and spans is None:  # segment 0 stays plain: a constraint, not a repair
        spans = (0, *([len(prof.costs)] * (len(prof.costs) - 1)))
    request = PlanRequest(
        stage_names=prof.stage_names,
        costs=prof.costs,
        budget_bytes=budget.budget_bytes,
        static_bytes=prof.static_bytes,
        loss_bytes=prof.loss_bytes,
        checkpoint_spans=spans,
        input_bytes=chain.input_bytes if prof.stage_of is None else None,
        saved_bytes=chain.saved_bytes if prof.stage_of is None else None,
        choose_ops=prof.has_ops and budget.keep_only is None,
        keep_only=budget.keep_only,
    )
    if prof.has_ops and len(prof.costs) > EXACT_UP_TO:
        notes.append(
            f"op policies are planned for chains of up to {EXACT_UP_TO} profiled stages and this one "
            f"has {len(prof.costs)}: the plan counts no kept outputs"
        )
    try:
        segs = run_planner(get_planner("budget", where=where), request, where=where)
    except PlanInfeasibleError as err:
        raise PlanInfeasibleError(
            str(err).replace("budget planner:", f"{where}:", 1),
            min_budget_bytes=err.min_budget_bytes,
            unwrapped_bytes=err.unwrapped_bytes,
        ) from None
    prediction = predict(segs, prof.costs, loss_bytes=prof.loss_bytes)
    notes.extend(
        [
            f"unwrapped step predicted at {format_bytes(budget.unwrapped_bytes)}",
            f"the loss ({budget.loss_described}) needs {format_bytes(prof.loss_bytes or 0)} above the output",
            f"the predicted peak falls in {describe_peak(prediction.peak_at, prof.stage_names)}",
        ]
    )
    if prof.stage_of is not None:  # profiled stages -> the chain's blocks
        blocks = [Segment(i, i + 1, False) for i in range(len(chain.stages))]
        for seg in segs:
            for i in range(seg.start, seg.stop):
                block = prof.stage_of[i]
                if seg.checkpoint and block is not None:  # spans of one: the segment is this block
                    blocks[block] = dataclasses.replace(seg, start=block, stop=block + 1)
        segs = tuple(blocks)
    extra = {
        "budget_bytes": budget.budget_bytes,
        "predicted_peak_bytes": prof.static_bytes + prediction.peak_bytes,
        "predicted_recompute_ms": prediction.recompute_ms,
    }
    return segs, extra


def predict_plan(plan: Plan, prof: Profile) -> tuple[int, float]:
    """A plan's predicted peak (parameters and inputs included) and recompute time, from a
    profile of the same model and inputs (``autockpt.tradeoff`` compares any plans so)."""
    try:
        segs = prof.segments_of(plan)
    except ValueError as err:
        raise ValueError(f"predict_plan: {err}") from None
    prediction = predict(segs, prof.costs, loss_bytes=prof.loss_bytes)
    return prof.static_bytes + prediction.peak_bytes, prediction.recompute_ms


def describe_peak(at: tuple[int, int, str], names: Sequence[str]) -> str:
    """Words for :attr:`Prediction.peak_at`, e.g. "the backward of stage '0+1'"."""
    start, stop, phase = at
    if phase == "loss":
        return "the loss, between forward and backward"
    if phase == "recompute":
        span = repr(names[start]) if stop == start + 1 else f"{names[start]!r}..{names[stop - 1]!r}"
        return f"the recompute and backward of the checkpointed segment {span}"
    return f"the {phase} of stage {names[start]!r}"
