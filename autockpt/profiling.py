"""``profile``: what each stage of a model costs in one training step.

Each stage runs alone, on the input the stages before it produce, with that input made to
require gradients. Bytes are allocator-level (``track_memory``), so op workspaces such as
oneDNN's reorder buffers are in them; they are exact for a given input, while times are
medians of repeats and stay noisy. The run is invisible like the dry run: buffers, RNG and
``.grad`` are put back.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from autockpt.losses import LossFn, step_loss
from autockpt.memory import _CpuAllocatorEvents, _StorageTracker, mark
from autockpt.plan import format_bytes
from autockpt.planners.budget import StageCost
from autockpt.runtime import dry_run_state
from autockpt.walk import Chain, Stage

__all__ = ["Profile", "measure_loss", "profile", "profile_chain"]


@dataclass(frozen=True)
class Profile:
    """Per-stage costs of a model for one input.

    Attributes:
        walker: the walker that found the stages.
        stage_names: one name per stage.
        costs: one :class:`~autockpt.planners.budget.StageCost` per stage.
        static_bytes: parameters, buffers and inputs: memory a step needs before it starts.
        device: where it was measured.
        loss_bytes: what the loss needs on top of the model's output, from its forward
            through its backward down to the output's gradient (that gradient included):
            measured for the ``loss_fn`` given, or for :func:`~autockpt.losses.default_loss`.
            ``None`` when not measured; planners then assume two tensors the size of the
            output.
    """

    walker: str
    stage_names: tuple[str, ...]
    costs: tuple[StageCost, ...]
    static_bytes: int
    device: str
    loss_bytes: int | None = None

    def to_json(self) -> str:
        """The profile as JSON."""
        return json.dumps(
            {
                "walker": self.walker,
                "device": self.device,
                "static_bytes": self.static_bytes,
                "loss_bytes": self.loss_bytes,
                "stages": [{"name": n, **c.to_dict()} for n, c in zip(self.stage_names, self.costs)],
            },
            indent=2,
        )

    def __str__(self) -> str:
        head = ("stage", "fwd ms", "bwd ms", "input", "kept", "fwd peak", "bwd peak", "param grads")
        rows = [head]
        for name, c in zip(self.stage_names, self.costs):
            rows.append(
                (
                    name,
                    f"{c.fwd_ms:.2f}",
                    f"{c.bwd_ms:.2f}",
                    format_bytes(c.in_bytes),
                    format_bytes(c.kept_bytes),
                    format_bytes(c.fwd_peak_bytes),
                    format_bytes(c.bwd_peak_bytes),
                    format_bytes(c.grad_bytes),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = [
            f"autockpt profile: walker={self.walker!r}, device={self.device}, {len(self.costs)} stages, "
            f"parameters+buffers+inputs {format_bytes(self.static_bytes)}"
            + (
                f", loss {format_bytes(self.loss_bytes)} above the output"
                if self.loss_bytes is not None
                else ""
            )
        ]
        lines += [
            "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
            for r in rows
        ]
        return "\n".join(lines)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _storage_bytes(tensors: Sequence[torch.Tensor], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(n for k, n in seen.items() if k not in exclude)


def _grad_input(x: Any) -> Any:
    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.numel():
            return t.detach().clone().requires_grad_()
        return t.detach()

    return tree_map_only(torch.Tensor, make, x)


def _measure(stage: Stage, x: Any, device: torch.device, repeats: int) -> tuple[StageCost, Any]:
    params = list({id(p): p for u in stage.units for m in u.modules for p in m.parameters()}.values())
    params = [p for p in params if p.requires_grad]
    if device.type == "meta":
        fwd_ms, bwd_ms = _nominal_times(stage, x, params)
    else:
        fwd_ms, bwd_ms = _times(stage, x, params, repeats, device)  # also warms up
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with _Windows(device) as windows:
        inputs = _grad_input(x)
        in_tensors = _tensors(inputs)
        in_keys = {t.untyped_storage()._cdata for t in in_tensors}
        windows.mark()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = stage(inputs)
        windows.mark()
        out_tensors = [t for t in _tensors(out) if t.untyped_storage()._cdata not in in_keys]
        out_bytes = _storage_bytes(out_tensors)
        keeps_input = any(k in saved for k in in_keys)
        keeps_output = any(t.untyped_storage()._cdata in saved for t in out_tensors)
        grad_outs = [t for t in _tensors(out) if t.requires_grad]
        # The loss makes the output gradient inside the measured backward, and no Python
        # reference keeps the output alive, so the output and its gradient are freed as in a
        # real step; the gradient's size is then taken off the peak (the model adds it).
        loss, seeds = _seeded_loss(grad_outs, device)
        next_value = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out)
        leaves = [t for t in in_tensors if t.requires_grad]
        del out, grad_outs, out_tensors
        for p in params:
            p.grad = None
        windows.mark()
        if loss.requires_grad:
            loss.backward(inputs=[*leaves, *params] or None)
        windows.mark()
        del loss, seeds  # the seeds lived through the backward: a real step frees no such thing
    (fwd_peak, fwd_net), (bwd_peak, _) = windows.result[1], windows.result[3]
    grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
    for p in params:
        p.grad = None
    cost = StageCost(
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        in_bytes=_storage_bytes(in_tensors),
        out_bytes=out_bytes,
        kept_bytes=max(0, fwd_net - out_bytes),
        keeps_input=keeps_input,
        keeps_output=keeps_output,
        fwd_peak_bytes=fwd_peak,
        bwd_peak_bytes=max(0, bwd_peak - out_bytes),
        grad_bytes=grad_bytes,
    )
    return cost, next_value


def _seeded_loss(outs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A scalar whose backward sends ones into every output, and the ones (keep them alive)."""
    total, seeds = torch.zeros((), device=device), []
    while outs:
        t = outs.pop()
        seeds.append(torch.ones_like(t))
        total = total + (t * seeds[-1]).sum()
    return total, seeds


class _Windows:
    """(peak, net) bytes between marks: one CPU profiler session, CUDA allocator stats, or,
    on the meta device, the storages of tensors created (nothing is allocated there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.session = _CpuAllocatorEvents() if device.type == "cpu" else None
        self.tensors = _StorageTracker("meta") if device.type == "meta" else None
        self.result: list[tuple[int, int]] = []
        self._base = 0

    def __enter__(self) -> _Windows:
        if self.session is not None:
            self.session.start()
        if self.tensors is not None:
            self.tensors.__enter__()
        return self

    def mark(self) -> None:
        if self.session is not None:
            mark()
            return
        if self.tensors is not None:
            live, peak = self.tensors.live, self.tensors.peak
            self.result.append((peak - self._base, live - self._base) if self.result else (0, 0))
            self._base = self.tensors.peak = live
            return
        torch.cuda.synchronize(self.device)
        now = torch.cuda.memory_allocated(self.device)
        if self.result or self._base:
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.result.append((peak, now - self._base))
        else:
            self.result.append((0, 0))
        self._base = now
        torch.cuda.reset_peak_memory_stats(self.device)

    def __exit__(self, *exc: object) -> None:
        if self.session is not None:
            self.result = self.session.stop_windows()
        if self.tensors is not None:
            self.tensors.__exit__(None, None, None)


# Nominal speeds for meta profiles: relative stage costs are what the planner needs.
_NOMINAL_FLOPS_PER_MS = 1e9  # 1 TFLOP/s
_NOMINAL_BYTES_PER_MS = 1e9  # 1 TB/s


def _nominal_times(stage: Stage, x: Any, params: list[nn.Parameter]) -> tuple[float, float]:
    """Forward and backward "ms" of a meta stage from its FLOPs and output bytes.

    Nothing runs on a meta tensor, so there is no time to measure; FLOPs (matmuls and
    convolutions, from ``FlopCounterMode``) at a nominal 1 TFLOP/s, plus writing the output
    at a nominal 1 TB/s so that elementwise stages are not free, rank recompute costs well
    enough for the planner. Absolute figures mean nothing.
    """
    from torch.utils.flop_counter import FlopCounterMode

    inputs = _grad_input(x)
    with FlopCounterMode(display=False) as fwd_counter:
        out = stage(inputs)
    outs = [t for t in _tensors(out) if t.requires_grad]
    moved = _storage_bytes(_tensors(out)) / _NOMINAL_BYTES_PER_MS
    with FlopCounterMode(display=False) as bwd_counter:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    for p in params:
        p.grad = None
    fwd = fwd_counter.get_total_flops() / _NOMINAL_FLOPS_PER_MS + moved
    bwd = bwd_counter.get_total_flops() / _NOMINAL_FLOPS_PER_MS + 2 * moved
    return fwd, bwd


class _Clock:
    """Milliseconds between marks: ``perf_counter`` on CPU, CUDA events on a GPU (whose
    kernels run asynchronously, so host time would measure only the launches)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]


def _times(
    stage: Stage, x: Any, params: list[nn.Parameter], repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median forward and backward ms over ``repeats`` runs, after one warm-up run."""
    fwd, bwd = [], []
    for i in range(max(1, repeats) + 1):
        inputs = _grad_input(x)
        clock = _Clock(device)
        clock.mark()
        out = stage(inputs)
        clock.mark()
        outs = [t for t in _tensors(out) if t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        clock.mark()
        f, b = clock.spans()
        if i > 0:  # the first run allocates lazily and creates kernels
            fwd.append(f)
            bwd.append(b)
        for p in params:
            p.grad = None
    return statistics.median(fwd), statistics.median(bwd)


def _device_of(model: nn.Module, x: Any) -> torch.device:
    """Where a step on input ``x`` runs: the inputs' device, else the parameters'."""
    return next(
        (t.device for t in _tensors(x)), next((p.device for p in model.parameters()), torch.device("cpu"))
    )


def profile_chain(model: nn.Module, chain: Chain, x: Any, static_bytes: int, *, repeats: int = 3) -> Profile:
    """Measure every stage of ``chain`` starting from the chain's input value ``x``."""
    device = _device_of(model, x)
    grads = [(p, p.grad) for p in model.parameters()]
    costs = []
    try:
        with dry_run_state(model, x):
            value = x
            for stage in chain.stages:
                cost, value = _measure(stage, value, device, repeats)
                costs.append(cost)
    finally:
        for p, g in grads:
            p.grad = g
    return Profile(chain.walker, chain.names, tuple(costs), static_bytes, str(device))


def measure_loss(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], loss_fn: LossFn | None, *, where: str
) -> int:
    """Bytes the loss needs on top of the model's output (see :attr:`Profile.loss_bytes`).

    The output comes from one forward under ``no_grad`` (buffers and RNG untouched) and is
    made a leaf, so only the loss's own tensors and the output's gradient are counted.
    """
    device = _device_of(model, [list(args), kwargs])
    with dry_run_state(model, [list(args), kwargs]), torch.no_grad():
        out = model(*args, **kwargs)
    out = tree_map_only(torch.Tensor, _grad_leaf, out)
    with _Windows(device) as windows:
        windows.mark()
        loss = step_loss(out, loss_fn, where=where)
        if loss.requires_grad:
            loss.backward()
        del loss
        windows.mark()
    return windows.result[1][0]


def _grad_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.is_floating_point() or t.is_complex() else t


def profile(
    model: nn.Module,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
) -> Profile:
    """Measure what every stage of ``model`` costs in one training step on these inputs.

    A later ``make_plan`` or ``auto_checkpoint`` with a budget, on the same model and inputs
    of the same shapes, plans from this profile instead of measuring again.

    The device is the inputs'. On CPU and CUDA, bytes are allocator-level and times are
    measured. On the **meta** device (a model built under ``with torch.device("meta"):``
    and ``torch.empty(..., device="meta")`` inputs) nothing is allocated or run: bytes are
    those of the tensors the stages would create (backend workspaces, such as oneDNN's in
    NCHW convolution backward, are not seen) and times are nominal, from FLOP counts. This
    plans models far larger than the machine; the plan then applies to the real model,
    whose stage names are the same.

    Args:
        model: any model ``auto_checkpoint`` accepts (checkpointed or not).
        example_inputs: positional inputs, a batch of the size you train with.
        example_kwargs: keyword inputs.
        mode: force a walker, as for :func:`auto_checkpoint`.
        loss_fn: the loss you train with, from the model's output to a scalar
            (``lambda out: F.cross_entropy(out, labels)``); its bytes are measured too,
            because the loss runs when every saved activation is alive. By default a
            weighted sum of the outputs (:func:`~autockpt.losses.default_loss`).
        repeats: timing repeats per stage (times are medians; bytes are exact).

    Returns:
        a :class:`Profile`; ``print`` it for a table, ``.to_json()`` for machines.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> prof = autockpt.profile(model, (torch.randn(4, 8),))
        >>> [c.in_bytes for c in prof.costs]
        [128, 128, 128]
    """
    from autockpt.planning import _as_args, _entry_value, _probe, _static_bytes, remember_profile
    from autockpt.walk import build_chain
    from autockpt.walkers import walk

    walked = walk(model, mode, where="profile")
    probe = _probe(model, walked, example_inputs, example_kwargs, "profile")
    chain = build_chain(walked.walker, walked.units, probe)
    args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
    x = _entry_value(walked, args, kwargs, "profile")
    result = profile_chain(model, chain, x, _static_bytes(model, x), repeats=repeats)
    result = dataclasses.replace(
        result, loss_bytes=measure_loss(model, args, kwargs, loss_fn, where="profile")
    )
    remember_profile(model, chain, x, result, loss_fn)
    return result
