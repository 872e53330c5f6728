"""Pins for single-line mutations that no other test caught (issue 35).

Each test names, in its docstring, the mutation it pins: a one-line change to the library
under which the whole suite still passed. All are small and deterministic: gradients in
float64 compared bitwise, the profile's timing figures under a fake clock, the budget DP
against exhaustive search over every plan of a short hand-made chain.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types

import pytest
import torch
from helpers import assert_same_state, count_checkpoint_calls, seeded_step, twin
from torch import nn
from torch.utils.checkpoint import CheckpointError

import autockpt
from autockpt.measure import timing
from autockpt.plan import Segment
from autockpt.planners import PlanRequest, StageCost
from autockpt.planners.budget import budget_planner, min_feasible_budget
from autockpt.planners.cost_model import predict
from autockpt.walkers.graph import trace_program, units_of

D = torch.float64


def linear_tanh_chain(pairs: int = 3, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(pairs) for m in (nn.Linear(width, width), nn.Tanh()))).to(D)


# --- execution ----------------------------------------------------------------------------


def test_a_random_hook_added_after_planning_is_replayed_with_the_forwards_draws() -> None:
    """Pins ``may_use_rng`` (execution/checkpoint_args.py) always returning ``False``: a
    segment of stock RNG-free modules skips the RNG stash, so a forward hook added after
    planning that draws random numbers would draw others in the recompute."""
    ref, ck = twin(linear_tanh_chain(), 3)
    plan = ck.forward.plan
    assert any(s.checkpoint and s.start <= 2 < s.stop for s in plan.segments), plan
    for model in (ref, ck):  # a leaf module of a checkpointed segment, after planning
        model[2].register_forward_hook(lambda mod, args, out: out + 1e-3 * torch.randn_like(out))
    x = torch.randn(4, 8, dtype=D)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, next_ref = seeded_step(ref, xa)
    out_ck, next_ck = seeded_step(ck, xb)
    assert torch.equal(out_ref, out_ck)
    assert_same_state(ref, ck)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(next_ref, next_ck), "RNG stream after the step differs"


class CastsInRecompute(nn.Module):
    """Computes its tanh in float32 when recomputed, and returns the forward's dtype either
    way: only a saved tensor's dtype differs, not the stage's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() if autockpt.is_recomputing() else x
        return torch.tanh(y).to(x.dtype)


def test_a_recompute_that_saves_another_dtype_raises() -> None:
    """Pins the lean checkpoint's ``repack`` (execution/lean_checkpoint.py) comparing the
    shape alone: a replay that saves a tensor of another dtype must raise, as torch's
    checkpoint does, not silently use it."""
    model = nn.Sequential(nn.Linear(6, 6), CastsInRecompute(), nn.Linear(6, 6), nn.Tanh()).to(D)
    model = autockpt.auto_checkpoint(model, 2)
    assert [s.checkpoint for s in model.forward.plan.segments] == [True, False]
    with count_checkpoint_calls() as spy:
        out = model(torch.randn(4, 6, dtype=D))
    assert (spy.lean.call_count, spy.torch.call_count) == (1, 0)
    with pytest.raises(CheckpointError, match=r"different metadata(.|\n)*torch.float32"):
        out.sum().backward()


# --- walkers ------------------------------------------------------------------------------


class NoGradMiddle(nn.Module):
    """Two layers in a ``no_grad`` region, where a single tensor crosses each gap."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        with torch.no_grad():
            x = torch.tanh(self.b(x))
            x = torch.tanh(self.c(x))
        return self.d(x)


def test_the_graph_walker_never_cuts_inside_a_no_grad_region() -> None:
    """Pins ``GraphProgram.cuts`` (walkers/graph.py) accepting cuts inside no-grad regions
    (``if alive <= 1 and grad`` -> ``if alive <= 1``): a piece starting there would run
    its layers with grad enabled."""
    program = trace_program(NoGradMiddle())
    off, on = (i for i, n in enumerate(program.nodes) if n.target is torch._C._set_grad_enabled)
    assert [p for p in program.cuts() if off < p <= on] == []
    assert [u.name for u in units_of(program)] == ["a", "b..c", "d"]


# --- profiling ----------------------------------------------------------------------------


def ticking_clock() -> types.SimpleNamespace:
    """A stand-in for the ``time`` module whose ``perf_counter`` moves one second a call."""
    ticks = itertools.count()
    return types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))


def test_a_stage_that_saves_nothing_is_all_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pins ``stage_times`` (measure/timing.py) charging 0 for the tail of a stage that saves
    nothing (``... if last_save.marks else f`` -> ``... else 0.0``): a recompute stops
    before such a stage ends a segment only if it saved nothing at all, so all of its
    forward is the tail (NOTE [The tail a recompute skips])."""
    monkeypatch.setattr(timing, "time", ticking_clock())
    cpu = torch.device("cpu")
    x = torch.randn(4, 8, dtype=D)
    # one tick between the forward's two marks; a multiplication by a number saves nothing
    fwd, _, tail, _ = timing.stage_times(lambda t: t * 2.0, x, [], 3, cpu, grads_as_given=False)
    assert (fwd, tail) == (1000.0, 1000.0)
    # tanh saves its output: one tick to its save, one from there to the forward's end
    fwd, _, tail, _ = timing.stage_times(torch.tanh, x, [], 3, cpu, grads_as_given=False)
    assert (fwd, tail) == (2000.0, 1000.0)


# --- verify -------------------------------------------------------------------------------


class NudgedInRecompute(nn.Module):
    """Scales by 1 + 1e-7 in a recompute: the gradients before it change by about 1e-7."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 1e-7) if autockpt.is_recomputing() else x


def test_verify_with_atol_zero_reports_a_tiny_difference() -> None:
    """Pins a hidden tolerance in ``verify``'s comparison (report/verification.py: ``atol`` ->
    ``max(atol, 1e-5)``): with ``atol=0`` a difference of about 1e-7 is a mismatch."""
    model = nn.Sequential(nn.Linear(3, 3), NudgedInRecompute(), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2, atol=0.0)
    assert not report.ok and "grad of 0.weight" in report.mismatches
    assert 0 < report.param_grad_max_abs_diff < 1e-5


class LateBuffer(nn.Module):
    """Registers a buffer on its third call: the checkpointed step of ``verify`` has it, the
    unwrapped one (the module's first two calls) not."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            self.register_buffer("late", torch.zeros(()))
        return x


def test_verify_reports_a_tensor_present_in_one_run_only() -> None:
    """Pins ``verify`` comparing only the names both runs have (report/verification.py: ``ref.tensors.keys()
    | ckpt.tensors.keys()`` -> ``&``): a buffer the checkpointed step has and the unwrapped
    one lacks is a mismatch."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), LateBuffer()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2)
    assert report.mismatches == ("buffer 3.late",)
    assert not report.ok and "MISMATCH" in str(report)


# --- the budget planner -------------------------------------------------------------------


def stage(fwd_ms: float, tail_ms: float, size: int, *, keeps_input: bool, keeps_output: bool) -> StageCost:
    """A stage whose input, output and forward peak are ``size`` bytes."""
    return StageCost(
        fwd_ms=fwd_ms, bwd_ms=2 * fwd_ms, tail_ms=tail_ms, in_bytes=size, out_bytes=size, kept_bytes=0,
        keeps_input=keeps_input, keeps_output=keeps_output, fwd_peak_bytes=size, bwd_peak_bytes=size,
        grad_bytes=0,
    )  # fmt: skip


def every_plan(n: int) -> list[tuple[Segment, ...]]:
    """Every single-level plan of ``n`` stages: each cut made or not, each segment plain or
    checkpointed."""
    plans = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        for flags in itertools.product([False, True], repeat=len(bounds) - 1):
            plans.append(tuple(Segment(a, b, f) for (a, b), f in zip(itertools.pairwise(bounds), flags)))
    return plans


def assert_plans_as_exhaustive_search(costs: tuple[StageCost, ...], loss_bytes: int | None) -> list[str]:
    """At every budget where some plan's predicted peak lies (the only budgets where the
    answer can change), the planner's plan fits, recomputes as little as the best of every
    plan that fits, and has no two neighbouring plain segments; below the lowest, it has
    none. Returns where each budget's plan peaks (:attr:`Prediction.peak_at`)."""
    names = tuple(str(i) for i in range(len(costs)))
    predictions = [predict(p, costs, loss_bytes=loss_bytes) for p in every_plan(len(costs))]
    budgets = sorted({p.peak_bytes for p in predictions})
    assert min_feasible_budget(costs, loss_bytes=loss_bytes) == budgets[0]
    peaks = []
    for budget in budgets:
        request = PlanRequest(stage_names=names, costs=costs, budget_bytes=budget, loss_bytes=loss_bytes)
        plan = budget_planner(request)
        assert [s.start for s in plan[1:]] == [s.stop for s in plan[:-1]] and plan[-1].stop == len(costs)
        assert not any(not a.checkpoint and not b.checkpoint for a, b in itertools.pairwise(plan)), plan
        got = predict(plan, costs, loss_bytes=loss_bytes)
        best = min(p.recompute_ms for p in predictions if p.peak_bytes <= budget)
        assert got.peak_bytes <= budget, (budget, plan)
        assert math.isclose(got.recompute_ms, best, rel_tol=1e-12), (budget, plan, got.recompute_ms, best)
        peaks.append(got.peak_at[2])
    with pytest.raises(autockpt.PlanInfeasibleError):
        budget_planner(dataclasses.replace(request, budget_bytes=budgets[0] - 1))
    return peaks


LINEAR = stage(10.0, 10.0, 1000, keeps_input=True, keeps_output=False)  # all its forward after its save
GELU = stage(1.0, 0.0, 1000, keeps_input=True, keeps_output=False)
RELU = stage(1.0, 0.0, 1000, keeps_input=False, keeps_output=True)


def test_the_budget_planner_counts_the_loss() -> None:
    """Pins the loss in the budget DP's end condition (planners/budget.py: ``h +
    model.loss(flag) <= budget`` -> ``h <= budget``): the loss runs on top of everything
    the forward holds, and here it is larger than any stage, so it sets most budgets' peak."""
    costs = (LINEAR, GELU, LINEAR, RELU, LINEAR)
    peaks = assert_plans_as_exhaustive_search(costs, loss_bytes=6000)
    assert "loss" in peaks


def test_the_budget_planner_joins_neighbouring_plain_segments() -> None:
    """Pins ``merge_plain`` (planners/budget_grid.py), e.g. made a no-op (``if out and not
    seg.checkpoint and not out[-1].checkpoint`` -> ``if False``): the DP builds plans a
    stage at a time, and a plan must come out with its plain stages joined."""
    costs = (RELU, LINEAR, GELU, RELU, LINEAR, GELU)
    assert_plans_as_exhaustive_search(costs, loss_bytes=None)
    whole = predict((Segment(0, 6, False),), costs).peak_bytes
    request = PlanRequest(stage_names=tuple("abcdef"), costs=costs, budget_bytes=whole - 1)
    plan = budget_planner(request)
    assert len(plan) == 2 and plan[0].checkpoint and not plan[1].checkpoint, plan


def test_the_budget_planner_counts_the_early_stop_tail() -> None:
    """Pins the early-stop tail in the budget DP's recompute time (planners/cost_model.py,
    ``CostModel.checkpoint_split``: ``ms - self.c[i].tail_ms`` dropped, or taken from the
    segment's first stage ``self.c[s]``): a segment's last stage recomputes only its
    forward before its tail, so the planner ends segments after a Linear (the tail is its
    whole forward) rather than after an activation (no tail)."""
    costs = (GELU, LINEAR, RELU, LINEAR, GELU, LINEAR)
    assert_plans_as_exhaustive_search(costs, loss_bytes=None)
    # one stage's bytes below the unwrapped peak: checkpoint the GELU and the Linear after it,
    # whose recompute is the GELU's 1 ms
    request = PlanRequest(stage_names=tuple("abcdef"), costs=costs, budget_bytes=6000)
    assert predict((Segment(0, 6, False),), costs).peak_bytes == 7000
    plan = budget_planner(request)
    assert plan == (Segment(0, 2, True), Segment(2, 6, False))
    assert predict(plan, costs).recompute_ms == 1.0
