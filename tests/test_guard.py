"""The mutation guard: changes between forward and backward that would corrupt a recompute.

Also the recompute check: a recompute that differs from its forward raises, naming the
segment and stage, and with ``debug=True`` the first op.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_state, seeded_step, twin
from models_for_tests import GPT, BranchyGPT, CallCounter
from torch import nn
from torch.utils.checkpoint import CheckpointError

import autockpt


class Scaled(nn.Module):
    """Multiplies by a constant buffer that its forward never changes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((width,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), Scaled(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2),
        nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2),
    )  # fmt: skip


def test_a_parameter_changed_in_place_before_backward_raises() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    out = ck(torch.randn(4, 8))
    with torch.no_grad():
        ck[0].weight.add_(1.0)
    with pytest.raises(
        autockpt.MutationError, match=r"parameter '0\.weight' \(shape \(8, 8\)\) was modified"
    ):
        out.sum().backward()


def test_the_unwrapped_model_fails_there_too() -> None:
    plain = model()
    out = plain(torch.randn(4, 8))
    with torch.no_grad():
        plain[3].weight.add_(1.0)  # saved by its Linear for the input gradient
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_constant_buffer_changed_in_place_raises() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    out = ck(torch.randn(4, 8))
    ck[1].scale.mul_(3.0)
    with pytest.raises(autockpt.MutationError, match=r"buffer '1\.scale'"):
        out.sum().backward()


def test_switching_to_eval_before_backward_raises_and_switching_back_does_not() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    x = torch.randn(4, 8)
    out = ck(x)
    ck.eval()
    with pytest.raises(autockpt.MutationError, match="switched to eval mode"):
        out.sum().backward()
    ck.train()
    out = ck(x)
    ck.eval()
    ck.train()  # a validation pass in between, mode restored before backward
    out.sum().backward()


def test_never_fires_in_a_training_loop_with_accumulation_and_shared_modules() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(8)
    layers = [nn.Linear(8, 8), bn, nn.Tanh(), nn.Linear(8, 8), bn, nn.Tanh(), nn.Linear(8, 8), nn.Tanh()]
    ref = nn.Sequential(*layers, nn.Linear(8, 2)).double()
    ck = autockpt.auto_checkpoint(copy.deepcopy(ref), 4)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, ck)]
    for step in range(3):
        for m, opt in zip((ref, ck), opts):
            for micro in range(2):  # gradient accumulation over two micro-batches
                torch.manual_seed(10 * step + micro)
                m(torch.randn(6, 8, dtype=torch.float64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), ck.state_dict().values()))


def test_two_forwards_then_one_backward_is_fine() -> None:
    """Both forwards' recomputes see their own buffers and dropout masks: gradients, outputs,
    BatchNorm statistics and the RNG stream equal the unwrapped model's."""
    ref, ck = twin(model().double(), 3)
    xs = torch.randn(2, 4, 8, dtype=torch.float64)
    results = []
    for m in (ref, ck):
        torch.manual_seed(1)
        a, b = m(xs[0]), m(xs[1])
        (a.sum() + (b * b).sum()).backward()
        results.append((a, b, torch.rand(1)))
    (ra, rb, r_next), (ca, cb, c_next) = results
    assert torch.equal(ra, ca) and torch.equal(rb, cb)
    assert_same_state(ref, ck)
    assert torch.equal(r_next, c_next), "RNG stream after the step differs"


def test_never_fires_on_a_traced_transformer_loop() -> None:
    torch.manual_seed(0)
    gpt = autockpt.auto_checkpoint(GPT(width=32, layers=3, heads=2, context=16))
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
    idx = torch.randint(0, 50, (2, 16))
    for _ in range(3):
        gpt(idx, attention_mask=torch.ones(2, 16)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert gpt.forward.plan.walker == "graph" and gpt.forward.plan.checkpointed_segments > 0


# --- forward hooks (CORRECTNESS.md item 9) ---------------------------------------------


def test_a_forward_hook_added_before_backward_raises_naming_the_module() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)  # segments 0-2 and 3-5 are recomputed
    out = ck(torch.randn(4, 8))
    ck[3].register_forward_hook(lambda module, args, output: output * 2)
    with pytest.raises(
        autockpt.MutationError,
        match=r"forward hooks of module '3' \(Linear\) changed between the forward and the backward of "
        r"checkpointed segment 1 \(stages 3-5\): 1 forward hook added\. .*after backward\(\)",
    ):
        out.sum().backward()


def test_a_forward_pre_hook_removed_before_backward_raises_naming_the_module() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    handle = ck[1].register_forward_pre_hook(lambda module, args: (args[0] * 3,))
    out = ck(torch.randn(4, 8))
    handle.remove()
    with pytest.raises(autockpt.MutationError, match=r"module '1' \(Scaled\) .*1 forward pre-hook removed"):
        out.sum().backward()


def test_a_global_forward_hook_added_before_backward_raises() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    out = ck(torch.randn(4, 8))
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        with pytest.raises(autockpt.MutationError, match=r"global forward hooks .*here from module '3'"):
            out.sum().backward()
    finally:
        handle.remove()


def _doubled(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    return output * 2  # picklable


def test_a_loaded_model_looks_at_its_hooks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model saved after a hook was added, and loaded where torch's hook-handle count is
    where it was when the guard last found no hooks (a new process counts from 0 again):
    the guard must look at the modules, not trust what it saw before saving."""
    import pickle

    from torch.utils.hooks import RemovableHandle

    ck = autockpt.auto_checkpoint(model(), 3)
    x = torch.randn(4, 8)
    ck(x).sum().backward()  # every segment's last look: no hooks, at this count
    count = RemovableHandle.next_id
    ck[3].register_forward_hook(_doubled)  # between steps: fine
    loaded = pickle.loads(pickle.dumps(ck))
    monkeypatch.setattr(RemovableHandle, "next_id", count)  # as in a fresh process
    out = loaded(x)
    out.register_hook(lambda grad: grad)  # any registration moves the count
    out.sum().backward()  # the hook was there in the forward too: nothing changed
    ref = copy.deepcopy(loaded)
    autockpt.restore(ref)
    for m in (ref, loaded):
        for p in m.parameters():
            p.grad = None
    for m in (ref, loaded):
        torch.manual_seed(1)  # the same dropout masks
        m(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), loaded.parameters()))


def test_hooks_present_from_before_the_forward_train_bitwise_exactly() -> None:
    ref, ck = twin(model().double(), 3)
    for m in (ref, ck):
        m[3].register_forward_hook(lambda module, args, output: output * 1.5)
        m[4].register_forward_pre_hook(lambda module, args: (args[0] + 0.25,))
    x = torch.randn(6, 8, dtype=torch.float64)
    for i in range(2):
        (oa, na), (ob, nb) = seeded_step(ref, x, seed=i), seeded_step(ck, x, seed=i)
        assert torch.equal(oa, ob) and torch.equal(na, nb)
    assert_same_state(ref, ck)


def test_hooks_changed_after_backward_or_on_a_block_around_its_checkpoint_are_fine() -> None:
    ck = autockpt.auto_checkpoint(model(), 3)
    x = torch.randn(4, 8)
    ck(x).sum().backward()
    handle = ck[3].register_forward_hook(lambda module, args, output: None)  # between steps
    ck(x).sum().backward()
    handle.remove()
    ck(x).sum().backward()
    torch.manual_seed(0)
    gpt = autockpt.auto_checkpoint(BranchyGPT(width=16, layers=2, heads=2), 2)
    assert gpt.forward.plan.walker == "blocks"
    idx, mask = torch.randint(0, 50, (2, 16)), torch.ones(2, 16)
    out = gpt(idx, attention_mask=mask)
    handle = gpt.blocks[0].register_forward_hook(lambda module, args, output: None)  # runs outside
    out.sum().backward()
    handle.remove()
    out = gpt(idx, attention_mask=mask)
    gpt.blocks[0].mlp[0].register_forward_hook(lambda module, args, output: None)  # runs inside
    with pytest.raises(autockpt.MutationError, match=r"module 'blocks\.0\.mlp\.0' \(Linear\)"):
        out.sum().backward()


# --- recompute check, debug=True (CORRECTNESS.md item 30) ------------------------------


class Shrinking(nn.Module):
    """Drops the last row on every other call: its output shape depends on the call count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x[: x.shape[0] - self.calls % 2]


def nondeterministic(module: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 8), module, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
        nn.Linear(8, 8), nn.Tanh(),
    )  # fmt: skip


@pytest.mark.parametrize("debug", [False, True])
def test_a_shape_nondeterministic_module_raises_a_checkpoint_error_naming_the_segment(debug: bool) -> None:
    ck = autockpt.auto_checkpoint(nondeterministic(Shrinking()), 3, debug=debug)
    out = ck(torch.randn(5, 8))
    where = r"the recompute of checkpointed segment 0 \(stages 0-2\) differs from its forward at stage '1' "
    detail = (
        r"\(Shrinking\), op \d+ aten\.slice\.Tensor: output 0 is \(5, 8\) float32 on cpu .*in the recompute, "
        r"\(4, 8\)"
        if debug
        else r"\(Shrinking\): its output is \(5, 8\) float32 on cpu in the recompute and \(4, 8\)"
    )
    with pytest.raises(CheckpointError, match=where + detail) as caught:
        out.sum().backward()
    assert isinstance(caught.value, autockpt.AutockptError)


def test_debug_names_the_first_op_whose_values_differ() -> None:
    ck = autockpt.auto_checkpoint(nondeterministic(CallCounter()), 3, debug=True)
    out = ck(torch.randn(5, 8))
    with pytest.raises(
        autockpt.AutockptError,
        match=r"\(debug=True\): the recompute of checkpointed segment 0 \(stages 0-2\) differs from its "
        r"forward at stage '1' \(CallCounter\), op \d+ aten\.mul\.Tensor: output 0 \(\(5, 8\) float32 on "
        r"cpu\) has other values than in the forward\. .*is_recomputing",
    ):
        out.sum().backward()


def test_without_debug_a_value_difference_is_not_checked() -> None:
    ck = autockpt.auto_checkpoint(nondeterministic(CallCounter()), 3)
    ck(torch.randn(5, 8)).sum().backward()  # wrong gradients, caught by verify (test_verify.py)
    assert not any(rt.debug for rt in ck.forward.runtime)


@pytest.mark.parametrize("segments", [3, "sqrt"])
def test_debug_on_a_normal_model_trains_bitwise_exactly(segments: object) -> None:
    ref, ck = twin(model().double(), segments, debug=True)
    x = torch.randn(6, 8, dtype=torch.float64)
    for i in range(3):
        (oa, na), (ob, nb) = seeded_step(ref, x, seed=i), seeded_step(ck, x, seed=i)
        assert torch.equal(oa, ob) and torch.equal(na, nb)
    assert_same_state(ref, ck)


def test_debug_on_a_traced_transformer_trains_exactly() -> None:
    torch.manual_seed(0)
    ref, ck = twin(GPT(width=16, layers=3, heads=2).double(), debug=True)
    assert ck.forward.plan.walker == "graph" and ck.forward.plan.checkpointed_segments > 0
    idx, mask = torch.randint(0, 50, (2, 16)), torch.ones(2, 16, dtype=torch.float64)
    for m in (ref, ck):
        torch.manual_seed(1)
        m(idx, attention_mask=mask).logsumexp(-1).mean().backward()
    assert_same_state(ref, ck)


@pytest.mark.parametrize("debug", ["yes", 1, None])
def test_debug_must_be_a_bool(debug: object) -> None:
    with pytest.raises(TypeError, match="auto_checkpoint: debug must be True or False"):
        autockpt.auto_checkpoint(model(), debug=debug)  # type: ignore[arg-type]


def test_debug_under_autocast_with_weight_casts_cached_from_an_earlier_forward() -> None:
    ref, ck = twin(model(), 3, debug=True)
    x = torch.randn(6, 8)
    for m in (ref, ck):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the second forward finds the casts cached
            a, b = m(x), m(x * 2)
        (a.float().sum() + b.float().square().sum()).backward()
    assert_same_state(ref, ck)


class ScaledBlock(nn.Module):
    """Reads its own parameter in its code (fx get_attr) and runs a BatchNorm later on, as
    timm's efficientvim blocks do: the read and the norm can land in different segments."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(width))
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * torch.sigmoid(self.alpha)
        h = torch.tanh(self.b(h))
        return x + self.norm(h)


def test_a_block_reading_its_own_parameter_does_not_guard_its_submodules_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(ScaledBlock() for _ in range(3)))
    x = torch.randn(32, 16)
    n = len(autockpt.make_plan(copy.deepcopy(model), example_inputs=(x,), mode="graph").stage_names)
    ref = copy.deepcopy(model)
    ck = autockpt.auto_checkpoint(model, n, example_inputs=(x,), mode="graph")
    for m in (ref, ck):
        for _ in range(2):
            m(x).sum().backward()
    assert_same_state(ref, ck)


class BiasedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h) + bias)  # tanh keeps its output: the recompute reads bias


class BiasBetweenBlocks(nn.Module):
    """The caller adds to a tensor in place between the blocks it hands it to."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BiasedBlock() for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(8)
        for block in self.blocks:
            h = block(h, bias)
            bias.add_(1.0)
        return h


def test_a_block_input_changed_in_place_before_its_recompute_raises() -> None:
    """``checkpoint`` is handed one input tensor per device (NOTE [Segment inputs]); the others
    were no longer checked, and their in-place change gave silently wrong gradients (found
    in review)."""
    torch.manual_seed(0)
    model = autockpt.auto_checkpoint(BiasBetweenBlocks(), mode="blocks", segments=4)
    with pytest.raises(autockpt.MutationError, match=r"an input tensor of checkpointed segment 3"):
        model(torch.randn(3, 8)).sum().backward()
