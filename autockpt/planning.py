"""Turning a walked model into a :class:`Plan`: the dry run, profiling, planner choice.

Pure orchestration between the walkers (``walk.py``, ``graph.py``, ``blocks.py``), the
planners (``planners/``) and the profiler (``profiling.py``); nothing here touches a
model's forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autockpt.budget_spec import parse_budget
from autockpt.errors import AutockptError, PlanInfeasibleError
from autockpt.losses import LossFn
from autockpt.plan import Plan, Segment, format_bytes
from autockpt.planners import PlanRequest, get_planner, run_planner
from autockpt.planners.basic import sqrt_segment_count, uniform_plan
from autockpt.planners.budget import predict
from autockpt.planners.registry import Planner
from autockpt.profiling import Profile, measure_loss, profile_chain
from autockpt.runtime import dry_run_state
from autockpt.walk import Chain, DryRun, Unit, build_chain, probe_units
from autockpt.walkers import Walked, walk

__all__ = ["SegmentsSpec", "describe_peak", "plan_chain", "prepare"]

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
) -> tuple[Walked, DryRun | None, Chain, Plan]:
    """Walk, dry-run, profile when a budget asks for it, and plan."""
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
    walked = walk(model, mode, where=where)
    probe = _probe(model, walked, example_inputs, example_kwargs, where)
    chain = build_chain(walked.walker, walked.units, probe)
    if budget is None:
        return walked, probe, chain, plan_chain(chain, segments, where=where, notes=walked.notes)
    args, kwargs = _as_args(example_inputs or ()), dict(example_kwargs or {})
    x = _entry_value(walked, args, kwargs, where)
    static = _static_bytes(model, x)
    prof = _cached_profile(model, chain, x, static)
    loss_bytes = _cached_loss_bytes(model, chain, x, args, kwargs, loss_fn, where)
    unwrapped = (
        static
        + predict((Segment(0, len(chain.stages), False),), prof.costs, loss_bytes=loss_bytes).peak_bytes
    )
    budget_bytes = parse_budget(budget, unwrapped_bytes=unwrapped, where=where)
    request = PlanRequest(
        stage_names=chain.names,
        input_bytes=chain.input_bytes,
        saved_bytes=chain.saved_bytes,
        costs=prof.costs,
        budget_bytes=budget_bytes,
        static_bytes=static,
        loss_bytes=loss_bytes,
    )
    try:
        segs = run_planner(get_planner("budget", where=where), request, where=where)
    except PlanInfeasibleError as err:
        raise PlanInfeasibleError(
            str(err).replace("budget planner:", f"{where}:", 1), min_budget_bytes=err.min_budget_bytes
        ) from None
    prediction = predict(segs, prof.costs, loss_bytes=loss_bytes)
    plan = Plan(
        strategy=f"budget={format_bytes(budget_bytes)}",
        budget_bytes=budget_bytes,
        walker=chain.walker,
        stage_names=chain.names,
        stage_kinds=chain.kinds,
        segments=segs,
        predicted_peak_bytes=static + prediction.peak_bytes,
        predicted_recompute_ms=prediction.recompute_ms,
        notes=(
            *walked.notes,
            *_fusion_notes(chain),
            f"unwrapped step predicted at {format_bytes(unwrapped)}",
            f"the loss ({'loss_fn' if loss_fn is not None else 'default, a weighted sum of the outputs'}) "
            f"needs {format_bytes(loss_bytes)} above the output",
            f"the predicted peak falls in {describe_peak(prediction.peak_at, chain.names)}",
        ),
    )
    return walked, probe, chain, plan


_PROFILES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Profile]] = weakref.WeakKeyDictionary()
_LOSSES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, int]] = weakref.WeakKeyDictionary()


def _cached_profile(model: nn.Module, chain: Chain, x: Any, static: int) -> Profile:
    """The model's profile for this chain and input signature, measured once.

    Bytes do not depend on parameter values, so ``make_plan(model, budget=...)`` followed by
    ``auto_checkpoint(model, budget=...)`` (or a retry at another budget) profiles once. The
    key holds everything bytes depend on: the stages, the input's and the parameters'
    shapes, dtypes, strides and devices, and train/eval mode.
    """
    per_model = _PROFILES.setdefault(model, {})
    key = _profile_key(model, chain, x)
    if key not in per_model:
        per_model[key] = profile_chain(model, chain, x, static)
    return per_model[key]


def _cached_loss_bytes(
    model: nn.Module,
    chain: Chain,
    x: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    where: str,
) -> int:
    """The loss's bytes (:attr:`Profile.loss_bytes`) for this input signature and ``loss_fn``,
    measured once per loss function object (a new lambda is measured again: one forward)."""
    key = (_profile_key(model, chain, x), loss_fn)
    per_model = _LOSSES.setdefault(model, {})
    try:
        return per_model[key]
    except TypeError:  # an unhashable loss_fn: measure every time
        return measure_loss(model, args, kwargs, loss_fn, where=where)
    except KeyError:
        per_model[key] = measure_loss(model, args, kwargs, loss_fn, where=where)
        return per_model[key]


def remember_profile(
    model: nn.Module, chain: Chain, x: Any, profile: Profile, loss_fn: LossFn | None
) -> None:
    """Keep a profile measured by :func:`autockpt.profile` for later plans of ``model``."""
    key = _profile_key(model, chain, x)
    _PROFILES.setdefault(model, {})[key] = dataclasses.replace(profile, loss_bytes=None)
    if profile.loss_bytes is not None:
        with contextlib.suppress(TypeError):
            _LOSSES.setdefault(model, {})[(key, loss_fn)] = profile.loss_bytes


def _profile_key(model: nn.Module, chain: Chain, x: Any) -> Hashable:
    return (chain.walker, chain.names, _signature(x), _signature(list(model.parameters())), model.training)


def _signature(tree: Any) -> tuple[Hashable, ...]:
    return tuple(
        (tuple(v.shape), v.dtype, str(v.device), v.stride()) if isinstance(v, torch.Tensor) else repr(v)
        for v in tree_leaves(tree)
    )


def describe_peak(at: tuple[int, int, str], names: Sequence[str]) -> str:
    """Words for :attr:`Prediction.peak_at`, e.g. "the backward of stage '0+1'"."""
    start, stop, phase = at
    if phase == "loss":
        return "the loss, between forward and backward"
    if phase == "recompute":
        span = repr(names[start]) if stop == start + 1 else f"{names[start]!r}..{names[stop - 1]!r}"
        return f"the recompute and backward of the checkpointed segment {span}"
    return f"the {phase} of stage {names[start]!r}"


def _static_bytes(model: nn.Module, x: Any) -> int:
    """Parameters, buffers and inputs: what a training step needs before it starts."""
    tensors = [
        *model.parameters(),
        *model.buffers(),
        *(t for t in tree_leaves(x) if isinstance(t, torch.Tensor)),
    ]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def plan_chain(chain: Chain, spec: SegmentsSpec, *, where: str, notes: Sequence[str] = ()) -> Plan:
    """Turn a chain and a ``segments`` argument into a :class:`Plan`.

    Selection order: a Plan passes through (its stages must match); an int is a segment
    count; a string names a registered planner; any other callable is a custom planner.
    For the block walker the segments are single blocks (see :func:`_block_segments`).
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
    request = PlanRequest(
        stage_names=chain.names, input_bytes=chain.input_bytes, saved_bytes=chain.saved_bytes
    )
    if isinstance(spec, int):
        if not 1 <= spec <= n:
            raise ValueError(
                f"{where}: segments={spec} but the model has {n} stages. "
                f"Use 1 <= segments <= {n}, or segments='sqrt'."
            )
        segments, strategy = uniform_plan(n, spec), str(spec)
        if chain.walker == "blocks":
            segments = _spread(n, spec)
    elif isinstance(spec, str) and chain.walker == "blocks" and spec.strip().lower() == "sqrt":
        segments, strategy = _spread(n, sqrt_segment_count(n)), "sqrt"
    elif isinstance(spec, str):
        segments = run_planner(get_planner(spec, where=where), request, where=where)
        strategy = spec.strip().lower()
    else:
        segments = run_planner(spec, request, where=where)
        strategy = getattr(spec, "__name__", type(spec).__name__)
    if chain.walker == "blocks":
        segments = _per_block(n, segments)
    notes = [*notes, *_fusion_notes(chain)]
    if chain.first_unit_unsafe and segments[0].checkpoint:
        segments = (Segment(segments[0].start, segments[0].stop, False), *segments[1:])
        notes.append("the first stage modifies the model input in place, so segment 0 is not checkpointed")
    plan = Plan(
        strategy=strategy,
        walker=chain.walker,
        stage_names=chain.names,
        stage_kinds=chain.kinds,
        segments=tuple(segments),
        notes=tuple(notes),
    )
    if plan.checkpointed_segments == 0 and strategy != "none":
        why = "the model has a single stage" if n == 1 else f"segments={spec!r} gives one segment"
        msg = (
            f"{where}: {why}, which is never recomputed, so checkpointing cannot lower the peak. "
            f"Use segments='sqrt' or an int >= 2 on a model with more stages."
        )
        warnings.warn(msg, UserWarning, stacklevel=3)
        plan = Plan(**{**plan.__dict__, "notes": (*plan.notes, msg)})
    return plan


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


def _check_spec(spec: object, where: str) -> None:
    if isinstance(spec, bool) or not (isinstance(spec, (int, str, Plan)) or callable(spec)):
        raise TypeError(
            f"{where}: segments must be an int number of segments, a strategy name such as "
            f"'sqrt', a callable planner or a Plan; got {type(spec).__name__} {spec!r}."
        )


def _probe(
    model: nn.Module,
    walked: Walked,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    where: str,
) -> DryRun | None:
    """The dry run's findings: run now on ``example_inputs``, or reused; None if none ran yet.

    The block walker has no dry run: each block is checkpointed alone and keeps its inputs.
    """
    if walked.walker == "blocks":
        return None
    if example_inputs is not None or example_kwargs:
        x = _entry_value(walked, _as_args(example_inputs or ()), dict(example_kwargs or {}), where)
        with dry_run_state(model, x):
            return probe_units(walked.units, x)
    from autockpt.forward import installed

    fwd = installed(model)
    if fwd is not None and fwd.probe is not None and _same_units(fwd.units, walked.units):
        return fwd.probe
    return None


def _entry_value(walked: Walked, args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> Any:
    """What the chain's first unit receives: the input, or for a graph the dict of inputs."""
    if walked.program is not None:
        return walked.program.bind(args, kwargs)
    if len(args) != 1 or kwargs:
        raise TypeError(
            f"{where}: an nn.Sequential takes one input, got {len(args)} example "
            f"inputs. Pass example_inputs=(x,)."
        )
    return args[0]


def _as_args(example_inputs: Sequence[Any] | Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _same_units(a: Sequence[Unit], b: Sequence[Unit]) -> bool:
    return len(a) == len(b) and all(x.name == y.name and x.fn is y.fn for x, y in zip(a, b))
