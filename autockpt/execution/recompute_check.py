"""Checking a recompute against its forward: stage outputs always, every op with ``debug=True``.

NOTE [Recompute check]
    A checkpointed segment is exact only if its recompute computes what its forward did.
    torch compares the shape, dtype and device of the tensors the segment saved for
    backward, after the recompute, and its error names neither the segment nor the
    module. So the runtime checks twice, naming both:

    - Always: the shape, dtype and device of every stage's output (one tuple per stage,
      no tensor work). A module whose output shape changes from run to run raises
      :class:`RecomputeMismatchError` at the first stage whose output differs. A change
      that stays inside the last stage torch's early stop lets the recompute reach is
      still found by torch's own check, unnamed; ``debug=True`` names it.
    - ``debug=True``: an :class:`OpRecorder` (a ``TorchDispatchMode``) records every op
      the forward runs: its name, the unit (module) running it, the shape, dtype and
      device of its outputs (stride and offset for views) and a digest of their bits; the
      recompute is compared op by op, so the error names the first op whose output
      differs, in shape or in any bit. Costs: a Python dispatch and a digest per op
      (transient memory about six times the largest op output, in chunks of 4M
      elements), 16 bytes per tensor output kept until the segment's backward, and, on
      CUDA, a device sync per op of the recompute. ``aten.detach`` is not recorded:
      torch's recompute hook detaches what it saves, which the forward does not; nor is
      a copy of a parameter (a leaf requiring grad), which autocast caches per region. The
      values of ops that allocate without writing (``empty_like``, ``resize_``; dropout
      starts from one) are not compared, nor are those of views, whose stride and offset
      are compared instead (their values are their input's).

    A value digest rather than clones: clones of every op output would keep more than the
    unwrapped model's activations alive. The digest (a sum and a position-weighted sum of
    the outputs' bits as integers) is exact for any single difference and for permutations.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointError

from autockpt.errors import AutockptError
from autockpt.walkers.chain import Stage

__all__ = ["OpRecorder", "RecomputeMismatchError", "output_metadata", "run_stage", "stage_mismatch"]

_local = threading.local()
_IGNORED = frozenset({torch.ops.aten.detach.default})
_TO_COPY = torch.ops.aten._to_copy.default
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22
_FIX = (
    "Make the module deterministic (seed its randomness from torch's RNG, which checkpointing "
    "replays), let it act once per step with autockpt.is_recomputing(), or keep it out of "
    "checkpointed segments (auto_checkpoint(..., segments='none') or a plan that does not "
    "checkpoint it)."
)


class RecomputeMismatchError(AutockptError, CheckpointError):
    """A checkpointed segment's recompute in backward computed something other than its
    forward did (a nondeterministic module), so its gradients would be wrong.

    It is both an :class:`autockpt.AutockptError` and a
    ``torch.utils.checkpoint.CheckpointError``.
    """


def output_metadata(x: Any) -> Any:
    """The shape, dtype and device of the tensors in ``x`` (a stage's output)."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype, x.device)
    if isinstance(x, tuple) and all(isinstance(t, torch.Tensor) or t is None for t in x):  # most blocks
        return tuple((t.shape, t.dtype, t.device) for t in x if t is not None)
    return tuple((t.shape, t.dtype, t.device) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def stage_mismatch(segment: str, stage: Stage, forward: Any, recompute: Any) -> RecomputeMismatchError:
    """The error for a stage whose output differs between forward and recompute."""
    return RecomputeMismatchError(
        f"autockpt: the recompute of {segment} differs from its forward at stage {stage.name!r} "
        f"({stage.kind}): its output is {_describe(recompute)} in the recompute and "
        f"{_describe(forward)} in the forward. {_FIX} auto_checkpoint(..., debug=True) names "
        f"the first op that differs."
    )


def _describe(meta: Any) -> str:
    if meta and isinstance(meta[0], torch.Size):
        meta = (meta,)
    parts = [f"{tuple(shape)} {_dtype(dtype)} on {device}" for shape, dtype, device in meta]
    return "(" + ", ".join(parts) + ")" if len(parts) != 1 else parts[0]


@contextmanager
def _at(where: str) -> Iterator[None]:
    previous = getattr(_local, "where", "")
    _local.where = where
    try:
        yield
    finally:
        _local.where = previous


def run_stage(stage: Stage, x: Any) -> Any:
    """Run ``stage`` unit by unit, telling the recorders which unit runs (``debug=True``)."""
    for unit in stage.units:
        where = f"stage {stage.name!r}" + (f", module {unit.name!r}" if len(stage.units) > 1 else "")
        with _at(f"{where} ({unit.kind})"):
            x = unit.fn(x)
    return x


@dataclass(frozen=True)
class _Op:
    """One op of a forward: where it ran, its name, its outputs' metadata and digests."""

    where: str
    name: str
    meta: tuple[Any, ...]
    digests: tuple[torch.Tensor | None, ...]


class OpRecorder(TorchDispatchMode):
    """Records every op of a segment's forward, or compares a recompute with that record.

    Args:
        segment: the segment, as error messages name it.
        expected: ``None`` to record (the forward); the forward's record to compare with
            (the recompute).
    """

    def __init__(self, segment: str, expected: Sequence[_Op] | None = None) -> None:
        super().__init__()
        self.segment = segment
        self.expected = expected
        self.ops: list[_Op] = []
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _IGNORED or (func is _TO_COPY and _is_parameter_like(args[0])):
            return out
        with _disable_current_modes():
            view = bool(getattr(func, "is_view", False))
            values = not view and not _uninitialized(func)
            leaves = tree_flatten(out)[0]
            meta = tuple(_leaf_meta(leaf, view) for leaf in leaves)
            where = getattr(_local, "where", "")
            if self.expected is None:
                digests = tuple(_digest(leaf) if values else None for leaf in leaves)
                self.ops.append(_Op(where, str(func), meta, digests))
            else:
                self._compare(str(func), meta, leaves, values, where)
        self.count += 1
        return out

    def _compare(self, name: str, meta: tuple[Any, ...], leaves: list[Any], values: bool, where: str) -> None:
        i, expected = self.count, self.expected or ()
        if i >= len(expected):
            self._fail(i, where, name, f"the recompute ran {name} after the {i} ops of the forward")
        op = expected[i]
        if op.name != name:
            self._fail(i, where, name, f"the forward ran {op.name} there ({op.where}), the recompute {name}")
        if len(op.meta) != len(meta):
            self._fail(i, where, name, f"it returned {len(meta)} values, in the forward {len(op.meta)}")
        for k, (then, now) in enumerate(zip(op.meta, meta)):
            if not _same(then, now):
                shown = f"output {k} is {_show(now)} in the recompute, {_show(then)} in the forward"
                self._fail(i, where, name, shown)
        if not values:
            return
        for k, (then_digest, leaf) in enumerate(zip(op.digests, leaves)):
            if then_digest is None:
                continue
            now_digest = _digest(leaf)
            if now_digest is not None and not torch.equal(then_digest, now_digest):
                self._fail(
                    i, where, name, f"output {k} ({_show(meta[k])}) has other values than in the forward"
                )

    def _fail(self, index: int, where: str, name: str, what: str) -> NoReturn:
        raise RecomputeMismatchError(
            f"autockpt (debug=True): the recompute of {self.segment} differs from its forward at "
            f"{where or 'the segment'}, op {index} {name}: {what}. {_FIX}"
        )


def _is_parameter_like(t: Any) -> bool:
    """A leaf that requires grad: autocast casts it once per autocast region and caches the
    copy, so a forward may find it cast already (by a dry run or an earlier forward in the
    same region) where the recompute casts it again. Its values are the mutation guard's."""
    return isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and not t._is_view()


def _uninitialized(func: Any) -> bool:
    """Whether ``func`` leaves its output's values unwritten (``empty_like``, ``resize_``)."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    return name.lstrip("_").startswith(("empty", "new_empty", "resize"))


def _leaf_meta(leaf: Any, view: bool) -> Any:
    if isinstance(leaf, torch.Tensor):
        meta = (tuple(leaf.shape), leaf.dtype, leaf.device)
        if view and leaf.layout == torch.strided:
            return (*meta, leaf.stride(), leaf.storage_offset())
        return meta
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str)):
        return ("value", leaf)
    return ("object", type(leaf).__name__)


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    # a float NaN returned twice (by .item()) is the same value
    return (
        len(a) == len(b) == 2
        and a[0] == b[0] == "value"
        and isinstance(a[1], float)
        and isinstance(b[1], float)
        and math.isnan(a[1])
        and math.isnan(b[1])
    )


def _show(meta: Any) -> str:
    if meta[0] in ("value", "object"):
        return repr(meta[1])
    text = f"{meta[0]} {_dtype(meta[1])} on {meta[2]}"
    return text + (f" (stride {meta[3]}, offset {meta[4]})" if len(meta) > 3 else "")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _digest(t: Any) -> torch.Tensor | None:
    """Two int64 sums of ``t``'s bits (plain, position-weighted); ``None`` where not possible."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.is_quantized
        or t.device.type == "meta"
    ):
        return None
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    word = _WORDS.get(x.element_size())
    if word is None:
        return None
    words = x.contiguous().reshape(-1).view(word)
    total = torch.zeros(2, dtype=torch.int64, device=x.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + part.numel(), dtype=torch.int64, device=x.device) % 65521 + 1
        total += torch.stack([part.sum(), (part * pos).sum()])
    return total
