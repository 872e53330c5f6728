"""autockpt's lean checkpoint keeps torch's non-reentrant contract (NOTE [Lean checkpoint]).

Each test runs the same function unwrapped, under torch's ``checkpoint`` and under
``lean_checkpoint``, and compares gradients bitwise, or checks the one behaviour it names.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.utils.checkpoint as tuc
from helpers import count_checkpoint_calls, step
from torch import nn

import autockpt
from autockpt.execution.lean_checkpoint import LEAN_AVAILABLE, lean_applies, lean_checkpoint

D = torch.float64
needs_lean = pytest.mark.skipif(
    not LEAN_AVAILABLE, reason="this torch cannot tell whether saved-tensor hooks are active"
)
Run = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def block(dtype: torch.dtype = D) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 6)).to(dtype)


def unwrapped(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def with_torch(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return tuc.checkpoint(fn, x, use_reentrant=False)  # type: ignore[no-any-return]


def lean(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return lean_checkpoint(fn, (x,), device_type=x.device.type, preserve_rng_state=True)  # type: ignore[no-any-return]


RUNS = {"unwrapped": unwrapped, "torch": with_torch, "lean": lean}


def grads_of(scenario: Callable[[Run], list[torch.Tensor]], run: Run) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return scenario(run)


def plain(run: Run) -> list[torch.Tensor]:
    m, x = block(), torch.randn(4, 6, dtype=D, requires_grad=True)
    run(m, x).pow(2).sum().backward()
    return [x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


def twice_with_retain_graph(run: Run) -> list[torch.Tensor]:
    m, x = block(), torch.randn(4, 6, dtype=D, requires_grad=True)
    loss = run(m, x).pow(2).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in m.parameters()]  # type: ignore[union-attr]
    loss.backward()
    return [*first, x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


def input_grad_first_then_all(run: Run) -> list[torch.Tensor]:
    m, x = block(), torch.randn(4, 6, dtype=D, requires_grad=True)
    loss = run(m, x).pow(2).sum()
    (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    return [gx, x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


def autocast_forward(run: Run) -> list[torch.Tensor]:
    m, x = block(torch.float32), torch.randn(4, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(m, x)
    out.float().pow(2).sum().backward()  # the replay must run under the forward's autocast
    return [x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


def autocast_backward_only(run: Run) -> list[torch.Tensor]:
    m, x = block(torch.float32), torch.randn(4, 6, requires_grad=True)
    loss = run(m, x).pow(2).sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss.backward()  # ... and not under the backward's
    return [x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


def part_of_the_graph_freed(run: Run) -> list[torch.Tensor]:
    m, x = block(), torch.randn(4, 6, dtype=D, requires_grad=True)
    kept = run(lambda t: (torch.exp(t), m(t)), x)[1]  # type: ignore[arg-type,index,return-value]
    # the exp output died with the tuple: its node, and the holder of the tensor it saved
    # (the first one saved), are freed before backward
    kept.sigmoid().sum().backward()
    return [x.grad, *(p.grad for p in m.parameters())]  # type: ignore[list-item]


SCENARIOS = [
    plain,
    twice_with_retain_graph,
    input_grad_first_then_all,
    autocast_forward,
    autocast_backward_only,
    part_of_the_graph_freed,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_gradients_match_unwrapped_and_torch_bitwise(scenario: Callable[[Run], list[torch.Tensor]]) -> None:
    ref, ours, theirs = (grads_of(scenario, RUNS[name]) for name in ("unwrapped", "lean", "torch"))
    assert len(ref) == len(ours) and all(g is not None for g in ours)
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_the_replay_stops_once_every_saved_tensor_is_back() -> None:
    reached = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)  # saves its output: the last save
        reached.append(1)
        return y * 2.0  # saves nothing

    x = torch.randn(3, dtype=D, requires_grad=True)
    lean(fn, x).sum().backward()
    assert reached == [1]  # the forward only; the replay stopped inside tanh


def test_the_replay_leaves_no_reference_cycle() -> None:
    """Tensors the replay saves for its own (discarded) graph are detached: a tanh node saving
    its own output would otherwise hold itself, freed only by the garbage collector."""
    m, x = block(), torch.randn(64, 6, dtype=D, requires_grad=True)
    live = {}
    gc.disable()
    try:
        for name in ("unwrapped", "lean"):
            with autockpt.track_memory("cpu", allocator=False) as mem:
                RUNS[name](m, x).sum().backward()
            live[name] = mem.tensor_live_bytes
            x.grad = None
            m.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    assert live["lean"] == live["unwrapped"]


def test_a_replay_that_saves_other_tensors_raises_checkpoint_error() -> None:
    calls = []

    def fewer(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(torch.tanh(x)) if len(calls) == 1 else torch.tanh(x) * 1.0

    def reshaped(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(x if len(calls) == 1 else x[:2]).sum()

    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(tuc.CheckpointError, match="A different number of tensors"):
        lean(fewer, x).sum().backward()
    calls.clear()
    with pytest.raises(tuc.CheckpointError, match="different metadata"):
        lean(reshaped, x).backward()


@needs_lean
def test_a_tensor_left_by_another_backward_is_recomputed() -> None:
    """A partial backward leaves the holders it did not reach filled; the next backward
    replays again rather than use them, so the runtime's mutation guard runs before any
    use (an optimizer step may have changed the weights in between: found in review)."""
    replays = []
    shared, head1, head2 = (nn.Linear(6, n).to(D) for n in (6, 1, 1))

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        replays.append(1)
        h = torch.tanh(shared(x))
        return head1(h), head2(h)

    x = torch.randn(4, 6, dtype=D)
    out1, out2 = lean(fn, x)  # type: ignore[arg-type,misc]
    torch.autograd.grad(out1.sum(), [head1.weight], retain_graph=True)  # head2's holders stay filled
    out2.sum().backward()
    assert len(replays) == 3  # the forward and one replay per backward


def test_errors_are_raised_after_the_replay_not_inside_the_function() -> None:
    calls = []

    def swallowing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        try:
            return torch.tanh(x if len(calls) == 1 else x[:2]).sum()
        except Exception:  # a model's own broad except must not hide a wrong recompute
            return x.sum()

    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(tuc.CheckpointError, match="different metadata"):
        lean(swallowing, x).backward()


@needs_lean
def test_an_input_changed_in_place_before_backward_raises() -> None:
    """torch's checkpoint refused it through its saved inputs; the lean one keeps no saved
    inputs, so the segment call checks their versions (NOTE [Segment inputs])."""
    model = autockpt.auto_checkpoint(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D), 2)
    x = torch.randn(4, 6, dtype=D)
    out = model(x)
    x.add_(1.0)  # the first Linear's recompute would read it
    with pytest.raises(autockpt.MutationError, match="an input tensor of checkpointed segment 0"):
        out.sum().backward()


def fallbacks() -> Iterator[tuple[str, object]]:
    yield "save_on_cpu", torch.autograd.graph.save_on_cpu()
    yield "device context", torch.device("cpu")
    yield "early stop switched off", tuc.set_checkpoint_early_stop(False)


@needs_lean
@pytest.mark.parametrize("name", [name for name, _ in fallbacks()])
def test_anything_unusual_goes_to_torchs_checkpoint(name: str) -> None:
    context = dict(fallbacks())[name]
    model = autockpt.auto_checkpoint(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(D), 2)
    with count_checkpoint_calls() as spy:
        step(model, torch.randn(4, 6, dtype=D))
        assert (spy.lean.call_count, spy.torch.call_count) == (1, 0)
        with context:  # type: ignore[attr-defined]
            assert not lean_applies("cpu")
            step(model, torch.randn(4, 6, dtype=D))
        assert (spy.lean.call_count, spy.torch.call_count) == (1, 1)


def test_the_pair_keeps_the_same_bytes_between_forward_and_backward() -> None:
    """What a checkpoint holds for backward: the input (and what torch keeps for its own
    bookkeeping, nothing with data); the lean one holds exactly what torch's does."""
    m, x = block(), torch.randn(256, 6, dtype=D, requires_grad=True)
    held = {}
    for name in ("torch", "lean", "unwrapped"):
        with autockpt.track_memory("cpu", allocator=False) as mem:
            out = RUNS[name](m, x)
        held[name] = mem.tensor_live_bytes
        out.sum().backward()
        del out
        x.grad = None
        m.zero_grad(set_to_none=True)
    assert held["lean"] == held["torch"] < held["unwrapped"]


def _cast_on_replay(calls: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(x if len(calls) == 1 else x.float()).sum()

    return fn


def _fewer_on_replay(calls: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return (torch.tanh(torch.tanh(x)) if len(calls) == 1 else torch.tanh(x) * 1.0).sum()

    return fn


@pytest.mark.parametrize("make", [_cast_on_replay, _fewer_on_replay], ids=["dtype", "count"])
@pytest.mark.parametrize("name", ["torch", "lean"])
def test_the_pair_raises_the_same_error_on_a_replay_that_differs(name: str, make: Callable) -> None:
    """A replay whose saved tensors differ in dtype (not only shape) or in number raises
    torch's CheckpointError from either checkpoint."""
    x = torch.randn(3, dtype=D, requires_grad=True)
    with pytest.raises(tuc.CheckpointError, match=r"different metadata|A different number of tensors"):
        RUNS[name](make([]), x).backward()
