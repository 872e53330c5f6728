"""verify() reports honestly and leaves the model exactly as it was."""

from __future__ import annotations

import copy

import torch
from helpers import assert_same_state
from models_for_tests import CallCounter
from torch import nn

import autockpt

D = torch.float64


def model_with_bn() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(inplace=True),
        nn.Dropout(0.3),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 2),
    ).to(D)


def test_verify_passes_and_reports_figures() -> None:
    report = autockpt.verify(model_with_bn(), (torch.randn(6, 4, dtype=D),), segments=3)
    assert report.ok and report.mismatches == ()
    assert report.param_grad_max_abs_diff == 0.0 and report.input_grad_max_abs_diff == 0.0
    assert report.peak_bytes_unwrapped > 0 and report.tensor_peak_bytes_checkpointed > 0
    assert report.plan.strategy == "3"
    text = str(report)
    assert text.startswith("autockpt verify: OK") and "peak (allocator)" in text


def test_verify_leaves_a_checkpointed_model_as_it_was() -> None:
    model = autockpt.auto_checkpoint(model_with_bn(), 2)
    x = torch.randn(6, 4, dtype=D)
    model(x).sum().backward()
    before = copy.deepcopy(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n, p in before.named_parameters():
        p.grad = grads[n]  # deepcopy drops .grad
    forward = model.forward
    rng = torch.get_rng_state()
    report = autockpt.verify(model, (x,), segments=4)
    assert report.ok and report.plan.strategy == "4"
    assert model.forward is forward and model.forward.plan.strategy == "2"
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_state(before, model)
    assert autockpt.verify(model, (x,)).plan.strategy == "2"  # default: the installed plan


def test_verify_leaves_a_plain_model_plain() -> None:
    model = model_with_bn()
    autockpt.verify(model, torch.randn(6, 4, dtype=D))
    assert "forward" not in vars(model)


def test_verify_catches_a_module_that_does_not_replay() -> None:
    model = nn.Sequential(nn.Linear(3, 3), CallCounter(), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2)
    assert not report.ok
    assert "grad of 0.weight" in report.mismatches
    assert report.param_grad_max_abs_diff > 0
    assert "MISMATCH" in str(report)


def test_tolerance_is_applied() -> None:
    model = nn.Sequential(nn.Linear(3, 3), CallCounter(), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2, atol=1e6)
    assert report.ok and report.atol == 1e6


def test_verify_takes_keyword_inputs() -> None:
    from models_for_tests import GPT

    torch.manual_seed(0)
    gpt = GPT(width=16, layers=3, heads=2, context=8).to(D)
    idx = torch.randint(0, 50, (2, 8))
    report = autockpt.verify(gpt, (idx,), example_kwargs={"attention_mask": torch.ones(2, 8, dtype=D)})
    assert report.ok and report.plan.walker == "graph" and report.plan.checkpointed_segments > 0
