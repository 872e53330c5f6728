"""CUDA: allocator statistics and events in ``track_memory`` and ``profile``, budgets and
exact gradients on a GPU. Skipped without one, except the window arithmetic, which runs
everywhere against a fake allocator. ``.ci/gpu`` runs this file and the CUDA benchmark."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autockpt
from autockpt.measure.memory import Windows

MiB = 2**20
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeAllocator:
    """The CUDA caching allocator's memory history, driven by hand; resetting statistics fails."""

    def __init__(self) -> None:
        self.trace: list[dict[str, object]] = []
        self.recording = False
        self.next_addr = 1 << 20

    def alloc(self, n: int) -> int:
        addr, self.next_addr = self.next_addr, self.next_addr + n
        if self.recording:
            self.trace.append({"action": "alloc", "addr": addr, "size": n})
        return addr

    def free(self, addr: int, n: int) -> None:
        if self.recording:
            self.trace.append({"action": "free_requested", "addr": addr, "size": n})
            self.trace.append({"action": "free_completed", "addr": addr, "size": n})

    def _record(self, enabled: str | None = "all", **kwargs: object) -> None:
        self.recording = enabled is not None

    def _mark(self) -> int:
        return self.alloc(512)  # a live marker: never freed inside the session

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from autockpt.measure import allocator

        def refuse(*args: object) -> None:
            raise AssertionError("the caller's peak statistics must not be reset")

        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", refuse)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.recording, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self._record)
        monkeypatch.setattr(
            torch.cuda.memory, "_snapshot", lambda device=None: {"device_traces": [self.trace]}
        )
        monkeypatch.setattr(allocator._CudaRecorder, "_mark_allocation", self._mark)
        monkeypatch.setattr(allocator, "_RECORDERS", {})
        monkeypatch.setattr(allocator._CudaRecorder, "open_sessions", 0)
        monkeypatch.setattr(allocator._CudaRecorder, "owns_history", False)


def test_cuda_windows_report_peak_and_net_above_each_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    fake.alloc(100)  # parameters: before any window
    with Windows(torch.device("cuda", 0)) as windows:
        windows.mark()
        a, b = fake.alloc(50), fake.alloc(30)
        fake.free(a, 50)
        windows.mark()  # window 1: peak 80, net 30
        fake.free(b, 30)
        windows.mark()  # window 2: peak 0, net -30
        c = fake.alloc(10)
        fake.free(c, 10)
        windows.mark()  # window 3: peak 10, net 0
    assert windows.result == [(0, 0), (80, 30), (0, -30), (10, 0)]
    assert not fake.recording  # switched off again: we switched it on


def test_a_marker_is_told_from_an_earlier_block_at_the_same_address() -> None:
    from autockpt.measure.allocator import MARK, cuda_deltas

    entries = [
        {"action": "alloc", "addr": 7, "size": 512},  # an ordinary small block...
        {"action": "free_requested", "addr": 7, "size": 512},
        {"action": "free_completed", "addr": 7, "size": 512},
        {"action": "alloc", "addr": 7, "size": 512},  # ...whose address the marker then takes
        {"action": "alloc", "addr": 9, "size": 4096},
        {"action": "free_requested", "addr": 9, "size": 4096},
    ]
    assert cuda_deltas(entries, {7}) == [512, -512, MARK, 4096, -4096]


def test_cuda_track_memory_nests_and_keeps_the_callers_history(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator()
    fake.install(monkeypatch)
    with autockpt.track_memory("cuda:0", tensors=False) as outer:
        a = fake.alloc(100)
        with autockpt.track_memory("cuda:0", tensors=False) as inner:
            b = fake.alloc(300)
            fake.free(b, 300)
        fake.free(a, 100)
    assert (inner.peak_bytes, inner.allocated_bytes) == (300, 0)
    assert (outer.peak_bytes, outer.allocated_bytes) == (400, 0)
    fake.recording = True  # the caller records history for the memory viewer: it stays on
    with autockpt.track_memory("cuda:0", tensors=False) as mem:
        fake.alloc(64)
    assert mem.peak_bytes == 64 and fake.recording


def chain(width: int = 512, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@gpu
def test_track_memory_on_cuda_counts_the_allocator() -> None:
    torch.cuda.synchronize()
    with autockpt.track_memory("cuda") as mem:
        x = torch.empty(4 * MiB // 4, device="cuda")
        y = x * 2
        del x, y
    assert mem.peak_bytes == 8 * MiB and mem.allocated_bytes == 0
    assert mem.tensor_peak_bytes == 8 * MiB


@gpu
def test_cuda_profile_bytes_equal_the_cpu_ones() -> None:
    x = torch.randn(1024, 512)
    cpu = autockpt.profile(chain(), (x,))
    cuda = autockpt.profile(chain().cuda(), (x.cuda(),))
    for a, b in zip(cpu.costs, cuda.costs):
        assert (a.in_bytes, a.out_bytes, a.kept_bytes, a.keeps_input, a.keeps_output) == (
            b.in_bytes, b.out_bytes, b.kept_bytes, b.keeps_input, b.keeps_output,
        )  # fmt: skip
        assert b.fwd_ms > 0 and b.bwd_ms > 0  # CUDA events, not host time


@gpu
@pytest.mark.parametrize("fraction", [1.0, 0.6, 0.4])
def test_cuda_budget_prediction_matches_the_allocator(fraction: float) -> None:
    x = torch.randn(4096, 512, device="cuda")
    model = chain(depth=16).cuda()
    plan = autockpt.make_plan(model, budget=fraction, example_inputs=(x,), loss_fn=square_mean)
    autockpt.auto_checkpoint(model, plan)
    from autockpt.measure.step import measure_step

    measured = measure_step(model, (x,), None, square_mean)
    assert plan.predicted_peak_bytes is not None and plan.budget_bytes is not None
    assert abs(measured - plan.predicted_peak_bytes) <= 0.10 * measured, (measured, plan.predicted_peak_bytes)
    assert measured <= 1.05 * plan.budget_bytes


@gpu
def test_cuda_gradients_and_dropout_masks_are_exact() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.Dropout(0.2), nn.GELU())])
    model = model.cuda().double()
    report = autockpt.verify(model, (torch.randn(64, 256, device="cuda", dtype=torch.float64),), segments=3)
    assert report.ok, str(report)


@gpu
def test_nin_on_cuda_trains_like_the_unwrapped_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    x = torch.randn(32, 3, 32, 32, device="cuda")
    model = autockpt.models.NiN(10).cuda()
    report = autockpt.verify(model, (x,), segments="sqrt", atol=1e-5, rtol=1e-4)
    assert report.ok, str(report)
    assert report.peak_bytes_checkpointed < report.peak_bytes_unwrapped


@gpu
def test_cuda_windows_nest_and_leave_the_callers_peak_alone() -> None:
    torch.cuda.synchronize()
    big = torch.empty(64 * MiB // 4, device="cuda")
    del big
    users_peak = torch.cuda.max_memory_allocated()
    with autockpt.track_memory("cuda", tensors=False) as outer:
        a = torch.empty(4 * MiB // 4, device="cuda")
        with autockpt.track_memory("cuda", tensors=False) as inner:
            b = torch.empty(2 * MiB // 4, device="cuda")
            del b
        del a
    assert (inner.peak_bytes, outer.peak_bytes) == (2 * MiB, 6 * MiB)
    assert torch.cuda.max_memory_allocated() == users_peak
    assert not torch._C._cuda_isHistoryEnabled()


class ToGpu(nn.Module):
    """A segment handed CPU tensors that computes on the GPU (offloaded inputs, accelerate's hooks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cuda()


@gpu
@pytest.mark.parametrize("autocast_in", ["forward", "backward"])
def test_cpu_inputs_replay_under_the_forwards_cuda_autocast(autocast_in: str) -> None:
    """The lean checkpoint records CUDA autocast whatever the inputs' device, as torch's does
    (NOTE [Lean checkpoint]; found in review): its replay must save what the forward saved."""
    torch.manual_seed(0)
    body = nn.Sequential(ToGpu(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU()).cuda()
    ref = copy.deepcopy(body)
    model = autockpt.auto_checkpoint(body, 2)
    x = torch.randn(8, 64)
    grads = []
    for m in (ref, model):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_in == "forward"):
            loss = m(x).float().square().mean()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_in == "backward"):
            loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_loss_on_cuda_is_bitwise_but_the_head(dtype: torch.dtype) -> None:
    """NOTE [Chunks that change no bit] rests on matrix products whose rows do not depend
    on the row count; this decides whether cuBLAS keeps that (a split-K kernel for a short
    chunk would not)."""
    from torch.nn import functional as F  # noqa: N812

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(2, 1000, 256, device="cuda", dtype=dtype, generator=g)
    weight = torch.randn(50257, 256, device="cuda", dtype=dtype, generator=g) * 0.02
    target = torch.randint(0, 50257, (2, 1000), device="cuda", generator=g)
    target[:, :100] = -100
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunked:
            loss = autockpt.linear_cross_entropy(h, w, target, chunks=8)
        else:
            loss = F.cross_entropy(F.linear(h, w).reshape(-1, 50257), target.reshape(-1))
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    (loss0, h0, w0), (loss1, h1, w1) = results
    assert torch.equal(loss1, loss0)
    assert torch.equal(h1, h0), f"hidden gradient differs by {(h1 - h0).abs().max().item():.3e}"
    assert ((w1 - w0).abs().max() / w0.abs().max()).item() < (1e-12 if dtype == torch.float64 else 1e-5)


def dropouts() -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.2)) for _ in range(6)])


@gpu
@pytest.mark.parametrize("case", ["dropout", "autocast", "backward twice", "input only"])
def test_lean_checkpoint_on_cuda_equals_torchs(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Lean on CUDA, once compared]: segments on CUDA through the lean checkpoint give
    bitwise torch's checkpoint's gradients. When this passes on a GPU, "cuda" may join
    LEAN_DEVICES in execution/lean_checkpoint.py."""
    from autockpt.execution import lean_checkpoint

    results = []
    for devices in (("cpu",), ("cpu", "cuda")):
        monkeypatch.setattr(lean_checkpoint, "LEAN_DEVICES", devices)
        torch.manual_seed(0)
        model = autockpt.auto_checkpoint(dropouts().cuda(), 3)
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        torch.manual_seed(1)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case == "autocast"):
            loss = model(x).float().square().mean()
        if case == "backward twice":
            loss.backward(retain_graph=True)
            loss.backward()
        elif case == "input only":
            (x.grad,) = torch.autograd.grad(loss, [x])
        else:
            loss.backward()
        results.append([x.grad, *(p.grad for p in model.parameters() if p.grad is not None)])
        results[-1].append(torch.cuda.get_rng_state())
    assert len(results[0]) == len(results[1])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
