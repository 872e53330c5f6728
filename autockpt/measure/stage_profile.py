"""Measuring stages: what running each one costs in a training step (a chain's profile).

Each stage runs alone, on the input the stages before it produce, with that input made to
require gradients. Bytes are allocator-level (``track_memory``), so op workspaces such as
oneDNN's reorder buffers are in them; they are exact for a given input, while times are
medians of repeats and stay noisy. The run is invisible like the dry run: buffers, RNG and
``.grad`` are put back.

NOTE [One session per profile]
    On CPU, opening an allocator session starts the profiler and closing it stops it and
    reads its events: about 0.4 ms each, 30 ms for the 78 stages of a small timm
    mobilenet, most of a training step. A chain is therefore measured in two passes: every
    stage's bytes, in windows of one session, and every stage's times, outside any session
    (the profiler's per-op hooks would slow what is timed). Each pass holds one stage's
    input at a time. On the CPU the bytes pass comes first and is the timing pass's
    warm-up (a stage's first run allocates lazily and creates kernels): two runs of each
    stage where a warm-up of its own made three, about 1.4 training steps less for the 78
    stages of timm's mobileone_s1 (bytes the same to the byte on the models tried). On CUDA
    a first run may also autotune (cuDNN's benchmark mode tries algorithms, with workspaces
    of their own), so the timing pass's warm-up runs first and leaves each stage warm for
    the bytes pass, as measuring a stage's times and bytes back to back did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.measure.dispatch import selective_dispatch_ms
from autockpt.measure.memory import Windows
from autockpt.measure.ops import measure_ops
from autockpt.measure.profile import Profile
from autockpt.measure.sandbox import dry_run_state
from autockpt.measure.tensors import (
    cloned,
    device_of,
    requiring_grad,
    saved_storages,
    storage_bytes,
    storage_key,
    tensors_in,
)
from autockpt.measure.timing import StageRun, nominal_times, stage_times
from autockpt.planners import OpCost, StageCost
from autockpt.walkers.chain import Chain

__all__ = ["StageRun", "StageTimes", "measured_stage_in", "profile_chain"]


StageTimes = tuple[float, float, float, tuple[OpCost, ...]]
"""A stage's forward, backward and tail ms, and its op profile (empty unless asked for)."""


def _stage_times(
    stage: StageRun,
    params: list[nn.Parameter],
    x: Any,
    device: torch.device,
    repeats: int,
    grads_as_given: bool,
    ops: bool,
    *,
    warm_up: bool = True,
) -> tuple[StageTimes, Any]:
    """The stage's times (measured after a warm-up run unless the stage is warm; nominal on
    meta) and its output (``None`` on meta)."""
    out = None
    if device.type == "meta":
        fwd_ms, bwd_ms = nominal_times(stage, x, params, grads_as_given)
        tail_ms = 0.0  # unknown: a recompute counts the whole stage
    else:  # also warms up
        fwd_ms, bwd_ms, tail_ms, out = stage_times(stage, x, params, repeats, device, grads_as_given, warm_up)
    op_costs = measure_ops(stage, x, device, grads_as_given=grads_as_given) if ops else ()
    return (fwd_ms, bwd_ms, tail_ms, op_costs), out


def measured_stage_in(
    windows: Windows,
    stage: StageRun,
    modules: Sequence[nn.Module],
    x: Any,
    device: torch.device,
    repeats: int,
    *,
    grads_as_given: bool = False,
    ops: bool = False,
    times: StageTimes | None = None,
) -> tuple[Callable[[], StageCost], Any, StageTimes]:
    """One stage measured as :func:`profile_chain` measures each (times, then bytes), the
    bytes inside an allocator session the caller holds open (one session for many
    measurements: each CPU session costs a profiler start and stop); the cost is read, by
    calling the function returned, once that session has closed. Given ``times`` (those of
    an identical stage measured before), only the bytes are measured. Returns the cost, the
    stage's output and its times."""
    params = _trained(p for m in modules for p in m.parameters())
    if times is None:
        times = _stage_times(stage, params, x, device, repeats, grads_as_given, ops)[0]  # output freed
    cost, out = _stage_cost_in(windows, stage, params, x, device, grads_as_given=grads_as_given)
    measured = times
    return (lambda: cost(measured)), out, times


def _stage_cost_in(
    windows: Windows,
    stage: StageRun,
    params: list[nn.Parameter],
    x: Any,
    device: torch.device,
    *,
    grads_as_given: bool = False,
) -> tuple[Callable[[StageTimes], StageCost], Any]:
    """The bytes of one stage: one forward and backward in four windows
    of ``windows``; the cost, given the stage's times, once ``windows`` has closed, and the
    stage's output."""
    inputs, leaves = requiring_grad(x, as_given=grads_as_given)
    in_tensors = tensors_in(inputs)
    in_keys = {storage_key(t) for t in in_tensors}
    first = windows.mark()
    with saved_storages() as saved:
        out = stage(inputs)
    windows.mark()
    out_tensors = [t for t in tensors_in(out) if storage_key(t) not in in_keys]
    out_bytes = storage_bytes(out_tensors)
    keeps_input = any(k in saved for k in in_keys)
    keeps_output = any(storage_key(t) in saved for t in out_tensors)
    grad_outs = [t for t in tensors_in(out) if t.requires_grad]
    # The loss makes the output gradient inside the measured backward, and no Python
    # reference keeps the output alive, so the output and its gradient are freed as in a
    # real step; the gradient's size is then taken off the peak (the model adds it).
    loss, seeds = _seeded_loss(grad_outs, device)
    next_value = cloned(out)
    del out, grad_outs, out_tensors
    for p in params:
        p.grad = None
    windows.mark()
    if loss.requires_grad:
        loss.backward(inputs=[*leaves, *params] or None)
    windows.mark()
    del loss, seeds  # the seeds lived through the backward: a real step frees no such thing
    grad_bytes = storage_bytes(p.grad for p in params if p.grad is not None)
    for p in params:
        p.grad = None

    def cost(times: StageTimes) -> StageCost:
        fwd_ms, bwd_ms, tail_ms, op_costs = times
        (fwd_peak, fwd_net), (bwd_peak, _) = windows.result[first + 1], windows.result[first + 3]
        return StageCost(
            fwd_ms=fwd_ms,
            bwd_ms=bwd_ms,
            tail_ms=tail_ms,
            in_bytes=storage_bytes(in_tensors),
            out_bytes=out_bytes,
            kept_bytes=max(0, fwd_net - out_bytes),
            keeps_input=keeps_input,
            keeps_output=keeps_output,
            fwd_peak_bytes=fwd_peak,
            bwd_peak_bytes=max(0, bwd_peak - out_bytes),
            grad_bytes=grad_bytes,
            ops=op_costs,
            sac_ms=len(op_costs) * selective_dispatch_ms(device) if op_costs else 0.0,
        )

    return cost, next_value


def _trained(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Those of ``params`` that require gradients, each once."""
    return [p for p in {id(p): p for p in params}.values() if p.requires_grad]


def _seeded_loss(outs: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A scalar whose backward sends ones into every output, and the ones (keep them alive)."""
    total, seeds = torch.zeros((), device=device), []
    while outs:
        t = outs.pop()
        seeds.append(torch.ones_like(t))
        total = total + (t * seeds[-1]).sum()
    return total, seeds


def profile_chain(
    model: nn.Module, chain: Chain, x: Any, static_bytes: int, *, repeats: int = 3, ops: bool = False
) -> Profile:
    """Measure every stage of ``chain`` starting from the chain's input value ``x`` (the
    caller keeps old garbage alive); ``ops`` adds the op-level profile.

    Two passes over the chain, each holding one stage's input at a time: the bytes, in
    windows of one allocator session, and the times (NOTE [One session per profile])."""
    device = device_of(model, x)
    grads = [(p, p.grad) for p in model.parameters()]
    stages = [(stage, _trained(p for u in stage.units for p in u.parameters())) for stage in chain.stages]
    try:
        with dry_run_state(model, x):
            costs = _measure_chain(stages, x, device, repeats, ops)
    finally:
        for p, g in grads:
            p.grad = g
    return Profile(chain.walker, chain.names, costs, static_bytes, str(device))


def _measure_chain(
    stages: Sequence[tuple[StageRun, list[nn.Parameter]]],
    x: Any,
    device: torch.device,
    repeats: int,
    ops: bool,
) -> tuple[StageCost, ...]:
    """Each stage's cost, the stages chained from ``x`` (see :func:`profile_chain`)."""
    times: list[StageTimes] = []
    if device.type not in ("cpu", "meta"):  # NOTE [One session per profile]: times first here
        _timing_pass(stages, x, device, repeats, ops, times, warm_up=True)
    costs = []
    with Windows(device, collect=False) as windows:
        value = x
        for stage, params in stages:
            if device.type == "meta":  # nominal times, from the same input; nothing is allocated
                times.append(_stage_times(stage, params, value, device, repeats, False, ops)[0])
            before = _buffer_ids(stage) if device.type == "cpu" else None
            cost, out = _stage_cost_in(windows, stage, params, value, device)
            if before is not None and _buffer_ids(stage) != before:  # built lazily: measure it warm
                cost, out = _stage_cost_in(windows, stage, params, value, device)
            costs.append(cost)
            value = out
        del value, out  # made inside the session: freed there
    if device.type == "cpu":  # each stage ran forward and backward in the bytes pass: warm
        _timing_pass(stages, x, device, repeats, ops, times, warm_up=False)
    return tuple(cost(t) for cost, t in zip(costs, times))


def _buffer_ids(stage: StageRun) -> list[int]:
    """The buffers of a stage's modules: one that a stage replaces on its first run (a table
    grown for a larger input; the dry run put the old one back) is measured again."""
    units = getattr(stage, "units", ())
    return [id(t) for u in units for top in u.modules for m in top.modules() for t in m._buffers.values()]


def _timing_pass(
    stages: Sequence[tuple[StageRun, list[nn.Parameter]]],
    x: Any,
    device: torch.device,
    repeats: int,
    ops: bool,
    times: list[StageTimes],
    *,
    warm_up: bool,
) -> None:
    """Every stage's times, appended to ``times``, outside any allocator session."""
    value = x
    for stage, params in stages:
        t, value = _stage_times(stage, params, value, device, repeats, False, ops, warm_up=warm_up)
        times.append(t)
