"""The forward hooks a recompute runs: which modules count, their state, the guard's error.

Part of the mutation guard (NOTE [Mutation guard] in ``execution/runtime.py``): a forward
hook or pre-hook added or removed between a checkpointed segment's forward and its
backward would make the recompute differ from the forward, so the runtime keeps the hook
state after the forward and compares it before the recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from autockpt.errors import MutationError
from autockpt.walkers.chain import Stage

__all__ = ["HookState", "hook_error", "hook_state", "hooked_modules"]

NamedModules = Sequence[tuple[str, nn.Module]]

# global pre-hook ids, global hook ids, and per module that has hooks (by its index in the
# hooked modules): (index, pre-hook ids, hook ids)
HookState = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]]


def hooked_modules(stages: Sequence[Stage], named: NamedModules) -> tuple[tuple[str, nn.Module], ...]:
    """The modules of ``named`` whose forward hooks run inside the segment of ``stages``.

    Left out: a block walker's block (its ``__call__``, hooks included, runs around the
    checkpoint, once per step) and the modules a graph trace went through (their code is
    inlined in the trace, their hooks never run; adding one makes the next call trace again).
    """
    outside = {id(m) for stage in stages for unit in stage.units for m in unit.hooks_outside}
    return tuple((name, m) for name, m in named if id(m) not in outside)


def hook_state(hooked: NamedModules) -> HookState:
    """The forward hooks and pre-hooks that would run on ``hooked``, as handle ids.

    Handle ids are unique per registration, so any addition or removal changes the state.
    Costs a truthiness test per module without hooks.
    """
    g = nn.modules.module
    per_module = [
        (i, tuple(m._forward_pre_hooks), tuple(m._forward_hooks))
        for i, (_, m) in enumerate(hooked)
        if m._forward_pre_hooks or m._forward_hooks
    ]
    return tuple(g._global_forward_pre_hooks), tuple(g._global_forward_hooks), tuple(per_module)


def hook_error(segment: str, hooked: NamedModules, then: HookState, now: HookState) -> MutationError:
    """The error naming the first module whose forward hooks changed, and how."""
    changes: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    if then[:2] != now[:2]:
        first = f", here from module {_name(*hooked[0])}" if hooked else ""
        where = (
            f"the global forward hooks (torch.nn.modules.module.register_module_forward_hook and "
            f"_pre_hook, which run on every module{first})"
        )
        changes += [(where, "pre-hook", then[0], now[0]), (where, "hook", then[1], now[1])]
    before = {i: (pre, post) for i, pre, post in then[2]}
    after = {i: (pre, post) for i, pre, post in now[2]}
    for i in sorted(before.keys() | after.keys()):
        where = f"the forward hooks of module {_name(*hooked[i])}"
        (pre0, post0), (pre1, post1) = before.get(i, ((), ())), after.get(i, ((), ()))
        changes += [(where, "pre-hook", pre0, pre1), (where, "hook", post0, post1)]
    where, kind, old, new = next(c for c in changes if c[2] != c[3])
    counts = ((len(set(new) - set(old)), "added"), (len(set(old) - set(new)), "removed"))
    what = " and ".join(f"{n} forward {kind}{'s' if n > 1 else ''} {verb}" for n, verb in counts if n)
    return MutationError(
        f"autockpt: {where} changed between the forward and the backward of {segment}: "
        f"{what or f'forward {kind}s reordered'}. Its recompute would run other hooks than its forward "
        f"did and give wrong gradients. Add and remove hooks after backward() (or before the "
        f"forward), or make a hook act once per step with autockpt.is_recomputing()."
    )


def _name(name: str, module: nn.Module) -> str:
    return f"{name!r} ({type(module).__name__})" if name else f"{type(module).__name__} (the root)"
