"""Op policies: which ops' outputs a checkpointed segment keeps instead of recomputing.

Exactness under every built-in policy is in the property tests (``test_property.py``,
``test_graph_property.py``); here: that a policy really keeps what it names, learns which
outputs are changed in place, costs memory in between, and refuses what it cannot do.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autockpt
from autockpt.measure.step import measure_step

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """How often each op packet runs inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def mlp(inplace: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(m for _ in range(6) for m in (nn.Linear(64, 256), nn.ReLU(inplace=inplace), nn.Linear(256, 64)))
    )


def recomputed_linears(model: nn.Module, x: torch.Tensor) -> int:
    """The Linear layers whose forward the backward of a plainly checkpointed ``model`` runs
    again: those in checkpointed segments, but not a segment's last stage, whose output
    nothing inside the segment saves (torch stops a recompute early once it has all it needs)."""
    model(x)  # the dry run fixes the plan
    plan = model.forward.plan
    n = 0
    for seg in plan.segments:
        if seg.checkpoint:
            kinds = plan.stage_kinds[seg.start : seg.stop]
            n += sum(k.split("+").count("Linear") for k in kinds) - (kinds[-1] == "Linear")
    return n


def backward_addmm(model: nn.Module, x: torch.Tensor) -> int:
    """The forward matmuls (addmm) the backward of one step runs: recomputed ones only."""
    loss = model(x).square().mean()
    with OpCounter() as counter:
        loss.backward()
    return counter.counts[aten.addmm]


def test_the_named_policies_are_listed_and_bad_ones_refused() -> None:
    assert {"recompute-all", "save-matmuls", "save-compute"} <= set(autockpt.available_policies())
    with pytest.raises(ValueError, match=r"unknown policy 'save-all'; choose one of \["):
        autockpt.auto_checkpoint(mlp(), 3, policy="save-all")
    with pytest.raises(TypeError, match="policy must be a registered name or a function"):
        autockpt.make_plan(mlp(), 3, policy=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exists already"):
        autockpt.register_policy("save-matmuls", lambda op: True)


def test_a_torch_without_outputs_for_policies_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from autockpt.execution import policies

    monkeypatch.setattr(policies, "_SEES_OUTPUTS", False)
    with pytest.raises(autockpt.AutockptError, match=r"policy='save-matmuls' needs a torch whose"):
        autockpt.auto_checkpoint(mlp(), 3, policy="save-matmuls")
    autockpt.auto_checkpoint(mlp(), 3, policy="recompute-all")


def _backward_matmuls(wrap: Callable[[nn.Module], nn.Module], x: torch.Tensor) -> int:
    """Matmuls in the backward graph of one compiled step (``aot_eager``'s graphs, counted)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts: list[int] = []

    def count(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        counts.append(sum(1 for n in gm.graph.nodes if n.target in matmuls))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, inputs: make_boxed_func(gm.forward), bw_compiler=count,
                           partition_fn=min_cut_rematerialization_partition)  # fmt: skip
    torch._dynamo.reset()
    wrap(backend)(x).square().mean().backward()
    torch._dynamo.reset()
    return counts[0]


@pytest.mark.slow
def test_a_policy_is_applied_under_torch_compile_in_either_order() -> None:
    x = torch.randn(16, 64)
    depth = 6  # 12 stages in 3 segments of 4; 2 checkpointed, whose 4 Linears are recomputed

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(64, 64), nn.GELU())])

    unwrapped = _backward_matmuls(lambda b: torch.compile(model(), backend=b), x)
    recompute_all = _backward_matmuls(
        lambda b: torch.compile(autockpt.auto_checkpoint(model(), 3), backend=b), x
    )
    assert recompute_all == unwrapped + 4
    kept = [
        _backward_matmuls(lambda b: torch.compile(autockpt.auto_checkpoint(model(), 3, policy="save-matmuls"),
                                                  backend=b), x),
        _backward_matmuls(lambda b: autockpt.auto_checkpoint(torch.compile(model(), backend=b), 3,
                                                             policy="save-matmuls"), x),
    ]  # fmt: skip
    assert kept == [unwrapped, unwrapped]  # no matmul recomputed, from the first step


def test_save_matmuls_recomputes_no_matmul_after_its_first_step() -> None:
    x = torch.randn(32, 64)
    plain = autockpt.auto_checkpoint(mlp(), 3)
    kept = autockpt.auto_checkpoint(mlp(), 3, policy="save-matmuls")
    assert kept.forward.plan.policy == "save-matmuls"
    recomputed = backward_addmm(plain, x)
    assert recomputed == recomputed_linears(plain, x) > 0
    assert backward_addmm(kept, x) == recomputed  # the first forward keeps nothing: it learns
    assert backward_addmm(kept, x) == 0
    assert backward_addmm(plain, x) == recomputed


def test_outputs_changed_in_place_are_recomputed_and_training_stays_exact() -> None:
    x = torch.randn(32, 64)
    model = autockpt.auto_checkpoint(mlp(inplace=True), 3, policy="save-matmuls")
    counts = [backward_addmm(model, x) for _ in range(3)]
    # each first Linear's output is changed by the in-place ReLU after it (the two are fused
    # into one stage): those are recomputed; the second Linears' outputs are kept
    plan = model.forward.plan
    fused = sum(
        plan.stage_kinds[seg.start : seg.stop].count("Linear+ReLU") for seg in plan.segments if seg.checkpoint
    )
    assert counts == [recomputed_linears(model, x), fused, fused] and fused > 0
    report = autockpt.verify(mlp(inplace=True).double(), (x.double(),), segments=3, policy="save-matmuls")
    assert report.ok, str(report)


def gelu_blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(m for _ in range(6) for m in (nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.LayerNorm(64)))
    )


def test_kept_outputs_cost_memory_between_recompute_all_and_none() -> None:
    # Kept: both Linears' outputs. Unwrapped, autograd saves those and also the block's input
    # and GELU's output. (In mlp(), kept Linear outputs would replace the saved ReLU outputs
    # and block inputs byte for byte: save-matmuls there holds as much as no checkpointing.)
    x = torch.randn(512, 64)
    unwrapped = measure_step(gelu_blocks(), (x,))
    peaks = {}
    for policy in ("recompute-all", "save-matmuls"):
        model = autockpt.auto_checkpoint(gelu_blocks(), 3, policy=policy)
        measure_step(model, (x,))  # the segments learn in their first forward
        peaks[policy] = measure_step(model, (x,))
    assert peaks["recompute-all"] < peaks["save-matmuls"] < unwrapped


def test_a_policy_function_and_a_registered_one() -> None:
    asked: list[Any] = []

    def keep_second_linears(op: Any) -> bool:
        asked.append(op)
        return op.overloadpacket is aten.addmm

    x = torch.randn(32, 64)
    model = autockpt.auto_checkpoint(mlp(), 3, policy=keep_second_linears)
    assert (
        model.forward.plan.policy.startswith("callable ")
        and "keep_second_linears" in model.forward.plan.policy
    )
    backward_addmm(model, x)
    assert backward_addmm(model, x) == 0 and aten.addmm.default in asked
    with pytest.raises(autockpt.AutockptError, match="pass it again as policy="):
        autockpt.auto_checkpoint(mlp(), model.forward.plan)
    autockpt.register_policy("test-keep-addmm", keep_second_linears)
    plan = autockpt.make_plan(mlp(), 3, policy="test-keep-addmm")
    again = autockpt.Plan.from_json(plan.to_json())
    assert again.policy == "test-keep-addmm" and "policy='test-keep-addmm'" in str(again)
    applied = again.apply(mlp())
    backward_addmm(applied, x)
    assert backward_addmm(applied, x) == 0


def test_a_random_op_is_never_kept_and_a_raising_policy_is_named() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(16, 16), nn.Dropout(0.5))))
    keep_all = autockpt.auto_checkpoint(copy.deepcopy(model), 2, policy=lambda op: True)
    with pytest.raises(autockpt.AutockptError, match=r"keeps the output of aten\.\w*dropout|bernoulli"):
        keep_all(torch.randn(4, 16)).sum().backward()

    def broken(op: Any) -> bool:
        raise KeyError("no table for this op")

    raising = autockpt.auto_checkpoint(copy.deepcopy(model), 2, policy=broken)
    with pytest.raises(autockpt.AutockptError, match=r"policy 'callable .*broken' raised KeyError on aten\."):
        raising(torch.randn(4, 16)).sum()


def test_policies_apply_to_blocks() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(mlp()[i * 3 : i * 3 + 3] for i in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x) if x.sum() > -1e9 else x
            return x

    x = torch.randn(32, 64)
    plain = autockpt.auto_checkpoint(Loop(), "sqrt", example_inputs=(x,))
    model = autockpt.auto_checkpoint(Loop(), "sqrt", policy="save-matmuls", example_inputs=(x,))
    assert model.forward.plan.walker == "blocks" and model.forward.plan.checkpointed_segments > 0
    recomputed = backward_addmm(plain, x)
    assert recomputed > 0 and backward_addmm(model, x) == recomputed and backward_addmm(model, x) == 0
    report = autockpt.verify(copy.deepcopy(Loop()).double(), (x.double(),), policy="save-matmuls")
    assert report.ok, str(report)
