"""autockpt.linear_cross_entropy: the loss and the input gradient bitwise those of
F.cross_entropy(F.linear(...)), the head's gradient within its reassociation bound, no logits
computed twice, and a fraction of the unchunked peak."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F  # noqa: N812
from torch.utils._python_dispatch import TorchDispatchMode

import autockpt
from autockpt.execution.linear_cross_entropy import ROW_MULTIPLE, chunk_bounds

BOUND = {torch.float64: 1e-12, torch.float32: 1e-5}  # relative, on the head's own gradient


def reference(h, w, t, b=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              softcap=None, divisor=None, logits_dtype=None):  # fmt: skip
    logits = F.linear(h, w, b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if logits_dtype is not None:
        logits = logits.to(logits_dtype)
    out = F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=ignore_index,
                          reduction=reduction, label_smoothing=label_smoothing)  # fmt: skip
    return out if divisor is None else out / divisor


def run(fn, h0, w0, b0, t, scale, **kw):
    """Loss and gradients of ``fn``, backward from ``loss * scale`` (a sum for 'none')."""
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    out = fn(h, w, t, b, **kw)
    (out.sum() if out.dim() else out if scale == 1.0 else out * scale).backward()
    return out.detach().reshape(-1), h.grad, w.grad, None if b is None else b.grad


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    return ((a - b).abs().max() / b.abs().max()).item()


def assert_exact(ours, ref, dtype):
    assert torch.equal(ours[0], ref[0]), "loss"
    assert torch.equal(ours[1], ref[1]), f"hidden gradient {(ours[1] - ref[1]).abs().max().item()}"
    for got, want in zip(ours[2:], ref[2:], strict=True):
        if want is not None:
            assert relative(got, want) <= BOUND[dtype]


@given(
    tokens=st.integers(1, 160),
    width=st.sampled_from([4, 8, 24]),
    classes=st.integers(2, 300),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    bias=st.booleans(),
    smoothing=st.sampled_from([0.0, 0.0, 0.1, 1.0]),
    softcap=st.sampled_from([None, None, 2.0]),
    reduction=st.sampled_from(["mean", "mean", "sum", "none"]),
    divisor=st.sampled_from([None, None, 7, 3.5]),
    scale=st.sampled_from([1.0, 1.0, 0.37]),
    chunks=st.sampled_from(["auto", 1, 2, 3, 7]),
    ignore_index=st.sampled_from([-100, 0]),
    ignored=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_bitwise_but_the_head(tokens, width, classes, dtype, bias, smoothing, softcap, reduction, divisor,
                              scale, chunks, ignore_index, ignored, seed):  # fmt: skip
    if reduction == "none":
        divisor = None
    g = torch.Generator().manual_seed(seed)
    h0 = torch.randn(tokens, width, generator=g, dtype=dtype)
    w0 = torch.randn(classes, width, generator=g, dtype=dtype) * 0.5
    b0 = torch.randn(classes, generator=g, dtype=dtype) if bias else None
    t = torch.randint(0, classes, (tokens,), generator=g)
    t[torch.rand(tokens, generator=g) < ignored] = ignore_index
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing, softcap=softcap,
              divisor=divisor)  # fmt: skip
    ref = run(reference, h0, w0, b0, t, scale, **kw)
    ours = run(autockpt.linear_cross_entropy, h0, w0, b0, t, scale, chunks=chunks, **kw)
    if torch.isnan(ref[0]).any():  # every token ignored, mean: 0/0 as in torch
        assert torch.isnan(ours[0]).all() == torch.isnan(ref[0]).all()
        return
    assert_exact(ours, ref, dtype)


@pytest.mark.parametrize("shape", [(2, 50), (3, 1, 37)])
def test_shapes_casts_and_non_contiguous_inputs(shape):
    """Batch dimensions, HF's logits.float() on float64, and a non-contiguous input with a
    bias (F.linear then takes matmul + add, not addmm)."""
    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(*shape, 16, dtype=torch.float64, generator=g).transpose(0, -2)
    w0, b0 = torch.randn(200, 16, dtype=torch.float64, generator=g), torch.randn(200, dtype=torch.float64)
    t = torch.randint(0, 200, h0.shape[:-1], generator=g)
    for dtype in (None, torch.float32):
        ref = run(reference, h0, w0, b0, t, 1.0, logits_dtype=dtype)
        ours = run(autockpt.linear_cross_entropy, h0, w0, b0, t, 1.0, logits_dtype=dtype, chunks=3)
        assert_exact(ours, ref, torch.float64)


def test_reduction_none_keeps_the_target_shape():
    h, w, t = torch.randn(2, 40, 8), torch.randn(30, 8), torch.randint(0, 30, (2, 40))
    out = autockpt.linear_cross_entropy(h, w, t, reduction="none", chunks=2)
    assert out.shape == (2, 40)
    assert torch.equal(out.reshape(-1), reference(h, w, t, reduction="none"))


def test_bf16_autocast_matches_the_unchunked_loss():
    g = torch.Generator().manual_seed(2)
    h0, w0 = torch.randn(96, 32, generator=g), torch.randn(500, 32, generator=g) * 0.1
    t = torch.randint(0, 500, (96,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run(reference, h0, w0, None, t, 1.0)
        ours = run(autockpt.linear_cross_entropy, h0, w0, None, t, 1.0, chunks=3)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert relative(ours[2], ref[2]) < 1e-2  # bf16 products, summed in float32 here


class Products(TorchDispatchMode):
    """Counts matrix products whose output is logits-shaped (``(rows, classes)``)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes, self.logits = classes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        product = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        if product and out.shape[-1] == self.classes:
            self.logits += 1
        return out


@pytest.mark.parametrize(("scale", "passes"), [(1.0, 1), (0.5, 2)])
def test_logits_computed_once_when_backward_starts_at_the_loss(scale, passes):
    """NOTE [Gradients in the forward]: loss.backward() computes no logits again; a loss
    scaled before backward does, once, for exactness."""
    h, w = torch.randn(64, 8, requires_grad=True), torch.randn(301, 8, requires_grad=True)
    t = torch.randint(0, 301, (64,))
    counter = Products(301)
    with counter:
        loss = autockpt.linear_cross_entropy(h, w, t, chunks=4)
        (loss * scale if scale != 1.0 else loss).backward()
    assert counter.logits == 4 * passes


def test_peak_is_a_fraction_of_the_whole_logits():
    """The tracker's peak over forward and backward: the unchunked loss holds logits,
    log-probabilities and their gradient (3 x 4 MiB here); 8 chunks hold two chunk-sized
    buffers, the head's gradient and the input's."""
    h, w = torch.randn(1024, 64, requires_grad=True), torch.randn(1000, 64, requires_grad=True)
    t = torch.randint(0, 1000, (1024,))
    logits = 1024 * 1000 * 4
    peaks = []
    for fn, kw in ((reference, {}), (autockpt.linear_cross_entropy, {"chunks": 8})):
        with autockpt.track_memory("cpu") as mem:
            fn(h, w, t, **kw).backward()
        peaks.append(mem.peak_bytes)
        h.grad = w.grad = None
    assert peaks[0] >= 3 * logits
    assert peaks[1] <= 2 * logits / 8 + w.numel() * 4 + h.numel() * 4 + 64 * 1024


def test_chunks_are_whole_blocks_of_rows():
    """NOTE [Chunks that change no bit]: every chunk but the last has a multiple of
    ROW_MULTIPLE rows; the last takes the rest; fewer chunks than asked when tokens are few."""
    for tokens, chunks in ((1000, 7), (2050, 10), (17, 4), (5, 3), (4096, "auto")):
        bounds = chunk_bounds(tokens, chunks, 256)
        assert bounds[0][0] == 0 and bounds[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
        assert all((hi - lo) % ROW_MULTIPLE == 0 and hi > lo for lo, hi in bounds[:-1])
        assert bounds[-1][1] - bounds[-1][0] >= min(tokens, ROW_MULTIPLE)
    assert len(chunk_bounds(1000, 7, 0)) == 7 and len(chunk_bounds(17, 4, 0)) == 1
    assert len(chunk_bounds(4096, "auto", 256)) == 16


def test_no_grad_and_double_backward():
    h, w, t = torch.randn(40, 8, requires_grad=True), torch.randn(30, 8), torch.randint(0, 30, (40,))
    with torch.no_grad():
        assert torch.equal(autockpt.linear_cross_entropy(h, w, t, chunks=2), reference(h, w, t))
    loss = autockpt.linear_cross_entropy(h, w, t, chunks=2)
    (grad,) = torch.autograd.grad(loss, h, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad|double backward"):
        grad.sum().backward()


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"target": torch.randint(0, 30, (41,))}, ValueError, "target \\(41,\\) must have hidden's shape"),
        ({"target": torch.rand(40)}, ValueError, "class indices"),
        ({"reduction": "batchmean"}, ValueError, "reduction='batchmean'"),
        ({"chunks": 0}, ValueError, "chunks=0"),
        ({"weight": torch.randn(30, 9)}, ValueError, "weight must be"),
        ({"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ({"target": torch.full((40,), 30)}, IndexError, "target 30 is out of range for 30 classes"),
    ],
)
def test_bad_input_names_the_value(kw, error, match):
    args = {"hidden": torch.randn(40, 8), "weight": torch.randn(30, 8), "target": torch.randint(0, 30, (40,))}
    args.update({k: v for k, v in kw.items() if k in args})
    options = {k: v for k, v in kw.items() if k not in args}
    with pytest.raises(error, match=match):
        autockpt.linear_cross_entropy(args["hidden"], args["weight"], args["target"], **options)
