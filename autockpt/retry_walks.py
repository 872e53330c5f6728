"""Walks kept for the retry after an infeasible budget (NOTE [A retry after an infeasible budget]).

NOTE [A retry after an infeasible budget]
    A budget below the floor raises PlanInfeasibleError with the floor and the unwrapped
    peak, and the natural next call is the same one at a feasible budget. The profile is
    cached (measure/model_profile.py), but walking and dry-running again made that retry
    cost much of the first call. So the walk, dry run and chain of a call that ended
    infeasible are kept for the model's next call, used only if that call's walk would see
    the same things: walker choice, the same modules in the same places, their forwards
    and plain settings (train/eval mode, flags, rates), parameter and input shapes and the
    other arguments; any other call drops them.

    A traced walk (the graph walker's fx trace) needs more. It holds the model, so a cache
    keyed weakly by the model would keep it alive (a leak, found in review); it is kept in
    a dict keyed weakly by the error the call raised instead, alive only while the caller
    holds that error, which is while the natural retry runs (inside its ``except``). And it
    bakes in control flow that any attribute may have decided, a config object's fields
    included (found in review): its key adds every module's non-tensor attributes, pickled
    (so nested objects count; an attribute that does not pickle means no reuse), and the
    class's ``forward`` beside the instance's. Globals stay unseen, as they are for the
    trace installed by any plan. On timm's mobilenetv2_035 (infeasible at 0.6, then the
    retry) this took the budget plan from 0.73 to 0.55-0.60 s CPU, about 10.6 to 8.3 steps.
"""

from __future__ import annotations

import io
import pickle
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.chain import Chain, DryRun
from autockpt.errors import PlanInfeasibleError
from autockpt.tensors import arguments_key, as_args, signature
from autockpt.walkers import Walked

__all__ = ["keep_for_retry", "take_kept"]

Kept = tuple[Hashable, Walked, DryRun | None, Chain]

_UNTRACED: weakref.WeakKeyDictionary[nn.Module, Kept] = weakref.WeakKeyDictionary()
_TRACED: weakref.WeakKeyDictionary[PlanInfeasibleError, tuple[nn.Module, Kept]] = weakref.WeakKeyDictionary()
_MODULE_STATE = frozenset(vars(nn.Module())) | {"forward"}  # hooks, registries; the installed forward


def keep_for_retry(
    err: PlanInfeasibleError,
    model: nn.Module,
    walked: Walked,
    dry: DryRun | None,
    chain: Chain,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    saved: bool,
) -> None:
    """Keep the walk of a call that raised ``err`` for the model's next call."""
    traced = walked.program is not None
    key = _walk_key(model, example_inputs, example_kwargs, mode, saved=saved, traced=traced)
    if not traced:
        _UNTRACED[model] = (key, walked, dry, chain)
    elif key is not None:
        _TRACED[err] = (model, (key, walked, dry, chain))


def take_kept(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    saved: bool,
) -> tuple[Walked, DryRun | None, Chain] | None:
    """The walk kept for ``model``'s retry, if this call's walk would see the same things;
    whatever was kept for it is dropped either way."""
    kept = _UNTRACED.pop(model, None)
    for err, (owner, entry) in list(_TRACED.items()):
        if owner is model:
            del _TRACED[err]
            kept = entry
    if kept is None:
        return None
    key, walked, dry, chain = kept
    traced = walked.program is not None
    now = _walk_key(model, example_inputs, example_kwargs, mode, saved=saved, traced=traced)
    return (walked, dry, chain) if now is not None and now == key else None


def _walk_key(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    saved: bool,
    traced: bool,
) -> Hashable:
    """What a walk and dry run of ``model`` on these inputs depend on; for a traced walk,
    every attribute too (``None`` when one does not pickle: then nothing is reused)."""
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    modules = list(model.named_modules())
    key = (
        mode,
        saved,
        tuple(kwargs),
        arguments_key([list(args), kwargs]),
        signature(list(model.parameters())),
        tuple((name, id(m), id(m.__dict__.get("forward")), _settings(m)) for name, m in modules),
    )
    if not traced:
        return key
    buffer = io.BytesIO()
    try:
        _ByIdentity(buffer).dump([_attributes(m) for _, m in modules])
    except Exception:  # anything a user stored on a module may refuse to pickle
        return None
    attributes = buffer.getvalue()
    return (*key, tuple(id(type(m).forward) for _, m in modules), attributes)


class _ByIdentity(pickle.Pickler):
    """Pickles tensors and modules met inside attributes (a plain list of layers) by
    identity: their contents are the parameters' and buffers' business, and copying them
    would cost the model's size."""

    def persistent_id(self, obj: Any) -> int | None:
        return id(obj) if isinstance(obj, (torch.Tensor, nn.Module)) else None


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's plain settings (``training``, ``inplace``, ``p``, flags a forward reads)."""
    return tuple(
        (k, v)
        for k, v in vars(module).items()
        if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
    )


def _attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own attributes other than its tensors, submodules, hooks and registries."""
    return {
        k: v
        for k, v in vars(module).items()
        if k not in _MODULE_STATE and not isinstance(v, (torch.Tensor, nn.Module))
    }
