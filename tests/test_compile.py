"""torch.compile: either order, fullgraph for Sequentials, no recompiles, really less memory.

Compiling takes tens of seconds on 2 cores, so these tests carry the ``slow`` marker;
``.ci/run`` runs the whole suite, markers included.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autockpt

pytestmark = pytest.mark.slow

# inductor fuses and reorders floating-point work; eager and compiled agree to about this
TOL = {"rtol": 1e-4, "atol": 1e-5}


def chain(width: int = 16, depth: int = 4) -> nn.Sequential:
    """9 stages by default: sqrt checkpoints 2 of 3 segments; compiling time grows with depth."""
    torch.manual_seed(0)
    return nn.Sequential(
        *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())], nn.Linear(width, 4)
    )


def step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    for p in model.parameters():
        p.grad = None
    return grads


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


def test_fullgraph_compile_of_a_checkpointed_sequential_matches_eager_without_recompiling() -> None:
    x = torch.randn(8, 16)
    eager = chain()
    ck = autockpt.auto_checkpoint(chain(), example_inputs=(x,))
    compiled = torch.compile(ck, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            for g, e in zip(step(compiled, x), step(eager, x)):
                torch.testing.assert_close(g, e, **TOL)
    assert ck.forward.plan.checkpointed_segments > 0


def test_checkpointing_a_compiled_model_checkpoints_the_module_inside() -> None:
    x = torch.randn(8, 16)
    eager = chain()
    compiled = autockpt.auto_checkpoint(torch.compile(chain()), example_inputs=(x,))
    assert type(compiled).__name__ == "OptimizedModule"
    assert autockpt.make_plan(compiled).checkpointed_segments > 0
    for g, e in zip(step(compiled, x), step(eager, x)):
        torch.testing.assert_close(g, e, **TOL)
    autockpt.restore(compiled)
    assert "forward" not in vars(compiled._orig_mod)


def test_batchnorm_under_compile_updates_once_and_trains_like_the_compiled_model() -> None:
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 4),
    )  # fmt: skip
    x = torch.randn(32, 16)
    plain = torch.compile(copy.deepcopy(base))
    ck = torch.compile(autockpt.auto_checkpoint(copy.deepcopy(base), 3, example_inputs=(x,)))
    for g, e in zip(step(ck, x), step(plain, x)):
        torch.testing.assert_close(g, e, **TOL)
    for a, b in zip(plain.state_dict().values(), ck.state_dict().values()):  # running stats once
        torch.testing.assert_close(a, b, **TOL)


def test_memory_is_lower_under_compile_at_allocator_level() -> None:
    # the CPU allocator events see inductor's buffers, which a dispatch-level tracker cannot
    x = torch.randn(1024, 128)  # 8 blocks: 0.48 of the plain peak (16 blocks: 0.37)
    plain = torch.compile(chain(128, 8))
    ck = torch.compile(autockpt.auto_checkpoint(chain(128, 8), example_inputs=(x,)))
    peaks = []
    for model in (plain, ck):
        step(model, x)
        with autockpt.track_memory("cpu", tensors=False) as mem:
            step(model, x)
        peaks.append(mem.peak_bytes)
    assert peaks[1] < 0.6 * peaks[0]


class Branchy(nn.Module):
    """Data-dependent control flow: dynamo cannot capture it in one graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_graph_breaks_inside_a_segment_are_reported_with_their_reason() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.BatchNorm1d(16), Branchy(), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
        nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4),
    )  # fmt: skip
    x = torch.randn(32, 16)
    ck = autockpt.auto_checkpoint(model, 3, example_inputs=(x,))
    stats = model[1].running_mean.clone()
    breaks = autockpt.find_graph_breaks(ck, (x,))
    assert [b.segment for b in breaks] == [0] and breaks[0].stages == ("0", "1", "2")
    assert "data-dependent" in breaks[0].reason.lower() and "test_compile.py" in breaks[0].reason
    assert torch.equal(model[1].running_mean, stats)  # the report's forward left no trace
    assert autockpt.find_graph_breaks(autockpt.auto_checkpoint(chain(), 3), (torch.randn(4, 16),)) == []


def test_graph_breaks_need_a_checkpointed_model() -> None:
    with pytest.raises(autockpt.AutockptError, match="not checkpointed"):
        autockpt.find_graph_breaks(chain(), (torch.randn(4, 16),))
