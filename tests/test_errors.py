"""Bad arguments get clear errors that name the value and the fix (table-driven)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import autockpt


class Untraceable(nn.Module):
    """Data-dependent control flow and no repeated blocks: no walker applies."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


def small() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2), nn.Tanh())


# (model factory, segments, exception, message fragments)
CASES: list[tuple[Any, Any, type[Exception], list[str]]] = [
    (small, 0, ValueError, ["segments=0", "4 stages", "1 <= segments <= 4"]),
    (small, -1, ValueError, ["segments=-1", "1 <= segments <= 4"]),
    (small, 5, ValueError, ["segments=5", "has 4 stages", "1 <= segments <= 4"]),
    (small, 2.5, TypeError, ["float 2.5", "int number of segments"]),
    (small, True, TypeError, ["bool True", "int number of segments"]),
    (small, "sqr", ValueError, ["'sqr'", "Did you mean 'sqrt'?", "'none'"]),
    (small, None, TypeError, ["NoneType None"]),
    (lambda: nn.Sequential(), "sqrt", autockpt.AutockptError, ["no modules", "at least one layer"]),
    (
        Untraceable,
        "sqrt",
        autockpt.AutockptError,
        ["cannot walk Untraceable", "could not trace", "no ModuleList"],
    ),
    (lambda: "not a model", "sqrt", TypeError, ["expected a torch.nn.Module, got str"]),
]


@pytest.mark.parametrize(("factory", "segments", "exc", "fragments"), CASES)
@pytest.mark.parametrize("api", [autockpt.auto_checkpoint, autockpt.make_plan])
def test_bad_arguments(
    api: Any, factory: Any, segments: Any, exc: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(exc) as err:
        api(factory(), segments)
    text = str(err.value)
    assert text.startswith(api.__name__ + ":"), text
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in {text!r}"


def test_restore_on_a_model_never_checkpointed() -> None:
    with pytest.raises(
        autockpt.AutockptError, match=re.escape("restore: this Sequential is not checkpointed")
    ):
        autockpt.restore(small())


def test_errors_share_one_family() -> None:
    assert issubclass(autockpt.PlanInfeasibleError, autockpt.AutockptError)
    assert issubclass(autockpt.AutockptError, RuntimeError)


def test_one_segment_warns_that_it_cannot_lower_the_peak() -> None:
    with pytest.warns(UserWarning, match="segments=1 gives one segment.*cannot lower the peak"):
        plan = autockpt.make_plan(small(), 1)
    assert plan.checkpointed_segments == 0
    assert any("cannot lower the peak" in n for n in plan.notes)


def test_single_stage_model_gets_an_explicit_noop_plan_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="single stage"):
        model = autockpt.auto_checkpoint(nn.Sequential(nn.Linear(3, 3)))
    x = torch.randn(2, 3)
    assert torch.equal(model(x), model[0](x))


def test_none_strategy_does_not_warn() -> None:
    assert autockpt.make_plan(small(), "none").checkpointed_segments == 0


def test_sequential_input_count_is_checked_like_sequential() -> None:
    model = autockpt.auto_checkpoint(small(), 2)
    with pytest.raises(TypeError):
        model(torch.randn(1, 2), torch.randn(1, 2))
    with pytest.raises(TypeError, match="one input"):
        autockpt.make_plan(small(), example_inputs=(torch.randn(1, 2), torch.randn(1, 2)))


def test_bad_mode_lists_the_walkers() -> None:
    with pytest.raises(
        ValueError, match=re.escape("mode='fx' is not a walker. Use one of 'sequential', 'graph', 'blocks'")
    ):
        autockpt.auto_checkpoint(small(), mode="fx")


def test_forced_walker_that_does_not_apply_says_why() -> None:
    with pytest.raises(
        autockpt.AutockptError, match=re.escape("sequential walker: Untraceable is not an nn.Sequential")
    ):
        autockpt.make_plan(Untraceable(), mode="sequential")
