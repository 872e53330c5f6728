"""Planning: the only place a :class:`~autockpt.plan.Plan` is built.

:func:`prepare` runs the pipeline up to a plan: walk the model, dry-run it, profile it
when a budget asks for costs, and call :func:`build_plan`. :func:`build_plan` turns a chain
and a ``segments=`` argument (a count, ``"sqrt"``, a registered name, a callable, a Plan)
or a budget into a Plan, applying every rule on the way, for every walker alike: the
stages a dry run fused, segment 0 kept plain when the first module writes into the model's
input, the block walker's one-block-per-checkpoint constraint, warnings for plans that
checkpoint nothing or save little. Nothing here touches a model's forward.

NOTE [Never a silent 1.00x]
    A plan can checkpoint segments and still keep as much for backward as no plan: the
    walker found two or three stages (a long skip connection crosses every cut), or one
    stage holds most of the activations and a checkpoint cannot split it. When a dry run
    has measured the stages, the plan's activation peak is estimated as the sqrt rule
    estimates it; at ``SAVES_LITTLE`` of the unwrapped estimate or above, the user is
    warned with the reason and what would help. Budget plans are exempt: their peak is
    predicted from measured costs and shown.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from autockpt.errors import AutockptError
from autockpt.measure.dry_run import dry_run
from autockpt.measure.losses import LossFn
from autockpt.measure.tensors import as_args
from autockpt.plan import Plan, Segment, StageFigures, format_bytes
from autockpt.planners import Planner, PlanRequest, available_planners, get_planner, run_planner
from autockpt.planners.basic import estimated_peak, uniform_plan
from autockpt.planners.cost_model import dry_run_costs
from autockpt.planning.budget_costs import BudgetCosts, OpPolicy, budget_costs, budget_segments, policy_masks
from autockpt.walkers import Walked, walk
from autockpt.walkers.chain import Chain, DryRun, Unit, build_chain
from autockpt.walkers.graph import none_pattern

__all__ = [
    "Replanner",
    "SegmentsSpec",
    "build_plan",
    "prepare",
    "reused_dry_run",
    "saves_little",
]

SegmentsSpec = int | str | Planner | Plan


def prepare(
    model: nn.Module,
    segments: SegmentsSpec,
    budget: int | float | str | None,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    where: str,
    loss_fn: LossFn | None = None,
    previous: tuple[tuple[Unit, ...], DryRun | None] | None = None,
    policy: str | None = None,
    policy_fn: OpPolicy | None = None,
) -> tuple[Walked, DryRun | None, Chain, Plan]:
    """Walk, dry-run, profile when a budget asks for it, and plan.

    ``previous`` is the units and dry run of the plan installed now, reused when the walk
    finds the same units and no example inputs are given. ``policy`` names the op policy the
    plan carries (a given Plan keeps its own when it is ``None``); ``policy_fn`` is its
    function, whose kept outputs a budget plan counts (NOTE [Budgets under a policy] in
    ``planning/budget_costs.py``).
    """
    _check_arguments(segments, budget, example_inputs, example_kwargs, loss_fn, where)
    choose_ops = policy == "auto" and not isinstance(segments, Plan)
    if choose_ops and budget is None:
        raise ValueError(
            f"{where}: policy='auto' lets the budget planner choose the ops each segment keeps, and "
            "no budget was given. Pass budget=... and example_inputs=..., or a named policy such as "
            "'save-matmuls'."
        )
    if isinstance(segments, Plan) and mode is None:
        mode = segments.walker  # a plan applies to the stages its walker found
    walked, dry, chain = walk_and_dry_run(
        model, example_inputs, example_kwargs, mode, where=where, previous=previous, saved=budget is None
    )
    costs = None
    if budget is not None:
        args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
        costs = budget_costs(
            model, walked, chain, args, kwargs, budget, loss_fn=loss_fn, where=where,
            ops=choose_ops or policy_fn is not None,
        )  # fmt: skip
        if policy_fn is not None:
            costs = dataclasses.replace(costs, keep_only=policy_masks(costs.profile, policy_fn))
    no_inputs = example_inputs is None and not example_kwargs
    none_traced = walked.program.none_args if walked.program is not None and no_inputs else frozenset()
    plan = build_plan(chain, "budget" if budget is not None else segments, where=where,
                      notes=walked.notes, budget=costs, traced_as_none=none_traced)  # fmt: skip
    if policy is not None and policy != plan.policy:
        plan = dataclasses.replace(plan, policy=policy)
    return walked, dry, chain, plan


def walk_and_dry_run(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    where: str,
    previous: tuple[tuple[Unit, ...], DryRun | None] | None = None,
    saved: bool = True,
) -> tuple[Walked, DryRun | None, Chain]:
    """The walk, the dry run (with example inputs, else the one reused from ``previous``)
    and the chain of stages they give; ``saved=False``: a dry run without the saved bytes
    (NOTE [Dry run bytes] in ``measure/dry_run.py``)."""
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    has_inputs = example_inputs is not None or bool(example_kwargs)
    none_args = none_pattern(model, args, kwargs) if has_inputs else None  # trace for this call
    walked = walk(model, mode, where=where, none_args=none_args)
    dry = (
        dry_run(model, walked, args, kwargs, where=where, saved=saved)
        if has_inputs
        else reused_dry_run(walked, previous)
    )
    return walked, dry, build_chain(walked.walker, walked.units, dry)


def _check_arguments(
    segments: SegmentsSpec,
    budget: object,
    example_inputs: object,
    example_kwargs: dict[str, Any] | None,
    loss_fn: object,
    where: str,
) -> None:
    _check_spec(segments, where)
    if budget is not None and segments not in ("sqrt", "budget"):
        raise ValueError(f"{where}: got both segments={segments!r} and budget={budget!r}. Pass one of them.")
    if loss_fn is not None and budget is None:
        raise ValueError(
            f"{where}: loss_fn is measured to plan for a memory budget, and no budget was given. "
            f"Pass budget=... with it, or leave loss_fn out."
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"{where}: loss_fn must be callable (output -> scalar tensor), got {type(loss_fn).__name__}."
        )
    if budget is not None and example_inputs is None and not example_kwargs:
        raise ValueError(
            f"{where}: budget={budget!r} needs example inputs to measure the model. Pass "
            f"example_inputs=(x,) with a batch of the size you train with."
        )


def _check_spec(spec: object, where: str) -> None:
    """Raise ``TypeError`` unless ``spec`` is a valid ``segments=`` argument."""
    if isinstance(spec, bool) or not (isinstance(spec, (int, str, Plan)) or callable(spec)):
        raise TypeError(
            f"{where}: segments must be an int number of segments, a strategy name such as "
            f"'sqrt', a callable planner or a Plan; got {type(spec).__name__} {spec!r}."
        )


def reused_dry_run(walked: Walked, previous: tuple[tuple[Unit, ...], DryRun | None] | None) -> DryRun | None:
    """The installed plan's dry run (``previous``: its units and dry run), if the walk found
    the very same units again and it measured the saved bytes (a budget plan's did not:
    NOTE [Dry run bytes]); ``None`` otherwise (the first training forward runs one)."""
    if previous is None or previous[1] is None or not previous[1].saved_bytes:
        return None
    units, dry = previous
    same = len(units) == len(walked.units) and all(
        a.name == b.name and a.fn is b.fn for a, b in zip(units, walked.units)
    )
    return dry if same else None


def build_plan(
    chain: Chain,
    spec: SegmentsSpec,
    *,
    where: str,
    notes: Sequence[str] = (),
    budget: BudgetCosts | None = None,
    traced_as_none: frozenset[str] = frozenset(),
) -> Plan:
    """Turn a chain and a ``segments`` argument, or measured costs and a budget, into a Plan.

    Selection order: a Plan passes through (its stages must match); a budget runs the
    ``"budget"`` planner on the profile; an int is a segment count; a string names a
    registered planner; any other callable is a custom planner. Then the chain's rules apply
    (see the module docstring). ``traced_as_none``: the optional arguments a trace made
    without example inputs took as ``None``; a plan that checkpoints nothing then says so.
    """
    n = len(chain.stages)
    if n == 0:
        raise AutockptError(
            f"{where}: the model has no modules, so there is nothing to checkpoint. "
            f"Pass a model with at least one layer."
        )
    if isinstance(spec, Plan):
        if spec.stage_names != chain.names:
            raise AutockptError(
                f"{where}: the plan's stages {list(spec.stage_names)} differ from the model's "
                f"{list(chain.names)}. Make a new plan with autockpt.make_plan(model, "
                f"example_inputs=...)."
            )
        return spec
    notes = [*notes, *_fusion_notes(chain)]
    extra: dict[str, Any] = {}
    if budget is not None:
        segments, extra = budget_segments(chain, budget, where, notes)
        strategy = f"budget={format_bytes(budget.budget_bytes)}"
    else:
        segments, strategy = _spec_segments(chain, spec, where)
        if chain.walker == "blocks":
            segments = _per_block(n, segments)
    if chain.first_unit_unsafe and segments[0].checkpoint:
        segments = (Segment(segments[0].start, segments[0].stop, False), *segments[1:])
        notes.append("the first stage modifies the model input in place, so segment 0 is not checkpointed")
    plan = Plan(strategy=strategy, walker=chain.walker, stage_names=chain.names, stage_kinds=chain.kinds,
                segments=tuple(segments), notes=tuple(notes), stage_figures=_figures(chain, budget),
                **extra)  # fmt: skip
    if plan.checkpointed_segments == 0 and strategy != "none" and budget is None:
        why = "the model has a single stage" if n == 1 else f"segments={spec!r} gives one segment"
        helps = ["mode='blocks' (each repeated block checkpointed alone)"] if chain.walker != "blocks" else []
        helps += ["an int segments >= 2"] if n > 1 else []
        msg = f"{where}: {why}, which is never recomputed, so checkpointing cannot lower the peak." + (
            f" Try {' or '.join(helps)}." if helps else ""
        )
        if traced_as_none:  # NOTE [A trace of another call checkpoints nothing] in execution/forward.py
            msg = (
                f"{where}: without example inputs the model was traced with its optional arguments "
                f"{sorted(traced_as_none)} as None, and that trace leaves nothing to checkpoint ({why}); "
                f"the first call that passes them is traced and planned again. Pass example_inputs=... "
                f"(or example_kwargs=...) as you call the model to plan for that call now."
            )
        warnings.warn(msg, UserWarning, stacklevel=4)
        plan = dataclasses.replace(plan, notes=(*plan.notes, msg))
    elif budget is None and spec != "none":
        reason = saves_little(chain, plan)
        if reason is not None:
            msg = f"{where}: this plan is estimated to save little memory: {reason}"
            warnings.warn(msg, UserWarning, stacklevel=4)
            plan = dataclasses.replace(plan, notes=(*plan.notes, msg))
    return plan


def _figures(chain: Chain, budget: BudgetCosts | None) -> tuple[StageFigures, ...] | None:
    """Per-stage figures for ``Plan.explain``: a budget's profile (with times), else the dry
    run's bytes, else none."""
    if budget is not None:
        by_name = dict(zip(budget.profile.stage_names, budget.profile.costs))  # blocks: gaps too
        if any(name not in by_name for name in chain.names):
            return None
        out, counted = [], False  # counted: the previous stage's output is in its saved bytes
        for c in (by_name[name] for name in chain.names):
            own_input = c.in_bytes if c.keeps_input and not counted else 0
            out.append(
                StageFigures(
                    c.in_bytes, c.kept_bytes + own_input + c.out_bytes * c.keeps_output, c.fwd_ms, c.tail_ms
                )
            )
            counted = c.keeps_output
        return tuple(out)
    if chain.input_bytes is not None and chain.saved_bytes:
        return tuple(StageFigures(i, s) for i, s in zip(chain.input_bytes, chain.saved_bytes))
    return None


# below this fraction of the unwrapped activation peak a plan counts as saving something
SAVES_LITTLE = 0.9


def saves_little(chain: Chain, plan: Plan) -> str | None:
    """Why ``plan`` keeps about as much for backward as no checkpointing, with what would
    help; ``None`` when it saves, or when no dry run measured the stages (NOTE [Never a
    silent 1.00x])."""
    inputs, saved = chain.input_bytes, chain.saved_bytes
    if inputs is None or not saved or sum(saved) <= 0 or plan.checkpointed_segments == 0:
        return None
    costs = dry_run_costs(inputs, saved)
    bounds = [s.start for s in plan.segments] + [plan.n_stages]
    ratio = estimated_peak(bounds, costs) / estimated_peak([0, plan.n_stages], costs)
    if ratio < SAVES_LITTLE:
        return None
    heavy = max(range(len(saved)), key=saved.__getitem__)
    head = f"its activation peak is {ratio:.2f}x the unwrapped model's"
    if len(saved) <= 3:
        return (
            f"{head}, because the {chain.walker} walker found only {len(saved)} stages "
            f"({', '.join(chain.names)}): a checkpoint can only start where a single tensor crosses "
            f"from one part of the model to the next. Try mode='blocks' to checkpoint repeated "
            f"blocks one by one, or auto_checkpoint the heavy submodule itself."
        )
    if saved[heavy] >= 0.5 * sum(saved):
        return (
            f"{head}, because stage {chain.names[heavy]!r} alone keeps {format_bytes(saved[heavy])} "
            f"of the {format_bytes(sum(saved))} kept for backward, and a checkpoint cannot split a "
            f"stage. auto_checkpoint that submodule itself, or try mode='blocks'."
        )
    return f"{head}. A budget (budget=..., example_inputs=...) plans from measured costs instead."


def _spec_segments(chain: Chain, spec: SegmentsSpec, where: str) -> tuple[tuple[Segment, ...], str]:
    n = len(chain.stages)
    request = PlanRequest(
        stage_names=chain.names, input_bytes=chain.input_bytes, saved_bytes=chain.saved_bytes
    )
    if isinstance(spec, int):
        if not 1 <= spec <= n:
            raise ValueError(
                f"{where}: segments={spec} but the model has {n} stages. "
                f"Use 1 <= segments <= {n}, or segments='sqrt'."
            )
        if chain.walker == "blocks":
            return _spread(n, spec), str(spec)
        return uniform_plan(n, spec), str(spec)
    if isinstance(spec, str):
        if chain.walker == "blocks" and spec.strip().lower() == "sqrt":
            return _spread(n, n), "sqrt"  # NOTE [sqrt on blocks]
        return run_planner(get_planner(spec, where=where), request, where=where), spec.strip().lower()
    if isinstance(spec, Plan):  # build_plan passes plans through before asking for segments
        raise TypeError(f"{where}: a Plan has its segments already")
    return run_planner(spec, request, where=where), getattr(spec, "__name__", type(spec).__name__)


# NOTE [sqrt on blocks]
#     The sqrt rule balances k kept segment inputs against one segment's activations:
#     k + n/k. The block walker cannot group blocks: a checkpoint holds exactly one block,
#     so with k of n blocks checkpointed the peak holds the other n - k blocks' activations
#     a and the k inputs b, (n - k) a + k b, falling with every block checkpointed while
#     a > b (a transformer layer saves ~60x its input). Every block is checkpointed, which
#     recomputes one forward in all, as the sqrt rule on a chain does, and is what HF's
#     gradient_checkpointing_enable does.


def _spread(n: int, k: int) -> tuple[Segment, ...]:
    """One segment per block, ``k`` of them checkpointed and evenly spread."""
    chosen = {(2 * i + 1) * n // (2 * k) for i in range(k)}
    return tuple(Segment(i, i + 1, i in chosen) for i in range(n))


def _per_block(n: int, segments: Sequence[Segment]) -> tuple[Segment, ...]:
    """Blocks are checkpointed one by one: a block is checkpointed if its segment was."""
    flags = [False] * n
    for seg in segments:
        for i in range(seg.start, seg.stop):
            flags[i] = seg.checkpoint
    return tuple(Segment(i, i + 1, flags[i]) for i in range(n))


def _fusion_notes(chain: Chain) -> list[str]:
    fused = [s.name for s in chain.stages if len(s.units) > 1]
    if not fused:
        return []
    return [f"fused with their predecessor (in-place input): {', '.join(fused)}"]


class Replanner:
    """Plans again for a checkpointed forward whose stages changed under it.

    The installed forward (``execution/forward.py``) runs plans and never makes one: when a
    walk again (hooks added where the walk went through, other optional arguments) or the
    first dry run (in-place modules fused) changes the chain, it asks this object, which
    ``auto_checkpoint`` hands it, for the new plan.
    """

    def after_walk(
        self, chain: Chain, spec: SegmentsSpec, *, why: str, model: str
    ) -> tuple[Plan, SegmentsSpec]:
        """The plan for a new walk's chain with the same strategy, and the strategy kept from
        now on: a budget or a given plan's stages are gone (a budget needs inputs to
        profile), so those become ``"sqrt"``, with a warning."""
        name = spec.strip().lower() if isinstance(spec, str) else None
        if name is not None and not name.isdigit() and (name == "budget" or name not in available_planners()):
            warnings.warn(
                f"auto_checkpoint: {model} was walked again ({why}), so its "
                f"plan ({spec}) no longer matches its stages; it is checkpointed with "
                f"segments='sqrt' from now on. For a budget, call auto_checkpoint(model, budget=..., "
                f"example_inputs=...) again with inputs like this call's, after adding hooks.",
                UserWarning,
                stacklevel=6,
            )
            spec = "sqrt"
        if isinstance(spec, str) and spec.isdigit():  # a strategy recorded as text ("3")
            spec = int(spec)
        n = len(chain.stages)
        return build_plan(
            chain, min(spec, n) if isinstance(spec, int) else spec, where="auto_checkpoint"
        ), spec

    def after_dry_run(self, chain: Chain, spec: SegmentsSpec, *, notes: Sequence[str]) -> Plan:
        """The plan for the chain the first dry run found (fused stages, boundary sizes)."""
        n = len(chain.stages)
        if isinstance(spec, int) and spec > n:
            warnings.warn(
                f"auto_checkpoint: the dry run fused modules that modify their input in place, "
                f"leaving {n} stages, so segments={spec} becomes segments={n}. Pass "
                f"example_inputs=(x,) to auto_checkpoint to see the real stage count up front.",
                UserWarning,
                stacklevel=6,
            )
            spec = n
        return build_plan(chain, spec, where="auto_checkpoint", notes=notes)
