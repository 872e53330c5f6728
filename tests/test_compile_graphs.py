"""Under torch.compile, autockpt adds no graph, no graph break and no recompile.

Counted with dynamo's own counters over two training steps at a fixed shape, on the
three kinds of walk: a Sequential (sequential walker), a model with residual adds, a
concatenation and a default argument (graph walker), and a tiny Hugging Face GPT-2
(block walker); in both wrapping orders. The compiled checkpointed gradients are compared
with the compiled unwrapped model's: ``aot_eager`` runs the same aten ops, so bitwise.
(NOTE [Planned once, compiled whole] in ``execution/forward.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_graph import TwoTowers
from torch import nn
from torch._dynamo.utils import counters

import autockpt

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

Build = Callable[[], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]


def chain() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(8)])
    return model, (torch.randn(4, 16),), {}


class Residual(nn.Module):
    """Residual adds, a ``torch.cat`` of a list (fx keeps it as an immutable list) and an
    argument left at its default: what a graph walk's program reads per call."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(6)
        )
        self.head = nn.Linear(16 * 8 * 8, 4)

    def forward(self, x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + scale * block(x)
        return self.head(torch.cat([x, x.neg()], dim=1).flatten(1))


def residual() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    model = Residual()
    assert autockpt.make_plan(model).walker == "graph"
    return model, (torch.randn(2, 3, 8, 8),), {}


def gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    transformers = pytest.importorskip("transformers")
    # no dropout: with it, torch's checkpoint under compile differs from compiled unwrapped
    # by a few ulps (docs/design.md)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # a tiny config names none: HF warns (a graph break of its own)
    ids = torch.randint(0, 32, (2, 8))
    return model, (), {"input_ids": ids, "labels": ids}


def _loss(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out.square().mean()


def _compiled_steps(build: Build, order: str) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
    """Gradients after two steps and (graphs, graph breaks, frames compiled)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, args, kwargs = build()
    model.train()
    if order == "unwrapped":
        run: nn.Module = torch.compile(model, backend="aot_eager")
    elif order == "checkpoint, then compile":
        run = torch.compile(autockpt.auto_checkpoint(model), backend="aot_eager")
    else:
        run = autockpt.auto_checkpoint(torch.compile(model, backend="aot_eager"))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _loss(run(*args, **kwargs)).backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    counts = (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["frames"]["total"],
    )
    torch._dynamo.reset()
    return grads, counts


@pytest.mark.parametrize("build", [chain, residual, gpt2], ids=["sequential", "graph", "blocks"])
def test_autockpt_adds_no_graph_break_and_no_recompile(build: Build) -> None:
    plain, plain_counts = _compiled_steps(build, "unwrapped")
    assert plain_counts == (1, 0, 1)  # the models compile whole
    for order in ("checkpoint, then compile", "compile, then checkpoint"):
        grads, counts = _compiled_steps(build, order)
        assert counts == plain_counts, f"{order}: (graphs, breaks, frames) {counts}, unwrapped {plain_counts}"
        assert grads.keys() == plain.keys()
        for name, g in grads.items():
            assert torch.equal(g, plain[name]), f"{order}: {name}"


def test_check_on_a_compiled_model_measures_the_compiled_step_once() -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(12)])
    x = torch.randn(512, 64)
    compiled = torch.compile(model, backend="aot_eager")
    autockpt.auto_checkpoint(compiled, budget=0.6, example_inputs=(x,), check=True)
    notes = [n for n in model.forward.plan.notes if n.startswith("compiled step measured peak")]
    assert len(notes) == 1
    assert counters["frames"]["total"] == 1  # compiled by the check, not run eagerly
    for _ in range(2):
        compiled(x).square().mean().backward()
    assert counters["frames"]["total"] == 1  # and training compiles nothing again
    torch._dynamo.reset()


def test_the_chunked_head_is_one_break_and_trains_as_in_eager() -> None:
    """The chunked loss runs as Python (NOTE [The chunked loss under torch.compile]): the
    model's body compiles before it, nothing recompiles after the first step, and the
    gradients are the eager chunked step's, bit for bit."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 256, (2, 16))

    def steps(compiled: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=256, n_positions=16, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"
        run = autockpt.auto_checkpoint(model, head="chunked")
        run = torch.compile(run, backend="aot_eager") if compiled else run
        graphs = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            run(input_ids=ids, labels=ids).loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
        torch._dynamo.reset()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, graphs

    eager, _ = steps(compiled=False)
    compiled, graphs = steps(compiled=True)
    assert graphs == [2, 2]  # before and after the loss; nothing compiled after the first step
    assert compiled.keys() == eager.keys()
    for name, g in compiled.items():
        assert torch.equal(g, eager[name]), name


class Branchy(nn.Module):
    """Data-dependent control flow: dynamo breaks the graph here, in any model."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


def branchy() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    def blocks() -> list[nn.Module]:
        return [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)]

    return nn.Sequential(*blocks(), Branchy(), *blocks()), (torch.randn(4, 16),), {}


def test_a_model_that_breaks_reports_only_its_own_breaks_and_trains_exactly() -> None:
    plain, (_, breaks, _) = _compiled_steps(branchy, "unwrapped")
    plain_reasons = set(counters["graph_break"])
    assert breaks >= 1
    for order in ("checkpoint, then compile", "compile, then checkpoint"):
        grads, _ = _compiled_steps(branchy, order)
        # a break inside a checkpointed segment is met again when dynamo falls back from
        # capturing the checkpoint whole, and the graphs around it follow the plan's
        # segments: counted otherwise, for the model's reason only
        assert set(counters["graph_break"]) == plain_reasons
        for name, g in grads.items():
            assert torch.equal(g, plain[name]), f"{order}: {name}"


def test_a_call_traced_again_under_compile_breaks_once_then_compiles_whole() -> None:
    image, text = torch.randn(8, 32), torch.randn(8, 32)  # open_clip's CLIP.forward pattern

    def steps(wrap: bool) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = TwoTowers()
        run = torch.compile(autockpt.auto_checkpoint(model) if wrap else model, backend="aot_eager")
        seen = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            a, b = run(image=image, text=text)
            (a.square().mean() + b.square().mean()).backward()
            seen.append((counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
                         counters["frames"]["total"]))  # fmt: skip
        if wrap:
            assert model.forward.plan.checkpointed_segments > 0
        torch._dynamo.reset()
        return {n: p.grad for n, p in model.named_parameters()}, seen

    plain, _ = steps(wrap=False)
    grads, seen = steps(wrap=True)
    # the trace again runs outside the graph once (a break), the next call compiles the
    # forward with the new trace (a recompile), and nothing after
    assert seen[1] == seen[2] == seen[3] and seen[3][1] == 1, seen
    for name, g in grads.items():
        assert torch.equal(g, plain[name]), name
