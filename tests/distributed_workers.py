"""Worker functions for the multi-process tests (importable by spawned processes).

Each worker joins a 2-rank gloo group through a file, runs every scenario, and saves the
gradients it ends with per scenario; the test compares them with a single-process run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from models_for_tests import GPT
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

import autockpt

WORLD = 2
D = torch.float64


class WithUnused(nn.Module):
    """A chain that never calls one of its layers (DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())])
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def chain() -> nn.Module:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.Tanh())], nn.Linear(8, 2))


def gpt() -> nn.Module:
    return GPT(width=16, layers=3, heads=2, context=8, dropout=0.0)


def batch(name: str, rank: int, micro: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * micro + len(name))
    if name == "tied":
        return torch.randint(0, 50, (3, 8), generator=g), torch.ones(3, 8, dtype=D)
    return (torch.randn(5, 8, generator=g, dtype=D),)


def loss_of(model: nn.Module, name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if name == "tied":
        return model(inputs[0], attention_mask=inputs[1]).logsumexp(-1).mean()
    return model(*inputs).square().mean()


SCENARIOS: dict[str, tuple[Callable[[], nn.Module], dict[str, bool]]] = {
    "plain": (chain, {}),
    "tied": (gpt, {}),
    "unused": (WithUnused, {"find_unused_parameters": True}),
    "two_forwards": (chain, {}),
    "no_sync": (chain, {}),
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return SCENARIOS[name][0]().to(D)


def step(model: nn.Module, name: str, rank: int) -> None:
    """One scenario's training step on ``rank``'s data (DDP or not)."""
    if name == "two_forwards":
        (loss_of(model, name, batch(name, rank, 0)) + loss_of(model, name, batch(name, rank, 1))).backward()
    elif name == "no_sync":
        ctx = model.no_sync() if isinstance(model, DDP) else torch.enable_grad()
        with ctx:
            loss_of(model, name, batch(name, rank, 0)).backward()
        loss_of(model, name, batch(name, rank, 1)).backward()
    else:
        loss_of(model, name, batch(name, rank, 0)).backward()


def reference(name: str) -> list[torch.Tensor | None]:
    """Single process: the gradients DDP should produce, the mean over ranks."""
    model = build(name)
    grads: list[list[torch.Tensor | None]] = []
    for rank in range(WORLD):
        for p in model.parameters():
            p.grad = None
        step(model, name, rank)
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
    return [None if g0 is None else (g0 + g1) / WORLD for g0, g1 in zip(*grads)]  # type: ignore[operator]


def ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for name, (_, options) in SCENARIOS.items():
            model = autockpt.auto_checkpoint(build(name), 3 if name != "tied" else "sqrt")
            ddp = DDP(model, **options)
            step(ddp, name, rank)
            plan = model.forward.plan
            grads = [p.grad for p in model.parameters()]
            torch.save(
                {"grads": grads, "checkpointed": plan.checkpointed_segments},
                Path(out_dir) / f"{name}.{rank}.pt",
            )
        dist.barrier()  # no rank tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()
    _exit_now()


def _exit_now() -> None:
    """Leave without running C++ static destructors: gloo's threads have aborted the process
    at interpreter shutdown ("terminate called without an active exception") on a loaded CI
    machine, after all results were written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fsdp_chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(8, 8), nn.Tanh())], nn.Linear(8, 2))


def fsdp_input(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:  # type: ignore[attr-defined]
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def fsdp_worker(rank: int, init_file: str, out_dir: str) -> None:
    """FSDP2 with a bf16 policy: unwrapped, checkpointed before and after sharding; 2 steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        variants = {
            "unwrapped": lambda: _shard(fsdp_chain()),
            "before": lambda: _shard(autockpt.auto_checkpoint(fsdp_chain(), 3)),
            "after": lambda: autockpt.auto_checkpoint(_shard(fsdp_chain()), 3),
        }
        for name, make in variants.items():
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                model(fsdp_input(rank)).float().square().mean().backward()
                grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
                opt.step()
                opt.zero_grad()
            checkpointed = model.forward.plan.checkpointed_segments if name != "unwrapped" else 0  # type: ignore[union-attr]
            torch.save(
                {"grads": grads, "checkpointed": checkpointed}, Path(out_dir) / f"fsdp_{name}.{rank}.pt"
            )
        dist.barrier()  # no rank tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()
    _exit_now()
