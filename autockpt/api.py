"""The public entry points: plan a model, checkpoint it in place, undo it.

``auto_checkpoint`` replaces only the model object's ``forward`` (an instance attribute),
so the class, the module tree, the parameter objects and the ``state_dict`` keys stay as
they were, optimizers keep working, and ``restore`` removes the attribute again.

The dry run and the re-planning it may cause: NOTE [The one-time dry run] in
``execution/forward.py``. Planning happens in ``planning/prepare.py``, the measured step of
``check=True`` in ``measure/step.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

from autockpt.errors import AutockptError, PlanInfeasibleError
from autockpt.execution.forward import CheckpointedForward, install, installed, uninstall, uninstall_within
from autockpt.execution.lm_head import can_chunk, installed_head, set_head, whole_head_note
from autockpt.execution.policies import OpPolicy, resolve_policy
from autockpt.measure.losses import LossFn
from autockpt.measure.step import measure_step
from autockpt.measure.tensors import as_args
from autockpt.plan import Plan, format_bytes, set_applier
from autockpt.planning.prepare import Replanner, SegmentsSpec, prepare, reused_dry_run
from autockpt.walkers import walk
from autockpt.walkers.chain import chain_from_names

__all__ = ["apply_plan", "auto_checkpoint", "make_plan", "restore"]

REPLANNER = Replanner()  # what an installed forward asks for a new plan (execution plans nothing)


def auto_checkpoint(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    budget: int | float | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    loss_fn: LossFn | None = None,
    check: bool = False,
    debug: bool = False,
    policy: str | OpPolicy | None = None,
    head: str | None = None,
    head_chunks: int | str = "auto",
) -> nn.Module:
    """Checkpoint ``model`` in place so training keeps fewer activations alive.

    The model's forward is replaced by one that runs checkpointed segments through a
    non-reentrant checkpoint (autockpt's own lean one in plain eager steps,
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` under ``torch.compile``,
    op policies or saved-tensor hooks); gradients, dropout masks and buffer updates are
    those of the unwrapped model. Calling it again replaces the plan. Under
    ``torch.no_grad()`` or ``inference_mode`` the original forward runs.

    Args:
        model: any module. An ``nn.Sequential`` is walked directly (nested ones are
            flattened), anything else is traced with ``torch.fx`` and cut where one tensor
            crosses, and an untraceable model gets its repeated blocks checkpointed.
        segments: ``"sqrt"`` (Chen's rule: about ``sqrt(n)`` segments, balanced by the
            bytes the dry run measured), an int number of segments,
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
            block walker each checkpoint holds one block: an int ``k`` means ``k`` evenly
            spread blocks, and ``"sqrt"`` every block (a block saves more than its input).
        loss_fn: with a budget, the loss you train with, from the model's output to a
            scalar (``lambda out: F.cross_entropy(out, labels)``). The loss runs while every
            saved activation is alive, so its bytes count; without it a weighted sum of the
            outputs stands in, which needs two tensors the size of the output.
        check: with a budget, run one training step on the example inputs and measure its
            real peak; if it is above the budget, plan again for a budget lowered by the
            excess (up to three times). The measured figure goes into the plan's notes, and
            a warning says so if the budget could not be kept. On a ``torch.compile``d
            model the plan is made and kept on the eager step, and one compiled step is
            measured too (compiling it then, not at the first training step): its peak is
            in the notes, with a warning if it is above the budget.
        debug: compare every op of each recompute with what the forward computed (shape,
            dtype, device and every bit of its outputs) and raise
            :class:`~autockpt.RecomputeMismatchError` (an :class:`AutockptError` and a
            ``torch.utils.checkpoint.CheckpointError``) naming the segment, the stage and
            the first op whose output differs. For finding a nondeterministic module: it
            costs a Python dispatch and a digest per op, and a device sync per recomputed
            op on CUDA. Without it a stage whose output shape, dtype or device differs in
            the recompute still raises that error, naming the segment and the stage.
        policy: inside each checkpointed segment, which ops' outputs are kept instead of
            recomputed: ``"recompute-all"`` (the default: none), ``"save-matmuls"``
            (matmuls, linear layers, convolutions, attention), ``"save-compute"`` (those,
            norms, softmax and pooling), a name registered with
            :func:`autockpt.register_policy`, or a function ``op -> bool`` called with each
            ``torch._ops.OpOverload``; with a budget, also ``"auto"``: the planner chooses
            each checkpointed segment's kept ops for the least recompute under the budget.
            With a budget, a named policy's kept outputs are counted by the planner, which
            then keeps exactly the ops it counted (``Segment.keep``). Kept outputs stay
            alive until the segment's backward: less recompute, more memory. The first
            forward of each segment keeps nothing while it learns which outputs later ops
            change in place (NOTE [Kept outputs changed in place] in
            ``execution/policies.py``); under ``torch.compile`` the compiled graph keeps
            the same ops from its first step (NOTE [Policies under torch.compile]).
        head: ``"whole"`` leaves the model's head and loss as they are; ``"chunked"``
            computes a Hugging Face causal LM's loss (called with ``labels=`` and gradients
            on) by :func:`autockpt.linear_cross_entropy`, so the logits for every token
            never exist at once: the largest tensors of a language model's step.
            The loss and every gradient are bitwise the model's own, except the head
            weight's (and its bias's, and the embedding tied to it), which are summed over
            chunks of tokens in another order. The output's ``logits`` are then ``None``;
            calls without labels or under ``torch.no_grad()`` return them as before. See
            NOTE [The head inside the model's own forward] in ``execution/lm_head.py``.
            By default (``None``): what the model has now, ``"whole"`` the first time.
        head_chunks: with ``head="chunked"``, ``"auto"`` or the number of token chunks
            (``linear_cross_entropy``'s ``chunks``).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a Module, or ``segments`` or ``debug`` has the wrong type.
        ValueError: ``segments`` is out of range or names no planner.
        AutockptError: the model has nothing to checkpoint or cannot be walked, or
            ``head="chunked"`` on a model whose loss autockpt cannot take over.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(9)])
        >>> model = autockpt.auto_checkpoint(model)
        >>> autockpt.make_plan(model).checkpointed_segments
        2
    """
    _check_module(model, "auto_checkpoint")
    _check_debug(debug, "auto_checkpoint")
    if (inner := _compiled_inner(model)) is not None:
        auto_checkpoint(inner, segments, budget=budget, example_inputs=example_inputs,
                        example_kwargs=example_kwargs, mode=mode, loss_fn=loss_fn, check=check,
                        debug=debug, policy=policy, head=head, head_chunks=head_chunks)  # fmt: skip
        if check and budget is not None:
            _note_the_compiled_peak(model, inner, example_inputs, example_kwargs, loss_fn)
        return model
    name, fn = _policy(policy, segments, "auto_checkpoint")
    if head is None:
        head = "chunked" if installed_head(model) is not None else "whole"
    before = _forwards(model)
    try:
        set_head(model, head, head_chunks, where="auto_checkpoint")
        walked, probe, chain, plan = prepare(
            model, segments, budget, example_inputs, example_kwargs, mode,
            where="auto_checkpoint", loss_fn=loss_fn, previous=_previous(model), policy=name, policy_fn=fn,
        )  # fmt: skip
        if head == "chunked" and walked.walker != "blocks":
            raise AutockptError(
                f"auto_checkpoint: head='chunked' runs {type(model).__name__}'s own forward with its blocks "
                f"checkpointed, but the {walked.walker} walker replaces that forward. Use mode='blocks'."
            )
    except PlanInfeasibleError as err:
        _put_forwards_back(model, before)
        if head == "whole" and can_chunk(model):
            raise PlanInfeasibleError(
                f"{err} {type(model).__name__}'s LM head and loss hold the logits of every token at "
                "once; with head='chunked' they run in token chunks, which lowers that floor.",
                min_budget_bytes=err.min_budget_bytes,
                unwrapped_bytes=err.unwrapped_bytes,
            ) from err
        raise
    except BaseException:
        _put_forwards_back(model, before)  # a failed call leaves the model as it found it
        raise
    if head == "chunked":  # in the walk's notes too, so plans made again keep saying it
        note = f"LM head and loss in token chunks (head='chunked', chunks={head_chunks!r})"
        walked = dataclasses.replace(walked, notes=(*walked.notes, note))
        plan = dataclasses.replace(plan, notes=(*plan.notes, note))
    elif budget is not None:
        labels = (example_kwargs or {}).get("labels")
        if (share := whole_head_note(model, labels, plan.predicted_peak_bytes)) is not None:
            plan = dataclasses.replace(plan, notes=(*plan.notes, share))
    spec = plan if budget is not None else segments
    install(model, walked, chain, plan, spec, probe, replanner=REPLANNER, debug=debug, policy_fn=fn)
    if check and budget is not None:
        _keep_the_promise(model, example_inputs, example_kwargs, mode, loss_fn)
    return model


def _keep_the_promise(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    loss_fn: LossFn | None,
) -> None:
    """Measure the applied plan; while it exceeds the budget, plan for less and re-measure."""
    fwd = _installed_or_fail(model)
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    target = fwd.plan.budget_bytes or 0
    limit, measured = target, measure_step(model, args, kwargs, loss_fn)
    for _ in range(3):
        if measured <= target:
            break
        limit -= measured - target
        if limit <= 0:  # the excess is more than the whole budget: no lower plan can help
            break
        try:
            _, probe, chain, plan = prepare(
                model, "sqrt", limit, args, kwargs, mode, where="auto_checkpoint", loss_fn=loss_fn,
                policy=fwd.plan.policy, policy_fn=fwd.policy_fn,
            )  # fmt: skip
        except PlanInfeasibleError:
            break
        install(
            model,
            fwd.walked,
            chain,
            plan,
            plan,
            probe,
            replanner=REPLANNER,
            debug=fwd.debug,
            policy_fn=fwd.policy_fn,
        )
        fwd = _installed_or_fail(model)
        measured = measure_step(model, args, kwargs, loss_fn)
    note = f"measured peak {format_bytes(measured)} for budget {format_bytes(target)}"
    if limit != target:
        note += f" (planned for {format_bytes(limit)} to keep it)"
    # the plan states the user's budget, whatever lower figure it was planned for
    fwd.plan = dataclasses.replace(fwd.plan, budget_bytes=target, notes=(*fwd.plan.notes, note))
    if measured > target:
        warnings.warn(f"auto_checkpoint: {note}; no plan found that keeps it.", UserWarning, stacklevel=3)


def _note_the_compiled_peak(
    compiled: nn.Module,
    inner: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    loss_fn: LossFn | None,
) -> None:
    """Measure one compiled step of the checkpointed model and say it in the plan's notes:
    the budget was kept on the eager step, which the compiled one may not match (compile
    fuses and reorders). The compilation this costs is the one training would do first."""
    fwd = _installed_or_fail(inner)
    measured = measure_step(compiled, as_args(example_inputs), dict(example_kwargs or {}), loss_fn)
    target = fwd.plan.budget_bytes or 0
    note = f"compiled step measured peak {format_bytes(measured)} for budget {format_bytes(target)}"
    fwd.plan = dataclasses.replace(fwd.plan, notes=(*fwd.plan.notes, note))
    if measured > target:
        warnings.warn(
            f"auto_checkpoint: {note}: torch.compile lays the step out otherwise than the eager one "
            "it was planned on. Lower the budget for the compiled model.",
            UserWarning,
            stacklevel=3,
        )


def make_plan(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    budget: int | float | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    loss_fn: LossFn | None = None,
    policy: str | OpPolicy | None = None,
) -> Plan:
    """The plan ``auto_checkpoint(model, segments, ...)`` would apply, without applying it.

    For a model that is already checkpointed, the stages found by its earlier dry run are
    reused. Arguments are those of :func:`auto_checkpoint`.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True),
        ...                             torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> autockpt.make_plan(model, 2).stage_names
        ('0+1', '2', '3')
    """
    _check_module(model, "make_plan")
    model = _compiled_inner(model) or model
    name, fn = _policy(policy, segments, "make_plan")
    return prepare(
        model, segments, budget, example_inputs, example_kwargs, mode,
        where="make_plan", loss_fn=loss_fn, previous=_previous(model), policy=name, policy_fn=fn,
    )[3]  # fmt: skip


def apply_plan(model: nn.Module, plan: Plan, *, debug: bool = False) -> nn.Module:
    """Checkpoint ``model`` in place with exactly ``plan`` (see :meth:`Plan.apply`); ``debug``
    as for :func:`auto_checkpoint`."""
    _check_module(model, "Plan.apply")
    _check_debug(debug, "Plan.apply")
    _, fn = _policy(None, plan, "Plan.apply")
    walked = walk(model, plan.walker, where="Plan.apply")
    chain = chain_from_names(plan.walker, walked.units, plan.stage_names)
    install(
        model, walked, chain, plan, plan, reused_dry_run(walked, _previous(model)),
        replanner=REPLANNER, debug=debug, policy_fn=fn,
    )  # fmt: skip
    return model


def _policy(policy: str | OpPolicy | None, segments: SegmentsSpec, where: str) -> tuple[str, OpPolicy | None]:
    """The op policy's name and function: ``policy`` if given, else a given Plan's own."""
    if policy is not None or not isinstance(segments, Plan):
        return resolve_policy(policy, where=where)
    if segments.policy.startswith("callable "):
        raise AutockptError(
            f"{where}: the plan was made with the policy function {segments.policy[9:]!r}, which a plan "
            "cannot carry; pass it again as policy=..., or register it with autockpt.register_policy."
        )
    return resolve_policy(segments.policy, where=where)


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`auto_checkpoint`: the model's original forward runs again.

    On a model that was checkpointed as a part of another (the model PEFT's
    ``merge_and_unload()`` returns), the checkpointed blocks inside it are restored.

    Raises:
        AutockptError: ``model`` was never checkpointed by autockpt.

    Examples:
        >>> import autockpt, torch
        >>> model = autockpt.auto_checkpoint(torch.nn.Sequential(torch.nn.Linear(2, 2)), "none")
        >>> autockpt.restore(model) is model and "forward" not in vars(model)
        True
    """
    _check_module(model, "restore")
    if (inner := _compiled_inner(model)) is not None:
        restore(inner)
        return model
    if not uninstall(model) and not uninstall_within(model):
        raise AutockptError(
            f"restore: this {type(model).__name__} is not checkpointed by autockpt, so there is "
            f"nothing to restore. Call autockpt.auto_checkpoint(model) first."
        )
    set_head(model, "whole", where="restore")
    return model


set_applier(apply_plan)  # NOTE [Plan.apply without an import cycle] in plan.py


def _previous(model: nn.Module) -> tuple[tuple[Any, ...], Any] | None:
    """The units and dry run of the plan installed on ``model`` now, for planning again."""
    fwd = installed(model)
    return (fwd.units, fwd.probe) if fwd is not None else None


def _forwards(model: nn.Module) -> tuple[Any, Any]:
    """The model's instance forward and, under a checkpointed one, the forward it calls."""
    fwd = model.__dict__.get("forward")
    return fwd, getattr(fwd, "original_forward", None) if isinstance(fwd, CheckpointedForward) else None


def _put_forwards_back(model: nn.Module, before: tuple[Any, Any]) -> None:
    fwd, inner = before
    if fwd is None:
        model.__dict__.pop("forward", None)
        return
    model.__dict__["forward"] = fwd
    if isinstance(fwd, CheckpointedForward):
        fwd.original_forward = inner


def _installed_or_fail(model: nn.Module) -> CheckpointedForward:
    fwd = installed(model)
    if fwd is None:
        raise AutockptError(f"auto_checkpoint: no plan is installed on this {type(model).__name__}.")
    return fwd


def _compiled_inner(model: nn.Module) -> nn.Module | None:
    """The module inside a ``torch.compile`` wrapper, whose forward the compiled code calls.

    Checkpointing it (before the first compiled call) is what ``auto_checkpoint`` on the
    wrapper means; the wrapper's own forward is dynamo's.
    """
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule" else None


def _check_module(model: object, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(model).__name__}.")


def _check_debug(debug: object, where: str) -> None:
    if not isinstance(debug, bool):
        raise TypeError(f"{where}: debug must be True or False, got {debug!r}.")
