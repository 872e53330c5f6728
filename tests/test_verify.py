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
    report = autockpt.verify(model, torch.randn(6, 4, dtype=D))
    assert "forward" not in vars(model)
    assert report.ok and report.mismatches == () and report.atol == report.rtol == 0.0
    assert report.plan.strategy == "sqrt" and report.plan.checkpointed_segments > 0  # the default
    assert report.param_grad_max_abs_diff == report.output_max_abs_diff == report.buffer_max_abs_diff == 0.0
    assert report.tensor_peak_bytes_checkpointed < report.tensor_peak_bytes_unwrapped


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


class BufferCounter(nn.Module):
    """Writes how often it ran into a buffer; its output is its input, untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.fill_(self.calls)
        return x


def test_verify_compares_buffers() -> None:
    # checkpointing runs the module more often (the dry run), so only the buffer differs
    model = nn.Sequential(nn.Linear(3, 3), BufferCounter(), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2)
    assert report.mismatches == ("buffer 1.seen",)
    assert report.buffer_max_abs_diff > 0 and report.output_max_abs_diff == 0.0


def test_verify_compares_outputs() -> None:
    # the counter sits in the last, plain segment: gradients agree, the output does not
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), CallCounter()).to(D)
    report = autockpt.verify(model, (torch.randn(2, 3, dtype=D),), segments=2)
    assert "output 0" in report.mismatches and report.output_max_abs_diff > 0


def test_verify_on_a_block_walked_model_leaves_no_forward_behind() -> None:
    from models_for_tests import BranchyGPT

    gpt = BranchyGPT(width=16, layers=3, heads=2, context=8).to(D)
    idx, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=D)
    report = autockpt.verify(gpt, (idx, mask), segments=2)
    assert report.ok and report.plan.walker == "blocks"
    assert not any("forward" in vars(m) for m in gpt.modules())
    autockpt.auto_checkpoint(gpt, 2, example_inputs=(idx, mask))
    installed = {name for name, m in gpt.named_modules() if "forward" in vars(m)}
    assert installed and all(name == "" or name.startswith("blocks.") for name in installed)
    autockpt.verify(gpt, (idx, mask), segments=3)
    assert {name for name, m in gpt.named_modules() if "forward" in vars(m)} == installed
    autockpt.restore(gpt)
    assert not any("forward" in vars(m) for m in gpt.modules())


def test_verify_right_after_wrapping_without_inputs_checks_the_plan_training_installs() -> None:
    """Without example inputs the installed plan is provisional: the first training step's dry
    run replaces it. verify checks the plan that step installs, and says so."""
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    model = autockpt.auto_checkpoint(autockpt.models.NiN(10).double())
    provisional = model.forward.plan
    report = autockpt.verify(model, (x,))
    assert report.ok and "provisional" in report.note and "note: the installed plan" in str(report)
    assert model.forward.plan == provisional  # verify left the model as it was
    model(x).sum().backward()  # the first training step
    assert model.forward.plan != provisional and report.plan == model.forward.plan
    assert autockpt.verify(model, (x,)).note == ""
