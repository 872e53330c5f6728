"""A hook registered on any module after ``auto_checkpoint`` runs as in the unwrapped model.

Each walker replaces some modules' calls by their parts (the sequential walker flattens
nested Sequentials, the graph walker traces through containers, the block walker runs
blocks inside checkpoints). A hook put on such a module after the walk must still run,
once per step, and an output-changing hook must give the unwrapped model's gradients
(NOTE [Flattened containers] in ``walkers/sequential.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_state, step
from torch import nn

import autockpt

Hook = Callable[[list[bool]], Callable[..., Any]]


def halving(calls: list[bool]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(autockpt.is_recomputing())
        return out * 0.5

    return hook


def noisy(calls: list[bool]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        calls.append(autockpt.is_recomputing())
        return out + 1e-3 * torch.randn_like(out)

    return hook


def shifting_pre(calls: list[bool]) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        calls.append(autockpt.is_recomputing())
        return (args[0] - 0.25,)

    return hook


HOOKS: list[tuple[str, Hook]] = [("forward", halving), ("forward", noisy), ("pre", shifting_pre)]


def register(module: nn.Module, kind: str, hook: Callable[..., Any]) -> None:
    if kind == "pre":
        module.register_forward_pre_hook(hook)
    else:
        module.register_forward_hook(hook)


def nested() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]).double()


class Traced(nn.Module):
    """A residual model fx traces through: its ``body`` containers are never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = x + layer(x)
        return x


class Untraceable(Traced):
    """The same, with a branch on a tensor's value: the block walker takes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e9:
            x = x * 2
        return super().forward(x)


def _training_steps(
    model: nn.Module,
    target: Callable[[nn.Module], nn.Module],
    kind: str,
    hook: Hook,
    recomputed: bool = True,
    **wrap: Any,
) -> None:
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, **wrap)
    x = torch.randn(8, 16, dtype=torch.float64)
    step(model, x)  # a step before the hook: the plan is in place
    model.zero_grad()
    ours: list[bool] = []
    theirs: list[bool] = []
    register(target(model), kind, hook(ours))
    register(target(ref), kind, hook(theirs))
    for _ in range(2):
        torch.manual_seed(1)
        step(ref, x)
        torch.manual_seed(1)
        step(model, x)
        assert_same_state(model, ref)
    assert ours.count(False) == theirs.count(False) == 2  # once a step, as unwrapped
    # inside a checkpoint the hook runs again in the recompute; a block's own hooks run around it
    assert any(ours) == recomputed


@pytest.mark.parametrize(("kind", "hook"), HOOKS)
def test_sequential_walker_a_hook_on_a_flattened_container(kind: str, hook: Hook) -> None:
    _training_steps(nested(), lambda m: m[2], kind, hook, segments=3)


def test_sequential_walker_the_hooked_container_is_one_stage_of_the_new_plan() -> None:
    model = autockpt.auto_checkpoint(nested(), segments=3)
    before = model.forward.plan.stage_names
    model[2].register_forward_hook(lambda m, a, out: out)
    step(model, torch.randn(8, 16, dtype=torch.float64))
    after = model.forward.plan.stage_names
    assert "2.0" in before and "2" not in before
    assert "2" in after and "2.0" not in after


@pytest.mark.parametrize(("kind", "hook"), HOOKS)
def test_graph_walker_a_hook_on_a_traced_through_container(kind: str, hook: Hook) -> None:
    torch.manual_seed(0)
    model = Traced().double()
    _training_steps(model, lambda m: m.body[2], kind, hook, segments=3, mode="graph")


@pytest.mark.parametrize(("kind", "hook"), HOOKS)
def test_block_walker_hooks_on_a_block_and_inside_one(kind: str, hook: Hook) -> None:
    torch.manual_seed(0)
    model = Untraceable().double()
    assert autockpt.make_plan(copy.deepcopy(model)).walker == "blocks"
    _training_steps(model, lambda m: m.body[2][0], kind, hook)
    _training_steps(Untraceable().double(), lambda m: m.body[2], kind, hook, recomputed=False)


def test_sequential_walker_a_backward_hook_on_a_flattened_container() -> None:
    model = nested()
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, segments=3)
    x = torch.randn(8, 16, dtype=torch.float64)
    step(model, x)
    model.zero_grad()
    counts = []
    for m in (model, ref):
        calls: list[int] = []
        m[2].register_full_backward_hook(lambda mod, gin, gout, c=calls: (c.append(1), (2 * gin[0],))[1])
        step(m, x)
        counts.append(len(calls))
    assert counts == [1, 1]
    assert_same_state(model, ref)
