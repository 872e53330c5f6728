"""The walk and dry run of a model on example inputs, remembered for the next call.

NOTE [Walks remembered]
    ``make_plan(budget=...)`` then ``auto_checkpoint(budget=...)``, ``profile`` then a plan,
    or a retry after :class:`~autockpt.errors.PlanInfeasibleError` walk the model (an fx
    trace) and dry-run it again on the same inputs, which costs one to two training steps
    of a small model each time (mobilenet_v2: 1.2 steps of the 10 a budget retry took).
    The profile is already remembered (``model_profile.py``); the walk and dry run are too,
    the latest per model, keyed by what they depend on: the walker asked for, the arguments
    traced as ``None``, the inputs' shapes, dtypes, strides and devices, and per module its
    identity, class, train/eval mode, ``inplace`` flag, instance ``forward`` (installing a
    plan replaces it, so a planned model is walked afresh) and forward hooks, with the
    global hooks and the parameters' shapes. Like the profile, the dry run is taken to
    depend on the inputs' shapes, not their values.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

from torch import nn

from autockpt.chain import DryRun
from autockpt.measure.dry_run import dry_run
from autockpt.tensors import tensors_in
from autockpt.walkers import Walked, walk
from autockpt.walkers.graph import none_pattern

__all__ = ["walked_on"]

# per model: the key, what it was computed from (kept alive, so that no id in the key is
# reused by a new object while the entry lives), the walk and the dry run
_WALKS: weakref.WeakKeyDictionary[nn.Module, tuple[Hashable, list[object], Walked, DryRun | None]] = (
    weakref.WeakKeyDictionary()
)


def walked_on(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str | None, *, where: str
) -> tuple[Walked, DryRun | None]:
    """The walk of ``model`` for a call on these inputs and its dry run on them, reused
    while nothing they depend on has changed (NOTE [Walks remembered])."""
    none_args = none_pattern(model, args, kwargs)
    alive: list[object] = []
    key = _key(model, args, kwargs, mode, none_args, alive)
    hit = _WALKS.get(model)
    if hit is not None and hit[0] == key:
        return hit[2], hit[3]
    walked = walk(model, mode, where=where, none_args=none_args)
    dry = dry_run(model, walked, args, kwargs, where=where)
    _WALKS[model] = (key, alive, walked, dry)
    return walked, dry


def _key(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mode: str | None,
    none_args: frozenset[str],
    alive: list[object],
) -> Hashable:
    """What the walk and dry run depend on; ``alive`` receives the objects whose ids it holds."""
    g = nn.modules.module
    alive.extend(model.modules())
    alive.extend(model.parameters())
    alive.extend(m.__dict__.get("forward") for m in model.modules())
    modules = tuple(
        (
            id(m),
            type(m),
            m.training,
            getattr(m, "inplace", None),
            id(m.__dict__.get("forward")),
            tuple(m._forward_pre_hooks),
            tuple(m._forward_hooks),
        )
        for m in model.modules()
    )
    inputs = tuple(
        (tuple(t.shape), t.dtype, str(t.device), t.stride(), t.requires_grad)
        for t in tensors_in([list(args), kwargs])
    )
    params = tuple((id(p), tuple(p.shape)) for p in model.parameters())
    hooks = (tuple(g._global_forward_pre_hooks), tuple(g._global_forward_hooks))
    return mode, none_args, tuple(sorted(kwargs)), len(args), inputs, modules, params, hooks
