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
    a dict keyed weakly by the error the call raised instead, and used only while that
    error is the one being handled (or one it was raised from): the natural retry, inside
    the ``except``. An error kept afterwards (a notebook's ``sys.last_value``, a stored one)
    may have seen anything change since. And a trace bakes in control flow that any
    attribute may have decided, a config object's fields included (found in review): its
    key adds, pickled, every module's own attributes (plain data by value, so nested
    objects count; tensors, modules, functions and classes by identity, kept alive with
    the key so no id is reused), its class and the attributes of every class in its MRO
    below ``nn.Module`` (a helper method or class flag replaced), whether it has hooks (a
    module with hooks is a leaf of the trace), its parameter and buffer names, and the
    pattern of ``None`` arguments the trace was made for. An attribute that does not
    pickle, or a key over 1 MiB, means no reuse. Globals stay unseen, as they are for the
    trace installed by any plan. Found in a second review, all but the last tested. On
    timm's mobilenetv2_035 (infeasible at 0.6, then the retry) this took the budget plan
    from 0.73 to 0.55-0.60 s CPU, about 10.6 to 8.3 steps; the key costs 3-9 ms on small
    timm models.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.chain import Chain, DryRun
from autockpt.errors import PlanInfeasibleError
from autockpt.tensors import arguments_key, as_args, signature
from autockpt.walkers import Walked
from autockpt.walkers.graph import none_pattern
from autockpt.walkers.graph_nodes import has_hooks

__all__ = ["keep_for_retry", "take_kept"]

Kept = tuple[Hashable, Walked, DryRun | None, Chain]

_UNTRACED: weakref.WeakKeyDictionary[nn.Module, Kept] = weakref.WeakKeyDictionary()
# per error: the model, what was kept, and the objects the key names by identity (kept alive
# with it, so no id in the key can be reused by another object meanwhile)
_TRACED: weakref.WeakKeyDictionary[PlanInfeasibleError, tuple[nn.Module, Kept, list[Any]]] = (
    weakref.WeakKeyDictionary()
)
_MODULE_STATE = frozenset(vars(nn.Module())) | {"forward"}  # hooks, registries; the installed forward
_MAX_ATTRIBUTE_BYTES = 1 << 20  # beyond this, a key is not worth its cost: no reuse
_TORCH_MODULE_MRO = frozenset(nn.Module.__mro__)  # classes whose attributes are torch's, not the model's
# pickled by identity in a key (``_ByIdentity``)
_BY_IDENTITY = (
    torch.Tensor,
    nn.Module,
    type,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    staticmethod,
    classmethod,
    property,
)


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
    refs: list[Any] = []
    traced = walked.program is not None
    key = _walk_key(model, example_inputs, example_kwargs, mode, saved=saved, refs=refs if traced else None)
    if not traced:
        _UNTRACED[model] = (key, walked, dry, chain)
    elif key is not None:
        _TRACED[err] = (model, (key, walked, dry, chain), refs)


def take_kept(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    saved: bool,
) -> tuple[Walked, DryRun | None, Chain] | None:
    """The walk kept for ``model``'s retry, if this call's walk would see the same things
    (a traced one only while its error is being handled); whatever was kept for it is
    dropped either way."""
    kept = _UNTRACED.pop(model, None)
    for err, (owner, entry, _) in list(_TRACED.items()):
        if owner is model:
            del _TRACED[err]
            kept = entry if _being_handled(err) else None
    if kept is None:
        return None
    key, walked, dry, chain = kept
    refs: list[Any] | None = [] if walked.program is not None else None
    now = _walk_key(model, example_inputs, example_kwargs, mode, saved=saved, refs=refs)
    return (walked, dry, chain) if now is not None and now == key else None


def _being_handled(err: BaseException) -> bool:
    """Whether ``err`` is the exception being handled now, or one it was raised from: the
    retry inside the ``except`` of the failed call. An error kept afterwards (a notebook's
    ``sys.last_value``, a stored one) may have seen anything change since."""
    now = sys.exc_info()[1]
    while now is not None:
        if now is err:
            return True
        now = now.__context__
    return False


def _walk_key(
    model: nn.Module,
    example_inputs: Sequence[Any] | None,
    example_kwargs: dict[str, Any] | None,
    mode: str | None,
    *,
    saved: bool,
    refs: list[Any] | None,
) -> Hashable:
    """What a walk and dry run of ``model`` on these inputs depend on; with ``refs`` (a
    traced walk) also everything the trace may have specialised on, the objects named by
    identity appended to ``refs`` (``None`` when an attribute does not pickle or the key
    would be large: then nothing is reused)."""
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
    if refs is None:
        return key
    classes: dict[type, dict[str, Any]] = {}
    for _, m in modules:
        for cls in type(m).__mro__:
            if cls not in classes and cls not in _TORCH_MODULE_MRO:
                classes[cls] = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    state = (
        sorted(none_pattern(model, args, kwargs)),
        [(type(m), m.__dict__.get("forward"), has_hooks(m), list(m._parameters), [(k, v is None) for k, v in
          m._buffers.items()], _attributes(m)) for _, m in modules],
        list(classes.items()),
    )  # fmt: skip
    buffer = io.BytesIO()
    try:
        _ByIdentity(buffer, refs).dump(state)
    except Exception:  # anything a user stored on a module or class may refuse to pickle
        return None
    attributes = buffer.getvalue()
    return (*key, attributes) if len(attributes) <= _MAX_ATTRIBUTE_BYTES else None


class _ByIdentity(pickle.Pickler):
    """Pickles plain data by value and, by identity, what it cannot or should not copy:
    tensors and modules (their contents are the parameters' and buffers' business, and
    copying them would cost the model's size), functions, methods and classes (pickle would
    name them, and a replaced one of the same name must count as a change)."""

    def __init__(self, file: io.BytesIO, refs: list[Any]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, _BY_IDENTITY):
            self.refs.append(obj)  # alive as long as the key: its id cannot be reused
            return id(obj)
        return None


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """A module's plain settings (``training``, ``inplace``, ``p``, flags a forward reads)."""
    return tuple(
        (k, v)
        for k, v in vars(module).items()
        if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
    )


def _attributes(module: nn.Module) -> dict[str, Any]:
    """A module's own attributes other than its hooks and registries (tensors and modules
    stored as plain attributes included: fx bakes them into a trace)."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_STATE}
