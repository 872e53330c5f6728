"""A user's saved-tensor hooks around a checkpointed step (NOTE [Saved-tensor hooks around a
checkpoint] in ``measure/sandbox.py``): every tensor kept until backward goes through them,
what an op policy keeps included, with no FutureWarning, in eager and compiled runs."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn

import autockpt

needs_the_option = pytest.mark.skipif(
    "respect_saved_tensors_hooks" not in inspect.signature(tuc.checkpoint).parameters,
    reason="this torch's checkpoint has no respect_saved_tensors_hooks",
)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))))


class Packs:
    """A saved_tensors_hooks pair that counts what it packs (an offloader would copy it)."""

    def __init__(self) -> None:
        self.count = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def packed_step(model: nn.Module, x: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    packs = Packs()
    with packs.hooks():
        loss = model(x).square().sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    return packs.count, grads


@needs_the_option
def test_what_a_policy_keeps_goes_through_the_users_hooks_and_nothing_warns() -> None:
    x = torch.randn(8, 16, dtype=torch.float64)
    ref = mlp().double()
    plain = autockpt.auto_checkpoint(copy.deepcopy(ref), 4, policy="recompute-all")
    kept = autockpt.auto_checkpoint(copy.deepcopy(ref), 4, policy="save-matmuls")
    _, expected = packed_step(ref, x)
    counts = {}
    for name, model in (("recompute-all", plain), ("save-matmuls", kept)):
        packed_step(model, x)  # the first step's dry run and plan
        counts[name], grads = packed_step(model, x)  # filterwarnings=error: no FutureWarning
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    # the policy keeps each checkpointed segment's two matmul outputs (3 segments x 3 blocks
    # of Linear-ReLU-Linear would keep more; at least one kept output per segment shows)
    assert counts["save-matmuls"] >= counts["recompute-all"] + 3


@needs_the_option
def test_save_on_cpu_around_a_compiled_checkpointed_step() -> None:
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    ref = mlp()
    model = torch.compile(
        autockpt.auto_checkpoint(copy.deepcopy(ref), 4, example_inputs=(x,)), backend="aot_eager"
    )
    for m in (ref, model):
        with torch.autograd.graph.save_on_cpu():
            m(x).square().sum().backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
