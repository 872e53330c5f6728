"""autockpt under DistributedDataParallel: 2 processes on the gloo backend, on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from distributed_workers import SCENARIOS, WORLD, ddp_worker, fsdp_worker, reference

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without distributed")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(ddp_worker, args=(str(out / "init"), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ddp_gradients_match_across_ranks_and_the_single_process_reference(
    ddp_results: Path, name: str
) -> None:
    ranks = [torch.load(ddp_results / f"{name}.{r}.pt") for r in range(WORLD)]
    assert all(r["checkpointed"] > 0 for r in ranks)
    expected = reference(name)
    for got in (r["grads"] for r in ranks):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            if e is None:  # the unused layer: no gradient anywhere
                assert g is None
            else:
                torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(fsdp_worker, args=(str(out / "init"), str(out)), nprocs=WORLD, join=True)
    return out


@pytest.mark.skipif(not fsdp2_available(), reason="this torch has no torch.distributed.fsdp.fully_shard")
@pytest.mark.parametrize("order", ["before", "after"])
def test_fsdp2_bf16_gradients_equal_the_unwrapped_sharded_model(fsdp_results: Path, order: str) -> None:
    for rank in range(WORLD):
        ref = torch.load(fsdp_results / f"fsdp_unwrapped.{rank}.pt")
        got = torch.load(fsdp_results / f"fsdp_{order}.{rank}.pt")
        assert got["checkpointed"] > 0
        for g, e in zip(got["grads"], ref["grads"], strict=True):
            assert torch.equal(g, e)  # the same bf16 arithmetic, recomputed: bitwise equal
