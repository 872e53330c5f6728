"""A recompute stops once backward has what it needs: the cost model counts it.

torch's non-reentrant checkpoint stops a recompute as soon as every tensor the first
forward saved has been saved again. A Linear saves its input before it multiplies, so a
segment ending with a Linear never recomputes that matmul; a ReLU saves its output, so a
segment ending with one recomputes all of it. The profile measures each stage's ``tail_ms``
(its forward after its last save) and the planner prefers segments that end where the tail
is long: on a Linear/GELU chain, segments that end with the Linear.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from typing import Any

import pytest
import torch
from test_policies import backward_addmm
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autockpt
from autockpt.measure import timing
from autockpt.plan import Segment
from autockpt.planners import StageCost
from autockpt.planners.budget import budget_planner
from autockpt.planners.cost_model import predict
from autockpt.planners.registry import PlanRequest


def test_a_segment_ending_with_a_linear_does_not_recompute_its_matmul() -> None:
    """The fact the cost model relies on, through autockpt's runtime."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
    x = torch.randn(8, 32)
    plan = autockpt.make_plan(model, 2)
    counts = []
    for segments in (
        (Segment(0, 1, False), Segment(1, 3, True), Segment(3, 4, False)),  # GELU, Linear
        (Segment(0, 2, True), Segment(2, 4, False)),  # Linear, GELU
    ):
        applied = dataclasses.replace(plan, segments=segments).apply(copy.deepcopy(model))
        counts.append(backward_addmm(applied, x))
    assert counts == [0, 1]


class OpClock(TorchDispatchMode):
    """A clock on which every op autograd dispatches takes one second: the profile's times
    become counts of ops, the same on every run."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def perf_counter(self) -> float:
        return float(self.ops)


def test_the_profile_measures_the_tail_after_the_last_save(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    clock = OpClock()
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    with clock:
        prof = autockpt.profile(model, (torch.randn(8, 16),), repeats=3)
    linear, relu = prof.costs
    # autograd saves an op's inputs before the op runs and its outputs after: the Linear's
    # matmul runs after its last save, the ReLU saves the output it has just made
    assert linear.tail_ms >= 1000.0 and linear.tail_ms >= 0.5 * linear.fwd_ms, linear
    assert relu.tail_ms == 0.0 and relu.fwd_ms >= 1000.0, relu
    assert "tail ms" in str(prof) and json.loads(prof.to_json())["stages"][0]["tail_ms"] == linear.tail_ms


def chain(pairs: int) -> tuple[StageCost, ...]:
    """Linear (slow, saves its input, whole forward after its save) and GELU (fast, saves its
    input) stages of equal sizes."""
    linear = StageCost(fwd_ms=10.0, bwd_ms=20.0, tail_ms=10.0, in_bytes=1000, out_bytes=1000, kept_bytes=0,
                       keeps_input=True, keeps_output=False, fwd_peak_bytes=1000, bwd_peak_bytes=1000,
                       grad_bytes=0)  # fmt: skip
    gelu = dataclasses.replace(linear, fwd_ms=1.0, bwd_ms=1.0, tail_ms=1.0)
    return (linear, gelu) * pairs


def test_the_planner_ends_segments_where_the_recompute_stops_early() -> None:
    costs = chain(8)
    unwrapped = predict((Segment(0, len(costs), False),), costs).peak_bytes
    request = PlanRequest(stage_names=tuple(str(i) for i in range(16)), costs=costs,
                          budget_bytes=int(0.7 * unwrapped))  # fmt: skip
    plan = budget_planner(request)
    checkpointed = [s for s in plan if s.checkpoint]
    assert checkpointed and all(s.stop % 2 == 1 for s in checkpointed)  # each ends with a Linear
    assert predict(plan, costs).recompute_ms < 10.0  # no matmul runs again
    # without the tail, the same budget costs matmuls: the planner saw no difference
    blind = tuple(dataclasses.replace(c, tail_ms=0.0) for c in costs)
    assert predict(budget_planner(dataclasses.replace(request, costs=blind)), blind).recompute_ms >= 10.0


def test_long_chains_of_small_items_plan_as_well_as_the_exact_solver() -> None:
    """Past 64 stages the planner thins its fronts to a grid. Rounding every item up to the
    grid had counted each of these 4 KiB items as two grid steps: at 0.9 of the unwrapped
    peak, 8x the exact plan's recompute."""
    from autockpt.planners.budget import _solve_exact
    from autockpt.planners.budget_grid import solve_on_grid
    from autockpt.planners.cost_model import CostModel

    costs = tuple(
        dataclasses.replace(c, in_bytes=4000, out_bytes=4000, fwd_peak_bytes=4000) for c in chain(40)
    )
    unwrapped = predict((Segment(0, len(costs), False),), costs).peak_bytes
    for fraction in (0.6, 0.9):
        budget = int(fraction * unwrapped)
        grid, exact = solve_on_grid(CostModel(costs), budget), _solve_exact(CostModel(costs), budget)
        assert grid is not None and exact is not None
        assert predict(grid, costs).peak_bytes <= budget
        assert predict(grid, costs).recompute_ms <= 1.05 * predict(exact, costs).recompute_ms + 1e-9
