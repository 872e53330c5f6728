"""Planning on the meta device: bytes without allocating, for models this machine cannot hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autockpt
from autockpt.planners.budget import min_feasible_budget

GiB = 2**30


def chain(width: int = 128, depth: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def on_meta(factory: type[nn.Module] | object, *args: object) -> nn.Module:
    with torch.device("meta"):
        return factory(*args)  # type: ignore[operator,no-any-return]


BYTES = ["in_bytes", "out_bytes", "kept_bytes", "keeps_input", "keeps_output", "grad_bytes"]


def test_meta_profile_has_the_bytes_of_a_real_one_on_a_linear_chain() -> None:
    # 4 blocks: every stage is compared, so depth adds nothing; the 1024 x 128 matmuls are
    # large enough that a GEMM workspace, were there one, would show in the real profile
    real = autockpt.profile(chain(depth=4), (torch.randn(1024, 128),), repeats=1)
    meta = autockpt.profile(on_meta(chain, 128, 4), (torch.empty(1024, 128, device="meta"),))
    assert len(real.costs) == len(meta.costs) == 8
    assert meta.device == "meta" and meta.static_bytes == real.static_bytes
    for a, b in zip(real.costs, meta.costs):
        assert {k: getattr(a, k) for k in BYTES} == {k: getattr(b, k) for k in BYTES}
        # no workspaces in a Linear chain: the allocator level equals the tensor level
        assert (a.fwd_peak_bytes, a.bwd_peak_bytes) == (b.fwd_peak_bytes, b.bwd_peak_bytes)


def test_meta_and_real_nin_have_the_same_floor_in_channels_last() -> None:
    x = torch.randn(16, 3, 32, 32).to(memory_format=torch.channels_last)
    real = autockpt.profile(autockpt.models.NiN().to(memory_format=torch.channels_last), (x,), repeats=1)
    model = on_meta(autockpt.models.NiN).to(memory_format=torch.channels_last)
    meta = autockpt.profile(model, (torch.empty_like(x, device="meta"),))
    for a, b in zip(real.costs, meta.costs):
        assert {k: getattr(a, k) for k in BYTES} == {k: getattr(b, k) for k in BYTES}
    assert min_feasible_budget(meta.costs) == pytest.approx(min_feasible_budget(real.costs), rel=0.01)


def test_meta_times_rank_stages_by_work() -> None:
    meta = autockpt.profile(on_meta(autockpt.models.NiN), (torch.empty(8, 3, 32, 32, device="meta"),))
    kinds = dict(zip(meta.stage_names, meta.costs))
    conv, pool = kinds["8+9"], kinds["6"]  # a 5x5 convolution and a max-pool
    assert conv.fwd_ms > 10 * pool.fwd_ms > 0
    assert conv.bwd_ms > conv.fwd_ms


LARGE_PLAN = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import torch
import autockpt
from test_meta import chain, on_meta

rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = on_meta(chain, 8192, 64)
x = torch.empty(2**18, 8192, device="meta")
plan = autockpt.make_plan(model, budget="256GiB", example_inputs=(x,))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
print(json.dumps({"peak": plan.predicted_peak_bytes, "notes": plan.notes, "maxrss_grown_kib": grown}))
"""


def test_a_model_larger_than_this_machine_is_planned_without_allocating() -> None:
    # 64 x (Linear 8192 + GELU) at batch 2**18: 8 GiB per activation, over 1 TiB unwrapped.
    # ru_maxrss is the high-water mark of a whole process, so the plan is made in a fresh one:
    # in the test process it would compare with the peak of every test run before.
    done = subprocess.run(
        [sys.executable, "-c", LARGE_PLAN, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["peak"] is not None and result["peak"] <= 256 * GiB
    unwrapped = next(n for n in result["notes"] if n.startswith("unwrapped step predicted at"))
    assert unwrapped.endswith(" GiB") and float(unwrapped.split()[-2]) > 1024
    assert result["maxrss_grown_kib"] < 2**20  # KiB: < 1 GiB


def test_a_meta_plan_applies_to_the_real_model_and_stays_exact() -> None:
    x = torch.randn(2048, 128, dtype=torch.float64)
    meta_x = torch.empty_like(x, device="meta")
    meta_plan = autockpt.make_plan(on_meta(chain).double(), budget=0.5, example_inputs=(meta_x,))
    assert meta_plan.checkpointed_segments > 0
    report = autockpt.verify(chain().double(), (x,), segments=meta_plan)
    assert report.ok and report.plan.segments == meta_plan.segments
    assert report.peak_bytes_checkpointed < report.peak_bytes_unwrapped


def test_meta_and_real_budgets_mean_the_same_bytes() -> None:
    x = torch.randn(1024, 128)
    # 4 blocks: 0.7 is above their floor (0.66) and checkpoints two segments
    real = autockpt.make_plan(chain(depth=4), budget=0.7, example_inputs=(x,))
    meta = autockpt.make_plan(
        on_meta(chain, 128, 4), budget=0.7, example_inputs=(torch.empty_like(x, device="meta"),)
    )
    assert real.checkpointed_segments > 0
    # the same unwrapped peak, so the same budget; the cut may differ (times are nominal)
    assert meta.budget_bytes == pytest.approx(real.budget_bytes, abs=16)  # a scalar or two
    assert meta.predicted_peak_bytes is not None and meta.predicted_peak_bytes <= meta.budget_bytes
