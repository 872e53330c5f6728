"""Acceptance tests from ../shared/CORRECTNESS.md owned by the core (items in brackets).

Every gradient comparison is bitwise in float64 on CPU [35].
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from helpers import assert_same_state, assert_same_step, count_checkpoint_calls, seeded_step, step, twin
from torch import nn

import autockpt
from autockpt.execution.lean_checkpoint import LEAN_AVAILABLE

D = torch.float64


def tanh_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(D)


def test_every_checkpoint_call_is_non_reentrant_and_nothing_warns() -> None:  # [1]
    model = autockpt.auto_checkpoint(tanh_mlp(), 3)
    with count_checkpoint_calls() as spy, warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, torch.randn(4, 6, dtype=D))
        with torch.autograd.graph.save_on_cpu():  # saved-tensor hooks: torch's checkpoint
            step(model, torch.randn(4, 6, dtype=D))
    # the lean checkpoint for the plain step where this torch allows it (NOTE [Lean checkpoint])
    assert (spy.lean.call_count, spy.torch.call_count) == ((2, 2) if LEAN_AVAILABLE else (0, 4))
    assert all(call.kwargs["use_reentrant"] is False for call in spy.torch.call_args_list)


def test_input_without_grad_needs_no_hack() -> None:  # [2]
    x = torch.randn(4, 6, dtype=D)
    ref, ck = twin(tanh_mlp(), 3)
    step(ref, x)
    step(ck, x)
    assert not x.requires_grad
    assert all(p.grad is not None for p in ck.parameters())
    assert_same_state(ref, ck)


def test_frozen_prefix() -> None:  # [3]
    model = tanh_mlp()
    model[0].requires_grad_(False)
    ref, ck = twin(model, 3)
    step(ref, torch.randn(4, 6, dtype=D))
    step(ck, torch.randn(4, 6, dtype=D).copy_(torch.zeros(4, 6)))  # different x: must differ
    assert not torch.equal(ref[2].weight.grad, ck[2].weight.grad)
    for p in (*ref.parameters(), *ck.parameters()):
        p.grad = None
    x = torch.randn(4, 6, dtype=D)
    step(ref, x)
    step(ck, x)
    assert ck[0].weight.grad is None
    assert_same_state(ref, ck)


def dropout_blocks(n: int = 9) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(n):
        layers += [nn.Linear(16, 16), nn.Dropout(0.3), nn.LayerNorm(16)]
    return nn.Sequential(*layers).to(D)


def test_dropout_masks_and_rng_stream_are_those_of_the_reference() -> None:  # [4]
    assert_same_step(dropout_blocks(), torch.randn(8, 16, dtype=D), "sqrt", steps=2)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("segments", [2, 3, 5])
def test_batchnorm_buffers_change_once_per_forward(momentum: float | None, segments: int) -> None:  # [5]
    model = nn.Sequential(
        nn.Linear(5, 7),
        nn.BatchNorm1d(7, momentum=momentum),
        nn.Tanh(),
        nn.Linear(7, 7),
        nn.BatchNorm1d(7, momentum=momentum),  # BN ends a segment for 2 and 5
        nn.Linear(7, 2),
    ).to(D)
    assert_same_step(model, torch.randn(6, 5, dtype=D), segments, steps=5)


class NormTwice(nn.Module):
    """One BatchNorm (momentum 0.5) called twice: on a batch whose mean is 2 it moves the
    running mean from 0 to 1, then on the batch times -1/2 back to exactly 0. The second
    output is then changed in place, so ``save-compute`` keeps only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3, momentum=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm(x)
        b = self.norm(x * -0.5).mul_(2.0)
        return a + b


def test_a_buffer_back_at_its_value_after_the_forward_is_still_replayed() -> None:  # [5]
    """Nothing shows that the forward wrote the running mean: it ends where it started and
    BatchNorm's CPU kernel moves no version counter. The recompute keeps the first norm's
    output and reruns only the second, a different sequence of updates, so it must never
    write the live buffer."""
    model = nn.Sequential(NormTwice(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 3)).to(D)
    ref, ck = twin(model, 2, policy="save-compute")
    assert ck.forward.plan.segments[0].checkpoint and ck.forward.plan.segments[0].start == 0
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], dtype=D)  # column means 2
    for i in range(3):  # the first forward keeps nothing (NOTE [Kept outputs changed in place])
        for model in (ref, ck):
            seeded_step(model, x.clone().requires_grad_(), seed=i)
        assert torch.equal(ref[0].norm.running_mean, torch.zeros(3, dtype=D))
        assert_same_state(ref, ck)


def test_batchnorm_under_no_grad_updates_once() -> None:  # [6]
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1), nn.BatchNorm1d(1)).to(D)
    ref, ck = twin(model, 2)
    x = torch.randn(5, 3, dtype=D)
    with torch.no_grad():
        ref(x), ck(x)
    assert int(ck[1].num_batches_tracked) == 1
    assert_same_state(ref, ck)


class CountingEMA(nn.Module):
    """Reads and updates a buffer in forward; counts calls unless recomputing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(4, dtype=D))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not autockpt.is_recomputing():
            self.calls += 1
        out = x * (1 + self.ema)  # output depends on the buffer: recompute must see the old value
        with torch.no_grad():
            self.ema.mul_(0.5).add_(x.mean(0))
        return out


class ReassignEMA(CountingEMA):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x * (1 + self.ema)
        self.ema = (self.ema * 0.5 + x.mean(0)).detach()  # reassigned, not in place
        return out


@pytest.mark.parametrize("cls", [CountingEMA, ReassignEMA])
def test_custom_buffers_read_in_forward_replay_exactly(cls: type[nn.Module]) -> None:  # [5, 7]
    model = nn.Sequential(nn.Linear(4, 4), cls(), nn.Tanh(), cls(), nn.Linear(4, 4)).to(D)
    assert_same_step(model, torch.randn(3, 4, dtype=D), 3, steps=3)


def test_counter_guarded_by_is_recomputing_counts_once_per_step() -> None:  # [7]
    model = nn.Sequential(nn.Linear(4, 4), CountingEMA(), nn.Linear(4, 4)).to(D)
    autockpt.auto_checkpoint(model, 2)
    step(model, torch.randn(3, 4, dtype=D))
    assert model[1].calls == 1
    assert not autockpt.is_recomputing()


class AddInPlace(nn.Module):
    """Mutates its input without declaring inplace=True: only the dry run can tell."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0).add_(1.0)


def inplace_chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
        AddInPlace(),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Flatten(),
        AddInPlace(),
        nn.ReLU(inplace=True),
        nn.Linear(6, 2),
    ).to(D)  # Flatten returns a view that AddInPlace mutates: the boundary before it is unsafe too


@pytest.mark.parametrize("segments", range(1, 6))
@pytest.mark.parametrize("with_inputs", [False, True])
def test_inplace_modules_never_start_a_segment(segments: int, with_inputs: bool) -> None:  # [11]
    x = torch.randn(4, 5, dtype=D)
    kwargs = {"example_inputs": (x,)} if with_inputs else {}
    ref, ck = twin(inplace_chain(), segments if segments > 1 else "none", **kwargs)
    step(ref, x.clone())
    step(ck, x.clone())
    assert_same_state(ref, ck)
    plan = ck.forward.plan
    if with_inputs or plan.checkpointed_segments:  # a plan that checkpoints nothing needs no dry run
        assert plan.stage_names == ("0+1", "2+3", "4", "5+6+7+8", "9")


def test_dry_run_replans_on_first_training_forward() -> None:  # [11]
    model = autockpt.auto_checkpoint(inplace_chain(), "sqrt")
    assert "2+3" not in model.forward.plan.stage_names  # AddInPlace is invisible statically
    step(model, torch.randn(4, 5, dtype=D))
    assert "2+3" in model.forward.plan.stage_names


def test_first_module_mutating_the_model_input_keeps_segment_zero_plain() -> None:  # [11]
    model = nn.Sequential(AddInPlace(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh()).to(D)
    x = torch.randn(2, 3, dtype=D)
    ref, ck = twin(model, 3, example_inputs=(x,))
    assert not ck.forward.plan.segments[0].checkpoint
    step(ref, x.clone())
    step(ck, x.clone())
    assert_same_state(ref, ck)


@pytest.mark.parametrize("segments", range(1, 4))
def test_shared_module_instances_run_at_every_position(segments: int) -> None:  # [15]
    a = nn.Linear(4, 4)
    act = nn.Tanh()
    model = nn.Sequential(a, act, a, act).to(D)
    assert autockpt.make_plan(model, "none").n_stages == 4  # children() would give 2
    x = torch.randn(3, 4, dtype=D)
    expected = model(x)
    if segments == 1:
        with pytest.warns(UserWarning):
            autockpt.auto_checkpoint(model, 1)
    else:
        ref, _ = twin(model, segments)
        step(ref, x)
        step(model, x)
        assert_same_state(ref, model)
    assert torch.equal(model(x), expected)


def test_tied_weights_across_segments_accumulate_once() -> None:  # [16]
    first, last = nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), last).to(D)
    ref, ck = twin(model, 3)
    assert ck[0].weight is ck[4].weight
    fired: list[int] = []
    for p in ck.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    x = torch.randn(2, 6, dtype=D)
    step(ref, x)
    step(ck, x)
    assert_same_state(ref, ck)
    assert len(fired) == len(list(ck.parameters())) == 3


def bn_dropout_chain() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(inplace=True),
        nn.Dropout(0.2),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.GELU(),
        nn.Linear(8, 3),
    ).to(D)


def test_two_forwards_then_backward_in_reverse_order() -> None:  # [23]
    ref, ck = twin(bn_dropout_chain(), 3)
    x1, x2 = torch.randn(4, 5, dtype=D), torch.randn(4, 5, dtype=D)
    losses = []
    for model in (ref, ck):
        torch.manual_seed(1)
        a, b = model(x1).sum(), model(x2).square().sum()
        b.backward()
        a.backward()
        losses.append((a, b, torch.rand(1)))
    assert all(torch.equal(u, v) for u, v in zip(*losses))
    assert_same_state(ref, ck)


def test_gradient_accumulation_and_optimizer_steps() -> None:  # [23]
    ref, ck = twin(bn_dropout_chain(), "sqrt")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, ck)]
    for it in range(2):
        for model, opt in zip((ref, ck), opts):
            torch.manual_seed(it)
            opt.zero_grad()
            for micro in range(4):
                step(model, torch.randn(4, 5, dtype=D) + micro)
        assert_same_state(ref, ck)
        for opt in opts:
            opt.step()
    assert_same_state(ref, ck)


def test_no_grad_and_inference_mode_bypass_checkpoint() -> None:  # [24]
    ref, ck = twin(bn_dropout_chain(), 3)
    x = torch.randn(4, 5, dtype=D)
    with count_checkpoint_calls() as spy, warnings.catch_warnings():
        warnings.simplefilter("error")
        for ctx in (torch.no_grad, torch.inference_mode):
            with ctx():
                torch.manual_seed(0)
                a = ref(x)
                torch.manual_seed(0)
                b = ck(x)
            assert torch.equal(a, b)
    assert spy.call_count == 0
    assert_same_state(ref, ck)


def test_eval_mode_with_grad_still_checkpoints() -> None:  # [24]
    ref, ck = twin(bn_dropout_chain(), 3)
    ref.eval(), ck.eval()
    with count_checkpoint_calls() as spy:
        step(ref, torch.ones(4, 5, dtype=D))
        step(ck, torch.ones(4, 5, dtype=D))
    assert spy.call_count == 2
    assert_same_state(ref, ck)


def test_names_types_and_parameter_objects_are_unchanged() -> None:  # [26]
    model = bn_dropout_chain()
    before = (
        list(model.state_dict()),
        list(model.named_parameters()),
        list(model.named_buffers()),
        list(model.named_modules()),
    )
    autockpt.auto_checkpoint(model)
    after = (
        list(model.state_dict()),
        list(model.named_parameters()),
        list(model.named_buffers()),
        list(model.named_modules()),
    )
    assert before[0] == after[0]
    for b, a in zip(before[1:], after[1:]):
        assert [n for n, _ in b] == [n for n, _ in a]
        assert all(x is y for (_, x), (_, y) in zip(b, a))
    assert type(model) is nn.Sequential and isinstance(model, nn.Sequential)


def test_old_checkpoints_load_both_ways_and_restore_undoes() -> None:  # [27]
    plain = bn_dropout_chain()
    saved = copy.deepcopy(plain.state_dict())
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    step(plain, torch.randn(4, 5, dtype=D))
    opt.step()
    opt_state = copy.deepcopy(opt.state_dict())
    model_state = copy.deepcopy(plain.state_dict())

    wrapped = autockpt.auto_checkpoint(bn_dropout_chain())
    wrapped.load_state_dict(model_state, strict=True)
    opt2 = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt_state))  # load_state_dict shares tensors
    reference = copy.deepcopy(plain)
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opt_ref.load_state_dict(copy.deepcopy(opt_state))
    for model, o in ((reference, opt_ref), (wrapped, opt2)):
        o.zero_grad()
        torch.manual_seed(3)
        step(model, torch.ones(4, 5, dtype=D))
        o.step()
    assert_same_state(reference, wrapped)

    fresh = bn_dropout_chain()
    fresh.load_state_dict(wrapped.state_dict(), strict=True)  # and back
    assert autockpt.restore(wrapped) is wrapped
    assert "forward" not in vars(wrapped) and wrapped.forward.__func__ is nn.Sequential.forward
    assert saved.keys() == wrapped.state_dict().keys()


def test_restore_brings_back_an_instance_forward_exactly() -> None:  # [27]
    model = tanh_mlp()
    custom = model.forward
    model.forward = custom  # an instance attribute set by the user
    autockpt.auto_checkpoint(model, 2)
    autockpt.auto_checkpoint(model, 3)
    autockpt.restore(model)
    assert vars(model)["forward"] is custom


def test_applying_twice_replaces_the_plan_and_never_stacks() -> None:  # [31]
    calls = []
    model = tanh_mlp()
    model[0].register_forward_hook(lambda *a: calls.append(1))
    autockpt.auto_checkpoint(model, 2)
    autockpt.auto_checkpoint(model, 3)
    assert model.forward.plan.strategy == "3"
    step(model, torch.randn(2, 6, dtype=D))  # the first training step also runs the dry run
    calls.clear()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        step(model, torch.randn(2, 6, dtype=D))
    assert len(calls) == 2  # forward + one recompute, not three
    _, once = twin(tanh_mlp(), 3)
    twice = autockpt.auto_checkpoint(copy.deepcopy(once), 3)
    x = torch.randn(2, 6, dtype=D)
    step(once, x)
    step(twice, x)
    assert_same_state(once, twice)


def test_deepcopy_is_independent_and_still_checkpointed() -> None:  # [32]
    model = autockpt.auto_checkpoint(bn_dropout_chain(), 3)
    clone = copy.deepcopy(model)
    assert clone.forward.model is clone and clone.forward.runtime[0].stages[0].units[0].fn is clone[0]
    with count_checkpoint_calls() as spy:
        step(clone, torch.randn(4, 5, dtype=D))
    assert spy.call_count == 2
    assert model[0].weight.grad is None


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_round_trip_stays_checkpointed(how: str) -> None:  # [32]
    model = autockpt.auto_checkpoint(
        bn_dropout_chain(), lambda r: [2] * (r.n_stages // 2) + [1] * (r.n_stages % 2)
    )
    step(model, torch.randn(4, 5, dtype=D))
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    ref = copy.deepcopy(model)
    with count_checkpoint_calls() as spy:
        seeded_step(loaded, torch.ones(4, 5, dtype=D))
    assert spy.call_count == len(loaded.forward.plan.segments) - 1
    seeded_step(ref, torch.ones(4, 5, dtype=D))
    assert_same_state(ref, loaded)


def test_count_above_the_stages_found_by_the_dry_run_is_clamped_with_a_warning() -> None:  # [11]
    model = nn.Sequential(nn.Linear(3, 3), nn.Flatten(), nn.ReLU(inplace=True), nn.Linear(3, 3)).to(D)
    ref, ck = twin(model, 3)  # statically 3 stages; the dry run fuses Flatten too
    x = torch.randn(2, 3, dtype=D)
    with pytest.warns(UserWarning, match="segments=3 becomes segments=2"):
        step(ck, x)
    step(ref, x)
    assert ck.forward.plan.stage_names == ("0+1+2", "3")
    assert_same_state(ref, ck)


def expansion_mlp(blocks: int = 5) -> nn.Sequential:
    return nn.Sequential(
        *[m for _ in range(blocks) for m in (nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))]
    ).to(D)


@pytest.mark.parametrize("with_inputs", [True, False])
def test_expansion_mlp_boundaries_sit_at_narrow_tensors(with_inputs: bool) -> None:  # [29]
    x = torch.randn(4, 8, dtype=D)
    ref, ck = twin(expansion_mlp(), "sqrt", **({"example_inputs": (x,)} if with_inputs else {}))
    step(ref, x)
    step(ck, x)  # without example inputs the first step's dry run re-plans
    assert_same_state(ref, ck)
    starts = [s.start for s in ck.forward.plan.segments]
    # about sqrt(15) segments (sqrt(A / b): every stage saves about its input); 5 of them, one
    # per block, is what puts every boundary at a narrow tensor
    assert len(starts) in (4, 5)
    assert all(ck.forward.plan.stage_kinds[i] == "Linear" and i % 3 == 0 for i in starts)
