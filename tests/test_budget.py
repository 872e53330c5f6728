"""The budget planner: optimal under its cost model, safe, monotone, and honest in practice."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import threading
import types
from unittest import mock

import pytest
import torch
import torchvision
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import autockpt
from autockpt.plan import Segment
from autockpt.planners import PlanRequest, StageCost, get_planner, run_planner
from autockpt.planners import budget as budget_module
from autockpt.planners.budget import _solve, min_feasible_budget
from autockpt.planners.cost_model import CostModel, predict

MiB = 2**20


@st.composite
def stage_costs(draw: st.DrawFn, max_stages: int = 8) -> tuple[StageCost, ...]:
    n = draw(st.integers(1, max_stages))
    sizes = [draw(st.integers(1, 50)) for _ in range(n + 1)]
    fwd = [draw(st.floats(0.1, 10)) for _ in range(n)]
    return tuple(
        StageCost(
            fwd_ms=fwd[i],
            tail_ms=draw(st.floats(0, fwd[i])),
            sac_ms=draw(st.floats(0, 2)),
            bwd_ms=draw(st.floats(0.1, 10)),
            in_bytes=sizes[i] * 1000,
            out_bytes=sizes[i + 1] * 1000,
            kept_bytes=draw(st.integers(0, 80)) * 1000,
            keeps_input=draw(st.booleans()),
            keeps_output=draw(st.booleans()),
            fwd_peak_bytes=sizes[i + 1] * 1000 + draw(st.integers(0, 20)) * 1000,
            bwd_peak_bytes=draw(st.integers(0, 60)) * 1000,
            grad_bytes=draw(st.integers(0, 10)) * 1000,
        )
        for i in range(n)
    )


def all_single_level_plans(n: int) -> list[tuple[Segment, ...]]:
    """Every way to cut n stages into segments, each plain or checkpointed."""
    plans = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
        spans = list(itertools.pairwise(bounds))
        for flags in itertools.product([False, True], repeat=len(spans)):
            plans.append(tuple(Segment(a, b, f) for (a, b), f in zip(spans, flags)))
    return plans


@given(stage_costs(), st.floats(0.2, 1.2), st.none() | st.integers(0, 100_000))
def test_dp_equals_exhaustive_search(costs: tuple[StageCost, ...], fraction: float, loss: int | None) -> None:
    unwrapped = predict((Segment(0, len(costs), False),), costs, loss_bytes=loss).peak_bytes
    budget = int(fraction * unwrapped)
    best = min(
        (predict(p, costs, loss_bytes=loss).recompute_ms for p in all_single_level_plans(len(costs))
         if predict(p, costs, loss_bytes=loss).peak_bytes <= budget),
        default=None,
    )  # fmt: skip
    plan = _solve(costs, budget, loss)
    if best is None:
        assert plan is None
        return
    assert plan is not None
    got = predict(plan, costs, loss_bytes=loss)
    assert got.peak_bytes <= budget
    assert math.isclose(got.recompute_ms, best, rel_tol=1e-9, abs_tol=1e-9)


@given(stage_costs(max_stages=12), st.floats(0.2, 1.0), st.floats(0.0, 0.5))
def test_more_budget_never_means_more_recompute_and_plans_are_deterministic(
    costs: tuple[StageCost, ...], fraction: float, extra: float
) -> None:
    unwrapped = predict((Segment(0, len(costs), False),), costs).peak_bytes
    low, high = int(fraction * unwrapped), int((fraction + extra) * unwrapped)
    a, b = _solve(costs, low), _solve(costs, high)
    if a is not None:
        assert b is not None
        assert predict(b, costs).recompute_ms <= predict(a, costs).recompute_ms + 1e-9
        assert _solve(costs, low) == a


@given(stage_costs(max_stages=10))
def test_min_feasible_budget_is_feasible_and_tight(costs: tuple[StageCost, ...]) -> None:
    floor = min_feasible_budget(costs)
    assert _solve(costs, floor) is not None
    assert _solve(costs, floor - 1) is None


@given(stage_costs(), st.none() | st.integers(0, 100_000), st.data())
def test_the_floor_is_the_lowest_peak_of_any_plan(
    costs: tuple[StageCost, ...], loss: int | None, data: st.DataObject
) -> None:
    n = len(costs)
    spans = data.draw(st.none() | st.lists(st.integers(0, n), min_size=n, max_size=n))
    allowed = [
        p for p in all_single_level_plans(n)
        if spans is None or all(len(seg) <= spans[seg.start] for seg in p if seg.checkpoint)
    ]  # fmt: skip
    lowest = min(predict(p, costs, loss_bytes=loss).peak_bytes for p in allowed)
    assert min_feasible_budget(costs, loss_bytes=loss, spans=spans) == lowest
    assert _solve(costs, lowest, loss, spans) is not None and _solve(costs, lowest - 1, loss, spans) is None


@given(stage_costs(), st.none() | st.integers(0, 100_000))
def test_budgets_above_the_unwrapped_step_or_below_the_floor_skip_the_dp(
    costs: tuple[StageCost, ...], loss: int | None
) -> None:
    """The DP takes about a second on a 56-stage chain; neither budget needs it (NOTE
    [Planner shortcuts]), and both answers are still those of exhaustive search."""
    whole = predict((Segment(0, len(costs), False),), costs, loss_bytes=loss).peak_bytes
    floor = min_feasible_budget(costs, loss_bytes=loss)
    with mock.patch.object(budget_module, "_solve_exact", side_effect=AssertionError("the DP ran")):
        assert _solve(costs, whole, loss) == (Segment(0, len(costs), False),)
        if floor > 0:
            assert _solve(costs, floor - 1, loss) is None


def test_infeasible_budget_names_the_floor_and_the_stage() -> None:
    costs = (StageCost(1, 1, 1000, 1000, 0, True, False, 1000, 50 * MiB, 0),) * 3
    request = PlanRequest(stage_names=("a", "b", "c"), costs=costs, budget_bytes=MiB, static_bytes=0)
    with pytest.raises(
        autockpt.PlanInfeasibleError, match=r"^budget planner: .*smallest achievable peak .* stage 'a'"
    ):
        run_planner(get_planner("budget", where="t"), request, where="t")
    with pytest.raises(autockpt.PlanInfeasibleError) as info:
        run_planner(get_planner("budget", where="t"), request, where="t")
    assert info.value.min_budget_bytes == min_feasible_budget(costs)
    assert f"is {autockpt.plan.format_bytes(min_feasible_budget(costs))}" in str(info.value)
    # the top of the useful range: the step without checkpointing, so a retry needs no second call
    unwrapped = predict((Segment(0, 3, False),), costs).peak_bytes
    assert info.value.unwrapped_bytes == unwrapped
    assert f"peaks at {autockpt.plan.format_bytes(unwrapped)}" in str(info.value)


def test_prediction_says_where_the_peak_falls() -> None:
    light = StageCost(1, 1, 1000, 1000, 1000, True, False, 1000, 1000, 0)
    heavy = dataclasses.replace(light, bwd_peak_bytes=50 * MiB)
    costs = (light, heavy, light, light)
    assert predict((Segment(0, 4, False),), costs).peak_at == (1, 2, "backward")
    split = (Segment(0, 2, True), Segment(2, 4, False))
    assert predict(split, costs).peak_at == (0, 2, "recompute")
    wide_out = dataclasses.replace(light, out_bytes=80 * MiB, fwd_peak_bytes=80 * MiB)
    assert predict((Segment(0, 2, False),), (light, wide_out)).peak_at == (2, 2, "loss")


def test_budget_plans_name_where_the_predicted_peak_falls() -> None:
    plan = autockpt.make_plan(chain(), budget=1.0, example_inputs=(torch.randn(8, WIDTH),))
    assert any(n.startswith("the predicted peak falls in the ") for n in plan.notes)


def test_budget_planner_without_costs_says_what_it_needs() -> None:
    with pytest.raises(ValueError, match="needs measured stage costs"):
        run_planner(get_planner("budget", where="t"), PlanRequest(stage_names=("a",)), where="t")


WIDTH = 16
BATCH = 1024  # activations of 64 KiB: they, not the parameters, set the peak, so fractions mean something
ACTIVATION = BATCH * WIDTH * 4


def chain() -> nn.Sequential:
    """A tiny chain for control flow: 4 x (Linear(16) + GELU), 8 stages.

    At batch ``BATCH`` the smallest achievable peak is 0.64 of the unwrapped step, so
    fractions 0.7 and up are feasible and checkpoint at least one segment; at batch 8 the
    parameters dominate and only the unwrapped plan fits.
    """
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())])


BAD = [
    (0, ValueError, "not positive"),
    (-5, ValueError, "not positive"),
    ("12 parsecs", ValueError, "cannot read budget='12 parsecs'"),
    (1.5, ValueError, "outside (0, 1]"),
    (True, TypeError, "budget=True is a bool"),
]


@pytest.mark.parametrize(("budget", "exc", "message"), BAD)
def test_bad_budgets(budget: object, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message.replace("(", r"\(").replace("]", r"\]")):
        autockpt.make_plan(chain(), budget=budget, example_inputs=(torch.randn(8, WIDTH),))  # type: ignore[arg-type]


def test_budget_without_example_inputs_or_with_segments() -> None:
    with pytest.raises(ValueError, match="needs example inputs"):
        autockpt.make_plan(chain(), budget="1GiB")
    with pytest.raises(ValueError, match="both segments=4 and budget"):
        autockpt.make_plan(chain(), 4, budget="1GiB", example_inputs=(torch.randn(8, WIDTH),))


@pytest.mark.parametrize("text", ["2GiB", "512MB", "1.5 gib", "1000000"])
def test_budget_strings(text: str) -> None:
    from autockpt.plan import parse_budget

    expected = {"2GiB": 2 * 2**30, "512MB": 512 * 10**6, "1.5 gib": int(1.5 * 2**30), "1000000": 10**6}
    assert parse_budget(text, unwrapped_bytes=1, where="t") == expected[text]


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def total_peak(model: nn.Module, x: torch.Tensor) -> int:
    tensors = [*model.parameters(), *model.buffers(), x]
    static = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        with autockpt.track_memory("cpu", tensors=False) as mem:
            out = model(x)
            square_mean(out).backward()
            del out
    return static + mem.peak_bytes


class ReadLinear(nn.Linear):
    """A Linear subclass fx traces through (as timm's ``Linear``): the trace reads its
    weight with ``get_attr`` and calls ``F.linear``, so no unit calls the module."""


class ReadHead(nn.Module):
    """A chain with a head fx traces through, whose weight's gradient (1 MiB) is a sixth of
    the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())])
        self.head = ReadLinear(256, 1024)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_the_gradient_of_a_module_the_trace_reads_is_counted() -> None:
    """A profile that left it out planned below the true floor: timm's mobilenetv3 with 1000
    classes predicted 19.4 MiB unwrapped for 22.9 measured, and here a plan at budget=0.8
    predicted 5.5 MB and peaked at 6.6 MB, when the floor is 0.89 of the unwrapped step."""
    torch.manual_seed(0)
    model, x = ReadHead(), torch.randn(128, 256)
    prof = autockpt.profile(model, (x,), loss_fn=square_mean)
    assert prof.walker == "graph" and prof.costs[-1].grad_bytes == (256 * 1024 + 1024) * 4
    with pytest.raises(autockpt.PlanInfeasibleError) as err:
        autockpt.make_plan(model, budget=0.5, example_inputs=(x,), loss_fn=square_mean)
    plan = autockpt.make_plan(
        model, budget=err.value.min_budget_bytes, example_inputs=(x,), loss_fn=square_mean
    )
    assert plan.checkpointed_segments > 0 and plan.predicted_peak_bytes is not None
    autockpt.auto_checkpoint(model, plan)
    measured = total_peak(model, x)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.02 * measured, (measured, plan.predicted_peak_bytes)


CASES = {  # small sizes, but every fraction below 1.0 is above the case's floor and checkpoints
    "nin_nchw": (lambda: autockpt.models.NiN(10), lambda: torch.randn(8, 3, 32, 32), [1.0]),
    "nin_channels_last": (  # floor 0.91 of unwrapped at batch 16; at batch 8 it is 0.921
        lambda: autockpt.models.NiN(10).to(memory_format=torch.channels_last),
        lambda: torch.randn(16, 3, 32, 32).to(memory_format=torch.channels_last),
        [1.0, 0.95, 0.92],
    ),
    "resnet18": (  # floor 0.88 at batch 32; at 24 it is 0.905: parameters and gradients weigh more
        lambda: torchvision.models.resnet18(),
        lambda: torch.randn(32, 3, 64, 64),
        [1.0, 0.95, 0.9],
    ),
    "deep_chain": (  # 24 stages, floor 0.375: 0.4 checkpoints 4 segments
        lambda: nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(64, 64), nn.GELU())]),
        lambda: torch.randn(1024, 64),
        [0.8, 0.55, 0.4],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_peak_matches_measured_and_the_budget_holds(name: str) -> None:
    model_factory, data, fractions = CASES[name]
    torch.manual_seed(0)
    model, x = model_factory(), data()
    unwrapped = autockpt.make_plan(
        model, budget=1.0, example_inputs=(x,), loss_fn=square_mean
    ).predicted_peak_bytes
    assert unwrapped is not None
    for fraction in fractions:
        plan = autockpt.make_plan(model, budget=fraction, example_inputs=(x,), loss_fn=square_mean)
        autockpt.auto_checkpoint(model, plan)
        measured = total_peak(model, x)
        predicted = plan.predicted_peak_bytes
        assert predicted is not None and predicted <= fraction * unwrapped
        assert abs(measured - predicted) <= 0.02 * measured, (fraction, measured, predicted)  # issue: 10%
        assert measured <= 1.05 * fraction * unwrapped, (fraction, measured, unwrapped)
        autockpt.restore(model)


def test_profile_bytes_are_exact_and_repeatable_while_times_may_vary() -> None:
    model, x = chain(), torch.randn(8, WIDTH)
    first, second = autockpt.profile(model, (x,)), autockpt.profile(model, (x,))
    strip = [dataclasses.replace(c, fwd_ms=0.0, bwd_ms=0.0, tail_ms=0.0) for c in first.costs]
    assert strip == [dataclasses.replace(c, fwd_ms=0.0, bwd_ms=0.0, tail_ms=0.0) for c in second.costs]
    activation = 8 * WIDTH * 4
    assert first.costs[1].in_bytes == activation  # GELU's input
    assert first.costs[0].keeps_input and first.costs[1].keeps_input  # Linear and GELU save inputs
    assert all(c.grad_bytes == (WIDTH * WIDTH + WIDTH) * 4 for c in first.costs[::2])
    text = str(first)
    assert text.startswith("autockpt profile: walker='sequential'") and "bwd peak" in text
    data = json.loads(first.to_json())
    assert len(data["stages"]) == 8 and data["stages"][0]["name"] == "0"


def test_profile_is_invisible() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    autockpt.profile(model, (x,))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_auto_checkpoint_with_a_budget_trains_exactly() -> None:
    x = torch.randn(BATCH, WIDTH)
    ref = chain()
    model = autockpt.auto_checkpoint(chain(), budget=0.7, example_inputs=(x,))  # checkpoints 2 segments
    plan = model.forward.plan
    assert plan.strategy.startswith("budget=") and plan.checkpointed_segments >= 1
    assert "predicted peak" in str(plan) and "predicted recompute time" in str(plan)
    for m in (ref, model):
        m(x).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))


def test_infeasible_budget_through_the_api() -> None:
    with pytest.raises(
        autockpt.PlanInfeasibleError, match=r"^auto_checkpoint: no plan fits budget=1\.00 KiB"
    ):
        autockpt.auto_checkpoint(chain(), budget=1024, example_inputs=(torch.randn(8, WIDTH),))


def test_an_infeasible_graph_walked_model_is_not_kept_alive() -> None:
    """The error of an infeasible budget does not keep the model (or an fx trace of it) alive."""
    import gc
    import weakref

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    model = Net()
    with pytest.raises(autockpt.PlanInfeasibleError):
        autockpt.auto_checkpoint(model, budget=1024, example_inputs=(torch.randn(8, WIDTH),), mode="graph")
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


class Configured(nn.Module):
    """A graph-walked model whose control flow a config object decides (HF's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(residual=True)
        self.a, self.b, self.c = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.mix(h) + (h if self.cfg.residual else 0)
        return self.c(h)


def sigmoid_mix(self: Configured, h: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(self.b(h))


CHANGES = ["none", "config field", "class method", "hook added", "unpicklable attribute"]
CHANGES += ["error held", "error dropped"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_retry_after_an_infeasible_budget_sees_every_change(change: str) -> None:
    """A retry after PlanInfeasibleError walks the model again, so whatever changed since (a
    config field, a class method, a hook), while the error is held or after, trains exactly."""
    x = torch.randn(8, WIDTH)
    torch.manual_seed(0)
    model = type("Local", (Configured,), {})()  # a class of its own: the test may change it
    if change == "unpicklable attribute":
        model.lock = threading.Lock()
    ref = copy.deepcopy(model) if change != "unpicklable attribute" else None
    try:
        autockpt.auto_checkpoint(model, budget=1024, example_inputs=(x,), mode="graph")
    except autockpt.PlanInfeasibleError as err:
        held = err
        budget = (err.min_budget_bytes + err.unwrapped_bytes) // 2  # type: ignore[operator]
        if change == "config field":
            model.cfg.residual = False
        if change == "class method":
            type(model).mix = sigmoid_mix  # type: ignore[method-assign]
        if change == "hook added":
            model.b.register_forward_hook(lambda m, i, o: None)
        if change not in ("error held", "error dropped"):  # the natural retry, inside the except
            autockpt.auto_checkpoint(model, budget=budget, example_inputs=(x,), mode="graph")
    if change == "error dropped":
        del held
    if change in ("error held", "error dropped"):
        autockpt.auto_checkpoint(model, budget=budget, example_inputs=(x,), mode="graph")
    if ref is None:
        return
    ref.cfg.residual = model.cfg.residual
    for m in (ref, model):
        m(x).square().mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), model.parameters()))


def test_long_chains_use_the_grid_and_stay_within_budget_and_near_optimal() -> None:
    import random

    from autockpt.planners.budget import _min_peak_exact, _solve_exact
    from autockpt.planners.budget_grid import solve_on_grid

    rng = random.Random(1)
    costs = tuple(
        StageCost(rng.uniform(1, 3), 2.0, 2**20, 2**20, rng.choice([0, 2**20, 4 * 2**20]), True,
                  rng.random() < 0.3, 2 * 2**20, 3 * 2**20, 2**10)
        for _ in range(80)
    )  # fmt: skip
    unwrapped = predict((Segment(0, 80, False),), costs).peak_bytes
    floor = min_feasible_budget(costs)
    # the grid reaches the exact floor here: found in one plan, not a bisection of twelve
    assert floor == _min_peak_exact(CostModel(costs))
    assert _solve(costs, floor) is not None and _solve(costs, floor - 1) is None
    budget = (floor + unwrapped) // 2
    grid, exact = solve_on_grid(CostModel(costs), budget), _solve_exact(CostModel(costs), budget)
    assert grid is not None and exact is not None
    assert predict(grid, costs).peak_bytes <= budget
    assert (
        predict(exact, costs).recompute_ms
        <= predict(grid, costs).recompute_ms
        <= 1.25 * predict(exact, costs).recompute_ms
    )


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_the_grid_is_exact_when_every_byte_figure_falls_on_it(seed: int) -> None:
    """With every byte figure a multiple of the grid step, no two paths holding different
    bytes share a cell, so the grid DP must find the exact DP's optimum and stay within
    the budget: a source taken that does not fit, or one left out that does, shows (merges
    of two sources in one cell never happen here; the next test covers them)."""
    import random

    from autockpt.planners.budget import _solve_exact
    from autockpt.planners.budget_grid import RESOLUTION, solve_on_grid

    rng = random.Random(seed)
    unit = 2**12
    costs = tuple(
        StageCost(rng.uniform(1, 3), 2.0, unit * rng.randint(1, 3), unit * rng.randint(1, 3),
                  unit * rng.choice([0, 1, 4]), rng.random() < 0.5, rng.random() < 0.3,
                  unit * rng.randint(1, 4), unit * rng.randint(1, 6), 0)
        for _ in range(72)
    )  # fmt: skip
    spans = [rng.randint(1, 40) for _ in costs]
    model = CostModel(costs, spans=spans)
    budget = RESOLUTION * unit  # the grid step is then exactly ``unit``
    assert (
        min_feasible_budget(costs, spans=spans) < budget < predict((Segment(0, 72, False),), costs).peak_bytes
    )
    grid, exact = solve_on_grid(model, budget), _solve_exact(model, budget)
    assert grid is not None and exact is not None
    assert predict(grid, costs).peak_bytes <= budget
    assert predict(grid, costs).recompute_ms == pytest.approx(predict(exact, costs).recompute_ms, rel=1e-12)


def _grid_reference(model: CostModel, budget: int) -> tuple[Segment, ...] | None:
    """The grid DP restated one path at a time, in the same order (plain items before
    checkpointed ones at each position, segments cut where they stop fitting): per cell of
    held bytes, the path of least (recompute, held bytes) among those offered to it. What
    ``solve_on_grid`` computes in vectorised steps; it shares their bounds (``longest_segment``,
    the cost model), so it checks the merging, not those."""
    from autockpt.planners.budget_grid import RESOLUTION, longest_segment, merge_plain

    n, quantum = len(model.c), max(1, math.ceil(budget / RESOLUTION))
    best: dict[tuple[int, int], dict[int, tuple[float, int, tuple[int, int, int, bool] | None]]] = {
        (f, p): {} for f in (0, 1) for p in range(n + 1)
    }
    best[(1, 0)][0] = (0.0, 0, None)

    def offer(f: int, t: int, cost: float, held: int, back: tuple[int, int, int, bool]) -> None:
        cell = held // quantum
        old = best[(f, t)].get(cell)
        if old is None or (cost, held) < (old[0], old[1]):
            best[(f, t)][cell] = (cost, held, back)

    for s in range(n):
        for flag in (0, 1):
            sources = sorted(best[(flag, s)].items())
            if not sources:
                continue
            lowest = sources[0][1][1]
            local, add = model.plain_local(s, bool(flag)), model.held(s, bool(flag))
            if lowest + local <= budget:
                for cell, (cost, held, _) in sources:
                    if held <= budget - max(local, add):
                        offer(int(model.c[s].keeps_output), s + 1, cost, held + add, (s, flag, cell, False))
            add = model.checkpoint_held(s, bool(flag))
            for t, (local, ms) in enumerate(model.checkpoint_locals(s, bool(flag)), start=s + 1):
                if lowest + local > budget or t > longest_segment(model, s):
                    break
                for cell, (cost, held, _) in sources:
                    if held <= budget - max(local, add):
                        offer(0, t, cost + ms, held + add, (s, flag, cell, True))
    ends = [
        (cost, held, cell, f)
        for f in (0, 1)
        for cell, (cost, held, _) in best[(f, n)].items()
        if held + model.loss(bool(f)) <= budget
    ]
    if not ends:
        return None
    _, _, cell, f = min(ends)
    segments, pos = [], n
    while pos > 0:
        back = best[(f, pos)][cell][2]
        assert back is not None
        s, f, cell, checkpointed = back
        segments.append(Segment(s, pos, checkpointed))
        pos = s
    return merge_plain(segments[::-1])


@pytest.mark.parametrize("seed", [5, 6, 7, 8, 9, 10])
def test_the_grid_dp_keeps_per_cell_the_path_of_least_recompute(seed: int) -> None:
    """``solve_on_grid`` against its definition, on chains whose bytes fall anywhere on the
    grid, so that two paths often share a cell (which one it keeps decides the plan); seeds
    9 and 10 draw times from a few values, and a stage's whole forward may be its tail (a
    one-stage checkpoint then recomputes nothing), so paths tie exactly and the tie-breaks
    decide."""
    import random

    from autockpt.planners.budget_grid import solve_on_grid

    rng = random.Random(seed)
    ties = seed >= 9
    costs = []
    for _ in range(rng.randint(65, 90)):
        fwd = float(rng.choice([1, 2])) if ties else rng.uniform(1, 3)
        tail = rng.choice([0.0, fwd]) if ties else rng.uniform(0, 1)
        costs.append(
            StageCost(fwd, 2.0, rng.randint(1, 3 * 2**20), rng.randint(1, 3 * 2**20),
                      rng.choice([0, rng.randint(1, 4 * 2**20)]), rng.random() < 0.5, rng.random() < 0.3,
                      rng.randint(0, 4 * 2**20), rng.randint(0, 6 * 2**20), 0, tail_ms=tail)
        )  # fmt: skip
    spans = [rng.randint(1, 40) for _ in costs] if seed % 2 else None
    model = CostModel(costs, spans=spans)
    floor = min_feasible_budget(costs, spans=spans)
    unwrapped = predict((Segment(0, len(costs), False),), costs).peak_bytes
    for fraction in (0.0, 0.02, 0.1, 0.3, 0.6, 0.9):
        budget = floor + int(fraction * (unwrapped - floor))
        assert solve_on_grid(model, budget) == _grid_reference(model, budget), fraction


def test_check_measures_the_plan_and_records_the_figure() -> None:
    x = torch.randn(BATCH, WIDTH)
    model = autockpt.auto_checkpoint(
        chain(), budget=0.8, example_inputs=(x,), check=True
    )  # headroom above the 0.64 floor
    plan = model.forward.plan
    assert plan.budget_bytes is not None
    note = next(n for n in plan.notes if n.startswith("measured peak"))
    assert f"for budget {autockpt.plan.format_bytes(plan.budget_bytes)}" in note
    assert autockpt.Plan.from_json(plan.to_json()) == plan


def test_check_tightens_a_plan_whose_prediction_was_too_low(monkeypatch: pytest.MonkeyPatch) -> None:
    import autockpt.api as verification

    real = verification.measure_step
    calls: list[int] = []

    def optimistic_model(
        model: nn.Module, args: object, kwargs: object = None, loss_fn: object = None
    ) -> int:
        calls.append(1)
        return real(model, args, kwargs, loss_fn) + (2 * ACTIVATION if len(calls) == 1 else 0)  # too big

    monkeypatch.setattr(verification, "measure_step", optimistic_model)
    x = torch.randn(BATCH, WIDTH)
    # 0.8 plans 0.73 of unwrapped; two activations over (0.18) put the measurement 0.11 above
    # 0.8, so the retry plans for 0.69: below the first plan, above the 0.64 floor
    first = autockpt.make_plan(chain(), budget=0.8, example_inputs=(x,))
    model = autockpt.auto_checkpoint(chain(), budget=0.8, example_inputs=(x,), check=True)
    assert len(calls) == 2
    assert model.forward.plan.predicted_peak_bytes < first.predicted_peak_bytes
    assert model.forward.plan.budget_bytes == first.budget_bytes  # the user's budget, not the limit
    assert any("planned for" in n for n in model.forward.plan.notes)


def test_a_model_is_profiled_once_per_input_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    import autockpt.measure.model_profile as planning

    calls: list[tuple[int, ...]] = []
    real = planning.profile_chain

    def counting(
        model: nn.Module, chain: object, x: torch.Tensor, static: int, **kw: object
    ) -> autockpt.Profile:
        calls.append(tuple(x.shape))
        return real(model, chain, x, static, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(planning, "profile_chain", counting)
    model = chain()
    x = torch.randn(BATCH, WIDTH)
    first = autockpt.make_plan(model, budget=0.7, example_inputs=(x,))
    autockpt.auto_checkpoint(model, budget=0.7, example_inputs=(x,))
    assert model.forward.plan.segments == first.segments
    autockpt.make_plan(model, budget=0.9, example_inputs=(torch.randn(BATCH, WIDTH),))
    assert calls == [(BATCH, WIDTH)]  # same shapes: measured once
    half = BATCH // 2
    autockpt.make_plan(model, budget=0.9, example_inputs=(torch.randn(half, WIDTH),))
    autockpt.make_plan(model.double(), budget=0.9, example_inputs=(torch.randn(half, WIDTH).double(),))
    # a new batch size or dtype: measured again
    assert calls == [(BATCH, WIDTH), (half, WIDTH), (half, WIDTH)]


def test_plans_reuse_a_profile_the_user_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    import autockpt.measure.model_profile as planning

    model, x = chain(), torch.randn(BATCH, WIDTH)
    prof = autockpt.profile(model, (x,))
    monkeypatch.setattr(planning, "profile_chain", None)  # any new measurement would fail
    plan = autockpt.make_plan(model, budget=0.7, example_inputs=(x,))
    assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
    assert prof.static_bytes < plan.predicted_peak_bytes <= plan.budget_bytes
