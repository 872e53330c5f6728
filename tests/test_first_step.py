"""Step one is as light as the rest: the dry run inside the first training step (no
``example_inputs``) must not raise that step's peak above the steady checkpointed step's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from models_for_tests import GPT
from torch import nn

import autockpt


def resnet() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(num_classes=10), torch.randn(8, 3, 48, 48)
    return model, lambda m: m(x).sum()


def decoder() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(vocab=64, width=64, layers=6, heads=4, context=128, dropout=0.0)
    idx, mask = torch.randint(0, 64, (8, 128)), torch.ones(8, 128)
    return model, lambda m: m(idx, attention_mask=mask).sum()


def segmenter() -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """An output as large as the input image: the dry run once kept it through its second
    pass (NOTE [A light dry run]), 1.056x of the steady step's peak."""
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=21
    )
    x, target = torch.randn(2, 3, 128, 128), torch.randint(0, 21, (2, 128, 128))
    return model, lambda m: nn.functional.cross_entropy(m(x)["out"], target)


def peaks(model: nn.Module, loss: Callable[[nn.Module], Any], steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        with autockpt.track_memory("cpu") as mem:
            loss(model).backward()
        model.zero_grad(set_to_none=True)
        out.append(mem.peak_bytes)
    return out


@pytest.mark.parametrize("build", [resnet, decoder, segmenter], ids=["resnet18", "transformer", "lraspp"])
def test_the_first_step_peaks_no_higher_than_the_steady_checkpointed_step(build: Callable[..., Any]) -> None:
    model, loss = build()
    plain = peaks(model, loss, 1)[0]
    first, *later = peaks(autockpt.auto_checkpoint(model), loss, 3)  # the dry run runs in step one
    assert model.forward.probe is not None, "the first step ran the dry run"
    steady = max(later)
    assert steady < plain
    assert first <= 1.05 * steady, (first, steady, plain)
