"""Shared helpers: run a training step and compare two models bitwise."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import autockpt
from autockpt.execution import runtime


def twin(model: nn.Module, segments: Any = "sqrt", **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """An unwrapped reference and a checkpointed deep copy of ``model``."""
    ref = copy.deepcopy(model)
    return ref, autockpt.auto_checkpoint(model, segments, **kwargs)


def step(model: nn.Module, x: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Any:
    """One forward and backward from a fixed RNG state; returns the output."""
    out = model(x)
    loss = loss_fn(out) if loss_fn else _weighted(out)
    loss.backward()
    return out


def _weighted(out: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * w).sum()


def seeded_step(model: nn.Module, x: Any, seed: int = 0) -> tuple[Any, torch.Tensor]:
    """``step`` after ``torch.manual_seed(seed)``; returns output and the next random draw."""
    torch.manual_seed(seed)
    out = step(model, x)
    return out, torch.rand(1)


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    """Parameters, gradients and buffers of ``a`` and ``b`` are bitwise equal."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), f"parameter {name} differs"
        ga, gb = pa[name].grad, pb[name].grad
        assert (ga is None) == (gb is None), f"grad of {name}: one is None"
        if ga is not None:
            assert torch.equal(ga, gb), f"grad of {name} differs: {(ga - gb).abs().max()}"
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for name in ba:
        assert torch.equal(ba[name], bb[name]), f"buffer {name} differs"


def assert_same_step(model: nn.Module, x: Any, segments: Any = "sqrt", steps: int = 1) -> None:
    """Checkpointed and unwrapped copies agree bitwise over ``steps`` training steps."""
    ref, ck = twin(model, segments)
    for i in range(steps):
        ra, rb = (x.clone().requires_grad_(x.is_floating_point()) for _ in range(2))
        oa, na = seeded_step(ref, ra, seed=i)
        ob, nb = seeded_step(ck, rb, seed=i)
        assert torch.equal(oa, ob)
        assert torch.equal(na, nb), "RNG stream after the step differs"
        if ra.requires_grad:
            assert torch.equal(ra.grad, rb.grad)
    assert_same_state(ref, ck)


class CheckpointCalls:
    """Spies on both ways a segment is checkpointed: torch's ``checkpoint`` and autockpt's
    lean one (NOTE [Lean checkpoint] in autockpt/execution/lean_checkpoint.py)."""

    def __init__(self, torch_spy: mock.MagicMock, lean_spy: mock.MagicMock) -> None:
        self.torch, self.lean = torch_spy, lean_spy

    @property
    def call_count(self) -> int:
        return int(self.torch.call_count + self.lean.call_count)

    def tensor_args(self) -> list[tuple[torch.Tensor, ...]]:
        """The tensors each call was handed (torch's calls, then the lean ones)."""
        calls = [call.args[1:] for call in self.torch.call_args_list]
        calls += [tuple(call.args[1]) for call in self.lean.call_args_list]
        return [tuple(a for a in args if isinstance(a, torch.Tensor)) for args in calls]


@contextlib.contextmanager
def count_checkpoint_calls() -> Iterator[CheckpointCalls]:
    """Counts checkpointed segment calls, whichever way each one is checkpointed."""
    with (
        mock.patch.object(tuc, "checkpoint", wraps=tuc.checkpoint) as torch_spy,
        mock.patch.object(runtime, "lean_checkpoint", wraps=runtime.lean_checkpoint) as lean_spy,
    ):
        yield CheckpointCalls(torch_spy, lean_spy)
