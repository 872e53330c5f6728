"""CPU bf16 autocast in forward, backward outside: the recompute runs under the same autocast."""

from __future__ import annotations

import copy

import torch
from torch import nn

import autockpt


def test_bf16_autocast_forward_matches_the_reference_and_recomputes_in_bf16() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(
        *[m for _ in range(6) for m in (nn.Linear(16, 16), nn.GELU())], nn.Dropout(0.1), nn.Linear(16, 4)
    )
    x = torch.randn(8, 16)
    ck = autockpt.auto_checkpoint(copy.deepcopy(ref), 3, example_inputs=(x,))  # dry run now
    seen: list[tuple[bool, torch.dtype]] = []
    ck[2].register_forward_hook(lambda m, a, out: seen.append((autockpt.is_recomputing(), out.dtype)))
    outs = []
    for model in (ref, ck):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()  # backward outside autocast
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), ck.parameters()))
    assert seen == [(False, torch.bfloat16), (True, torch.bfloat16)]  # forward, then its recompute
