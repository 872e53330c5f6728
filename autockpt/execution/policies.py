"""Op policies: inside a checkpointed segment, which ops' outputs are kept instead of recomputed.

A segment checkpointed plainly recomputes every op of its forward in backward. Under a
policy it keeps the outputs of the ops the policy names (typically the expensive ones:
matmuls, convolutions, attention) and recomputes only the rest, through torch's selective
checkpointing (``create_selective_checkpoint_contexts`` as non-reentrant ``checkpoint``'s
``context_fn``). A policy is a function ``op -> bool`` ("keep this op's output"), called
with the ``torch._ops.OpOverload`` each op dispatches to; named policies are registered
like planners.

NOTE [Kept outputs changed in place]
    torch caches a kept op's output as the very tensor the forward goes on with, so an
    in-place op after it (a convolution followed by ``ReLU(inplace=True)``, a residual
    ``add_``) changes the cached value, and the recompute would get the changed one: torch
    refuses that in backward. Which outputs are changed later is only known once the
    segment has run, so the first forward of every segment keeps nothing and notes, per op
    position, each output that a later op writes into; from the second forward on, the
    policy keeps what it names except those positions, and only where the op at a position
    is the one seen then. A write into a kept output that the first forward did not show
    (the segment's ops changed) raises :class:`~autockpt.errors.AutockptError` in the
    forward rather than a confusing error in backward.

NOTE [Policies under torch.compile]
    Dynamo captures a checkpoint's ``context_fn`` only as a plain function or a ``partial``
    of constants, called afresh for each trace, and AOTAutograd then traces the segment
    under the contexts it returns, tagging each node to save or recompute. So a compiled
    segment gets a stateless ``partial`` (``compiled_context_fn``) making the same choices
    as the eager ``SelectiveRecompute``: the policy's ops, or the ops a plan's
    ``Segment.keep`` names at their positions (a position whose op differs keeps nothing:
    safe, it is recomputed), never a random op. What the eager one learns on a first
    forward, the outputs a later op writes into, is not needed there: the compiled graph is
    functionalized, so no kept value is changed in place.

NOTE [Random ops are never kept]
    Keeping the output of a random op (dropout's mask) while recomputing its neighbours
    would be consistent, but a kept random op also skips its draw in the recompute, and
    the RNG replay that makes dropout exact assumes every draw happens again. A policy
    that asks to keep one is refused with the op's name; the named policies never do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)

from autockpt.errors import AutockptError
from autockpt.measure.tensors import storage_key, written_storages

__all__ = [
    "OpPolicy",
    "SelectiveRecompute",
    "available_policies",
    "compiled_context_fn",
    "register_policy",
    "resolve_policy",
]

OpPolicy = Callable[[torch._ops.OpOverload], bool]
ContextManager = contextlib.AbstractContextManager[Any]
"""Whether to keep an op's output (``True``) or recompute it in backward (``False``)."""

DEFAULT_POLICY = "recompute-all"
AUTO_POLICY = "auto"  # the budget planner chooses each segment's ops (Segment.keep)

_aten = torch.ops.aten

# Ops whose outputs cost many FLOPs per byte: matmuls, convolutions, attention.
MATMUL_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name)
    for name in (
        "mm addmm bmm baddbmm _int_mm convolution _convolution mkldnn_convolution cudnn_convolution "
        "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_flash_attention "
        "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
        "_flash_attention_forward _efficient_attention_forward"
    ).split()
    if hasattr(_aten, name)
)

# Besides those: reductions over their input that take several passes (norms, softmax,
# pooling), whose recompute costs more time per byte kept than a pointwise op's.
COMPUTE_OPS: frozenset[Any] = MATMUL_OPS | frozenset(
    getattr(_aten, name)
    for name in (
        "native_layer_norm native_group_norm native_batch_norm _native_batch_norm_legit "
        "_native_batch_norm_legit_functional _fused_rms_norm _softmax _log_softmax "
        "max_pool2d_with_indices max_pool3d_with_indices avg_pool2d avg_pool3d "
        "_adaptive_avg_pool2d _adaptive_avg_pool3d upsample_bilinear2d upsample_nearest2d"
    ).split()
    if hasattr(_aten, name)
)


def _in(ops: frozenset[Any], op: torch._ops.OpOverload) -> bool:
    return op.overloadpacket in ops


_POLICIES: dict[str, OpPolicy | None] = {
    DEFAULT_POLICY: None,
    AUTO_POLICY: None,
    "save-matmuls": functools.partial(_in, MATMUL_OPS),
    "save-compute": functools.partial(_in, COMPUTE_OPS),
}


def register_policy(name: str, policy: OpPolicy) -> None:
    """Register ``policy`` (``op -> bool``: keep this op's output) under ``name`` for
    ``policy=``.

    Raises:
        ValueError: the name is taken or empty.
        TypeError: ``policy`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_policy: name must be a non-empty string, got {name!r}.")
    if name in _POLICIES:
        raise ValueError(f"register_policy: a policy named {name!r} exists already; choose another name.")
    if not callable(policy):
        raise TypeError(
            f"register_policy: policy must be callable (op -> bool), got {type(policy).__name__}."
        )
    _POLICIES[name] = policy


def available_policies() -> list[str]:
    """Names ``policy=`` accepts: the built-in ones and those registered."""
    return sorted(_POLICIES)


def resolve_policy(spec: str | OpPolicy | None, *, where: str) -> tuple[str, OpPolicy | None]:
    """``(name, function)`` for a ``policy=`` argument; the function is ``None`` for
    ``"recompute-all"``. A callable is named after its qualified name.

    Raises:
        ValueError: an unknown name.
        TypeError: neither a name nor a callable.
    """
    if spec is None:
        return DEFAULT_POLICY, None
    if isinstance(spec, str):
        if spec not in _POLICIES:
            raise ValueError(
                f"{where}: unknown policy {spec!r}; choose one of {available_policies()}, or pass a "
                "function op -> bool (keep this op's output), or register one with autockpt.register_policy."
            )
        name, fn = spec, _POLICIES[spec]
    elif callable(spec):
        name, fn = f"callable {getattr(spec, '__qualname__', type(spec).__name__)}", spec
    else:
        raise TypeError(f"{where}: policy must be a registered name or a function op -> bool, got {spec!r}.")
    if (fn is not None or name == AUTO_POLICY) and not _SEES_OUTPUTS:
        raise AutockptError(
            f"{where}: policy={name!r} needs a torch whose selective checkpointing shows the policy each "
            f"op's output (SelectiveCheckpointContext.op_output); torch {torch.__version__} does not. "
            "Upgrade torch, or use policy='recompute-all'."
        )
    return name, fn


# NOTE [Kept outputs changed in place] needs each kept output's storage when deciding
_SEES_OUTPUTS = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters


class SelectiveRecompute:
    """The ``context_fn`` of one checkpointed segment under a policy (NOTE [Kept outputs
    changed in place], NOTE [Random ops are never kept]); under ``torch.compile`` the
    segment gets :func:`compiled_context_fn` instead."""

    def __init__(
        self, name: str, policy: OpPolicy | None, segment: str, keep: frozenset[str] | None = None
    ) -> None:
        self.name = name
        self.policy = policy
        self.keep = keep  # "position:op" keys a plan chose (Segment.keep), instead of a policy
        # the same as position -> op name, looked up per op without formatting a key
        self.keep_at = {int(p): n for p, _, n in (k.partition(":") for k in keep or ())}
        self.segment = segment
        self.probed = False
        self.ops: dict[int, Any] = {}  # position -> op, as the first forward ran them
        self.changed: set[int] = set()  # positions whose output a later op writes into

    def __call__(
        self,
    ) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
        probing = not self.probed
        self.probed = True
        counter = itertools.count()
        kept_at: dict[int, int] = {}  # storage id -> position of the kept (or wanted) output

        def decide(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            k = next(counter)
            for storage in written_storages(op, args, kwargs):
                if storage in kept_at:
                    pos = kept_at.pop(storage)
                    if not probing and pos not in self.changed:
                        raise AutockptError(
                            f"policy {self.name!r} kept the output of {self.ops.get(pos)} in {self.segment}, "
                            f"and {op} then changed it in place, which its first forward did not do. "
                            "The segment's ops differ between calls; use policy='recompute-all' for it."
                        )
                    self.changed.add(pos)
            if probing:
                self.ops[k] = op
            if self.keep is not None:
                name = self.keep_at.get(k)
                wanted = name is not None and name == str(op)
            else:
                wanted = self._wants(op)
            if not wanted:
                return CheckpointPolicy.PREFER_RECOMPUTE
            for t in ctx.op_output if isinstance(ctx.op_output, (list, tuple)) else (ctx.op_output,):
                if isinstance(t, torch.Tensor):
                    kept_at[storage_key(t)] = k
            keep = not probing and k not in self.changed and self.ops.get(k) is op
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        contexts: tuple[ContextManager, ContextManager] = create_selective_checkpoint_contexts(decide)
        return contexts

    def _wants(self, op: torch._ops.OpOverload) -> bool:
        if self.policy is None:
            return False
        try:
            wanted = bool(self.policy(op))
        except Exception as err:
            raise AutockptError(
                f"policy {self.name!r} raised {type(err).__name__} on {op} in {self.segment}: {err}"
            ) from err
        if wanted and torch.Tag.nondeterministic_seeded in op.tags:
            raise AutockptError(
                f"policy {self.name!r} keeps the output of {op} in {self.segment}, a random op: its draw "
                "would be skipped in the recompute, so dropout could not be exact. Return False for ops "
                "tagged torch.Tag.nondeterministic_seeded."
            )
        return wanted


def compiled_context_fn(
    selective: SelectiveRecompute,
) -> functools.partial[tuple[ContextManager, ContextManager]]:
    """The ``context_fn`` of ``selective``'s segment inside a compiled graph (NOTE [Policies
    under torch.compile]): the same ops kept, decided without state carried between calls,
    as dynamo requires of a checkpoint's ``context_fn`` (a function or a ``partial`` of
    constants)."""
    keep_at = tuple(sorted(selective.keep_at.items())) if selective.keep is not None else None
    return functools.partial(_compiled_contexts, selective.policy, keep_at)


def _compiled_contexts(
    policy: OpPolicy | None, keep_at: tuple[tuple[int, str], ...] | None
) -> tuple[ContextManager, ContextManager]:
    """Fresh contexts for one trace of a segment: op ``k`` of the forward is kept when the
    policy wants it (``keep_at``: when the plan named it at position ``k``) and it is not a
    random op; the recompute asks again position by position and gets the same answer."""
    chosen = dict(keep_at) if keep_at is not None else None
    decisions: list[bool] = []
    replayed = itertools.count()

    def decide(ctx: Any, op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute:
            k = next(replayed)
            wanted = decisions[k] if k < len(decisions) else False
        else:
            k = len(decisions)
            random = torch.Tag.nondeterministic_seeded in op.tags
            if chosen is not None:
                wanted = chosen.get(k) == str(op) and not random
            else:
                wanted = policy is not None and bool(policy(op)) and not random
            decisions.append(wanted)
        return CheckpointPolicy.MUST_SAVE if wanted else CheckpointPolicy.PREFER_RECOMPUTE

    contexts: tuple[ContextManager, ContextManager] = create_selective_checkpoint_contexts(decide)
    return contexts
