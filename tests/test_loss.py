"""The loss in memory plans: measured for the loss given, exact on a chain, checked for misuse."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autockpt
from autockpt.measure.losses import default_loss
from autockpt.measure.step import measure_step

MiB = 2**20


def wide_chain(depth: int = 2) -> nn.Sequential:
    """A chain whose output is as wide as its activations, so the loss is a large term.

    The loss's bytes depend only on the output, so two blocks (4 stages) do for tests of
    what is measured and said; budgets that must checkpoint need more depth.
    """
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(256, 256), nn.GELU())])


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()  # backward holds three temporaries the size of the output


@pytest.mark.parametrize("fraction", [1.0, 0.7, 0.55])
def test_prediction_with_the_loss_given_is_the_measured_peak(fraction: float) -> None:
    x = torch.randn(2048, 256)  # activations of 2 MiB
    model = wide_chain(6)  # 12 stages: the least depth at which 0.55 is feasible (3 checkpointed)
    plan = autockpt.make_plan(model, budget=fraction, example_inputs=(x,), loss_fn=square_mean)
    autockpt.auto_checkpoint(model, plan)
    measured = measure_step(model, (x,), None, square_mean)
    assert plan.predicted_peak_bytes is not None
    # measured here: equal to about 1 KiB. The margin is a quarter of an activation, because
    # the CPU allocator's accounting has been seen 0.4 MiB off in long test runs.
    assert abs(measured - plan.predicted_peak_bytes) <= MiB // 2, (measured, plan.predicted_peak_bytes)


def test_a_loss_heavier_than_the_default_is_seen() -> None:
    x = torch.randn(1024, 256)
    out_bytes = 1024 * 256 * 4
    given = autockpt.profile(wide_chain(), (x,), loss_fn=square_mean)
    default = autockpt.profile(wide_chain(), (x,))
    scalars = 64  # the loss and its gradient
    assert default.loss_bytes == pytest.approx(2 * out_bytes, abs=scalars)  # a weight and the gradient
    assert given.loss_bytes == pytest.approx(4 * out_bytes, abs=scalars)  # pow backward: 3 temporaries
    unwrapped = [
        autockpt.make_plan(wide_chain(), budget=1.0, example_inputs=(x,), loss_fn=fn).predicted_peak_bytes
        for fn in (None, square_mean)
    ]
    assert unwrapped[1] == pytest.approx(unwrapped[0] + 2 * out_bytes, abs=64)  # type: ignore[operator]


def test_the_profile_reports_the_loss() -> None:
    prof = autockpt.profile(wide_chain(), (torch.randn(64, 256),), loss_fn=square_mean)
    assert "loss 256.01 KiB above the output" in str(prof)
    assert json.loads(prof.to_json())["loss_bytes"] == pytest.approx(4 * 64 * 256 * 4, abs=64)


def test_the_loss_is_measured_once_per_loss_function(monkeypatch: pytest.MonkeyPatch) -> None:
    import autockpt.measure.model_profile as planning

    calls: list[object] = []
    real = planning.measure_loss

    def counting(*args: object, **kwargs: object) -> int:
        calls.append(args[3])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(planning, "measure_loss", counting)
    model, x = wide_chain(), torch.randn(1024, 256)
    for budget in (1.0, 0.9):  # two blocks: 0.9 checkpoints one segment, 0.8 is below the floor
        autockpt.make_plan(model, budget=budget, example_inputs=(x,), loss_fn=square_mean)
        autockpt.make_plan(model, budget=budget, example_inputs=(x,))
    assert calls == [square_mean, None]


def test_plans_say_which_loss_they_assumed() -> None:
    x = torch.randn(1024, 256)
    default = autockpt.make_plan(wide_chain(), budget=0.9, example_inputs=(x,))
    given = autockpt.make_plan(wide_chain(), budget=0.9, example_inputs=(x,), loss_fn=square_mean)
    assert any("the loss (default, a weighted sum of the outputs) needs" in n for n in default.notes)
    assert any("the loss (loss_fn) needs 4.00 MiB above the output" in n for n in given.notes)


def test_verify_and_check_use_the_loss_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import autockpt.api as verification

    x = torch.randn(1024, 256)
    model = wide_chain()
    report = autockpt.verify(model, (x,), segments=4, loss_fn=square_mean)
    assert report.ok
    assert report.peak_bytes_unwrapped > autockpt.verify(model, (x,), segments=4).peak_bytes_unwrapped
    losses: list[object] = []
    real = verification.measure_step

    def recording(model: nn.Module, args: object, kwargs: object = None, loss_fn: object = None) -> int:
        losses.append(loss_fn)
        return real(model, args, kwargs, loss_fn)  # type: ignore[arg-type]

    monkeypatch.setattr(verification, "measure_step", recording)
    autockpt.auto_checkpoint(model, budget=0.9, example_inputs=(x,), loss_fn=square_mean, check=True)
    assert losses and all(fn is square_mean for fn in losses)


def test_loss_fn_misuse_is_named() -> None:
    x = torch.randn(8, 256)
    with pytest.raises(ValueError, match="loss_fn is measured to plan for a memory budget"):
        autockpt.make_plan(wide_chain(), 4, example_inputs=(x,), loss_fn=square_mean)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        autockpt.make_plan(wide_chain(), budget=0.5, example_inputs=(x,), loss_fn="mse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor .* shape \(8, 256\)"):
        autockpt.make_plan(wide_chain(), budget=0.5, example_inputs=(x,), loss_fn=lambda out: out * 2)


def test_default_loss_is_repeatable_and_reaches_every_output() -> None:
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    first = default_loss({"a": a, "b": (b, torch.ones(2))})
    first.backward()
    grads = (a.grad.clone(), b.grad.clone())  # type: ignore[union-attr]
    assert grads[0].ne(0).all() and grads[1].ne(0).all()
    assert torch.equal(first, default_loss({"a": a, "b": (b, torch.ones(2))}))
    assert default_loss(torch.ones(2)).item() == 0.0  # nothing requires gradients
