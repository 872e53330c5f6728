"""The planner registry: named strategies that turn a chain into segments.

A planner is a pure function ``fn(request) -> segments``: it takes a
:class:`PlanRequest` (how many stages, their names, costs when profiled) and returns
either a sequence of :class:`~autockpt.plan.Segment` or a sequence of segment sizes
(ints summing to the number of stages; every segment but the last is checkpointed).
Planners never import torch, so they stay fast to property-test.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autockpt.plan import Segment, validate_segments

__all__ = [
    "OpCost",
    "PlanRequest",
    "Planner",
    "StageCost",
    "available_planners",
    "get_planner",
    "register_planner",
    "segments_from_sizes",
]


@dataclass(frozen=True)
class OpCost:
    """One op of a stage's forward, as the op-level profile saw it (``profile(ops=True)``).

    Attributes:
        op: the op's name, e.g. ``"aten.addmm.default"``.
        out_bytes: the new memory its outputs take (views and in-place results: 0).
        ms: its forward time (measured; nominal from FLOPs on the meta device).
        flops: its FLOPs, where torch has a formula for the op (matmuls, convolutions,
            attention), else 0.
        saved: autograd keeps its output for backward when the stage runs plainly.
        keepable: an op policy may keep its output: it makes new memory, it is not
            random, and no later op of the stage writes into it (NOTE [Kept outputs
            changed in place] in ``execution/policies.py``).
        output: its output is the stage's output (held by what comes next anyway).
        tail: it runs after the last tensor the stage saves for backward: a recompute
            ending with this stage stops before it (NOTE [The tail a recompute skips]).
    """

    op: str
    out_bytes: int
    ms: float
    flops: int
    saved: bool
    keepable: bool
    output: bool = False
    tail: bool = False


@dataclass(frozen=True)
class StageCost:
    """What one stage costs in a training step (bytes are allocator-level).

    Attributes:
        fwd_ms: forward time.
        bwd_ms: backward time.
        in_bytes: its input, i.e. what a checkpoint starting here keeps.
        out_bytes: its output (and the size of the gradient flowing into it).
        kept_bytes: what it holds from its forward to its backward when not checkpointed,
            apart from its input and output (saved intermediates).
        keeps_input: it saves its input for backward (a Linear, a convolution).
        keeps_output: it saves its output for backward (a ReLU, a sigmoid).
        fwd_peak_bytes: working peak of its forward above its input (output included).
        bwd_peak_bytes: working peak of its backward above what it holds and its output
            gradient (workspaces, input and parameter gradients included).
        grad_bytes: parameter gradients it leaves allocated after its backward.
        ops: its forward's ops in the order they run, when profiled with ``ops=True``.
        tail_ms: the part of its forward after the last tensor it saves for backward: a
            recompute ending with this stage stops before it (torch's early stop), so a
            checkpointed segment's last stage costs ``fwd_ms - tail_ms`` to recompute.
        sac_ms: what selective checkpointing's per-op dispatch adds to the stage, forward
            and recompute together, when its checkpointed segment keeps any op (measured
            with ``ops=True``; NOTE [Selective dispatch cost] in ``planners/cost_model.py``).
    """

    fwd_ms: float
    bwd_ms: float
    in_bytes: int
    out_bytes: int
    kept_bytes: int
    keeps_input: bool
    keeps_output: bool
    fwd_peak_bytes: int
    bwd_peak_bytes: int
    grad_bytes: int
    ops: tuple[OpCost, ...] = ()
    tail_ms: float = 0.0
    sac_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``ops`` only when profiled)."""
        data = asdict(self)
        if not self.ops:
            del data["ops"]
        return data


@dataclass(frozen=True)
class PlanRequest:
    """What a planner is asked to plan.

    Attributes:
        stage_names: one name per stage of the chain, in order.
        input_bytes: per stage, the bytes a checkpoint starting there keeps alive (its
            input), when a dry run measured them; ``None`` otherwise.
        saved_bytes: per stage, the bytes it saves for backward when not checkpointed.
        costs: per stage, measured costs (from :func:`autockpt.profile`), if profiled.
        budget_bytes: the memory budget for a whole training step, if one was given.
        static_bytes: bytes that exist before the step (parameters, buffers, inputs),
            which the budget includes but no plan changes.
        loss_bytes: what the loss needs on top of the model's output (its intermediates
            and the output's gradient), when measured; ``None`` assumes two tensors the
            size of the output.
        checkpoint_spans: per stage, the most stages a checkpointed segment starting there
            may hold (0: none may start there); ``None`` for no limit. The block walker's
            profile uses it: its blocks are checkpointed one at a time, and the code between
            blocks cannot be checkpointed at all.
        choose_ops: also choose, per checkpointed segment, which ops' outputs to keep
            (``policy="auto"``); needs costs with ops (``StageCost.ops``).
        keep_only: per stage, per op, whether a named policy keeps its output: every
            checkpointed segment then keeps exactly those, and the planner counts them.
    """

    stage_names: tuple[str, ...]
    input_bytes: tuple[int, ...] | None = None
    saved_bytes: tuple[int, ...] | None = None
    costs: tuple[StageCost, ...] | None = None
    budget_bytes: int | None = None
    static_bytes: int = 0
    loss_bytes: int | None = None
    checkpoint_spans: tuple[int, ...] | None = None
    choose_ops: bool = False
    keep_only: tuple[tuple[bool, ...], ...] | None = None

    @property
    def n_stages(self) -> int:
        """Number of stages in the chain."""
        return len(self.stage_names)


Planner = Callable[[PlanRequest], Sequence[Segment] | Sequence[int]]

_PLANNERS: dict[str, Planner] = {}


def _normalize(name: str) -> str:
    return name.strip().lower()


def register_planner(name: str, fn: Planner, *, overwrite: bool = False) -> None:
    """Make ``fn`` available as ``auto_checkpoint(model, segments=name)``.

    Args:
        name: the strategy name; compared case-insensitively.
        fn: ``fn(request: PlanRequest) -> Sequence[Segment] | Sequence[int]``.
        overwrite: replace an existing planner of the same name instead of raising.

    Raises:
        ValueError: the name is taken (and ``overwrite`` is false) or is empty.
        TypeError: ``fn`` is not callable.

    Examples:
        >>> import autockpt
        >>> autockpt.register_planner("halves", lambda req: [req.n_stages // 2,
        ...                           req.n_stages - req.n_stages // 2], overwrite=True)
        >>> "halves" in autockpt.available_planners()
        True
    """
    if not isinstance(name, str) or not _normalize(name):
        raise ValueError(f"register_planner: name must be a non-empty string, got {name!r}.")
    if not callable(fn):
        raise TypeError(f"register_planner: fn must be callable, got {type(fn).__name__}.")
    key = _normalize(name)
    if key in _PLANNERS and not overwrite:
        raise ValueError(
            f"register_planner: a planner named {key!r} exists already. Pass overwrite=True to replace it."
        )
    _PLANNERS[key] = fn


def available_planners() -> tuple[str, ...]:
    """Names accepted as ``segments=`` strings, sorted."""
    return tuple(sorted(_PLANNERS))


def get_planner(name: str, *, where: str) -> Planner:
    """The planner registered under ``name``.

    Raises:
        ValueError: no such planner; the message lists the registered names.
    """
    key = _normalize(name)
    try:
        return _PLANNERS[key]
    except KeyError:
        names = available_planners()
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{where}: unknown segments strategy {name!r}.{hint} Use an int (number of "
            f"segments), a callable, or one of: {', '.join(repr(n) for n in names)}."
        ) from None


def segments_from_sizes(sizes: Sequence[int], n_stages: int, *, where: str) -> tuple[Segment, ...]:
    """Consecutive segments of the given sizes; all but the last are checkpointed.

    Raises:
        ValueError: a size is not a positive int or the sizes do not sum to ``n_stages``.
    """
    out = []
    start = 0
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{where}: segment sizes must be positive ints, got {list(sizes)!r}.")
        out.append(Segment(start, start + size, checkpoint=True))
        start += size
    if start != n_stages:
        raise ValueError(
            f"{where}: segment sizes {list(sizes)!r} sum to {start}, but the chain has {n_stages} stages."
        )
    if out:
        out[-1] = Segment(out[-1].start, out[-1].stop, checkpoint=False)
    return tuple(out)


def run_planner(fn: Planner, request: PlanRequest, *, where: str) -> tuple[Segment, ...]:
    """Call a planner and check that its answer tiles the chain."""
    result = list(fn(request))
    if result and all(isinstance(r, Segment) for r in result):
        segments = tuple(r for r in result if isinstance(r, Segment))
        validate_segments(segments, 0, request.n_stages, where=where)
        return segments
    if all(isinstance(r, int) and not isinstance(r, bool) for r in result):
        return segments_from_sizes(result, request.n_stages, where=where)  # type: ignore[arg-type]
    raise TypeError(f"{where}: a planner must return Segments or segment sizes (ints), got {result!r}.")
