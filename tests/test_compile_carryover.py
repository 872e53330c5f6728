"""One checkpointed model's torch.compile must not change how another is compiled.

Every installed forward used to be ``CheckpointedForward.__call__``, one code object for
every checkpointed model in the process, and dynamo keeps its cache entries, recompile
limit and automatic-dynamic shape state per code object/location: a model compiled after
another checkpointed one was compiled as that one's recompile, with every input size
symbolic (NOTE [One compiled frame per model] in execution/forward.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autockpt

pytestmark = pytest.mark.filterwarnings("ignore")


class _Recorder:
    """Dynamo's ``aot_eager`` backend, recording whether any graph input had a symbolic
    size (dynamic shapes). (The plain ``eager`` backend cannot run a BatchNorm inside
    torch's checkpoint: its counter update trips autograd's saved-tensor version check.)"""

    def __init__(self) -> None:
        self.graphs = 0
        self.symbolic = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        for node in gm.graph.nodes:
            val = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                self.symbolic |= any(isinstance(s, torch.SymInt) for s in val.shape)
            if node.op == "placeholder" and isinstance(val, torch.SymInt):
                self.symbolic = True
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _chain() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.GELU())])


class _ConvNet(nn.Module):
    """A model of its own class (as torchvision's resnet18 is): ``torch.compile`` of it starts
    its frame at the model's ``forward``, the installed one once checkpointed."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
        for _ in range(4):
            layers += [nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def _train_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_second_checkpointed_model_compiles_as_if_alone() -> None:
    torch.manual_seed(0)
    first = _chain()
    x1 = torch.randn(4, 16)
    autockpt.auto_checkpoint(first, example_inputs=(x1,))
    compiled_first = torch.compile(first, backend="aot_eager")
    for _ in range(2):
        _train_step(compiled_first, x1)
    del first, compiled_first

    net = _ConvNet().train()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    recorder = _Recorder()
    wrapped = autockpt.auto_checkpoint(torch.compile(net, backend=recorder), example_inputs=(x,))
    assert autockpt.make_plan(wrapped).checkpointed_segments > 0
    grads = _train_step(wrapped, x)
    assert recorder.graphs >= 1
    # alone, this model compiles with static shapes; the first one must not make it dynamic
    assert not recorder.symbolic, "the second model was compiled with dynamic shapes"
    for g, r in zip(grads, _train_step(ref, x)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_many_checkpointed_models_each_compile() -> None:
    """More checkpointed models than dynamo's recompile limit (lowered to 2 to keep it quick):
    each is still compiled."""
    with torch._dynamo.config.patch(recompile_limit=2):
        _compile_models(4)


def _compile_models(count: int) -> None:
    for i in range(count):
        model = nn.Sequential(nn.Linear(4 + i, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(3, 4 + i)
        autockpt.auto_checkpoint(model, 2, example_inputs=(x,))
        recorder = _Recorder()
        _train_step(torch.compile(model, backend=recorder, dynamic=False), x)
        assert recorder.graphs >= 1, (
            f"model {i} ran uncompiled (dynamo's recompile limit, shared across models)"
        )
