"""Profiling a model walked by blocks: its blocks, and the code before, between and after them.

A model fx cannot trace runs its own forward; autockpt only sees its repeated blocks. A
budget still covers the whole step, so the code around the blocks (embeddings, a stem, a
head, masks built on the way) must be measured too, and only the model itself can run it.
So the model runs one training step here, with three things added for the duration:

* every block runs under ``torch.utils.checkpoint``, so the step holds little more than the
  blocks' inputs (it never needs more memory than the unwrapped step), and without a
  key/value cache, as checkpointed blocks run (:mod:`autockpt.walkers.kv_caches`: measuring a block
  alone and then running it would otherwise append to the model's cache twice);
* the first time a block is called, it is first measured alone on the inputs the model hands
  it (:func:`~autockpt.measure.stage_profile.measured_stage_in`, inputs requiring gradients
  exactly where the model's do), in windows of the step's own allocator session (a session
  of its own would stop and restart the CPU profiler twice per block);
* markers in one allocator session, at each block's entry and exit in forward and, through
  tensor hooks, where each block's output and input gradients are ready in backward, cut the
  step into windows: the code between block ``i - 1`` and block ``i`` is the "gap" stage
  ``i``, measured where it really runs, forward and backward.

The profile's stages are then gap 0, block 0, gap 1, ..., block n-1, gap n; gaps cannot be
checkpointed (:attr:`Profile.checkpoint_spans`). Inputs shared by several blocks (attention
masks, rotary tables) are allocated once, before the first block, so they belong to gap 0's
bytes, not to every block's input. Buffers, RNG, ``.grad`` and forwards are left as they were.

NOTE [Blocks in the order they run]
    The block walker lists blocks in the order of the module tree, and a model may call them
    in another: torchvision's SSD registers its classification head before its regression
    head and runs the regression head first. The step's windows were labelled by that list,
    so the gaps' bytes went to the wrong stages (the model's output and the loss to a gap in
    the middle), and the cost model replayed the backward in the wrong order: with the
    classification head's backward first, every regression head's activations are still
    alive. ssdlite320's unwrapped step was predicted 6% low, and its budget plan ran 5.9%
    over budget. The profile's stages follow the order in which the blocks first ran with
    gradients, and ``stage_of`` maps them back to the chain's blocks.

NOTE [Twin blocks are timed once]
    Timing a block takes a warm-up and ``repeats`` runs, four forwards and backwards where
    measuring its bytes takes one, and most block-walked models are a stack of identical
    layers: timing each again only re-measures the same kernels (and their noise). So a
    block whose module classes (all of them: timm puts an Identity or a DropPath in a block
    depending on its depth), parameter shapes and inputs (shapes, dtypes, strides, devices,
    gradients, and the other arguments) match one timed before takes that block's times;
    its bytes, and its op profile when one is asked for, are still measured on its own. On
    tiny 4-layer Hugging Face configs this removes about a tenth of a budget plan's cost;
    the more layers, the more.

NOTE [Blocks a step skips]
    A model with LayerDrop (wav2vec2, HF's default ``layerdrop=0.1``) skips each layer of a
    training step at random, and a block the profiled step skipped cannot be measured; with
    four layers that is a third of all steps. The budget must hold on steps that run every
    layer, so the step is profiled again, with the CPU generator seeded otherwise inside
    the step (``preserved`` puts the caller's RNG back), until one ran every block, up to
    ``STEP_ATTEMPTS`` times; the error names the blocks that never ran.

NOTE [The model's output in a block profile]
    The last gap ends with the model's output, which a training loop holds until the step
    ends (the cost model keeps the output alive through the whole backward). Counted among
    the bytes that gap keeps, it was released with the gap's backward, and every block's
    backward was predicted one output too low: 16% under the measured peak, and 9% over
    the budget, for a head with a wide output. So the last gap's output is the model's, and
    its gradient is taken off the gap's backward peak, as ``profile_chain`` does for any
    stage. Only what the model's own code made counts: a block's output the model returns
    as it is was counted with that block. That was first read as the gap's net bytes, which
    go negative where the profiled step frees more than the head makes: a mask made before
    the blocks dies when the forward returns, and an output a block returns and the model
    drops (GPT-Neo's attention weights, Swin's) dies there too, because the profiled blocks
    run checkpointed, though a plain block's autograd keeps it. A negative output took that
    much off every backward: GPT-Neo's budget plan ran 9% over its budget, Swin's 7.6%. So
    the output's bytes are those of the model's output storages that are not a block's
    output still alive (held weakly: a freed output's address is soon reused).
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from autockpt.errors import AutockptError
from autockpt.measure.losses import training_step
from autockpt.measure.memory import Windows
from autockpt.measure.profile import Profile
from autockpt.measure.sandbox import CHECKPOINT_OPTIONS, preserved, recomputing
from autockpt.measure.stage_profile import StageTimes, measured_stage_in
from autockpt.measure.tensors import (
    arguments_key,
    device_of,
    requiring_grad,
    signature,
    storage_bytes,
    storage_key,
    storage_sizes,
    tensors_in,
)
from autockpt.planners import StageCost
from autockpt.walkers.chain import Chain
from autockpt.walkers.kv_caches import without_caches

__all__ = ["STEP_ATTEMPTS", "profile_blocks"]

STEP_ATTEMPTS = 5  # NOTE [Blocks a step skips]


class _Step:
    """Labelled markers in one set of allocator windows, and what each labelled window saw."""

    def __init__(self, windows: Windows, params: list[nn.Parameter]) -> None:
        self.windows = windows
        self.labels: list[tuple[str, int]] = []  # (label, the mark's number in windows)
        self.times: list[float] = []
        self.params = params
        self.grads: dict[str, int] = {}  # per backward window: parameter gradients it created
        self.order: list[int] = []  # the blocks, by the order of their first call with gradients
        # what the blocks returned, weakly: an address a freed output had may be reused
        self.block_outputs: list[weakref.ref[torch.Tensor]] = []
        self._seen: set[int] = set()

    def mark(self, label: str) -> None:
        if self.windows.device.type == "cuda":
            torch.cuda.synchronize(self.windows.device)
        if self.labels and self.labels[-1][0].startswith("bwd"):
            new = [p for p in self.params if p.grad is not None and id(p) not in self._seen]
            self._seen.update(id(p) for p in new)
            self.grads[self.labels[-1][0]] = storage_bytes(p.grad for p in new if p.grad is not None)
        self.labels.append((label, self.windows.mark()))
        self.times.append(time.perf_counter())

    def by_label(self) -> dict[str, tuple[int, int, float]]:
        """(peak, net, ms) per label, the first window of each label (after the windows
        closed): from its mark to the next mark, which is the next label's unless a block's
        own measurement marked in between (only after a "measure" label)."""
        result = self.windows.result
        out: dict[str, tuple[int, int, float]] = {}
        for k, (label, mark) in enumerate(self.labels[:-1]):
            peak, net = result[mark + 1] if mark + 1 < len(result) else (0, 0)
            out.setdefault(label, (peak, net, (self.times[k + 1] - self.times[k]) * 1e3))
        return out


def profile_blocks(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_bytes: int,
    *,
    repeats: int = 3,
    ops: bool = False,
) -> Profile:
    """Profile a block-walked model: each block alone, and the gaps in one real step (the
    caller keeps old garbage alive: its windows collect the young generations only). With
    ``ops``, each block's ops too (the gaps are never checkpointed: they need none)."""
    device = device_of(model, [list(args), kwargs])
    for attempt in range(STEP_ATTEMPTS):  # NOTE [Blocks a step skips]
        step, alone, inputs, out_bytes = _profile_step(
            model, chain, args, kwargs, device, repeats, ops, attempt
        )
        if len(alone) == len(chain.stages):
            break
    costs = {i: cost() for i, cost in alone.items()}
    return _assemble(
        chain, step.order, costs, inputs, step.by_label(), step.grads, static_bytes, device, out_bytes
    )


def _profile_step(
    model: nn.Module,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device,
    repeats: int,
    ops: bool,
    attempt: int,
) -> tuple[_Step, dict[int, Callable[[], StageCost]], dict[int, dict[int, int]], int]:
    """One profiled step of the model: its windows, each block's cost (read once the windows
    closed), each block's input storages, and the model's output bytes."""
    blocks = [stage.units[0].modules[0] for stage in chain.stages]
    calls = [stage.units[0].fn for stage in chain.stages]
    in_block = {id(p) for b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if p.requires_grad and id(p) not in in_block]
    alone: dict[int, Callable[[], StageCost]] = {}  # each block's cost, read once the windows closed
    timed: dict[Hashable, StageTimes] = {}  # NOTE [Twin blocks are timed once]
    inputs: dict[int, dict[int, int]] = {}  # per block: storage key -> bytes of its inputs
    # the caller's inputs get no .grad: the step runs on copies, requiring grad where they do
    (call_args, call_kwargs), _ = requiring_grad((list(args), kwargs), as_given=True)
    # preserved puts back the blocks' forwards, buffers, .grad and the RNG afterwards
    with (
        preserved(model, [list(args), kwargs]) as fresh,
        recomputing(),
        Windows(device, collect=False) as windows,
    ):
        fresh()
        if attempt:  # another draw of the blocks a step skips (NOTE [Blocks a step skips])
            torch.default_generator.manual_seed(attempt)
        step = _Step(windows, outside)
        for i, (block, call) in enumerate(zip(blocks, calls)):
            block.__dict__["forward"] = _measuring_forward(
                i, block, call, step, alone, timed, inputs, device, repeats, ops
            )
        step.mark("gap 0")
        out_bytes = []

        def after_forward(out: Any) -> None:
            # NOTE [The model's output in a block profile]: what the model's code made of it
            passed = {storage_key(t) for ref in step.block_outputs if (t := ref()) is not None}
            out_bytes.append(storage_bytes(t for t in tensors_in(out) if storage_key(t) not in passed))
            step.mark("loss")

        training_step(
            model, call_args, call_kwargs, None, where="profile", after_forward=after_forward,
            before_backward=lambda: step.mark(f"bwd gap {len(blocks)}"),
        )  # fmt: skip
        step.mark("end")
    return step, alone, inputs, out_bytes[0]


def _measuring_forward(
    i: int,
    block: nn.Module,
    call: Callable[[Any], Any],
    step: _Step,
    alone: dict[int, Callable[[], StageCost]],
    timed: dict[Hashable, StageTimes],
    inputs: dict[int, dict[int, int]],
    device: torch.device,
    repeats: int,
    ops: bool,
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # measured as it will run: checkpointed, without a cache
            args, kwargs, _ = without_caches(args, kwargs)
        if i not in alone and torch.is_grad_enabled():
            step.order.append(i)  # NOTE [Blocks in the order they run]
            step.mark(f"measure {i}")  # the measurement's own allocations: windows to ignore
            twin = _twin_key(block, args, kwargs)
            alone[i], _, timed[twin] = measured_stage_in(
                step.windows,
                call,
                [block],
                (args, kwargs),
                device,
                repeats,
                grads_as_given=True,
                ops=ops,
                times=None if ops else timed.get(twin),  # an op profile is each block's own
            )
            inputs[i] = storage_sizes(tensors_in((args, kwargs)))
        if i in alone:  # windows are labelled by position in step.order
            k = step.order.index(i)
            pos, after = str(k), str(k + 1)
        else:  # a call without gradients: labels of its own
            pos = after = f"?{i}"
        first_in = next((t for t in tensors_in((args, kwargs)) if t.requires_grad), None)
        if first_in is not None and torch.is_grad_enabled():
            # A view of its own, so this hook fires before any hook on the tensor itself (the
            # previous block's output, whose hook opens that block's backward window).
            alias = first_in.view_as(first_in)
            alias.register_hook(_marker(step, f"bwd gap {pos}"))
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: alias if t is first_in else t, (args, kwargs)
            )
        step.mark(f"block {pos}")
        out = checkpoint(lambda *a, **k: call((a, k)), *args, **CHECKPOINT_OPTIONS, **kwargs)
        outs = tensors_in(out)
        step.block_outputs += [weakref.ref(t) for t in outs]
        first_out = next((t for t in outs if t.requires_grad), None)
        if first_out is not None:
            first_out.register_hook(_marker(step, f"bwd block {pos}"))
        step.mark(f"gap {after}")
        return out

    return forward


def _twin_key(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What makes two blocks twins (NOTE [Twin blocks are timed once]): the classes of all
    their modules, their parameters' signature and their arguments' key."""
    return (
        tuple(type(m) for m in block.modules()),  # timm's Identity-or-DropPath differ here
        signature(list(block.parameters())),
        tuple(kwargs),
        arguments_key([list(args), kwargs]),
    )


def _marker(step: _Step, label: str) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        step.mark(label)

    return hook


def _assemble(
    chain: Chain,
    order: list[int],
    alone: dict[int, StageCost],
    inputs: dict[int, dict[int, int]],
    windows: dict[str, tuple[int, int, float]],
    grads: dict[str, int],
    static_bytes: int,
    device: torch.device,
    model_out_bytes: int,
) -> Profile:
    """The profile's stages from the step's windows. The last gap's output is the model's:
    the cost model keeps it alive through the whole backward, so it must not hide among the
    bytes that gap keeps, and its gradient, made in that gap's backward window, is taken off
    the window's peak as ``profile_chain`` does (NOTE [The model's output in a block
    profile]). Blocks and gaps are in the order the blocks ran (NOTE [Blocks in the order
    they run])."""
    n = len(chain.stages)
    missing = [chain.names[i] for i in range(n) if i not in alone]
    if missing:
        raise AutockptError(
            f"profile: blocks {missing} did not run with gradients enabled in a forward of the model, "
            f"so they cannot be measured. Profile with the inputs you train with."
        )
    shared = {k for i in range(n) for k in inputs[i] if any(k in inputs[j] for j in range(n) if j != i)}
    costs: list[StageCost] = []
    names: list[str] = []
    stage_of: list[int | None] = []
    ran = [chain.names[b] for b in order]
    for i in range(n + 1):
        prev_out = costs[-1].out_bytes if costs else 0
        fwd_peak, fwd_net, fwd_ms = windows.get(f"gap {i}", (0, 0, 0.0))
        bwd_peak, _, bwd_ms = windows.get(f"bwd gap {i}", (0, 0, 0.0))
        if i < n:
            next_in = sum(b for k, b in inputs[order[i]].items() if k not in shared)
        else:  # the model's output, as far as the model's code made it (NOTE [The model's output ...])
            next_in = model_out_bytes
            bwd_peak = max(0, bwd_peak - next_in)
        costs.append(
            StageCost(
                fwd_ms=fwd_ms,
                bwd_ms=bwd_ms,
                in_bytes=prev_out,
                out_bytes=next_in,
                kept_bytes=max(0, fwd_net - next_in),
                keeps_input=False,
                keeps_output=False,
                fwd_peak_bytes=fwd_peak,
                bwd_peak_bytes=bwd_peak,
                grad_bytes=grads.get(f"bwd gap {i}", 0),
            )
        )
        names.append(_gap_name(tuple(ran), i))
        stage_of.append(None)
        if i < n:
            costs.append(dataclasses.replace(alone[order[i]], in_bytes=next_in))
            names.append(ran[i])
            stage_of.append(order[i])
    return Profile("blocks", tuple(names), tuple(costs), static_bytes, str(device), stage_of=tuple(stage_of))


def _gap_name(names: tuple[str, ...], i: int) -> str:
    if i == 0:
        return f"(before {names[0]})"
    if i == len(names):
        return f"(after {names[-1]})"
    return f"(between {names[i - 1]} and {names[i]})"
