"""The mutation guard: changes between forward and backward that would corrupt a recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from models_for_tests import GPT
from torch import nn

import autockpt


class Scaled(nn.Module):
    """Multiplies by a constant buffer that its forward never changes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((width,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), Scaled(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2),
    )  # fmt: skip


def test_a_parameter_changed_in_place_before_backward_raises() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    out = ck(torch.randn(4, 8))
    with torch.no_grad():
        ck[0].weight.add_(1.0)
    with pytest.raises(
        autockpt.MutationError, match=r"parameter '0\.weight' \(shape \(8, 8\)\) was modified"
    ):
        out.sum().backward()


def test_the_unwrapped_model_fails_there_too() -> None:
    plain = model()
    out = plain(torch.randn(4, 8))
    with torch.no_grad():
        plain[3].weight.add_(1.0)  # saved by its Linear for the input gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_constant_buffer_changed_in_place_raises() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    out = ck(torch.randn(4, 8))
    ck[1].scale.mul_(3.0)
    with pytest.raises(autockpt.MutationError, match=r"buffer '1\.scale'"):
        out.sum().backward()


def test_switching_to_eval_before_backward_raises_and_switching_back_does_not() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    x = torch.randn(4, 8)
    out = ck(x)
    ck.eval()
    with pytest.raises(autockpt.MutationError, match="switched to eval mode"):
        out.sum().backward()
    ck.train()
    out = ck(x)
    ck.eval()
    ck.train()  # a validation pass in between, mode restored before backward
    out.sum().backward()


def test_never_fires_in_a_training_loop_with_accumulation_and_shared_modules() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    layers = [nn.Linear(8, 8), bn, nn.Tanh(), nn.Linear(8, 8), bn, nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
    ref = nn.Sequential(*layers, nn.Linear(8, 2)).double()
    ck = autockpt.auto_checkpoint(copy.deepcopy(ref), 4)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ck)]
    for step in range(3):
        for m, opt in zip((ref, ck), opts):
            for micro in range(2):  # gradient accumulation over two micro-batches
                torch.manual_seed(10 * step + micro)
                m(torch.randn(6, 8, dtype=torch.float64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), ck.state_dict().values()))


def test_two_forwards_then_one_backward_is_fine() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    a, b = ck(torch.randn(4, 8)), ck(torch.randn(4, 8))
    (a.sum() + b.sum()).backward()


def test_never_fires_on_a_traced_transformer_loop() -> None:
    torch.manual_seed(0)
    gpt = autockpt.auto_checkpoint(GPT(width=32, layers=3, heads=2, context=16))
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    idx = torch.randint(0, 50, (2, 16))
    for _ in range(3):
        gpt(idx, attention_mask=torch.ones(2, 16)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert gpt.forward.plan.walker == "graph" and gpt.forward.plan.checkpointed_segments > 0
