"""The loss of a linear head and cross-entropy, in token chunks, without the whole logits.

NOTE [Chunks that change no bit]
    ``F.cross_entropy(F.linear(h, W, b), t)`` holds logits, log-probabilities and their
    gradient for every token: three ``tokens x vocabulary`` tensors, the peak of most
    language models. Every one of those rows depends on its own token only, so the loss
    can run over chunks of tokens, each chunk's rows computed by the same kernels on the
    same values. Two things make that exact rather than close:

    - The per-token gradients of the reduction do not depend on the logits: the mean's
      ``-(g / n)`` at each target, label smoothing's share, a divisor. So the reduction is
      built once with torch's own ops (``_reduction_graph``) on placeholders, and its
      backward gives each token's gradient before any chunk runs; each chunk then runs its
      head and log-softmax, takes that gradient through autograd at once, and is freed.
      The loss value is the same reduction over the gathered per-token figures (``N``
      floats), so it is bitwise the unchunked loss's too.
    - Matrix products must not depend on how many rows they get. On CPU (oneDNN/MKL,
      float32 and float64) a row of a product is bitwise the same for any block of at
      least 16 rows, but not for smaller blocks or their edge rows (measured with 2 to 11
      rows). So chunks have a multiple of ``ROW_MULTIPLE`` rows and the last one takes the
      rest. On CUDA, cuBLAS may pick a split-K kernel for a short chunk: not yet measured.

    What changes is the head's own weight (and bias) gradient: a sum over tokens, summed
    chunk by chunk (``W.grad = sum_c g_c^T h_c``), so reassociated. Float64: relative
    difference below 1e-12 (``tests/test_linear_cross_entropy.py``).

NOTE [Gradients in the forward]
    Since each token's gradient is known before the chunk runs, the chunk's gradients are
    computed in the forward, for an incoming gradient of exactly 1 (``loss.backward()``),
    and kept (``hidden``-sized, plus the head's gradient); the backward hands them over.
    No logits are computed twice. When the incoming gradient is anything else (a loss
    scaled before ``backward``, ``reduction="none"``), multiplying afterwards would round
    differently, so the backward runs the chunks again with the real gradient: exact,
    at twice the head's time.

NOTE [Two chunk-sized buffers]
    A chunk holds its head output until the log-softmax has read it, then the
    log-probabilities and the gradient arriving at them (zeros but at the targets). The
    log-softmax's backward kernel (``_log_softmax_backward_data``, what autograd's
    ``LogSoftmaxBackward0`` calls) writes its result over that gradient: per row it sums
    the gradient, then writes each element from the same element, so the values are the
    kernel's own (the bitwise tests would catch a kernel that did otherwise). Two
    logits-sized buffers per chunk, then, where autograd would hold four. With soft-capping
    or a cast between head and log-softmax, the head output also lives on to backward.

NOTE [The chunked loss under torch.compile]
    The loss is a Python loop over chunks whose rows, target checks and in-forward
    gradients depend on the data (``nonzero`` over the kept targets, ``.item()`` for an
    error's message, leaves created with ``requires_grad``): traced by dynamo, a GPT-2 with
    the chunked head compiled to 7 graphs with 15 breaks. So the whole loss runs as Python
    (``outside_compiled_graphs``): one break where it is called, the model's body compiled
    before it, and the loss exact as in eager, with the kernels named above.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from autockpt.execution.outside_graphs import outside_compiled_graphs

__all__ = ["ROW_MULTIPLE", "auto_rows", "chunk_bounds", "linear_cross_entropy"]

ROW_MULTIPLE = 16  # rows per chunk are a multiple of this (NOTE [Chunks that change no bit])
_REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class _Loss:
    """Everything about the loss that is not a differentiable tensor."""

    ignore_index: int
    reduction: str
    label_smoothing: float
    softcap: float | None
    logits_dtype: torch.dtype | None
    divisor: torch.Tensor | float | int | None
    fused_bias: bool  # F.linear would use addmm (2-D or contiguous input), not matmul + add
    bounds: tuple[tuple[int, int], ...]
    n_classes: int
    ce_dtype: torch.dtype  # what F.cross_entropy computes in here (autocast's cast included)

    @property
    def column(self) -> int:
        """The class index that stands for "the target" in ``_reduce``'s two-column input."""
        return 1 if self.ignore_index == 0 else 0


@outside_compiled_graphs  # NOTE [The chunked loss under torch.compile]
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunks: int | str = "auto",
    divisor: torch.Tensor | float | int | None = None,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of a linear head over the last dimension, without the whole logits.

    The result and gradients are those of::

        logits = F.linear(hidden, weight, bias)
        if softcap is not None:                      # Gemma 2's final logit soft-capping
            logits = torch.tanh(logits / softcap) * softcap
        if logits_dtype is not None:                 # Hugging Face's logits.float()
            logits = logits.to(logits_dtype)
        loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), ignore_index=...,
                               reduction=..., label_smoothing=...)
        if divisor is not None:                      # num_items_in_batch
            loss = loss / divisor

    computed over chunks of tokens, so only one chunk's logits exist at a time. The loss
    and the gradient of ``hidden`` (and so of every parameter before the head) are bitwise
    those of the code above; the gradients of ``weight`` and ``bias`` are summed chunk by
    chunk, so they differ by the order of that sum (NOTE [Chunks that change no bit]).
    Each chunk's gradients are computed in the forward when the loss is what
    ``backward()`` starts from (NOTE [Gradients in the forward]), so no logits are
    computed twice.

    Args:
        hidden: ``(..., D)`` inputs of the head.
        weight: ``(V, D)`` head weight.
        target: class indices, ``hidden``'s shape without its last dimension.
        bias: ``(V,)`` head bias, or ``None``.
        ignore_index, reduction, label_smoothing: as for ``F.cross_entropy``.
        softcap: cap logits to ``(-softcap, softcap)`` with ``tanh`` first.
        chunks: ``"auto"`` (chunks whose logits take about the weight's bytes) or the number of
            chunks. Chunks have a multiple of 16 tokens; the last takes the rest.
        divisor: divide the reduced loss by this (Hugging Face's ``num_items_in_batch``
            with ``reduction="sum"``).
        logits_dtype: cast the logits to this dtype before the loss.

    Raises:
        ValueError: shapes, dtypes or options that the code above would reject, or that it
            does not cover (class-probability targets).
        IndexError: a target out of range that is not ``ignore_index``.
    """
    n_classes = _check(hidden, weight, target, bias, reduction, label_smoothing, softcap, chunks)
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = target.reshape(-1)
    _check_targets(labels, ignore_index, n_classes)
    ce_dtype = _ce_dtype(flat, weight, logits_dtype)
    loss = _Loss(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        softcap=softcap,
        logits_dtype=logits_dtype,
        divisor=divisor,
        fused_bias=hidden.dim() <= 2 or hidden.is_contiguous(),
        bounds=chunk_bounds(flat.shape[0], chunks, auto_rows(weight, ce_dtype)),
        n_classes=n_classes,
        ce_dtype=ce_dtype,
    )
    out: torch.Tensor = _ChunkedLoss.apply(flat, weight, bias, labels, loss)
    return out.reshape(target.shape) if reduction == "none" else out


def chunk_bounds(tokens: int, chunks: int | str, rows: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of the chunks: ``chunks`` of them (``"auto"``: as many as make chunks of
    about ``rows`` rows), as even as can be with whole blocks of ``ROW_MULTIPLE`` rows, the
    last one taking the rest; fewer when there are not enough blocks
    (NOTE [Chunks that change no bit])."""
    blocks = max(1, tokens // ROW_MULTIPLE)
    wanted = -(-tokens // max(rows, 1)) if chunks == "auto" else int(chunks)
    count = max(1, min(wanted, blocks))
    ends = [ROW_MULTIPLE * (blocks * (i + 1) // count) for i in range(count)]
    ends[-1] = tokens
    return tuple(zip([0, *ends[:-1]], ends, strict=True))


def auto_rows(weight: torch.Tensor, ce_dtype: torch.dtype) -> int:
    """``chunks="auto"``: rows per chunk such that a chunk's logits take about the head
    weight's bytes, so that its two logits-sized buffers (NOTE [Two chunk-sized buffers])
    and the head's gradient hold about three times the weight. Smaller chunks cost time:
    every chunk reads the whole weight twice and adds into its whole gradient once
    (``docs/head.md`` has the measured trade-off)."""
    per_row = weight.shape[0] * torch.finfo(ce_dtype).bits // 8
    return max(ROW_MULTIPLE, weight.numel() * weight.element_size() // per_row)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        loss: _Loss,
    ) -> torch.Tensor:
        need = tuple(ctx.needs_input_grad[:3])
        ctx.loss, ctx.need = loss, need
        ctx.early = any(need) and loss.reduction != "none"  # NOTE [Gradients in the forward]
        token_grads = _token_grads(target, loss, hidden.device, None) if ctx.early else None
        asked = need if ctx.early else None
        run = _run_chunks(hidden, weight, bias, target, loss, token_grads, asked)
        if any(need):
            ctx.save_for_backward(hidden, weight, bias, target, *run.grads)
        return _reduce(run.picked, run.row_sums, target, loss)

    @staticmethod
    @torch.autograd.function.once_differentiable  # type: ignore[misc]
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, target, *grads = ctx.saved_tensors
        if not (ctx.early and bool((grad == 1).all())):
            token_grads = _token_grads(target, ctx.loss, hidden.device, grad)
            grads = _run_chunks(hidden, weight, bias, target, ctx.loss, token_grads, ctx.need).grads
        return (*(g if need else None for g, need in zip(grads, ctx.need, strict=True)), None, None)


@dataclasses.dataclass
class _Run:
    """What one pass over the chunks gives: per-token figures and gradients."""

    picked: torch.Tensor  # (N, 2): each token's log-probability of its target, in loss.column
    row_sums: torch.Tensor | None  # (N,): each token's sum of log-probabilities (label smoothing)
    grads: list[torch.Tensor]  # hidden's, weight's and bias's gradient (empty where not asked)


def _run_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    loss: _Loss,
    token_grads: tuple[torch.Tensor, torch.Tensor | None] | None,
    need: tuple[bool, ...] | None,
) -> _Run:
    """One pass over the chunks: each chunk's head and log-softmax, its per-token figures
    and, for the per-token gradients ``token_grads``, the gradients ``need`` asks for."""
    n = hidden.shape[0]
    safe = _safe_target(target, loss.ignore_index)
    ce_dtype = loss.ce_dtype
    run = _Run(hidden.new_zeros((n, 2), dtype=ce_dtype), None, [])
    if loss.label_smoothing > 0:
        run.row_sums = hidden.new_empty(n, dtype=ce_dtype)
    col = loss.column
    need_h, need_w, need_b = need if token_grads is not None and need is not None else (False, False, False)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w: torch.Tensor | None = None
    grad_b: torch.Tensor | None = None
    w, b = weight.detach(), None if bias is None else bias.detach()
    for lo, hi in loss.bounds:
        rows = hidden[lo:hi].detach()
        with torch.no_grad():
            out = _linear(rows, w, b, loss)
        chained = loss.softcap is not None or ce_dtype != out.dtype
        with torch.set_grad_enabled(chained and (need_h or need_w or need_b)):
            leaf = out.requires_grad_(torch.is_grad_enabled())
            logits = _capped_and_cast(leaf, loss)
        with torch.no_grad(), torch.autocast(out.device.type, enabled=False):  # as inside cross-entropy
            logp = torch.log_softmax(logits, 1)
            run.picked[lo:hi, col : col + 1] = logp.gather(1, safe[lo:hi, None])
            if run.row_sums is not None:
                run.row_sums[lo:hi] = logp.sum(1)
        if not chained:
            del out, leaf, logits  # nothing needs the head's output again (NOTE [Two chunk-sized buffers])
        if token_grads is None or not (need_h or need_w or need_b):
            continue
        with torch.no_grad():
            grad = torch.zeros_like(logp).scatter_(1, safe[lo:hi, None], token_grads[0][lo:hi, col : col + 1])
            if token_grads[1] is not None:
                grad.add_(token_grads[1][lo:hi, None])
            torch.ops.aten._log_softmax_backward_data.out(grad, logp, 1, logp.dtype, out=grad)
            del logp
        if chained:  # back through the cast and soft-capping
            (grad,) = torch.autograd.grad(logits, leaf, grad)
            del out, leaf, logits
        # the head's own backward, as autograd's mm/addmm backward computes it
        with torch.no_grad():
            if grad_h is not None:
                grad_h[lo:hi] = grad.mm(w.to(grad.dtype))  # .to: autocast's cast, or nothing
            if need_w:
                used = rows.to(grad.dtype)
                if grad_w is None:
                    grad_w = grad.t().mm(used).to(_accumulator(weight))
                elif grad_w.dtype == grad.dtype:
                    grad_w.addmm_(grad.t(), used)
                else:  # 16-bit products summed in float32
                    grad_w.add_(grad.t().mm(used))
            if need_b:
                part = grad.sum(0)
                grad_b = part.to(_accumulator(weight)) if grad_b is None else grad_b.add_(part)
        del grad
    empty = hidden.new_empty(0)
    run.grads = [
        empty if grad_h is None else grad_h,
        empty if grad_w is None else grad_w.to(weight.dtype),
        empty if grad_b is None or bias is None else grad_b.to(bias.dtype),
    ]
    return run


def _accumulator(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's gradient is summed in over chunks: float32 for 16-bit weights."""
    return torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype


def _linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, loss: _Loss) -> torch.Tensor:
    """One chunk's head output, by the kernel ``F.linear`` picks for the whole input."""
    if bias is None or loss.fused_bias:
        return F.linear(rows, weight, bias)
    return torch.matmul(rows, weight.t()) + bias  # F.linear on a non-contiguous input of 3+ dimensions


def _capped_and_cast(out: torch.Tensor, loss: _Loss) -> torch.Tensor:
    """Soft-capping, the logits' cast and the cast ``F.cross_entropy`` makes under autocast:
    what stands between the head and the log-softmax (``out`` itself when nothing does)."""
    logits = out
    if loss.softcap is not None:
        logits = torch.tanh(logits / loss.softcap) * loss.softcap
    if loss.logits_dtype is not None:
        logits = logits.to(loss.logits_dtype)
    return logits.to(loss.ce_dtype)


def _token_grads(
    target: torch.Tensor, loss: _Loss, device: torch.device, grad: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's gradient at its picked log-probability and at its row sum, for the
    incoming gradient ``grad`` (1 when ``None``): the reduction's backward, run on
    placeholders, since none of it depends on the logits (NOTE [Chunks that change no bit])."""
    n = target.shape[0]
    with torch.enable_grad():
        picked = torch.zeros((n, 2), dtype=loss.ce_dtype, device=device, requires_grad=True)
        row_sums = None
        if loss.label_smoothing > 0:
            row_sums = torch.zeros(n, dtype=loss.ce_dtype, device=device, requires_grad=True)
        out = _reduce(picked, row_sums, target, loss)
        leaves = [picked] if row_sums is None else [picked, row_sums]
        got = torch.autograd.grad(out, leaves, torch.ones_like(out) if grad is None else grad)
    return got[0], (got[1] if row_sums is not None else None)


def _reduce(
    picked: torch.Tensor,
    row_sums: torch.Tensor | None,
    target: torch.Tensor,
    loss: _Loss,
) -> torch.Tensor:
    """The loss from the per-token figures, by the ops ``F.cross_entropy`` runs after its
    log-softmax (its label-smoothing branch included), then the divisor."""
    ignored = target == loss.ignore_index
    classes = torch.where(ignored, loss.ignore_index, loss.column)
    with torch.autocast(picked.device.type, enabled=False):
        out = F.nll_loss(picked, classes, ignore_index=loss.ignore_index, reduction=loss.reduction)
        if row_sums is not None:
            smooth = (-row_sums).masked_fill(ignored, 0.0)
            if loss.reduction == "mean":
                smooth = smooth.sum() / (~ignored).sum()
            elif loss.reduction == "sum":
                smooth = smooth.sum()
            eps = loss.label_smoothing
            out = (1 - eps) * out + smooth * (eps / loss.n_classes)
    if loss.divisor is not None:
        divisor = loss.divisor
        if isinstance(divisor, torch.Tensor):
            divisor = divisor.to(out.device)
        out = out / divisor
    return out


def _safe_target(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Targets with ignored tokens pointing at class 0, for gathers and scatters (their
    figures are never read: ``nll_loss`` skips them, their gradients are 0)."""
    return target.masked_fill(target == ignore_index, 0)


@functools.lru_cache(maxsize=64)
def _ce_dtype_for(device: str, dtype: torch.dtype, cast_to: torch.dtype) -> torch.dtype:
    """What ``F.cross_entropy`` under autocast (to ``cast_to``, the cache's key) makes of ``dtype``."""
    with torch.no_grad():
        logits = torch.zeros((1, 2), dtype=dtype, device=device)
        return F.cross_entropy(logits, torch.zeros(1, dtype=torch.long, device=device)).dtype


def _ce_dtype(hidden: torch.Tensor, weight: torch.Tensor, logits_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``F.cross_entropy`` computes in for these logits here: theirs, or what
    autocast casts them to (it casts the loss's input, not the log-softmax inside it)."""
    device = hidden.device.type
    with torch.no_grad():
        dtype = logits_dtype or F.linear(hidden[:0], weight[:0]).dtype
    if not torch.is_autocast_enabled(device):
        return dtype
    return _ce_dtype_for(str(hidden.device), dtype, torch.get_autocast_dtype(device))


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    chunks: int | str,
) -> int:
    """Reject what the unchunked code would reject, naming the value; the class count."""
    where = "autockpt.linear_cross_entropy"
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{where}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not make a linear "
            "head; weight must be (vocabulary, hidden[-1])."
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{where}: bias {tuple(bias.shape)} must be ({weight.shape[0]},), one per class.")
    if target.is_floating_point() or target.is_complex():
        raise ValueError(
            f"{where}: target has dtype {target.dtype}; only class indices (an integer tensor) are "
            "supported, not class probabilities. Use F.cross_entropy for soft targets."
        )
    if target.dtype not in (torch.long, torch.uint8):  # as nll_loss: Long or Byte
        raise ValueError(f"{where}: target has dtype {target.dtype}; class indices are torch.long or uint8.")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: target {tuple(target.shape)} must have hidden's shape without its last dimension, "
            f"{tuple(hidden.shape[:-1])}: one class index per token."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{where}: reduction={reduction!r}; use one of {_REDUCTIONS}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{where}: label_smoothing={label_smoothing!r} must be in [0, 1].")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{where}: softcap={softcap!r} must be a positive number or None.")
    if chunks != "auto" and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"{where}: chunks={chunks!r}; use 'auto' or a number of chunks >= 1.")
    return int(weight.shape[0])


def _check_targets(target: torch.Tensor, ignore_index: int, n_classes: int) -> None:
    """Targets out of range raise, as ``F.cross_entropy`` does (one device sync)."""
    kept = target[target != ignore_index]
    if kept.numel() and bool(((kept < 0) | (kept >= n_classes)).any()):
        bad = kept[(kept < 0) | (kept >= n_classes)][0].item()
        raise IndexError(
            f"autockpt.linear_cross_entropy: target {bad} is out of range for {n_classes} classes "
            f"(and is not ignore_index={ignore_index})."
        )
