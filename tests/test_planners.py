"""Planners are pure functions: generic tests over the whole registry, then specifics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import autockpt
from autockpt.plan import Plan, Segment
from autockpt.planners import PlanRequest, StageCost, get_planner, run_planner
from autockpt.planners.basic import (
    _byte_sizes,
    balanced_sizes,
    estimated_peak,
    snap_boundaries,
    sqrt_segment_count,
    uniform_plan,
)
from autockpt.planners.budget import min_feasible_budget
from autockpt.planners.cost_model import dry_run_costs, predict


def request(n: int) -> PlanRequest:
    return PlanRequest(stage_names=tuple(str(i) for i in range(n)))


def measured_request(n: int) -> PlanRequest:
    """A request as after profiling, with a budget between the floor and the unwrapped peak."""
    costs = tuple(StageCost(1.0 + i % 3, 2.0, 1000, 1000, 500 * (1 + i % 2), True, False, 1500, 3000, 100)
                  for i in range(n))  # fmt: skip
    unwrapped = predict((Segment(0, n, False),), costs).peak_bytes
    floor = min_feasible_budget(costs)
    return PlanRequest(
        stage_names=tuple(str(i) for i in range(n)),
        input_bytes=tuple(c.in_bytes for c in costs),
        saved_bytes=tuple(c.kept_bytes + c.in_bytes for c in costs),
        costs=costs,
        budget_bytes=(floor + unwrapped) // 2,
    )


@pytest.mark.parametrize("name", autockpt.available_planners())
@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 20])
def test_every_planner_tiles_the_chain_and_is_deterministic(name: str, n: int) -> None:
    fn = get_planner(name, where="test")
    for req in (request(n), measured_request(n)):
        if name == "budget" and req.costs is None:
            continue
        first = run_planner(fn, req, where="test")
        assert first == run_planner(fn, req, where="test")
        assert first[0].start == 0 and first[-1].stop == n
        for a, b in itertools.pairwise(first):
            assert a.stop == b.start
        assert not first[-1].checkpoint, "the last segment buys nothing at the peak"
        if req.costs is not None and req.budget_bytes is not None and name == "budget":
            assert predict(first, req.costs).peak_bytes <= req.budget_bytes


@pytest.mark.parametrize("n", range(1, 21))
def test_sqrt_uses_ceil_sqrt_balanced_segments(n: int) -> None:
    segs = run_planner(get_planner("sqrt", where="t"), request(n), where="t")
    assert len(segs) == math.ceil(math.sqrt(n)) == sqrt_segment_count(n)
    sizes = [len(s) for s in segs]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n", range(1, 21))
def test_uniform_partition_is_ordered_complete_balanced_for_every_k(n: int) -> None:
    for k in range(1, n + 1):
        segs = uniform_plan(n, k)
        assert len(segs) == k
        assert [s.start for s in segs] == sorted(s.start for s in segs)
        assert sum(len(s) for s in segs) == n
        assert max(map(len, segs)) - min(map(len, segs)) <= 1
        assert [s.checkpoint for s in segs] == [True] * (k - 1) + [False]


@pytest.mark.parametrize(("n", "k"), [(5, 0), (5, 6), (0, 1), (3, -1)])
def test_balanced_sizes_rejects_impossible_counts(n: int, k: int) -> None:
    with pytest.raises(ValueError, match="1 <= k <= n"):
        balanced_sizes(n, k)


def test_none_planner_checkpoints_nothing() -> None:
    assert run_planner(get_planner("none", where="t"), request(4), where="t") == (Segment(0, 4, False),)


def test_custom_planner_may_return_sizes_or_segments() -> None:
    assert run_planner(lambda r: [2, 1], request(3), where="t") == (Segment(0, 2, True), Segment(2, 3, False))
    segs = (Segment(0, 1, False), Segment(1, 3, True))
    assert run_planner(lambda r: segs, request(3), where="t") == segs


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([2, 2], "sum to 4, but the chain has 3"),
        ([0, 3], "positive ints"),
        ((Segment(0, 1, True), Segment(2, 3, False)), "contiguous"),
        ((Segment(0, 2, True),), "every stage must be in exactly one segment"),
        (["a"], "must return Segments or segment sizes"),
    ],
)
def test_custom_planner_answers_are_validated(answer: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        run_planner(lambda r: answer, request(3), where="t")  # type: ignore[arg-type, return-value]


def test_register_planner_normalises_names_before_the_duplicate_check() -> None:
    autockpt.register_planner(
        "Test-Halves", lambda r: [r.n_stages // 2, r.n_stages - r.n_stages // 2], overwrite=True
    )
    assert "test-halves" in autockpt.available_planners()
    with pytest.raises(ValueError, match="exists already"):
        autockpt.register_planner("TEST-HALVES ", lambda r: [r.n_stages])
    with pytest.raises(TypeError, match="callable"):
        autockpt.register_planner("bad", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        autockpt.register_planner(" ", lambda r: [r.n_stages])


def test_unknown_planner_lists_the_registry_and_suggests() -> None:
    with pytest.raises(ValueError) as err:
        get_planner("sqr", where="auto_checkpoint")
    text = str(err.value)
    assert "'sqr'" in text and "Did you mean 'sqrt'?" in text
    for name in autockpt.available_planners():
        assert repr(name) in text


@given(st.lists(st.integers(1, 5), min_size=1, max_size=8), st.data())
def test_plan_json_round_trip(sizes: list[int], data: st.DataObject) -> None:
    n = sum(sizes)
    segs = run_planner(lambda r: sizes, request(n), where="t")
    plan = Plan(
        strategy="custom",
        walker="sequential",
        stage_names=tuple(str(i) for i in range(n)),
        stage_kinds=tuple(data.draw(st.sampled_from(["Linear", "Conv2d+ReLU"])) for _ in range(n)),
        segments=segs,
        predicted_peak_bytes=data.draw(st.none() | st.integers(0, 2**40)),
        notes=("a note",),
    )
    assert Plan.from_json(plan.to_json()) == plan


def test_nested_segments_round_trip_and_count_recompute() -> None:
    inner = (Segment(0, 2, True), Segment(2, 4, False))
    plan = Plan(
        "nested", "sequential", tuple("abcde"), ("L",) * 5, (Segment(0, 4, True, inner), Segment(4, 5, False))
    )
    assert plan.recomputed_stages == 4 + 2
    assert Plan.from_json(plan.to_json()) == plan
    assert "0.0" in str(plan)


def test_plan_rejects_bad_segments_and_bad_json() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Plan("x", "sequential", ("a", "b"), ("L", "L"), (Segment(1, 2, False),))
    with pytest.raises(ValueError, match="not an autockpt plan"):
        Plan.from_json('{"strategy": "sqrt"}')


def test_plan_table_names_every_stage_and_what_is_recomputed() -> None:
    plan = Plan(
        "2",
        "sequential",
        ("0+1", "2", "3"),
        ("Conv2d+ReLU", "Linear", "Tanh"),
        (Segment(0, 2, True), Segment(2, 3, False)),
    )
    text = str(plan)
    assert "strategy='2'" in text and "walker='sequential'" in text
    assert "0+1:Conv2d+ReLU" in text and "3:Tanh" in text
    lines = text.splitlines()
    assert lines[2].split()[:3] == ["0", "0-1", "yes"]
    assert lines[3].split()[:3] == ["1", "2", "no"]
    assert "recomputed in backward: 2 of 3" in text


@given(st.integers(1, 60), st.data())
def test_sqrt_with_bytes_keeps_the_count_and_moves_each_boundary_at_most_half_a_segment(
    n: int, data: st.DataObject
) -> None:
    sizes_bytes = tuple(data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n)))
    plain = run_planner(get_planner("sqrt", where="t"), request(n), where="t")
    req = PlanRequest(stage_names=request(n).stage_names, input_bytes=sizes_bytes)
    snapped = run_planner(get_planner("sqrt", where="t"), req, where="t")
    assert len(snapped) == len(plain)
    reach = min(map(len, plain)) // 2
    for a, b in zip(plain[1:], snapped[1:]):
        assert abs(a.start - b.start) <= reach
        assert sizes_bytes[b.start] <= sizes_bytes[a.start]  # the count-balanced spot is a candidate


def test_sqrt_moves_boundaries_of_an_expansion_mlp_to_narrow_tensors() -> None:  # CORRECTNESS 29
    # 5 blocks of (Linear d->4d, GELU, Linear 4d->d): inputs are narrow every third stage
    widths = tuple(1 if i % 3 == 0 else 4 for i in range(15))
    req = PlanRequest(stage_names=request(15).stage_names, input_bytes=widths)
    plain = run_planner(get_planner("sqrt", where="t"), request(15), where="t")
    snapped = run_planner(get_planner("sqrt", where="t"), req, where="t")
    assert [s.start for s in plain] == [0, 4, 8, 12]
    assert [s.start for s in snapped] == [0, 3, 9, 12]


def sqrt_with(saved: list[int], inputs: list[int]) -> tuple[Segment, ...]:
    n = len(saved)
    req = PlanRequest(stage_names=request(n).stage_names, input_bytes=tuple(inputs), saved_bytes=tuple(saved))
    return run_planner(get_planner("sqrt", where="t"), req, where="t")


@pytest.mark.parametrize("n", [4, 9, 16, 25, 30])
def test_sqrt_on_bytes_is_sqrt_n_when_every_stage_saves_its_input(n: int) -> None:
    segs = sqrt_with([100] * n, [100] * n)
    assert len(segs) == math.ceil(math.sqrt(n))


def test_sqrt_on_bytes_uses_more_segments_when_stages_hold_more_than_their_input() -> None:
    # 12 transformer-like blocks: each saves 16x its input (attention maps, MLP)
    assert len(sqrt_with([1600] * 12, [100] * 12)) == 12  # ceil(sqrt(192)) = 14, at most n
    assert len(sqrt_with([400] * 36, [100] * 36)) == 12  # sqrt(36 * 4) = 12, not sqrt(36) = 6


def test_sqrt_on_bytes_balances_saved_bytes_not_stage_counts() -> None:
    saved = [800, 800, 100, 100, 100, 100, 100, 100, 100, 100]  # two heavy stages first
    segs = sqrt_with(saved, [100] * 10)
    per_segment = [sum(saved[s.start : s.stop]) for s in segs]
    assert len(segs[0]) == 1 and per_segment[0] == 800  # a count split would hold both heavy stages
    costs = dry_run_costs([100] * 10, saved)
    by_count = [0, *itertools.accumulate(balanced_sizes(10, len(segs)))]
    assert estimated_peak([s.start for s in segs] + [10], costs) < estimated_peak(by_count, costs)


def test_sqrt_on_bytes_starts_segments_at_the_heavy_half_of_each_block() -> None:
    # 12 transformer blocks as (attention, MLP) stage pairs: attention saves ~3x the MLP and
    # every input is equal; recomputing (MLP, attention) pairs would stack the MLP's saved
    # bytes under the attention backward, so each segment must start at an attention stage
    saved = [60, 22] * 12
    segs = sqrt_with(saved, [4] * 24)
    assert all(s.start % 2 == 0 for s in segs if s.checkpoint)
    assert len(segs) in (12, 13)  # one per block; the last may be split off the plain tail


@given(st.integers(2, 40), st.data())
def test_sqrt_on_bytes_never_estimates_worse_than_the_split_at_sqrt_a_over_b(
    n: int, data: st.DataObject
) -> None:
    saved = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    inputs = data.draw(st.lists(st.integers(1, 200), min_size=n, max_size=n))
    k = min(n, math.ceil(math.sqrt(sum(saved) * (n - 1) / sum(inputs[1:]))))
    plain = [0, *snap_boundaries(_byte_sizes(saved, k), tuple(inputs), tuple(saved)), n]
    chosen = sqrt_with(saved, inputs)
    bounds = [s.start for s in chosen] + [n]
    costs = dry_run_costs(inputs, saved)
    assert estimated_peak(bounds, costs) <= estimated_peak(plain, costs)


def _chain(blocks: int = 9) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        *(m for _ in range(blocks) for m in (torch.nn.Linear(256, 256), torch.nn.GELU()))
    )


def test_explain_gives_each_segment_its_kept_input_and_what_its_stages_save() -> None:
    x = torch.randn(512, 256)  # 512 KiB; every Linear and GELU saves its input
    plan = autockpt.make_plan(_chain(), example_inputs=(x,))
    text = plan.explain()
    assert "segment 0: stages 0-3 (0 .. 3), checkpointed" in text
    assert (
        "keeps its input, 512.00 KiB, from forward to backward, in place of the 2.00 MiB its stages save"
        in text
    )
    assert f"segment {len(plan.segments) - 1}: " in text and text.count(", plain") == 1
    assert "in all: checkpoints keep 2.00 MiB of inputs in place of the 7.50 MiB their stages save" in text
    assert Plan.from_json(plan.to_json()) == plan  # the figures travel with the plan


def test_explain_shows_recompute_times_for_a_budget_plan_and_says_when_it_has_no_figures() -> None:
    x = torch.randn(512, 256)
    text = autockpt.make_plan(_chain(), budget=0.6, example_inputs=(x,)).explain()
    assert "recomputes 4 stage forwards in backward (" in text and "the recompute costs" in text
    bare = autockpt.make_plan(_chain()).explain()
    assert "no per-stage figures" in bare and "keeps its input" not in bare
