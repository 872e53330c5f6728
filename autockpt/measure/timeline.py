"""Memory through one training step: predicted from a profile, measured from the allocator.

A predicted curve walks the cost model's events (:func:`~autockpt.planners.cost_model.memory_events`)
in the order a step runs them, each as long as its profiled time: forward stage by stage,
the loss, then backward with each checkpointed segment's recompute. A measured curve is the
allocator's running total through one real step (after a warm-up step), on the allocator
event clock. Both start from the step's static bytes (parameters, buffers, inputs), so the
curves and their peaks compare directly with each other and with a plan's predicted peak.
``MemoryTimeline.figure`` draws them with each peak marked; ``Profile.timeline`` and
``autockpt profile --plot`` make them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from autockpt.measure.allocator import MARK, open_session
from autockpt.measure.figures import finish_figure, new_figure, save
from autockpt.measure.losses import LossFn, training_step
from autockpt.measure.sandbox import preserved, recomputing
from autockpt.measure.tensors import device_of, static_bytes
from autockpt.plan import format_bytes
from autockpt.planners.cost_model import MemoryEvent

__all__ = ["Curve", "MemoryTimeline", "measured_curve", "predicted_curve"]


@dataclass(frozen=True)
class Curve:
    """Bytes held through one step.

    Attributes:
        label: the legend's name for it (``"unwrapped (predicted)"``).
        times_ms: when each point is, from the step's start.
        bytes: what is held then, static bytes included.
        peak_at: words for where the peak falls (``"backward of stage 'fc'"``).
        measured: whether the allocator measured it (else the cost model predicted it).
    """

    label: str
    times_ms: tuple[float, ...]
    bytes: tuple[int, ...]
    peak_at: str
    measured: bool = False

    @property
    def peak_bytes(self) -> int:
        return max(self.bytes)

    @property
    def peak_ms(self) -> float:
        """When the peak is first reached."""
        return self.times_ms[self.bytes.index(self.peak_bytes)]


def predicted_curve(
    label: str, events: Sequence[MemoryEvent], static: int, stage_names: Sequence[str]
) -> Curve:
    """The curve of ``events``: each event holds its bytes for its time (the loss, not
    profiled, for a moment)."""
    times: list[float] = [0.0]
    held: list[int] = [static]  # the step starts with parameters, buffers and inputs
    now = 0.0
    for e in events:
        times += [now, now + e.ms]
        held += [static + e.bytes] * 2
        now += e.ms
    top = max(events, key=lambda e: e.bytes)
    return Curve(label, tuple(times), tuple(held), _describe(top, stage_names))


def _describe(event: MemoryEvent, names: Sequence[str]) -> str:
    if event.phase == "loss":
        return "the loss, between forward and backward"
    where = f"{event.phase} of stage {names[event.stage]!r}"
    if event.segment is not None:
        start, stop = event.segment
        span = repr(names[start]) if stop == start + 1 else f"{names[start]!r}..{names[stop - 1]!r}"
        where += f" (checkpointed segment {span})"
    return where


def measured_curve(
    label: str,
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
) -> Curve:
    """The allocator's running total through one training step of ``model`` as it is now
    (after a warm-up step), static bytes included; the model is left as it was."""
    kwargs = dict(kwargs or {})
    device = device_of(model, [list(args), kwargs])
    with preserved(model, [list(args), kwargs]) as fresh, recomputing():
        for warm in (True, False):
            fresh()
            session = open_session(device)
            session.mark()
            training_step(model, args, kwargs, loss_fn, where="measured_curve")
            session.mark()
            deltas, times = session.close(), session.times
            if not warm:
                break
    base = static_bytes(model, [list(args), kwargs])
    marks = [t for t, d in zip(times, deltas) if d is MARK]
    start = marks[0] if marks else (times[0] if times else 0.0)
    live, points, held = 0, [0.0], [base]
    for t, d in zip(times, deltas):
        if d is MARK:
            continue
        live += d
        points.append(max(0.0, t - start))
        held.append(base + live)
    if marks:
        points.append(max(0.0, marks[-1] - start))
        held.append(held[-1])
    return Curve(label, tuple(points), tuple(held), "allocator peak", measured=True)


@dataclass(frozen=True)
class MemoryTimeline:
    """Curves of one step's memory; ``print()`` it for each curve's peak."""

    curves: tuple[Curve, ...]

    def __str__(self) -> str:
        lines = []
        for c in self.curves:
            lines.append(
                f"{c.label}: peak {format_bytes(c.peak_bytes)} at {c.peak_ms:.1f} ms, {c.peak_at}; "
                f"step {c.times_ms[-1]:.1f} ms"
            )
        return "\n".join(lines)

    def figure(self) -> Any:
        """A matplotlib figure: bytes held (y) through the step (x, ms), peaks marked."""
        mib = 2**20
        fig, ax = new_figure("MemoryTimeline.figure", (10, 4.5))
        for c in self.curves:
            (line,) = ax.plot(
                c.times_ms, [b / mib for b in c.bytes], ":" if c.measured else "-", label=c.label
            )
            ax.plot(
                c.peak_ms, c.peak_bytes / mib, "v", color=line.get_color(), markersize=9,
                label=f"peak {format_bytes(c.peak_bytes)}: {c.peak_at}",
            )  # fmt: skip
        return finish_figure(
            fig, ax, xlabel="time in the step (ms; predicted from the profile, or measured)",
            ylabel="memory held (MiB)", title="autockpt: memory through one training step",
        )  # fmt: skip

    def plot(self, path: str | Path, formats: Iterable[str] = ("png", "svg")) -> list[Path]:
        """Save :meth:`figure` as ``path`` with each suffix in ``formats``; the files written."""
        return save(self.figure(), path, formats)
