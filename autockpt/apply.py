"""The public entry points: plan a model, checkpoint it in place, undo it.

``auto_checkpoint`` replaces only the model object's ``forward`` (an instance attribute),
so the class, the module tree, the parameter objects and the ``state_dict`` keys stay as
they were, optimizers keep working, and ``restore`` removes the attribute again.

NOTE [The one-time dry run]
    Whether a module modifies its input in place cannot always be read off its
    attributes, so autockpt runs the model's modules once on a real input and watches
    tensor version counters (see NOTE [In-place boundaries] in ``walk.py``). With
    ``example_inputs`` this happens at planning time; without, on the first forward pass
    that records gradients. The dry run is invisible: buffers and RNG are restored and
    :func:`autockpt.is_recomputing` is true during it. If it finds a module that the
    plan put right after a boundary, the plan is made again with the same strategy.
"""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.errors import AutockptError
from autockpt.plan import Plan, Segment
from autockpt.planners import PlanRequest, get_planner, run_planner
from autockpt.planners.basic import uniform_plan
from autockpt.planners.registry import Planner
from autockpt.runtime import SegmentRuntime, build_runtime, dry_run_state, run_segments
from autockpt.walk import (
    Chain,
    DryRun,
    Unit,
    build_chain,
    chain_from_names,
    probe_units,
    sequential_units,
)

__all__ = ["apply_plan", "auto_checkpoint", "make_plan", "restore"]

logger = logging.getLogger(__name__)

SegmentsSpec = int | str | Planner | Plan


def auto_checkpoint(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    example_inputs: Sequence[Any] | None = None,
) -> nn.Module:
    """Checkpoint ``model`` in place so training keeps fewer activations alive.

    The model's forward is replaced by one that runs checkpointed segments through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; gradients, dropout
    masks and buffer updates are those of the unwrapped model. Calling it again replaces
    the plan. Under ``torch.no_grad()`` or ``inference_mode`` the original forward runs.

    Args:
        model: an ``nn.Sequential`` (nested Sequentials are flattened).
        segments: ``"sqrt"`` (``ceil(sqrt(n))`` segments), an int number of segments,
            ``"none"``, another registered planner name, a callable planner, or a
            :class:`Plan`. All segments but the last are recomputed in backward.
        example_inputs: positional inputs for a dry run that finds modules which modify
            their input in place; without them the dry run happens on the first training
            forward.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a Module, or ``segments`` has the wrong type.
        ValueError: ``segments`` is out of range or names no planner.
        AutockptError: the model has nothing to checkpoint or cannot be walked.

    Example:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(9)])
        >>> model = autockpt.auto_checkpoint(model)
        >>> autockpt.make_plan(model).checkpointed_segments
        2
    """
    _check_module(model, "auto_checkpoint")
    _check_spec(segments, "auto_checkpoint")
    units = sequential_units(model, where="auto_checkpoint")
    probe = _probe(model, units, example_inputs, "auto_checkpoint")
    chain = build_chain("sequential", units, probe)
    plan = plan_chain(chain, segments, where="auto_checkpoint")
    _install(model, units, chain, plan, segments, probe)
    return model


def make_plan(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    example_inputs: Sequence[Any] | None = None,
) -> Plan:
    """The plan ``auto_checkpoint(model, segments, ...)`` would apply, without applying it.

    For a model that is already checkpointed, the stages found by its earlier dry run are
    reused. Arguments are those of :func:`auto_checkpoint`.

    Example:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True),
        ...                             torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> autockpt.make_plan(model, 2).stage_names
        ('0+1', '2', '3')
    """
    _check_module(model, "make_plan")
    _check_spec(segments, "make_plan")
    units = sequential_units(model, where="make_plan")
    probe = _probe(model, units, example_inputs, "make_plan")
    return plan_chain(build_chain("sequential", units, probe), segments, where="make_plan")


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model`` in place with exactly ``plan`` (see :meth:`Plan.apply`)."""
    _check_module(model, "Plan.apply")
    units = sequential_units(model, where="Plan.apply")
    chain = chain_from_names(plan.walker, units, plan.stage_names)
    _install(model, units, chain, plan, plan, _probe(model, units, None, "Plan.apply"))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`auto_checkpoint`: the model's original forward runs again.

    Raises:
        AutockptError: ``model`` was never checkpointed by autockpt.

    Example:
        >>> import autockpt, torch
        >>> model = autockpt.auto_checkpoint(torch.nn.Sequential(torch.nn.Linear(2, 2)), "none")
        >>> autockpt.restore(model) is model and "forward" not in vars(model)
        True
    """
    _check_module(model, "restore")
    fwd = _installed(model)
    if fwd is None:
        raise AutockptError(
            f"restore: this {type(model).__name__} is not checkpointed by autockpt, so there is "
            f"nothing to restore. Call autockpt.auto_checkpoint(model) first."
        )
    del model.__dict__["forward"]
    if fwd.original_forward is not None:
        model.__dict__["forward"] = fwd.original_forward
    return model


# --- planning -------------------------------------------------------------------------


def plan_chain(chain: Chain, spec: SegmentsSpec, *, where: str) -> Plan:
    """Turn a chain and a ``segments`` argument into a :class:`Plan`.

    Selection order: a Plan passes through (its stages must match); an int is a segment
    count; a string names a registered planner; any other callable is a custom planner.
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
    request = PlanRequest(stage_names=chain.names, input_bytes=chain.input_bytes)
    if isinstance(spec, int):
        if not 1 <= spec <= n:
            raise ValueError(
                f"{where}: segments={spec} but the model has {n} stages. "
                f"Use 1 <= segments <= {n}, or segments='sqrt'."
            )
        segments, strategy = uniform_plan(n, spec), str(spec)
    elif isinstance(spec, str):
        segments = run_planner(get_planner(spec, where=where), request, where=where)
        strategy = spec.strip().lower()
    else:
        segments = run_planner(spec, request, where=where)
        strategy = getattr(spec, "__name__", type(spec).__name__)
    notes = list(_fusion_notes(chain))
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


def _fusion_notes(chain: Chain) -> list[str]:
    fused = [s.name for s in chain.stages if len(s.units) > 1]
    if not fused:
        return []
    return [f"fused with their predecessor (in-place input): {', '.join(fused)}"]


# --- walking and the dry run ----------------------------------------------------------


def _check_module(model: object, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(model).__name__}.")


def _check_spec(spec: object, where: str) -> None:
    if isinstance(spec, bool) or not (isinstance(spec, (int, str, Plan)) or callable(spec)):
        raise TypeError(
            f"{where}: segments must be an int number of segments, a strategy name such as "
            f"'sqrt', a callable planner or a Plan; got {type(spec).__name__} {spec!r}."
        )


def _probe(
    model: nn.Module, units: Sequence[Unit], example_inputs: Sequence[Any] | None, where: str
) -> DryRun | None:
    """The dry run's findings: run now on ``example_inputs``, or reused; None if none ran yet."""
    if example_inputs is not None:
        args = _as_args(example_inputs)
        if len(args) != 1:
            raise TypeError(
                f"{where}: an nn.Sequential takes one input, got {len(args)} example "
                f"inputs. Pass example_inputs=(x,)."
            )
        with dry_run_state(model, args[0]):
            return probe_units(units, args[0])
    fwd = _installed(model)
    if fwd is not None and fwd.probe is not None and _same_units(fwd.units, units):
        return fwd.probe
    return None


def _as_args(example_inputs: Sequence[Any] | Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _same_units(a: Sequence[Unit], b: Sequence[Unit]) -> bool:
    return len(a) == len(b) and all(x.name == y.name and x.module is y.module for x, y in zip(a, b))


# --- the installed forward ------------------------------------------------------------


class CheckpointedForward:
    """What ``model.forward`` is while a model is checkpointed (picklable, deep-copyable)."""

    _autockpt_forward = True

    def __init__(
        self,
        model: nn.Module,
        units: tuple[Unit, ...],
        chain: Chain,
        plan: Plan,
        spec: SegmentsSpec,
        probe: DryRun | None,
        original_forward: Callable[..., Any] | None,
    ) -> None:
        self.model = model
        self.units = units
        self.plan = plan
        self.spec = spec
        self.probe = probe
        self.original_forward = original_forward
        self.runtime: tuple[SegmentRuntime, ...] = build_runtime(plan.segments, chain.stages)

    def _plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.original_forward is not None:
            return self.original_forward(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or self.plan.checkpointed_segments == 0:
            return self._plain(*args, **kwargs)
        if len(args) != 1 or kwargs:
            return self._plain(*args, **kwargs)  # let the model raise its own TypeError
        if self.probe is None:
            self._dry_run(args[0])
        return run_segments(self.runtime, args[0])

    def _dry_run(self, x: Any) -> None:
        with dry_run_state(self.model, x):
            self.probe = probe_units(self.units, x)
        chain = build_chain(self.plan.walker, self.units, self.probe)
        if isinstance(self.spec, Plan) or self.spec is None:
            if chain.names == self.plan.stage_names and not (
                chain.first_unit_unsafe and self.plan.segments[0].checkpoint
            ):
                return
            raise AutockptError(
                f"auto_checkpoint: the dry run found modules that modify their input in place "
                f"at units {sorted(self.probe.unsafe)}, which the given plan puts after a boundary. "
                f"Make the plan with autockpt.make_plan(model, example_inputs=(x,))."
            )
        # Re-plan with what the dry run found: fused stages and boundary sizes.
        spec = self.spec
        n = len(chain.stages)
        if isinstance(spec, int) and spec > n:
            warnings.warn(
                f"auto_checkpoint: the dry run fused modules that modify their input in place, "
                f"leaving {n} stages, so segments={spec} becomes segments={n}. Pass "
                f"example_inputs=(x,) to auto_checkpoint to see the real stage count up front.",
                UserWarning,
                stacklevel=4,
            )
            spec = n
        plan = plan_chain(chain, spec, where="auto_checkpoint")
        if plan != self.plan:
            logger.info("autockpt: re-planned %r after the dry run", spec)
            self.plan = plan
            self.runtime = build_runtime(plan.segments, chain.stages)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        spec = state["spec"]
        if callable(spec) and not isinstance(spec, Plan):
            try:
                pickle.dumps(spec)
            except Exception:  # a lambda or local function: keep the plan, drop the recipe
                state["spec"] = None
        return state


def _installed(model: nn.Module) -> CheckpointedForward | None:
    fwd = model.__dict__.get("forward")
    return fwd if isinstance(fwd, CheckpointedForward) else None


def _install(
    model: nn.Module,
    units: tuple[Unit, ...],
    chain: Chain,
    plan: Plan,
    spec: SegmentsSpec,
    probe: DryRun | None,
) -> None:
    previous = _installed(model)
    original = previous.original_forward if previous is not None else model.__dict__.get("forward")
    model.__dict__["forward"] = CheckpointedForward(model, units, chain, plan, spec, probe, original)
