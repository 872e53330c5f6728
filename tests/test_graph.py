"""Any model: the graph walker (torch.fx) and the block walker, on real architectures."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchvision
from helpers import assert_same_state
from models_for_tests import GPT, BranchyGPT, ManyOutputs, Pair
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils._pytree import tree_leaves
from torchvision.models.vision_transformer import VisionTransformer

import autockpt
from autockpt.walkers.graph import trace_program

D = torch.float64


def tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, Pair):
        out = (out.main, out.aux)
    if isinstance(out, dict):
        out = [tensors(v) for v in out.values()]
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def loss_of(out: Any) -> torch.Tensor:
    leaves = [t for t in tensors(out) if t.requires_grad]
    return sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)).sum() for t in leaves)


def same_training(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, steps: int = 2, **plan: Any
) -> nn.Module:
    """Checkpointed and unwrapped copies give bitwise equal outputs, grads and buffers."""
    kwargs = kwargs or {}
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, **plan)
    for i in range(steps):
        results = []
        for m in (ref, model):
            torch.manual_seed(i)
            out = m(*args, **kwargs)
            loss_of(out).backward()
            results.append((tensors(out), torch.rand(1)))
        (a, ra), (b, rb) = results
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(ra, rb)
    assert_same_state(ref, model)
    return model


def vit(image_size: int) -> nn.Module:
    """ViT-B/16's architecture (12 layers, 12 heads, patch 16) at width 96 instead of 768:
    the same graph to walk, 1.5 M parameters instead of 86 M."""
    return VisionTransformer(
        image_size=image_size, patch_size=16, num_layers=12, num_heads=12, hidden_dim=96, mlp_dim=384
    )


TORCHVISION: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (lambda: torchvision.models.resnet18(), (2, 3, 32, 32)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(), (2, 3, 32, 32)),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(), (2, 3, 32, 32)),  # stochastic depth
    "vit_b_16_narrow": (lambda: vit(32), (2, 3, 32, 32)),
    "googlenet": (lambda: torchvision.models.googlenet(aux_logits=True, init_weights=False), (2, 3, 64, 64)),
}


@pytest.mark.parametrize("name", list(TORCHVISION))
def test_torchvision_gradients_are_exact(name: str) -> None:
    factory, shape = TORCHVISION[name]
    torch.manual_seed(0)
    model = factory().to(D).train()
    model = same_training(model, (torch.randn(shape, dtype=D),), steps=1)
    assert model.forward.plan.walker == "graph"
    assert model.forward.plan.checkpointed_segments >= 2


def peak(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> int:
    for _ in range(2):  # warm-up, then measure
        for p in model.parameters():
            p.grad = None
        with autockpt.track_memory("cpu", tensors=False) as mem:
            loss_of(model(*args, **(kwargs or {}))).backward()
    return mem.peak_bytes


MEMORY = {  # float32, activations large enough to dominate parameters and gradients
    "resnet18": (lambda: torchvision.models.resnet18(), (32, 3, 64, 64)),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(), (32, 3, 64, 64)),
    "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(), (16, 3, 64, 64)),
    # 17 tokens at 64 x 64; at 32 x 32 (5 tokens) the narrow ViT's activations are too few
    "vit_b_16_narrow": (lambda: vit(64), (16, 3, 64, 64)),
    "googlenet": (lambda: torchvision.models.googlenet(aux_logits=True, init_weights=False), (16, 3, 64, 64)),
}


@pytest.mark.parametrize("name", list(MEMORY))
def test_torchvision_peak_is_below_unwrapped(name: str) -> None:
    factory, shape = MEMORY[name]
    torch.manual_seed(0)
    model = factory().train()
    x = torch.randn(shape)
    plain = peak(model, (x,))
    wrapped = peak(autockpt.auto_checkpoint(model, example_inputs=(x,)), (x,))
    assert wrapped <= 0.9 * plain, (wrapped, plain)  # 0.41-0.82 of it (resnet18 highest; torch 2.14, CPU)


def gpt_inputs(batch: int = 2, t: int = 16, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, vocab, (batch, t))
    mask = torch.ones(batch, t, dtype=D)
    mask[-1, t // 2 :] = 0
    return idx, mask


@pytest.mark.parametrize("mode", ["graph", "blocks"])
def test_gpt_decoder_is_exact_through_either_walker(mode: str) -> None:
    idx, mask = gpt_inputs()
    model = same_training(GPT().to(D), (idx,), {"attention_mask": mask}, steps=2, mode=mode)
    plan = model.forward.plan
    assert plan.walker == mode and plan.checkpointed_segments >= 2
    assert model.head.weight is model.tok.weight


@pytest.mark.parametrize("mode", ["graph", "blocks"])
def test_gpt_decoder_peak_is_below_unwrapped(mode: str) -> None:
    torch.manual_seed(0)
    model = GPT(width=64, layers=6, heads=4, context=128)
    idx = torch.randint(0, 50, (8, 128))
    mask = torch.ones(8, 128)
    plain = peak(model, (idx,), {"attention_mask": mask})
    autockpt.auto_checkpoint(model, mode=mode)
    wrapped = peak(model, (idx,), {"attention_mask": mask})
    assert wrapped <= 0.4 * plain, (wrapped, plain)  # 0.21 of it through either walker (torch 2.14, CPU)


def test_untraceable_model_falls_back_to_blocks_and_says_why() -> None:
    idx, mask = gpt_inputs()
    model = same_training(BranchyGPT().to(D), (idx,), {"attention_mask": mask})
    plan = model.forward.plan
    assert plan.walker == "blocks"
    assert plan.stage_names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    assert any("graph walker: torch.fx could not trace it" in n for n in plan.notes)
    assert "graph walker" in str(plan)
    assert sum(1 for b in model.blocks if "forward" in vars(b)) == plan.checkpointed_segments == 4


@pytest.mark.parametrize(
    ("segments", "expected"), [(1, [2]), (2, [1, 3]), (4, [0, 1, 2, 3]), ("sqrt", [0, 1, 2, 3])]
)
def test_block_counts_are_evenly_spread(segments: Any, expected: list[int]) -> None:
    plan = autockpt.make_plan(BranchyGPT(), segments, mode="blocks")
    assert [s.start for s in plan.segments if s.checkpoint] == expected


def test_restore_removes_block_forwards_and_reapplying_does_not_stack() -> None:
    model = BranchyGPT()
    keys = list(model.state_dict())
    autockpt.auto_checkpoint(model, 4)
    autockpt.auto_checkpoint(model, 2)
    assert sum("forward" in vars(b) for b in model.blocks) == 2
    autockpt.restore(model)
    assert not any("forward" in vars(b) for b in (model, *model.blocks))
    assert list(model.state_dict()) == keys


def test_a_single_linear_gets_an_explicit_noop_plan_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="single stage"):
        model = autockpt.auto_checkpoint(nn.Linear(3, 3))
    assert model.forward.plan.walker == "graph" and model.forward.plan.checkpointed_segments == 0
    x = torch.randn(2, 3)
    assert torch.equal(model(x), nn.Linear.forward(model, x))


@pytest.mark.parametrize("segments", [2, 3, 4])
def test_calling_conventions_and_nested_outputs(segments: int) -> None:  # items 12, 13
    x, y = torch.randn(3, 4, dtype=D), torch.randn(3, 2, dtype=D)
    model = same_training(ManyOutputs().to(D), (x, y), {"scale": 0.5}, segments=segments)
    out = model(x, y, scale=0.5)
    assert isinstance(out["tail"], Pair) and out["pair"][1] is None
    assert not out["stats"].requires_grad  # the no-grad region stays no-grad


def make_pair() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(5, 5), nn.Tanh())]).to(D)
    ref = copy.deepcopy(model)

    class Wrapped(nn.Module):  # not a Sequential: goes through the graph walker
        def __init__(self, body: nn.Module) -> None:
            super().__init__()
            self.body = body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * 2

    return Wrapped(ref), autockpt.auto_checkpoint(Wrapped(model), 3)


def test_autograd_grad_backward_inputs_double_backward_and_retain_graph() -> None:  # item 14
    ref, ck = make_pair()
    assert ck.forward.plan.walker == "graph"
    x = torch.randn(4, 5, dtype=D, requires_grad=True)
    results = []
    for m in (ref, ck):
        out = m(x).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        penalty = gx.square().sum()  # gradient penalty: double backward
        penalty.backward(inputs=list(m.parameters()))
        first = [p.grad.clone() for p in m.parameters()]
        out2 = m(x).sum()
        out2.backward(retain_graph=True)
        out2.backward()
        results.append((gx.detach(), first, [p.grad.clone() for p in m.parameters()]))
    (a, fa, ga), (b, fb, gb) = results
    assert torch.equal(a, b)
    assert all(torch.equal(p, q) for p, q in zip(fa, fb))
    assert all(torch.equal(p, q) for p, q in zip(ga, gb))


def test_tied_weights_accumulate_once_per_step() -> None:  # item 16
    idx, mask = gpt_inputs()
    model = autockpt.auto_checkpoint(GPT().to(D))
    fired: list[str] = []
    model.tok.weight.register_post_accumulate_grad_hook(lambda p: fired.append("tok"))
    loss_of(model(idx, attention_mask=mask)).backward()
    assert fired == ["tok"]


def test_hooks_guarded_by_is_recomputing_fire_once_per_position() -> None:  # item 25
    idx, mask = gpt_inputs()
    model = autockpt.auto_checkpoint(
        GPT().to(D), example_inputs=(idx,), example_kwargs={"attention_mask": mask}
    )
    seen: list[str] = []
    backward: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.LayerNorm):
            module.register_forward_hook(
                lambda m, a, o, name=name: None if autockpt.is_recomputing() else seen.append(name)
            )
    model.blocks[0].register_full_backward_hook(lambda m, gi, go: backward.append("b0"))
    loss_of(model(idx, attention_mask=mask)).backward()
    expected = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert sorted(seen) == sorted(expected) and len(seen) == len(expected)
    assert backward == ["b0"]


def test_an_argument_the_model_cannot_do_without_fails_as_it_would_unwrapped() -> None:
    class Required(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return self.b(self.a(x) + bias)

    model = autockpt.auto_checkpoint(Required(), 2)
    model(torch.randn(2, 3), torch.randn(3)).sum().backward()
    with pytest.raises(TypeError):  # None + tensor, as in the unwrapped model
        model(torch.randn(2, 3))


class OptionalMask(nn.Module):
    """``if mask is not None`` inside: fx can trace one pattern of None arguments at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(9))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if mask is not None:
                x = x * mask
        return x


@pytest.mark.parametrize("with_inputs", [False, True])
def test_optional_arguments_are_traced_for_the_call_and_checkpointed_either_way(with_inputs: bool) -> None:
    torch.manual_seed(0)
    x, mask = torch.randn(4, 16), torch.rand(4, 16)
    ref = OptionalMask()
    model = copy.deepcopy(ref)
    autockpt.auto_checkpoint(model, example_inputs=(x,) if with_inputs else None)
    assert model.forward.walked.walker == "graph" and model.forward.plan.checkpointed_segments >= 2
    assert autockpt.verify(model, (x,)).ok and autockpt.verify(model, (x, mask)).ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call falls back to the plain forward
        for args in [(x,), (x, mask), (x,)]:
            ref(*args).square().sum().backward()
            model(*args).square().sum().backward()
    assert_same_state(ref, model)
    patterns = {*model.forward.traced, model.forward.walked.program.none_args}
    assert patterns == {frozenset(), frozenset({"mask"})}


class TwoTowers(nn.Module):
    """Every argument defaults to None (open_clip's CLIP.forward): the defaults' trace is one
    stage that checkpoints nothing (NOTE [A trace of another call checkpoints nothing])."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())))
        self.txt = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(32, 32), nn.GELU())))

    def forward(
        self, image: torch.Tensor | None = None, text: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (
            self.img(image) if image is not None else None,
            self.txt(text) if text is not None else None,
        )


def test_an_all_none_default_trace_is_traced_again_for_the_real_call() -> None:
    torch.manual_seed(0)
    ref = TwoTowers().double()
    with pytest.warns(UserWarning, match=r"traced with its optional arguments \['image', 'text'\] as None"):
        model = autockpt.auto_checkpoint(copy.deepcopy(ref))  # no example inputs: the defaults' trace
    assert model.forward.plan.checkpointed_segments == 0
    image, text = torch.randn(8, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)
    for m in (ref, model):
        for _ in range(2):
            out = m(image=image, text=text)
            (out[0].square().sum() + out[1].sum()).backward()
    assert model.forward.plan.checkpointed_segments > 0
    assert model.forward.walked.program.none_args == frozenset()
    assert_same_state(ref, model)


class WritesIntoItsInput(nn.Module):
    """A residual block whose code starts by writing into its input, as many blocks do."""

    def __init__(self, how: str, width: int = 32) -> None:
        super().__init__()
        self.how = how
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.how == "torch.relu_":
            h = torch.relu_(h)
        elif self.how == "inplace=True":
            h = nn.functional.relu(h, inplace=True)
        else:
            h = h.mul_(0.5)
        return h + self.b(torch.tanh(self.a(h)))


class InPlaceStack(nn.Module):
    def __init__(self, how: str, n: int = 6, width: int = 32) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        self.blocks = nn.ModuleList(WritesIntoItsInput(how, width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("how", ["torch.relu_", "inplace=True", "Tensor.mul_"])
def test_blocks_that_start_by_writing_into_their_input_stay_separate_stages(how: str) -> None:
    x = torch.randn(64, 32, dtype=D)
    model = InPlaceStack(how).to(D)
    plan = autockpt.make_plan(model, example_inputs=(x,))
    assert plan.stage_names == ("stem", *(f"blocks.{i}" for i in range(6)), "head")
    assert plan.checkpointed_segments >= 2
    plain = peak(copy.deepcopy(model), (x,))
    same_training(model, (x,), example_inputs=(x,))
    assert peak(model, (x,)) < plain


def test_a_module_list_of_layers_of_different_classes_is_one_group_of_blocks() -> None:
    from autockpt.walkers.blocks import find_blocks

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # a first layer unlike the rest, as in wav2vec2's feature encoder
            self.convs = nn.ModuleList([nn.Sequential(nn.Conv1d(1, 4, 3), nn.GroupNorm(2, 4)), Pair2()])
            self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])  # leaves: never blocks

    class Pair2(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3)

    assert [name for name, _ in find_blocks(Net())] == ["convs.0", "convs.1"]


def test_a_layer_replaced_after_planning_is_the_one_that_runs() -> None:
    """Fine-tuning swaps the classifier head after wrapping (timm's ``reset_classifier``):
    the traced program must call the new head, not the one it saw when tracing."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(D)
    x = torch.randn(2, 3, 32, 32, dtype=D)
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, segments=3, mode="graph")
    model(x).sum().backward()  # trained a while before the head is swapped
    head = nn.Linear(512, 4).to(D)
    model.fc, ref.fc = head, copy.deepcopy(head)
    out, expected = model(x), ref(x)
    assert out.shape == (2, 4)
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert head.weight.grad is not None and torch.equal(head.weight.grad, ref.fc.weight.grad)


class TwoStreamBlock(nn.Module):
    """A block that passes two tensors on (patch tokens and a class token, as timm's PiT)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mix = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.cls = nn.Linear(d, d)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, c = pair
        x = x + self.mix(x + c)
        return x, c + self.cls(x.mean(1, keepdim=True))


class TwoStream(nn.Module):
    def __init__(self, d: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.c0 = nn.Parameter(torch.zeros(1, 1, d))
        self.blocks = nn.Sequential(*(TwoStreamBlock(d) for _ in range(depth)))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, c = self.blocks((x, self.c0.expand(x.shape[0], 1, -1)))
        return self.head(c[:, 0] + x.mean(1))


def test_blocks_that_pass_two_tensors_are_checkpointed_one_by_one() -> None:
    """fx traces it, but no cut has one tensor crossing: the graph walker's one piece would
    hold every block (1.00x); the block walker is taken (NOTE [One unit holds the blocks])."""
    torch.manual_seed(0)
    x = torch.randn(4, 64, 16, dtype=D)
    model = same_training(TwoStream().to(D), (x,), steps=1)
    assert model.forward.plan.walker == "blocks"
    assert model.forward.plan.checkpointed_segments == 6
    assert peak(model, (x,)) < 0.7 * peak(TwoStream().to(D), (x,))
    forced = autockpt.auto_checkpoint(TwoStream().to(D), mode="graph")
    assert forced.forward.plan.walker == "graph"


class Staged(nn.Module):
    """Stages as a ModuleList of ModuleLists of blocks (timm's Twins), run by a loop with
    data-dependent control flow, so fx cannot trace it and the block walker runs."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()

        def block() -> nn.Module:
            return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        self.stages = nn.ModuleList(nn.ModuleList(block() for _ in range(3)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = x + block(x) if x.sum() > -1e9 else x
        return x


def test_lists_of_lists_checkpoint_the_blocks_not_the_lists() -> None:
    """A ModuleList is never called, so a checkpoint put on one never runs: before the fix
    the plan said 2 checkpointed 'blocks' (the stage lists), the peak stayed 1.00x and a
    budget profile failed ("did not run with gradients enabled")."""
    torch.manual_seed(0)
    x = torch.randn(256, 16, dtype=D)
    model = same_training(Staged().to(D), (x,), steps=1)
    assert model.forward.plan.walker == "blocks"
    assert model.forward.plan.stage_names == tuple(f"stages.{i}.{j}" for i in range(2) for j in range(3))
    assert peak(model, (x,)) < 0.6 * peak(Staged().to(D), (x,))
    budgeted = autockpt.auto_checkpoint(Staged().to(D), budget=0.8, example_inputs=(x,))
    assert budgeted.forward.plan.checkpointed_segments >= 1


class NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: a subclass of a torch layer, with a child of its own."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # as timm's: no input check fx cannot trace
        if self.training:
            self.num_batches_tracked.add_(1)
        mean, var = self.running_mean, self.running_var
        x = F.batch_norm(x, mean, var, self.weight, self.bias, self.training, 0.1, 1e-5)
        return self.act(x)


class Getter(nn.ModuleDict):
    """torchvision's IntermediateLayerGetter in small: a container with a forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = layer(x)
        return x


class NormActNet(nn.Module):
    def __init__(self, c: int = 8, n: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        blocks = {f"b{i}": nn.Sequential(nn.Conv2d(c, c, 3, padding=1), NormAct(c)) for i in range(n)}
        self.body = Getter(blocks)
        self.head = nn.Linear(c, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def test_subclasses_of_torch_layers_are_traced_as_one_call_and_train_exactly() -> None:
    """NOTE [Subclassed torch layers stay whole]: one node per NormAct (traced through, eight:
    five buffer reads, the counter's add_, batch_norm, the activation), while a container
    with a forward is still traced through to its layers; running stats stay exact."""
    program = trace_program(NormActNet())
    called = [str(n.target) for n in program.nodes if n.op == "call_module"]
    assert called == ["stem", *(f"body.b{i}.{j}" for i in range(6) for j in (0, 1)), "head"]
    assert not [n for n in program.nodes if n.op == "get_attr"]
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, dtype=D)
    model = same_training(NormActNet().to(D), (x,), example_inputs=(x,))
    assert model.forward.plan.checkpointed_segments >= 2
    assert peak(model, (x,)) < peak(NormActNet().to(D), (x,))
    same_training(NormActNet().to(D), (x,), budget=0.7, example_inputs=(x,), loss_fn=loss_of)
