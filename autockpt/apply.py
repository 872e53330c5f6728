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
from torch.utils._pytree import tree_leaves

from autockpt.blocks import BlockCall, BlockForward
from autockpt.budget_spec import parse_budget
from autockpt.errors import AutockptError, PlanInfeasibleError
from autockpt.graph import UnbindableError
from autockpt.plan import Plan, Segment, format_bytes
from autockpt.planners import PlanRequest, get_planner, run_planner
from autockpt.planners.basic import sqrt_segment_count, uniform_plan
from autockpt.planners.budget import predict
from autockpt.planners.registry import Planner
from autockpt.runtime import SegmentRuntime, build_runtime, dry_run_state, run_segments
from autockpt.walk import (
    Chain,
    DryRun,
    Unit,
    build_chain,
    chain_from_names,
    probe_units,
)
from autockpt.walkers import Walked, walk

__all__ = ["apply_plan", "auto_checkpoint", "make_plan", "restore"]

logger = logging.getLogger(__name__)

SegmentsSpec = int | str | Planner | Plan


def auto_checkpoint(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    budget: int | float | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    check: bool = False,
) -> nn.Module:
    """Checkpoint ``model`` in place so training keeps fewer activations alive.

    The model's forward is replaced by one that runs checkpointed segments through
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``; gradients, dropout
    masks and buffer updates are those of the unwrapped model. Calling it again replaces
    the plan. Under ``torch.no_grad()`` or ``inference_mode`` the original forward runs.

    Args:
        model: any module. An ``nn.Sequential`` is walked directly (nested ones are
            flattened), anything else is traced with ``torch.fx`` and cut where one tensor
            crosses, and an untraceable model gets its repeated blocks checkpointed.
        segments: ``"sqrt"`` (``ceil(sqrt(n))`` segments), an int number of segments,
            ``"none"``, another registered planner name, a callable planner, or a
            :class:`Plan`. All segments but the last are recomputed in backward.
        budget: plan for a memory budget instead: bytes, a string such as ``"2GiB"`` or
            ``"512MB"``, or a fraction in (0, 1] of the unwrapped step's peak. The budget
            covers one training step with parameters, buffers and inputs included. Needs
            ``example_inputs``: every stage is profiled on them, and the ``"budget"``
            planner picks the plan with least recompute whose predicted peak fits.
        example_inputs: positional inputs for a dry run that finds modules which modify
            their input in place; without them the dry run happens on the first training
            forward.
        example_kwargs: keyword inputs for the same dry run (e.g. an attention mask).
        mode: force a walker: ``"sequential"``, ``"graph"`` or ``"blocks"``. With the
            block walker, ``"sqrt"`` and an int ``k`` mean ``k`` (or ``ceil(sqrt(n))``)
            evenly spread blocks are checkpointed, each on its own.
        check: with a budget, run one training step on the example inputs and measure its
            real peak; if it is above the budget, plan again for a budget lowered by the
            excess (up to three times). The measured figure goes into the plan's notes, and
            a warning says so if the budget could not be kept.

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
    walked, probe, chain, plan = _plan(
        model, segments, budget, example_inputs, example_kwargs, mode, where="auto_checkpoint"
    )
    _install(model, walked, chain, plan, plan if budget is not None else segments, probe)
    if check and budget is not None:
        _keep_the_promise(model, budget, example_inputs, example_kwargs, mode)
    return model


def _keep_the_promise(
    model: nn.Module,
    budget: int | float | str,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
) -> None:
    """Measure the applied plan; while it exceeds the budget, plan for less and re-measure."""
    from autockpt.verification import measure_step

    fwd = _installed(model)
    assert fwd is not None
    args, kwargs = _as_args(example_inputs or ()), dict(example_kwargs or {})
    target = fwd.plan.budget_bytes or 0
    limit, measured = target, measure_step(model, args, kwargs)
    for _ in range(3):
        if measured <= target:
            break
        limit -= measured - target
        try:
            _, probe, chain, plan = _plan(model, "sqrt", limit, args, kwargs, mode, where="auto_checkpoint")
        except PlanInfeasibleError:
            break
        _install(model, fwd.walked, chain, plan, plan, probe)
        fwd = _installed(model)
        assert fwd is not None
        measured = measure_step(model, args, kwargs)
    note = f"measured peak {format_bytes(measured)} for budget {format_bytes(target)}"
    fwd.plan = Plan(**{**fwd.plan.__dict__, "notes": (*fwd.plan.notes, note)})
    if measured > target:
        warnings.warn(f"auto_checkpoint: {note}; no plan found that keeps it.", UserWarning, stacklevel=3)


def make_plan(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    budget: int | float | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
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
    return _plan(model, segments, budget, example_inputs, example_kwargs, mode, where="make_plan")[3]


def _plan(
    model: nn.Module,
    segments: SegmentsSpec,
    budget: int | float | str | None,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    where: str,
) -> tuple[Walked, DryRun | None, Chain, Plan]:
    """Walk, dry-run, profile when a budget asks for it, and plan."""
    if budget is not None and segments not in ("sqrt", "budget"):
        raise ValueError(f"{where}: got both segments={segments!r} and budget={budget!r}. Pass one of them.")
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
    from autockpt.profiling import profile_chain

    x = _entry_value(walked, _as_args(example_inputs or ()), dict(example_kwargs or {}), where)
    static = _static_bytes(model, x)
    prof = profile_chain(model, chain, x, static)
    unwrapped = static + predict((Segment(0, len(chain.stages), False),), prof.costs).peak_bytes
    budget_bytes = parse_budget(budget, unwrapped_bytes=unwrapped, where=where)
    request = PlanRequest(
        stage_names=chain.names,
        input_bytes=chain.input_bytes,
        saved_bytes=chain.saved_bytes,
        costs=prof.costs,
        budget_bytes=budget_bytes,
        static_bytes=static,
    )
    try:
        segs = run_planner(get_planner("budget", where=where), request, where=where)
    except PlanInfeasibleError as err:
        raise PlanInfeasibleError(str(err).replace("budget planner:", f"{where}:", 1)) from None
    prediction = predict(segs, prof.costs)
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
        ),
    )
    return walked, probe, chain, plan


def _static_bytes(model: nn.Module, x: Any) -> int:
    """Parameters, buffers and inputs: what a training step needs before it starts."""
    tensors = [
        *model.parameters(),
        *model.buffers(),
        *(t for t in tree_leaves(x) if isinstance(t, torch.Tensor)),
    ]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Checkpoint ``model`` in place with exactly ``plan`` (see :meth:`Plan.apply`)."""
    _check_module(model, "Plan.apply")
    walked = walk(model, plan.walker, where="Plan.apply")
    chain = chain_from_names(plan.walker, walked.units, plan.stage_names)
    _install(model, walked, chain, plan, plan, _probe(model, walked, None, None, "Plan.apply"))
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
    fwd.remove_blocks()
    del model.__dict__["forward"]
    if fwd.original_forward is not None:
        model.__dict__["forward"] = fwd.original_forward
    return model


# --- planning -------------------------------------------------------------------------


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
    fwd = _installed(model)
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


# --- the installed forward ------------------------------------------------------------


class CheckpointedForward:
    """What ``model.forward`` is while a model is checkpointed (picklable, deep-copyable)."""

    _autockpt_forward = True

    def __init__(
        self,
        model: nn.Module,
        walked: Walked,
        chain: Chain,
        plan: Plan,
        spec: SegmentsSpec,
        probe: DryRun | None,
        original_forward: Callable[..., Any] | None,
    ) -> None:
        self.model = model
        self.walked = walked
        self.plan = plan
        self.spec = spec
        self.probe = probe
        self.original_forward = original_forward
        self.blocks: list[nn.Module] = []
        self.warned_unbindable = False
        self.runtime: tuple[SegmentRuntime, ...] = ()
        self._bind(chain)

    @property
    def units(self) -> tuple[Unit, ...]:
        """The walker's units, before fusion."""
        return self.walked.units

    def _bind(self, chain: Chain) -> None:
        """Build the runtime for the current plan; for blocks, install their forwards."""
        self.runtime = build_runtime(self.plan.segments, chain.stages)
        if self.walked.walker != "blocks":
            return
        self.remove_blocks()
        for rt in self.runtime:
            if rt.segment.checkpoint:
                (unit,) = rt.stages[0].units
                call = unit.fn
                assert isinstance(call, BlockCall)
                call.block.__dict__["forward"] = BlockForward(rt, call)
                self.blocks.append(call.block)

    def remove_blocks(self) -> None:
        """Give checkpointed blocks their own forward back."""
        for block in self.blocks:
            fwd = block.__dict__.pop("forward", None)
            if isinstance(fwd, BlockForward) and fwd.call.original is not None:
                block.__dict__["forward"] = fwd.call.original
        self.blocks = []

    def _plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.original_forward is not None:
            return self.original_forward(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            not torch.is_grad_enabled()
            or self.plan.checkpointed_segments == 0
            or self.walked.walker == "blocks"  # the blocks checkpoint themselves
        ):
            return self._plain(*args, **kwargs)
        program = self.walked.program
        if program is None:
            if len(args) != 1 or kwargs:
                return self._plain(*args, **kwargs)  # let the model raise its own TypeError
            x = args[0]
        else:
            if program.hooks_added():
                self._retrace()
                program = self.walked.program
                assert program is not None
            try:
                x = program.bind(args, kwargs)
            except UnbindableError as missing:
                if not self.warned_unbindable:
                    self.warned_unbindable = True
                    warnings.warn(
                        f"auto_checkpoint: {type(self.model).__name__} was traced with "
                        f"{missing.args[0]!r} given, but it is None now; this call runs without "
                        f"checkpointing. Pass it, or checkpoint with mode='blocks'.",
                        UserWarning,
                        stacklevel=3,
                    )
                return self._plain(*args, **kwargs)
        if self.probe is None:
            self._dry_run(x)
        out = run_segments(self.runtime, x)
        return out if program is None else program.result(out)

    def _retrace(self) -> None:
        """Hooks were added to a module the trace went through: trace again, keeping it whole."""
        logger.info("autockpt: hooks were added inside %s; tracing again", type(self.model).__name__)
        self.walked = walk(self.model, "graph", where="auto_checkpoint")
        self.probe = None
        chain = build_chain("graph", self.walked.units)
        spec = self.spec if self.spec is not None and not isinstance(self.spec, Plan) else self.plan.strategy
        self.plan = plan_chain(chain, _respec(spec, len(chain.stages)), where="auto_checkpoint")
        self._bind(chain)

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
        plan = plan_chain(chain, spec, where="auto_checkpoint", notes=self.walked.notes)
        if plan != self.plan:
            logger.info("autockpt: re-planned %r after the dry run", spec)
            self.plan = plan
            self._bind(chain)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        spec = state["spec"]
        if callable(spec) and not isinstance(spec, Plan):
            try:
                pickle.dumps(spec)
            except Exception:  # a lambda or local function: keep the plan, drop the recipe
                state["spec"] = None
        return state


def _respec(spec: SegmentsSpec, n: int) -> SegmentsSpec:
    """A strategy recorded as text ("3", "sqrt") back as an argument, clamped to ``n``."""
    if isinstance(spec, str) and spec.isdigit():
        spec = int(spec)
    return min(spec, n) if isinstance(spec, int) else spec


def _installed(model: nn.Module) -> CheckpointedForward | None:
    fwd = model.__dict__.get("forward")
    return fwd if isinstance(fwd, CheckpointedForward) else None


def _install(
    model: nn.Module,
    walked: Walked,
    chain: Chain,
    plan: Plan,
    spec: SegmentsSpec,
    probe: DryRun | None,
) -> None:
    previous = _installed(model)
    if previous is not None:
        previous.remove_blocks()
    original = previous.original_forward if previous is not None else model.__dict__.get("forward")
    model.__dict__["forward"] = CheckpointedForward(model, walked, chain, plan, spec, probe, original)
