"""The cost model: what a single-level plan holds at every moment of a training step.

Per stage, the figures are those :func:`autockpt.profile` measures (see :class:`StageCost`).
A single-level plan is a sequence of items, each a plain stage or a checkpointed segment
whose recompute runs its stages plain. Every memory event of an item happens on top of
``H``, the bytes held by the items before it (a plain stage holds what it saved, a
checkpointed segment holds its input; a boundary tensor kept by both sides counts once),
so

    peak(plan) = max over items j of  H_j + local(item j)

where ``local`` depends only on the item's span (its forward, and in backward its recompute
plus the gradients of everything after it). Between forward and backward the loss runs
on top of everything held: the output and the loss's working bytes (its intermediates and
the output's gradient), which :func:`autockpt.profile` measures for the loss it is given
(``loss_bytes``); without a measurement, two tensors the size of the output are assumed.
The output itself stays alive through the backward, as a training loop's ``out`` variable
keeps it (``out = model(x); loss_fn(out).backward()``); a step written as one expression
frees it earlier and peaks up to one output lower than predicted.
The chain's input is one of the static bytes (with parameters and buffers) that every
budget includes, so the first item never counts it again.

A checkpointed segment may keep some ops' outputs (``Segment.keep``, chosen by
``policy="auto"``): they are held from its forward to its backward, so the segment holds
``K`` more bytes for everything after it, and its own forward and recompute events count
all ``K`` (kept outputs accumulate in the forward, and wait in the recompute until their op
is reached); its backward events count ``K_u``, the kept outputs autograd does not save,
which are the ones torch may still cache there (a recompute stops once it has what backward
needs). Both are upper bounds. The recompute of each stage is shorter by its kept ops'
times, scaled so that they never add up to more than the stage's own forward time.

A recompute stops once it has saved again every tensor the first forward saved (torch's
early stop), so a segment's last stage costs its forward time less its ``tail_ms``, the
time after its last save: a segment ending with a Linear recomputes nothing of it (the
Linear saves its input before it multiplies), one ending with a ReLU all of it (the ReLU
saves its output). Kept ops of the last stage are scaled to fit in what remains.

NOTE [Selective dispatch cost]: a segment that keeps ops runs under torch's selective
checkpointing, which sends each of its ops through a Python dispatch mode and the policy,
in the forward and again in the recompute. Each stage's ``sac_ms`` (its op count times the
per-op cost measured once per device, :mod:`autockpt.measure.dispatch`) is counted with its
recompute when its segment keeps anything; a segment keeping nothing runs as a plain
checkpoint and pays none. It was added after the frontier measured HF GPT-2's ``"auto"``
plans no faster than recomputing whole blocks on CPU; with it, they still measure within
the machine's noise of those (docs/design.md).

:func:`memory_events` lists the events in the order a step runs them, each with its bytes
and its time; :func:`predict` is their maximum and the recompute they add. The budget
planner (:mod:`autockpt.planners.budget`) searches over plans with the same figures.

NOTE [One cost model]
    ``"sqrt"`` plans from the dry run's bytes alone (no profile: no times, workspaces or
    gradients), and used to score its candidate splits with an estimate of its own, which
    took the last, plain segment to hold all it saved through every stage's backward. Two
    models of one step disagreed (the budget planner's peak and the sqrt planner's), and
    fixing one left the other. Now the dry run's bytes become stage figures
    (:func:`dry_run_costs`) and every plan is scored by :func:`predict`: the plain tail
    frees each stage's saved tensors as its backward passes, as it does in a real step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from autockpt.plan import Segment
from autockpt.planners.registry import StageCost

__all__ = [
    "CostModel",
    "KeptOp",
    "MemoryEvent",
    "Prediction",
    "assumed_loss_bytes",
    "dry_run_costs",
    "keepable_ops",
    "kept_effect",
    "memory_events",
    "predict",
    "recompute_ms",
]


@dataclass(frozen=True)
class KeptOp:
    """An op a checkpointed segment may keep: stage, index among the stage's ops, name,
    bytes, bytes autograd does not save anyway, and the recompute ms keeping it saves."""

    stage: int
    index: int
    op: str
    bytes: int
    unsaved_bytes: int
    ms: float


def keepable_ops(cost: StageCost, stage: int, *, last: bool = False) -> list[KeptOp]:
    """The ops of one stage a policy may keep and whose recompute takes time; their times
    scaled so that they add up to no more than the stage's recomputed forward time. In a
    segment's ``last`` stage, the ops of its tail (:attr:`OpCost.tail`) and an op making
    the stage's output are no candidates: a recompute stops once backward has what it
    needs, so they are not recomputed anyway."""
    skipped = [last and (o.output or o.tail) for o in cost.ops]
    total = sum(o.ms for o, skip in zip(cost.ops, skipped) if not skip)
    recomputed = cost.fwd_ms - cost.tail_ms * last  # the early stop skips the last stage's tail
    scale = max(0.0, min(1.0, recomputed / total)) if total > 0 else 0.0
    return [
        KeptOp(stage, j, o.op, o.out_bytes, 0 if o.saved else o.out_bytes, o.ms * scale)
        for j, (o, skip) in enumerate(zip(cost.ops, skipped))
        if o.keepable and o.ms > 0 and not skip
    ]


def recompute_ms(cost: StageCost, kept_ms: float, last: bool) -> float:
    """How long a checkpointed stage's recompute takes: its forward, less what its kept ops
    save and, when it ends the segment, less the tail the early stop skips."""
    return max(0.0, cost.fwd_ms - cost.tail_ms * last - kept_ms)


def kept_effect(seg: Segment, costs: Sequence[StageCost]) -> tuple[int, int, list[float]]:
    """``(K, K_u, ms saved per stage)`` of a segment's kept ops (see the module docstring).

    Raises:
        ValueError: a kept op is not where the segment's op profile puts it.
    """
    saved = [0.0] * len(seg)
    if not seg.keep:
        return 0, 0, saved
    ops = [(i, j, o) for i in range(seg.start, seg.stop) for j, o in enumerate(costs[i].ops)]
    if not ops:  # a profile without ops: the segment's own figures, all of it unsaved
        saved[-1] = seg.kept_ms
        return seg.kept_bytes, seg.kept_bytes, saved
    by_place = {
        (k.stage, k.index): k
        for i in range(seg.start, seg.stop)
        for k in keepable_ops(costs[i], i, last=i == seg.stop - 1)
    }
    total = unsaved = 0
    for key in seg.keep:
        pos, _, name = key.partition(":")
        i, j, o = ops[int(pos)] if pos.isdigit() and int(pos) < len(ops) else (None, None, None)
        if o is None or o.op != name:
            raise ValueError(f"{seg}: kept op {key!r} is not in its stages' op profile")
        if not o.keepable:
            raise ValueError(f"{seg}: kept op {key!r} is not one a policy may keep")
        kept = by_place.get((i, j))  # type: ignore[arg-type]
        total += o.out_bytes
        unsaved += 0 if o.saved else o.out_bytes
        saved[i - seg.start] += kept.ms if kept is not None else 0.0  # type: ignore[operator]
    return total, unsaved, saved


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of a plan under the cost model.

    ``peak_at`` says where the peak falls: ``(start, stop, phase)`` with phase
    ``"forward"`` or ``"backward"`` of plain stage ``start``, ``"recompute"`` for the
    recompute and backward of checkpointed segment ``[start, stop)``, or ``"loss"``
    (between forward and backward, ``start == stop ==`` the number of stages).
    """

    peak_bytes: int
    recompute_ms: float
    peak_at: tuple[int, int, str] = (0, 0, "loss")


@dataclass(frozen=True)
class MemoryEvent:
    """One moment of a predicted step: a stage's forward, the loss, a recompute, a backward.

    Attributes:
        phase: ``"forward"`` (a plain stage, or a checkpointed one's first forward),
            ``"loss"``, ``"recompute"`` (a checkpointed stage's forward run again in
            backward) or ``"backward"``.
        stage: the stage (the number of stages for the loss).
        segment: ``(start, stop)`` of the checkpointed segment the stage is in, else ``None``.
        bytes: the most the step holds during the event, static bytes excluded.
        ms: how long the event takes (the profile's forward or backward time; the loss's
            time is not profiled and counts as 0).
    """

    phase: str
    stage: int
    segment: tuple[int, int] | None
    bytes: int
    ms: float


def dry_run_costs(input_bytes: Sequence[int], saved_bytes: Sequence[int]) -> list[StageCost]:
    """Per-stage figures from a dry run's bytes alone, for plans made without a profile
    (``"sqrt"``; NOTE [One cost model]): stage ``i`` holds what it saved (its input
    included, when it saves it), hands the next stage's input on as its output, and its
    backward needs about as much again as it saved (the gradients of its saved tensors).
    No times; the model's output and the loss count as nothing (``loss_bytes=0``)."""
    n = len(input_bytes)
    return [
        StageCost(
            fwd_ms=0.0,
            bwd_ms=0.0,
            in_bytes=input_bytes[i],
            out_bytes=input_bytes[i + 1] if i + 1 < n else 0,
            kept_bytes=saved_bytes[i],
            keeps_input=False,
            keeps_output=False,
            fwd_peak_bytes=0,
            bwd_peak_bytes=saved_bytes[i],
            grad_bytes=0,
        )
        for i in range(n)
    ]


def assumed_loss_bytes(costs: Sequence[StageCost]) -> int:
    """The loss's working bytes when none were measured: one intermediate the size of the
    output and the output's gradient (a weighted sum, an MSE against a target)."""
    return 2 * costs[-1].out_bytes if costs else 0


class CostModel:
    """The model's figures for one chain. ``kept`` says whether the item before holds the
    current input (a plain stage that keeps its output), so a boundary tensor is counted
    once. ``spans``: per stage, the most stages a checkpoint starting there may hold."""

    def __init__(
        self, costs: Sequence[StageCost], loss_bytes: int | None = None, spans: Sequence[int] | None = None
    ) -> None:
        self.c = list(costs)
        n = len(costs)
        self.spans = list(spans) if spans is not None else None
        self.grads_after = [sum(c.grad_bytes for c in costs[i + 1 :]) for i in range(n)]
        self.loss_bytes = assumed_loss_bytes(costs) if loss_bytes is None else loss_bytes
        # the output stays alive through the whole backward: a training loop's ``out``
        # variable (``out = model(x); loss_fn(out).backward()``) still refers to it
        self.out = costs[-1].out_bytes if costs else 0

    def loss(self, kept: bool) -> int:
        """What the loss adds to everything held: the output, unless the last plain stage
        holds it already, and the loss's working bytes."""
        return self.out * (not kept) + self.loss_bytes

    def held(self, i: int, kept: bool) -> int:
        """What plain stage ``i`` holds until its backward."""
        c = self.c[i]
        return c.kept_bytes + c.out_bytes * c.keeps_output + c.in_bytes * (c.keeps_input and not kept)

    def plain_events(self, i: int, kept: bool) -> tuple[int, int]:
        """``(forward, backward)`` bytes of plain stage ``i`` above what the items before hold."""
        c = self.c[i]
        fwd = c.in_bytes * (not kept) + c.fwd_peak_bytes
        out = self.out * (not (i == len(self.c) - 1 and c.keeps_output))  # unless held already
        bwd = self.held(i, kept) + c.out_bytes + c.bwd_peak_bytes + self.grads_after[i] + out
        return fwd, bwd

    def plain_local(self, i: int, kept: bool) -> int:
        return max(self.plain_events(i, kept))

    def checkpoint_events(self, s: int, kept: bool) -> Iterator[tuple[int, int, int]]:
        """``(first forward, recompute, backward)`` bytes of stage i = s, s+1, ... inside a
        checkpointed segment starting at ``s``, above what the items before it hold.

        Stage i's first forward saves nothing; its recompute forward and its backward run on
        top of what stages s..i-1 saved again.
        """
        before = 0
        base = self.c[s].in_bytes * (not kept)
        inner_kept = True  # the segment's input is held by the checkpoint
        for i in range(s, len(self.c)):
            c = self.c[i]
            current = c.in_bytes if i > s else 0
            first = base + current + c.fwd_peak_bytes
            refwd = base + before + c.in_bytes * (not inner_kept) + c.fwd_peak_bytes + self.out
            held = self.held(i, inner_kept)
            rebwd = base + before + held + c.out_bytes + c.bwd_peak_bytes + self.grads_after[i] + self.out
            yield first, refwd, rebwd
            before += held
            inner_kept = c.keeps_output

    def checkpoint_locals(self, s: int, kept: bool) -> Iterator[tuple[int, float]]:
        """``(local, recompute ms)`` of segments ``[s, t)`` for t = s+1, s+2, ..."""
        for forward, backward, ms in self.checkpoint_split(s, kept):
            yield max(forward, backward), ms

    def checkpoint_split(self, s: int, kept: bool) -> Iterator[tuple[int, int, float]]:
        """``(largest forward or recompute event, largest backward event, recompute ms)``
        of segments ``[s, t)`` for t = s+1, s+2, ...: kept ops add to the two differently."""
        forward = backward = 0
        ms = 0.0
        for i, (first, refwd, rebwd) in enumerate(self.checkpoint_events(s, kept), start=s):
            forward, backward, ms = max(forward, first, refwd), max(backward, rebwd), ms + self.c[i].fwd_ms
            yield forward, backward, ms - self.c[i].tail_ms  # the early stop skips the last stage's tail

    def checkpoint_held(self, s: int, kept: bool) -> int:
        return self.c[s].in_bytes * (not kept)


def memory_events(
    segments: Sequence[Segment], costs: Sequence[StageCost], *, loss_bytes: int | None = None
) -> tuple[MemoryEvent, ...]:
    """The events of one training step under a single-level plan, in the order they run:
    forward item by item, the loss, backward item by item in reverse (a checkpointed
    segment's recompute forwards, then its stages' backwards).

    ``loss_bytes`` is the loss's working bytes (:attr:`autockpt.Profile.loss_bytes`);
    ``None`` assumes two tensors the size of the output. Nested segments are taken as if
    their checkpointed segment recomputed plainly (an upper bound on their peak).
    """
    model = CostModel(costs, loss_bytes)
    forward: list[MemoryEvent] = []
    backward: list[list[MemoryEvent]] = []  # per item, in the order the item runs them
    held, kept = 0, True  # the chain's input is a static byte
    for seg in segments:
        if seg.checkpoint:
            span = (seg.start, seg.stop)
            stages = range(seg.start, seg.stop)
            events = list(zip(stages, model.checkpoint_events(seg.start, kept)))
            k, ku, saved = kept_effect(seg, costs)
            forward += [MemoryEvent("forward", i, span, held + e[0] + k, costs[i].fwd_ms) for i, e in events]
            item = [
                MemoryEvent(
                    "recompute",
                    i,
                    span,
                    held + e[1] + k,
                    recompute_ms(costs[i], saved[i - seg.start], i == seg.stop - 1)
                    + costs[i].sac_ms * bool(seg.keep),  # NOTE [Selective dispatch cost]
                )
                for i, e in events
            ]
            item += [
                MemoryEvent("backward", i, span, held + e[2] + ku, costs[i].bwd_ms) for i, e in events[::-1]
            ]
            backward.append(item)
            held += model.checkpoint_held(seg.start, kept) + k
            kept = False
        else:
            for i in range(seg.start, seg.stop):
                fwd, bwd = model.plain_events(i, kept)
                forward.append(MemoryEvent("forward", i, None, held + fwd, costs[i].fwd_ms))
                backward.append([MemoryEvent("backward", i, None, held + bwd, costs[i].bwd_ms)])
                held += model.held(i, kept)
                kept = costs[i].keeps_output
    loss = MemoryEvent("loss", len(costs), None, held + model.loss(kept), 0.0)
    return (*forward, loss, *(e for item in reversed(backward) for e in item))


def predict(
    segments: Sequence[Segment], costs: Sequence[StageCost], *, loss_bytes: int | None = None
) -> Prediction:
    """Peak bytes and recompute time of a single-level plan under the cost model: the
    largest of its :func:`memory_events` (the earliest stage's on a tie) and the time of
    its recompute events."""
    events = memory_events(segments, costs, loss_bytes=loss_bytes)
    peak = max(events, key=lambda e: (e.bytes, -e.stage, e.phase == "forward"))
    if peak.segment is not None:
        at = (*peak.segment, "recompute")
    elif peak.phase == "loss":
        at = (len(costs), len(costs), "loss")
    else:
        at = (peak.stage, peak.stage + 1, peak.phase)
    recompute = sum(e.ms for e in events if e.phase == "recompute")
    return Prediction(peak.bytes, recompute, at)
