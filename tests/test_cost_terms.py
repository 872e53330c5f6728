"""Each term of the budget planner's cost model, predicted against the measured peak.

One small model per term, chosen so that the term is a large part of the peak: parameter
gradients (wide layers, a tiny batch), the loss (a vocabulary much wider than the model),
boundary bytes (the inputs a checkpointed plan keeps) and op workspaces (an NCHW
convolution's backward). Each test checks that the prediction with the profile as measured
matches the allocator's peak, and that the same prediction with the term dropped misses it:
so a cost model that forgot the term fails here, in seconds, not only in a long benchmark.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import autockpt
from autockpt.measure.step import measure_step
from autockpt.plan import Segment
from autockpt.planners import StageCost
from autockpt.planners.cost_model import predict

TOLERANCE = 0.02  # of the measured peak


def predicted(prof: autockpt.Profile, segments: tuple[Segment, ...], **dropped: Any) -> int:
    """The predicted step peak, with the named StageCost fields (or ``loss_bytes``) set to 0."""
    loss = 0 if "loss_bytes" in dropped else prof.loss_bytes
    costs = tuple(
        dataclasses.replace(c, **{k: v for k, v in dropped.items() if k != "loss_bytes"}) for c in prof.costs
    )
    return prof.static_bytes + predict(segments, costs, loss_bytes=loss).peak_bytes


def check_term(
    model: nn.Module,
    x: torch.Tensor,
    segments: int,
    drop: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> None:
    torch.manual_seed(0)
    plan = autockpt.make_plan(model, segments, example_inputs=(x,))
    prof = autockpt.profile(model, (x,), loss_fn=loss_fn, repeats=1)
    autockpt.auto_checkpoint(model, plan)
    measured = measure_step(model, (x,), loss_fn=loss_fn)
    with_term = predicted(prof, plan.segments)
    without = predicted(prof, plan.segments, **drop)
    assert abs(with_term - measured) <= TOLERANCE * measured, (with_term, measured)
    assert abs(without - measured) > TOLERANCE * measured, (without, measured)


def test_parameter_gradients() -> None:
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.Tanh())])
    check_term(model, torch.randn(4, 256), 2, {"grad_bytes": 0})


def test_loss_bytes() -> None:
    model = nn.Sequential(nn.Embedding(2000, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 2000))
    labels = torch.zeros(8 * 16, dtype=torch.long)

    def lm_loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), labels)

    check_term(model, torch.zeros(8, 16, dtype=torch.long), 2, {"loss_bytes": 0}, loss_fn=lm_loss)


def test_boundary_bytes() -> None:
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Tanh())])
    check_term(model, torch.randn(512, 32), 8, {"in_bytes": 0, "out_bytes": 0})


def test_op_workspaces() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()
    )
    check_term(model, torch.randn(8, 3, 32, 32), 2, {"fwd_peak_bytes": 0, "bwd_peak_bytes": 0})


def test_the_terms_are_stage_cost_fields() -> None:
    fields = {f.name for f in dataclasses.fields(StageCost)}
    assert {"grad_bytes", "in_bytes", "out_bytes", "fwd_peak_bytes", "bwd_peak_bytes"} <= fields
