"""Never a silent 1.00x: a plan that saves little says why and what would help."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import autockpt


class Heavy(nn.Module):
    """One module that keeps almost all of the activations (a wide hidden layer)."""

    def __init__(self, width: int = 16, hidden: int = 4096) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class LongSkip(nn.Module):
    """The stem's output is added back at the end, so it crosses every cut in between."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        self.body = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        h = y
        for layer in self.body:
            h = layer(h)
        return self.head(h + y)


def test_one_stage_holding_most_activations_is_named() -> None:
    model = nn.Sequential(
        nn.Linear(16, 16), nn.Tanh(), Heavy(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )
    with pytest.warns(UserWarning, match=r"save little memory.*stage '2' alone keeps") as record:
        plan = autockpt.make_plan(model, example_inputs=(torch.randn(64, 16),))
    assert len(record) == 1 and any("save little" in n for n in plan.notes)


def test_a_long_skip_connection_is_explained_with_the_stages_found() -> None:
    x = torch.randn(256, 64)
    with pytest.warns(UserWarning, match=r"found only 3 stages \(stem, body, head\).*mode='blocks'"):
        model = autockpt.auto_checkpoint(LongSkip(), mode="graph", example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # warned once, at planning: not again in training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autockpt.auto_checkpoint(LongSkip(), mode="blocks", example_inputs=(x,))


def test_left_to_choose_the_walker_takes_the_blocks_the_skip_spans() -> None:
    """The body piece is most of the model and all blocks (NOTE [One unit holds the blocks])."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = autockpt.auto_checkpoint(LongSkip(), example_inputs=(torch.randn(256, 64),))
    assert model.forward.plan.walker == "blocks"
    assert model.forward.plan.checkpointed_segments == 8


def test_without_example_inputs_the_warning_comes_with_the_first_step() -> None:
    model = autockpt.auto_checkpoint(LongSkip(), mode="graph")
    with pytest.warns(UserWarning, match="save little memory"):
        model(torch.randn(256, 64)).sum().backward()


def test_a_plan_that_saves_does_not_warn() -> None:
    model = nn.Sequential(*(m for _ in range(16) for m in (nn.Linear(64, 64), nn.Tanh())))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autockpt.make_plan(model, example_inputs=(torch.randn(256, 64),))
