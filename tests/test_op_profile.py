"""The op-level profile (``profile(..., ops=True)``): each stage's ops, their output bytes,
FLOPs, times, whether autograd keeps their outputs and whether a policy may keep them."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

import autockpt

B, D, H = 32, 64, 256


def block(inplace: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, H), nn.ReLU(inplace=inplace), nn.Linear(H, D), nn.Dropout(0.5), nn.LayerNorm(D)
    )


def ops_of(prof: autockpt.Profile) -> list[list[tuple[str, int, bool, bool]]]:
    return [[(o.op, o.out_bytes, o.saved, o.keepable) for o in c.ops] for c in prof.costs]


def test_each_stage_lists_its_ops_with_bytes_flops_and_what_autograd_keeps() -> None:
    prof = autockpt.profile(block(), (torch.randn(B, D),), ops=True)
    f = 4  # float32
    linear1, relu, linear2, dropout, norm = ops_of(prof)
    # Linear: a transposed view of the weight (no bytes), then addmm; ReLU keeps its own
    # output, so the first addmm's output is not kept by autograd, and may be by a policy
    assert linear1 == [("aten.t.default", 0, False, False), ("aten.addmm.default", B * H * f, False, True)]
    assert relu == [("aten.relu.default", B * H * f, True, True)]
    assert linear2[1] == ("aten.addmm.default", B * D * f, False, True)
    # dropout: the mask is made, then drawn into in place (changed: not keepable), and the
    # random op itself is never keepable
    assert [o[0] for o in dropout] == [
        "aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor"
    ]  # fmt: skip
    assert dropout[0][2:] == (True, False) and dropout[1][3] is False
    assert norm[0][0] == "aten.native_layer_norm.default" and norm[0][2] is True
    addmm = prof.costs[0].ops[1]
    assert addmm.flops == 2 * B * D * H and addmm.ms > 0
    assert all(o.flops == 0 for o in prof.costs[1].ops)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


def test_ops_after_the_last_save_are_the_tail_and_never_offered_at_a_segments_end() -> None:
    """Autograd saves a Linear's input and weight before its addmm runs, and the residual
    add saves nothing, so a recompute ending with this stage stops before the addmm, whose
    output is not the stage's: keeping it would hold its bytes and save no recompute. ReLU
    saves its output after it runs: no tail."""
    from autockpt.planners.cost_model import keepable_ops

    prof = autockpt.profile(nn.Sequential(Residual(), nn.ReLU()), (torch.randn(B, D),), ops=True)
    residual, relu = prof.costs
    assert [(o.op, o.output, o.tail) for o in residual.ops] == [
        ("aten.t.default", False, False), ("aten.addmm.default", False, True), ("aten.add.Tensor", True, True)
    ]  # fmt: skip
    assert [o.tail for o in relu.ops] == [False]
    # the addmm is a candidate inside a segment, not at its end
    assert [k.op for k in keepable_ops(residual, 0)] == ["aten.addmm.default", "aten.add.Tensor"]
    assert keepable_ops(residual, 0, last=True) == []


def test_an_output_changed_in_place_later_is_not_keepable() -> None:
    prof = autockpt.profile(block(inplace=True), (torch.randn(B, D),), ops=True)
    fused = prof.costs[0]  # Linear and its in-place ReLU are one stage
    assert [(o.op, o.keepable) for o in fused.ops] == [
        ("aten.t.default", False), ("aten.addmm.default", False), ("aten.relu_.default", False)
    ]  # fmt: skip


def test_the_op_profile_is_printed_and_in_the_json() -> None:
    prof = autockpt.profile(block(), (torch.randn(B, D),), ops=True)
    text = str(prof)
    assert "ops (saved: autograd keeps the output" in text
    assert text.count("aten.addmm.default") == 2
    stages = json.loads(prof.to_json())["stages"]
    assert [o["op"] for o in stages[0]["ops"]] == ["aten.t.default", "aten.addmm.default"]
    plain = autockpt.profile(block(), (torch.randn(B, D),))
    assert not plain.has_ops and "ops (" not in str(plain)
    assert "ops" not in json.loads(plain.to_json())["stages"][0]


def test_op_positions_are_the_ones_a_policy_sees() -> None:
    """The planner names kept ops by their place in a segment's forward, so the profile must
    see the same ops, in the same order, as selective checkpointing's policy does."""
    x = torch.randn(B, D)
    model = nn.Sequential(*block(), *block(inplace=True), *block())
    prof = autockpt.profile(model, (x,), ops=True)
    seen: list[str] = []

    def record(op: Any) -> bool:
        seen.append(str(op))
        return False

    autockpt.auto_checkpoint(model, 2, policy=record)
    model(x).sum().backward()
    plan = model.forward.plan  # as the dry run in that first step left it
    seg = plan.segments[0]
    assert seg.checkpoint
    profiled = [o.op for c in prof.costs[seg.start : seg.stop] for o in c.ops]
    assert seen[: len(profiled)] == profiled


def test_on_the_meta_device_times_come_from_flops() -> None:
    with torch.device("meta"):
        model = block()
        x = torch.empty(B, D)
    prof = autockpt.profile(model, (x,), ops=True)
    addmm = prof.costs[0].ops[1]
    assert addmm.op == "aten.addmm.default" and addmm.flops == 2 * B * D * H
    assert addmm.ms > prof.costs[1].ops[0].ms > 0  # the matmul outweighs the ReLU
