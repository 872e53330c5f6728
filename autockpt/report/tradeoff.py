"""The memory/time trade-off of a model: plans from the floor to no checkpointing, side by side.

``tradeoff`` profiles the model once, then plans at a sweep of budgets from the planner's
floor to the unwrapped step, plus ``"sqrt"`` and a range of segment counts, and predicts
each plan's peak and recompute time from the same profile; with ``measure=True`` each plan
also runs real steps. ``Tradeoff.figure`` draws peak against time with the unwrapped step,
``"sqrt"``, the budget front and the floor marked; ``Tradeoff.plot`` saves it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autockpt.api import apply_plan
from autockpt.errors import PlanInfeasibleError
from autockpt.execution.lm_head import installed_head, set_head
from autockpt.measure.figures import finish_figure, new_figure, save
from autockpt.measure.losses import LossFn, training_step
from autockpt.measure.step import measure_step
from autockpt.measure.tensors import as_args
from autockpt.plan import Plan, format_bytes
from autockpt.planning.budget_costs import budget_costs, predict_plan
from autockpt.planning.prepare import SegmentsSpec, build_plan, walk_and_dry_run

__all__ = ["Tradeoff", "TradeoffPoint", "tradeoff"]


@dataclass(frozen=True)
class TradeoffPoint:
    """One plan of the sweep.

    Attributes:
        kind: ``"unwrapped"``, ``"sqrt"``, ``"count"`` or ``"budget"``.
        label: how tables and legends name it (``"budget 12.00 MiB"``, ``"4 segments"``).
        plan: the plan (``segments="none"`` for the unwrapped point).
        predicted_peak_bytes: the cost model's peak, parameters and inputs included.
        predicted_step_ms: the profile's forward and backward plus the plan's recompute.
        measured_peak_bytes: with ``measure=True``, the allocator-level peak of a step.
        measured_step_ms: with ``measure=True``, the median time of three steps.
    """

    kind: str
    label: str
    plan: Plan
    predicted_peak_bytes: int
    predicted_step_ms: float
    measured_peak_bytes: int | None = None
    measured_step_ms: float | None = None


@dataclass(frozen=True)
class Tradeoff:
    """The sweep's points and the planner's floor; ``print()`` it for a table."""

    points: tuple[TradeoffPoint, ...]
    floor_bytes: int

    @property
    def unwrapped(self) -> TradeoffPoint:
        return next(p for p in self.points if p.kind == "unwrapped")

    def __str__(self) -> str:
        base_peak, base_ms = self.unwrapped.predicted_peak_bytes, self.unwrapped.predicted_step_ms
        rows = [("plan", "segments", "ckpt", "pred. peak", "pred. time", "meas. peak", "meas. time")]
        for p in self.points:
            rows.append(
                (
                    p.label,
                    str(len(p.plan.segments)),
                    str(p.plan.checkpointed_segments),
                    f"{format_bytes(p.predicted_peak_bytes)} ({p.predicted_peak_bytes / base_peak:.2f}x)",
                    f"{p.predicted_step_ms:.1f} ms ({p.predicted_step_ms / base_ms:.2f}x)",
                    "-" if p.measured_peak_bytes is None else format_bytes(p.measured_peak_bytes),
                    "-" if p.measured_step_ms is None else f"{p.measured_step_ms:.1f} ms",
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(r[c].ljust(widths[c]) for c in range(len(r))).rstrip() for r in rows]
        lines.append(f"floor: no plan peaks below {format_bytes(self.floor_bytes)}")
        return "\n".join(lines)

    def figure(self) -> Any:
        """A matplotlib figure: peak (x) against step time (y), predicted (and measured)."""
        mib = 2**20
        fig, ax = new_figure("Tradeoff.figure", (9.5, 4.5))
        measured = all(p.measured_peak_bytes is not None for p in self.points)
        for which, marker_style in (
            (("predicted", "-"), ("measured", ":")) if measured else (("predicted", "-"),)
        ):

            def xy(p: TradeoffPoint, which: str = which) -> tuple[float, float]:
                if which == "measured":
                    return p.measured_peak_bytes / mib, p.measured_step_ms  # type: ignore[operator,return-value]
                return p.predicted_peak_bytes / mib, p.predicted_step_ms

            front = sorted((xy(p) for p in self.points if p.kind == "budget"), key=lambda t: t[0])
            if front:
                ax.plot(*zip(*front), marker_style, marker="o", label=f"budget front ({which})")
            counts = [xy(p) for p in self.points if p.kind == "count"]
            if counts:
                ax.plot(*zip(*counts), "s", fillstyle="none", label=f"segment counts ({which})")
            for kind, marker, name in (("sqrt", "*", "sqrt"), ("unwrapped", "D", "unwrapped")):
                for p in self.points:
                    if p.kind == kind:
                        ax.plot(*xy(p), marker, markersize=11, label=f"{name} ({which})")
        ax.axvline(self.floor_bytes / mib, color="grey", linestyle="--", label="floor")
        return finish_figure(
            fig, ax, xlabel="peak memory of a training step (MiB)", ylabel="step time (ms)",
            title="autockpt: memory / time trade-off",
        )  # fmt: skip

    def plot(self, path: str | Path, formats: Iterable[str] = ("png", "svg")) -> list[Path]:
        """Save :meth:`figure` as ``path`` with each suffix in ``formats``; the files written."""
        return save(self.figure(), path, formats)


def tradeoff(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    *,
    example_kwargs: dict[str, Any] | None = None,
    budgets: Sequence[int | float | str] | None = None,
    counts: Sequence[int] | None = None,
    measure: bool = False,
    loss_fn: LossFn | None = None,
    mode: str | None = None,
    progress: bool = True,
    head: str | None = None,
) -> Tradeoff:
    """Plans across the memory/time trade-off of ``model`` on these inputs.

    The model is walked, dry-run and profiled once; every plan comes from that profile, so
    the sweep costs one profile plus one planner run per point, and with
    ``measure=True`` four training steps per point (one warm-up, three timed; the model
    itself is left unwrapped and unchanged).

    Args:
        model: any model ``auto_checkpoint`` accepts, not checkpointed.
        example_inputs: positional inputs, a batch of the size you train with.
        example_kwargs: keyword inputs.
        budgets: the budgets to plan for (as ``budget=`` takes them); by default 12 from
            the planner's floor to the unwrapped step's peak.
        counts: segment counts to plan besides ``"sqrt"``; by default up to 8 from 2 to
            the number of stages, spread geometrically.
        measure: also run each plan and measure its peak and step time.
        loss_fn: the loss you train with (see :func:`autockpt.auto_checkpoint`).
        mode: force a walker.
        progress: a progress bar on stderr while measuring (needs ``tqdm``).
        head: ``"chunked"`` sweeps the step with a causal LM's loss computed in token chunks,
            ``"whole"`` without (see :func:`autockpt.auto_checkpoint`); by default the
            model's own. Two sweeps, one of each, show what chunking the head buys.

    Examples:
        >>> import autockpt, torch
        >>> net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        >>> sweep = autockpt.tradeoff(net, (torch.randn(256, 64),), budgets=[0.6, 0.8])
        >>> [p.kind for p in sweep.points][:4]
        ['unwrapped', 'sqrt', 'count', 'count']
    """
    had = installed_head(model)
    wanted = head or ("chunked" if had is not None else "whole")
    if wanted != ("chunked" if had is not None else "whole"):
        set_head(model, wanted, where="tradeoff")
    try:
        sweep = (budgets, counts, measure, loss_fn, mode, progress)
        return _sweep(model, example_inputs, example_kwargs, *sweep)
    finally:
        if had is not None:
            model.__dict__["forward"] = had  # the model's own chunked head, as it was
        elif wanted == "chunked":
            set_head(model, "whole", where="tradeoff")


def _sweep(
    model: nn.Module,
    example_inputs: Sequence[Any] | Any,
    example_kwargs: dict[str, Any] | None,
    budgets: Sequence[int | float | str] | None,
    counts: Sequence[int] | None,
    measure: bool,
    loss_fn: LossFn | None,
    mode: str | None,
    progress: bool,
) -> Tradeoff:
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    walked, _, chain = walk_and_dry_run(model, args, example_kwargs, mode, where="tradeoff")

    def plan_for(spec: SegmentsSpec, budget: int | float | str | None = None) -> Plan:
        costs = None
        if budget is not None:
            costs = budget_costs(
                model, walked, chain, args, kwargs, budget, loss_fn=loss_fn, where="tradeoff"
            )
        with warnings.catch_warnings():  # "saves little" and one-segment warnings: the table shows it
            warnings.simplefilter("ignore")
            return build_plan(chain, spec, where="tradeoff", notes=walked.notes, budget=costs)

    plain = plan_for("none")
    prof = budget_costs(model, walked, chain, args, kwargs, 1.0, loss_fn=loss_fn, where="tradeoff").profile
    base_ms = sum(c.fwd_ms + c.bwd_ms for c in prof.costs)

    def point(kind: str, label: str, plan: Plan) -> TradeoffPoint:
        peak, recompute_ms = predict_plan(plan, prof)
        return TradeoffPoint(kind, label, plan, peak, base_ms + recompute_ms)

    points = [point("unwrapped", "unwrapped", plain), point("sqrt", "sqrt", plan_for("sqrt"))]
    n = plain.n_stages
    for k in counts if counts is not None else _default_counts(n):
        if 2 <= k <= n:
            points.append(point("count", f"{k} segments", plan_for(k)))
    try:
        plan_for("budget", 1)
        floor = 1
    except PlanInfeasibleError as err:
        floor = err.min_budget_bytes or 1
    top = points[0].predicted_peak_bytes
    for b in budgets if budgets is not None else _default_budgets(floor, top):
        try:
            plan = plan_for("budget", b)
        except PlanInfeasibleError:
            continue
        points.append(point("budget", f"budget {format_bytes(plan.budget_bytes or 0)}", plan))
    # beyond 64 stages the floor comes from a bisection (within 0.1%); a plan at it shows it exactly
    floor = min([floor, *(p.predicted_peak_bytes for p in points if p.kind == "budget")])
    if measure:
        points = _measured(model, points, args, example_kwargs, loss_fn, progress)
    return Tradeoff(tuple(points), floor)


def _step_times(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None, loss_fn: LossFn | None
) -> list[float]:
    """Milliseconds of three training steps after a warm-up, on a copy the caller throws away;
    the caller's random number stream is left as it was."""
    times = []
    with torch.random.fork_rng(devices=[]):
        for i in range(4):
            for p in model.parameters():
                p.grad = None
            _sync(args)
            t0 = time.perf_counter()
            training_step(model, args, kwargs, loss_fn, where="tradeoff")
            _sync(args)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def _sync(args: Sequence[Any]) -> None:
    """Wait for the inputs' CUDA device, so that host timers see the work."""
    devices = {t.device for t in args if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


def _default_counts(n: int) -> list[int]:
    if n < 2:
        return []
    return sorted({round(2 * (n / 2) ** (i / 7)) for i in range(8)})


def _default_budgets(floor: int, top: int, points: int = 12) -> list[int]:
    return [math.ceil(floor + (top - floor) * i / (points - 1)) for i in range(points)]


def _measured(
    model: nn.Module,
    points: list[TradeoffPoint],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    loss_fn: LossFn | None,
    progress: bool,
) -> list[TradeoffPoint]:
    bar: Any = points
    if progress:
        try:
            from tqdm import tqdm  # type: ignore[import-untyped]

            bar = tqdm(points, desc="autockpt tradeoff", unit="plan", file=sys.stderr)
        except ImportError:
            pass
    out = []
    for p in bar:
        twin = copy.deepcopy(model)
        apply_plan(twin, p.plan)
        peak = measure_step(twin, args, kwargs, loss_fn)
        step_ms = statistics.median(_step_times(twin, args, kwargs, loss_fn))
        out.append(dataclasses.replace(p, measured_peak_bytes=peak, measured_step_ms=step_ms))
    return out
