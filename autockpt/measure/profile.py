"""The profile of a model: per stage, what running it costs in one training step.

:class:`Profile` is what ``autockpt.profile`` returns and the budget planner plans from:
the stage costs (``autockpt.planners.StageCost``), the static and loss bytes, and views of
them (a table, JSON, the segments of a plan, the predicted memory timeline). It is data;
measuring it is ``stage_profile`` (a chain, stage by stage) and ``blocks`` (a block-walked
model in one step), and ``model_profile`` runs either for a model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autockpt.measure.timeline import Curve, MemoryTimeline, predicted_curve
from autockpt.plan import Plan, Segment, format_bytes
from autockpt.planners import StageCost
from autockpt.planners.cost_model import memory_events

__all__ = ["Profile"]


@dataclass(frozen=True)
class Profile:
    """Per-stage costs of a model for one input.

    Attributes:
        walker: the walker that found the stages.
        stage_names: one name per stage.
        costs: one :class:`~autockpt.planners.budget.StageCost` per stage.
        static_bytes: parameters, buffers and inputs: memory a step needs before it starts.
        device: where it was measured.
        loss_bytes: what the loss needs on top of the model's output, from its forward
            through its backward down to the output's gradient (that gradient included):
            measured for the ``loss_fn`` given, or for :func:`~autockpt.measure.losses.default_loss`.
            ``None`` when not measured; planners then assume two tensors the size of the
            output.
        stage_of: for the block walker, which block each profiled stage is (``None`` for
            the code between blocks, profiled as stages of its own); ``None`` when the
            profiled stages are the chain's.
    """

    walker: str
    stage_names: tuple[str, ...]
    costs: tuple[StageCost, ...]
    static_bytes: int
    device: str
    loss_bytes: int | None = None
    stage_of: tuple[int | None, ...] | None = None

    @property
    def checkpoint_spans(self) -> tuple[int, ...] | None:
        """Per profiled stage, the most stages a checkpoint starting there may hold (see
        :attr:`PlanRequest.checkpoint_spans`): one block at a time for the block walker."""
        if self.stage_of is None:
            return None
        return tuple(0 if block is None else 1 for block in self.stage_of)

    def segments_of(self, plan: Plan) -> tuple[Segment, ...]:
        """``plan``'s segments over the profiled stages: the plan's own for a chain, and for
        the block walker one per profiled stage, a block checkpointed as its plan says.

        Raises:
            ValueError: the plan has another number of stages than this profile.
        """
        if self.stage_of is None:
            if len(self.costs) != plan.n_stages:
                raise ValueError(
                    f"the plan has {plan.n_stages} stages, the profile {len(self.costs)}: plan and "
                    "profile the same model with the same inputs and mode."
                )
            return plan.segments
        flags = {i: seg.checkpoint for seg in plan.segments for i in range(seg.start, seg.stop)}
        return tuple(
            Segment(i, i + 1, block is not None and flags.get(block, False))
            for i, block in enumerate(self.stage_of)
        )

    def timeline(self, plan: Plan | None = None, *, measured: Sequence[Curve] = ()) -> MemoryTimeline:
        """Predicted memory through one training step, unwrapped and (given) with ``plan``,
        plus any ``measured`` curves (:func:`autockpt.measure.timeline.measured_curve`)."""
        curves = []
        plans: list[tuple[str, Sequence[Segment]]] = [("unwrapped", (Segment(0, len(self.costs), False),))]
        if plan is not None:
            plans.append((f"plan {plan.strategy}", self.segments_of(plan)))
        for label, segments in plans:
            events = memory_events(segments, self.costs, loss_bytes=self.loss_bytes)
            curve = predicted_curve(f"{label} (predicted)", events, self.static_bytes, self.stage_names)
            curves.append(curve)
        return MemoryTimeline((*curves, *measured))

    def plot(self, plan: Plan | None = None) -> Any:
        """A matplotlib figure of :meth:`timeline`: memory through one step, unwrapped and
        with ``plan``, each peak marked with where it falls (``.savefig`` it)."""
        return self.timeline(plan).figure()

    def to_json(self) -> str:
        """The profile as JSON."""
        return json.dumps(
            {
                "walker": self.walker,
                "device": self.device,
                "static_bytes": self.static_bytes,
                "loss_bytes": self.loss_bytes,
                "stages": [
                    {"name": n, **c.to_dict(), **({"block": b} if self.stage_of is not None else {})}
                    for n, c, b in zip(
                        self.stage_names, self.costs, self.stage_of or [None] * len(self.costs)
                    )
                ],
            },
            indent=2,
        )

    def __str__(self) -> str:
        head = (
            "stage",
            "fwd ms",
            "tail ms",
            "bwd ms",
            "input",
            "kept",
            "fwd peak",
            "bwd peak",
            "param grads",
        )
        rows = [head]
        for name, c in zip(self.stage_names, self.costs):
            rows.append(
                (
                    name,
                    f"{c.fwd_ms:.2f}",
                    f"{c.tail_ms:.2f}",
                    f"{c.bwd_ms:.2f}",
                    format_bytes(c.in_bytes),
                    format_bytes(c.kept_bytes),
                    format_bytes(c.fwd_peak_bytes),
                    format_bytes(c.bwd_peak_bytes),
                    format_bytes(c.grad_bytes),
                )
            )
        lines = [
            f"autockpt profile: walker={self.walker!r}, device={self.device}, {len(self.costs)} stages, "
            f"parameters+buffers+inputs {format_bytes(self.static_bytes)}"
            + (
                f", loss {format_bytes(self.loss_bytes)} above the output"
                if self.loss_bytes is not None
                else ""
            )
        ]
        lines += _table(rows)
        if self.has_ops:
            lines.append(
                "ops (saved: autograd keeps the output; keepable: a policy may keep it; "
                "tail: after the stage's last save)"
            )
            op_rows = [("stage", "op", "output", "ms", "MFLOP", "saved", "keepable", "tail")]
            for name, c in zip(self.stage_names, self.costs):
                op_rows += [
                    (
                        name,
                        o.op,
                        format_bytes(o.out_bytes),
                        f"{o.ms:.3f}",
                        f"{o.flops / 1e6:.1f}",
                        "yes" if o.saved else "no",
                        "yes" if o.keepable else "no",
                        "yes" if o.tail else "no",
                    )
                    for o in c.ops
                ]
            lines += _table(op_rows, left=2)
        return "\n".join(lines)

    @property
    def has_ops(self) -> bool:
        """Whether the op-level profile was taken (``profile(..., ops=True)``)."""
        return any(c.ops for c in self.costs)


def _table(rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Rows as aligned lines: the first ``left`` columns to the left, the rest to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(v.ljust(w) if i < left else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
