"""Running a planned chain: checkpointed segments, exact buffers, the mutation guard.

The recompute check (stage outputs always, every op under ``debug=True``) lives in
``execution/recompute_check.py`` (NOTE [Recompute check]).

NOTE [Buffers change once per forward]
    ``torch.utils.checkpoint`` replays a segment's forward in backward, so a BatchNorm in
    training mode updates its running statistics twice per step. We keep, for every
    checkpointed segment call, the buffers its forward changed *as they were before that
    forward* (a clone for in-place updates, the old object for reassigned buffers). The
    recompute runs against private copies of every buffer of the segment (of those old
    values where the forward changed one, of the live value elsewhere), so it sees exactly
    what the original forward saw and never writes a live buffer, and the live buffers are
    put back afterwards: the user observes one update per forward. Copies of all, since a
    buffer can be written and end where it started, and a recompute under an op policy
    replays only part of those writes (docs/design.md).

    Which buffers changed must be known exactly, and without waiting for the device:
    comparing values (``torch.equal``) is exact but waits for an asynchronous device (CUDA)
    on every call; version counters are free but miss writes through ``.data`` and kernels
    such as BatchNorm's CPU statistics update. A buffer whose version counter moved has
    changed. For the others, on the CPU (where a comparison waits for nothing) values are
    compared and only changed buffers keep their copy; on other devices every copy is kept
    until the segment's backward, which costs the segment's buffer bytes (KiBs for norm
    layers) and no wait. An earlier version learned on the first call which buffers change
    and trusted that afterwards; a buffer that changes only later (after a warm-up step,
    through ``.data``) then escaped replay and was updated twice (found in review).

NOTE [Mutation guard]
    A recompute runs with the parameters, buffers and train/eval modes of the moment it
    happens. If they changed since the forward, the unwrapped model would fail in backward
    (autograd's version check on saved tensors) or use the forward's mode, while the
    checkpointed one would silently compute other gradients. So each checkpoint call keeps
    the version counters of its segment's parameters and buffers (those the forward itself
    changed are replayed, hence exempt) and the modules' modes, and the recompute raises
    :class:`MutationError` on any difference. Optimizers step after backward, DDP
    broadcasts buffers before forward and FSDP2 preserves version counters when it
    re-gathers parameters, so normal training never trips it.

    Forward hooks and pre-hooks run again in the recompute too, so one added or removed in
    between changes it just as silently. Each call also keeps the keys (handle ids) of the
    forward hook and pre-hook dicts, global and per module, of the modules whose hooks run
    inside the segment, as they are after the forward (a hook that removes itself while
    the forward runs, as lazy modules' does, is not a change), and compares them: no
    tensor work, one truthiness test per module without hooks. Modules the segment
    reaches without ``__call__`` are left out: a block walker's block (its hooks run
    around the checkpoint, once) and modules a graph trace went through. Hooks installed
    once (FSDP2's, ``torch.distributed``'s composable ``checkpoint``, pruning, weight norm)
    stay the same between forward and backward; autockpt installs none. The hook state and
    its error live in ``execution/hooks.py``.

NOTE [Under torch.compile]
    Dynamo turns ``checkpoint`` into a higher-order op whose body must not mutate Python
    state, and AOTAutograd then recomputes the body's nodes in the compiled backward. So
    while compiling, a segment is a plain function of its inputs: no call counting, no
    buffer copies, no mutation guard. They are not needed there: the compiled graph applies
    buffer mutations once (functionalized), and its random ops replay from saved seeds.
    ``is_recomputing()`` cannot be seen from compiled code.

NOTE [Segment inputs]
    Non-reentrant ``checkpoint`` keeps its arguments for the recompute and walks them once
    per call to find the device whose RNG state it stashes. A block's input is ``(args,
    kwargs)``, often a dozen entries deep, and walking it on every call was part of what
    made a tiny GPT-2's step slower than with HF's own checkpointing, which passes only the
    hidden states. So the segment's input rides in the ``_SegmentCall`` object, which
    the checkpoint keeps exactly as long as it would keep its arguments, and one top-level
    tensor per device is passed, for the devices: ``checkpoint`` saves every tensor argument
    for backward and unpacks it there (a Llama layer's position ids and cache positions as
    well as its hidden states cost 14 us a layer, 0.3% of a tiny Llama's step). Its unpack
    also refused an argument modified in place before the recompute; the call keeps the
    versions of the top-level tensors it does not pass and the guard raises instead (found
    in review: a caller adding to a bias tensor between blocks got wrong gradients).

NOTE [Recompute detection]
    A checkpointed function is called once in the forward pass and again for every
    recompute. ``_SegmentCall`` counts its calls instead of using ``context_fn``, which
    keeps it plain Python that torch.compile can trace.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import noop_context_fn

from autockpt.errors import MutationError
from autockpt.execution.checkpoint_args import device_hints, may_use_rng, rng_free_modules
from autockpt.execution.hooks import HookState, hook_error, hook_state, hooked_modules
from autockpt.execution.lean_checkpoint import lean_applies, lean_checkpoint
from autockpt.execution.policies import OpPolicy, SelectiveRecompute, compiled_context_fn
from autockpt.execution.recompute_check import OpRecorder, output_metadata, run_stage, stage_mismatch
from autockpt.measure.sandbox import (
    CHECKPOINT_OPTIONS,
    BufferSlot,
    buffer_slots,
    private_copies,
    put_buffers,
    read_buffers,
    recomputing,
)
from autockpt.plan import Segment
from autockpt.walkers.chain import Stage, Unit

__all__ = [
    "SegmentRuntime",
    "build_runtime",
    "checkpoint_segment",
    "compiled_body",
    "run_body",
    "run_segments",
]

# The guard reads these for every tensor and module of a segment on every call; mapped in C
# rather than looped in Python: on small layers every microsecond of a call shows.
_VERSION = operator.attrgetter("_version")
_TRAINING = operator.attrgetter("training")
_CPU = torch.device("cpu")


def segment_buffers(stages: Sequence[Stage]) -> tuple[BufferSlot, ...]:
    """Every (module, buffer name) slot reachable from the stages, each once."""
    return buffer_slots(
        m for stage in stages for unit in stage.units
        for m in (*(m for top in unit.modules for m in top.modules()), *unit.reads)
    )  # fmt: skip


@dataclass(eq=False)
class SegmentRuntime:
    """A plan segment bound to its stages and buffers, plus what we learned about them."""

    segment: Segment
    stages: tuple[Stage, ...]
    buffers: tuple[BufferSlot, ...]
    children: tuple[SegmentRuntime, ...] = ()
    rng_free: tuple[nn.Module, ...] | None = None  # execution/checkpoint_args.py
    named_modules: tuple[tuple[str, nn.Module], ...] = ()  # checkpointed only; the mutation guard's
    modules: tuple[nn.Module, ...] = ()  # the modules of named_modules
    hooked: tuple[tuple[str, nn.Module], ...] = ()  # checkpointed only; whose forward hooks run inside
    guarded_dicts: tuple[dict[str, Any], ...] = ()  # the _parameters and _buffers of named_modules
    label: str = ""  # "2", or "2.1" for a nested segment
    debug: bool = False  # check every op of a recompute (NOTE [Recompute check] in recompute_check.py)
    selective: SelectiveRecompute | None = None  # an op policy's context_fn (execution/policies.py)
    compiled_context: Any = None  # the same policy's context_fn under torch.compile

    @property
    def description(self) -> str:
        """The segment, as error messages name it."""
        seg = self.segment
        stages = f"stage {seg.start}" if len(seg) == 1 else f"stages {seg.start}-{seg.stop - 1}"
        return f"checkpointed segment {self.label} ({stages})"


def build_runtime(
    segments: Sequence[Segment],
    stages: Sequence[Stage],
    *,
    debug: bool = False,
    prefix: str = "",
    policy: tuple[str, OpPolicy | None] | None = None,
) -> tuple[SegmentRuntime, ...]:
    """Bind plan segments to the chain's stages; ``debug`` checks every op of each recompute;
    ``policy`` (name, function) chooses the ops whose outputs checkpointed segments keep
    (those without nested segments)."""
    out = []
    for i, seg in enumerate(segments):
        own = tuple(stages[seg.start : seg.stop])
        named = _named_modules(own) if seg.checkpoint else ()
        rt = SegmentRuntime(
            segment=seg,
            stages=own,
            buffers=segment_buffers(own) if seg.checkpoint else (),
            children=build_runtime(seg.children, stages, debug=debug, prefix=f"{prefix}{i}.", policy=policy),
            rng_free=rng_free_modules(own),
            named_modules=named,
            modules=tuple(m for _, m in named),
            hooked=hooked_modules(own, named) if seg.checkpoint else (),
            guarded_dicts=tuple(d for _, m in named for d in (m._parameters, m._buffers)),
            label=f"{prefix}{i}",
            debug=debug,
        )
        name, fn = policy if policy is not None else ("recompute-all", None)
        if seg.checkpoint and not seg.children and (fn is not None or seg.keep):
            keep = frozenset(seg.keep) if seg.keep else None
            rt.selective = SelectiveRecompute(name, fn, rt.description, keep)
            rt.compiled_context = compiled_context_fn(rt.selective)
        out.append(rt)
    return tuple(out)


def run_segments(runtimes: Sequence[SegmentRuntime], x: Any) -> Any:
    """Run the segments in order, checkpointing those the plan marks."""
    for rt in runtimes:
        x = checkpoint_segment(rt, x) if rt.segment.checkpoint else run_body(rt, x)
    return x


def checkpoint_segment(rt: SegmentRuntime, x: Any) -> Any:
    """One checkpointed call of ``rt``'s segment on ``x``."""
    if torch.compiler.is_compiling():  # see NOTE [Under torch.compile]
        leaves, spec = tree_flatten(x)
        body = functools.partial(compiled_body, rt, spec)
        if rt.compiled_context is None:
            return torch.utils.checkpoint.checkpoint(body, *leaves, **CHECKPOINT_OPTIONS)
        return torch.utils.checkpoint.checkpoint(
            body, *leaves, **CHECKPOINT_OPTIONS, context_fn=rt.compiled_context
        )
    hints, others = device_hints(x)
    device = hints[0].device if hints else _CPU
    device_type = device.type
    if (
        rt.selective is None
        and not rt.children
        and lean_applies(device_type)
        and all(t.device == device for t in hints)
    ):  # NOTE [Lean checkpoint] in execution/lean_checkpoint.py; it keeps no input versions of its own
        call = _SegmentCall(rt, x, (*hints, *others))
        return lean_checkpoint(
            call, hints, device_type=device_type, preserve_rng_state=may_use_rng(rt.rng_free)
        )
    return torch.utils.checkpoint.checkpoint(
        _SegmentCall(rt, x, others),
        *hints,
        **CHECKPOINT_OPTIONS,
        preserve_rng_state=may_use_rng(rt.rng_free),
        context_fn=noop_context_fn if rt.selective is None else rt.selective,
    )


def compiled_body(rt: SegmentRuntime, spec: Any, *leaves: Any) -> Any:
    return run_body(rt, tree_unflatten(list(leaves), spec))


def run_body(rt: SegmentRuntime, x: Any) -> Any:
    if rt.children:
        return run_segments(rt.children, x)
    debug = rt.debug and not torch.compiler.is_compiling()  # debug=True is for eager runs
    for stage in rt.stages:
        x = run_stage(stage, x) if debug else stage(x)
    return x


def compares_values(device: torch.device) -> bool:
    """Whether buffer values are compared on ``device``: only where it waits for nothing."""
    return device.type == "cpu"


def _changed(t: torch.Tensor, before: torch.Tensor, version: int) -> bool:
    """Whether a buffer may have changed in place since ``before`` was copied (NOTE [Buffers
    change once per forward]): its version moved, its value differs (CPU), or, on a device
    where comparing would wait, it is assumed to have."""
    if t._version != version:
        return True
    if compares_values(t.device):
        return not torch.equal(t, before)
    return True


class _SegmentCall:
    """The function one checkpoint call runs: forward first, recomputes after."""

    def __init__(self, rt: SegmentRuntime, x: Any, others: Sequence[torch.Tensor] = ()) -> None:
        self.rt = rt
        self.x = x  # the segment's input (NOTE [Segment inputs])
        self.inputs = others  # input tensors checkpoint does not keep
        self.input_versions = list(map(_VERSION, others))
        self.old: dict[int, torch.Tensor | None] | None = None
        self.guarded: list[torch.Tensor] = []  # parameters and buffers whose versions are kept
        self.versions: list[int] = []  # per self.guarded
        self.modes: list[bool] = []  # per rt.named_modules
        self.hooks: HookState = ((), (), ())
        self.outputs: list[Any] = []  # per stage: shapes, dtypes and devices of its output
        self.recorder: OpRecorder | None = None  # debug=True: every op of the forward

    def __call__(self, *hints: torch.Tensor) -> Any:
        x = self.x
        if self.old is None:
            return self._forward(x)
        return self._recompute(x)

    def _forward(self, x: Any) -> Any:
        rt = self.rt
        if not rt.buffers and not rt.debug:  # most transformer blocks: nothing to replay
            out, self.old = self._body(x), {}
            self._remember_state(self.old)
            return out
        before = read_buffers(rt.buffers)
        versions = [t._version if t is not None else 0 for t in before]
        clones = private_copies(before)
        if rt.debug:
            self.recorder = OpRecorder(rt.description)
            with self.recorder:
                out = self._body(x)
        else:
            out = self._body(x)
        old: dict[int, torch.Tensor | None] = {}
        for i, ((module, name), t) in enumerate(zip(rt.buffers, before)):
            now = module._buffers.get(name)
            if now is not t:
                old[i] = t
            elif t is not None and _changed(t, clones[i], versions[i]):  # type: ignore[arg-type]
                old[i] = clones[i]
        self.old = old
        self._remember_state(old)
        return out

    def _body(self, x: Any) -> Any:
        """The segment's stages; the forward notes each stage's output metadata, a
        recompute compares with it (NOTE [Recompute check] in recompute_check.py)."""
        rt = self.rt
        if rt.children:
            return run_segments(rt.children, x)  # each nested checkpointed segment checks itself
        recompute = self.old is not None
        for k, stage in enumerate(rt.stages):
            x = run_stage(stage, x) if rt.debug else stage(x)
            meta = output_metadata(x)
            if not recompute:
                self.outputs.append(meta)
            elif meta != self.outputs[k]:
                raise stage_mismatch(rt.description, stage, self.outputs[k], meta)
        return x

    def _remember_state(self, replayed: dict[int, torch.Tensor | None]) -> None:
        """What the recompute must find unchanged: parameter and buffer versions (buffers
        this forward changed are replayed from the copies above, so they are exempt) and
        every module's train/eval mode. See NOTE [Mutation guard]."""
        rt = self.rt
        # one comprehension, empty dicts (most of a block's) skipped: a third of the map/filter chain's cost
        guarded = [t for d in rt.guarded_dicts if d for t in d.values() if t is not None]
        if replayed:
            skip = {id(rt.buffers[i][0]._buffers.get(rt.buffers[i][1])) for i in replayed}
            guarded = [t for t in guarded if id(t) not in skip]
        self.guarded = guarded
        self.versions = list(map(_VERSION, guarded))
        self.modes = list(map(_TRAINING, rt.modules))
        self.hooks = hook_state(rt.hooked)

    def _check_state(self) -> None:
        rt = self.rt
        if (
            list(map(_VERSION, self.inputs)) == self.input_versions
            and list(map(_VERSION, self.guarded)) == self.versions
            and list(map(_TRAINING, rt.modules)) == self.modes
            and hook_state(rt.hooked) == self.hooks
        ):
            return
        for t, version in zip(self.inputs, self.input_versions):
            if t._version != version:
                raise MutationError(
                    f"autockpt: an input tensor of {self.rt.description} (shape {tuple(t.shape)}) was "
                    f"modified in place between the forward and the backward; its recompute would see "
                    f"the new values and give wrong gradients. Pass a copy (t.clone()) or modify it "
                    f"after backward()."
                )
        for t, version in zip(self.guarded, self.versions):
            if t._version != version:
                name = self._name_of(t)
                kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
                raise MutationError(
                    f"autockpt: {kind} {name!r} (shape {tuple(t.shape)}) was modified in place between "
                    f"the forward and the backward of a checkpointed segment; recomputing it with the new "
                    f"values would give wrong gradients. Modify parameters after backward() (call "
                    f"optimizer.step() after loss.backward()), or exclude the module from checkpointing."
                )
        for (name, module), training in zip(self.rt.named_modules, self.modes):
            if module.training != training:
                now, then = ("eval", "training") if training else ("training", "eval")
                raise MutationError(
                    f"autockpt: module {name or type(module).__name__!r} was switched to {now} mode "
                    f"between the forward (in {then} mode) and the backward of a checkpointed segment; "
                    f"its recompute would take the other path (dropout, batch statistics) and give wrong "
                    f"gradients. Switch modes after backward(), or call model.train()/eval() before forward."
                )
        hooks = hook_state(self.rt.hooked)
        if hooks != self.hooks:
            raise hook_error(self.rt.description, self.rt.hooked, self.hooks, hooks)

    def _name_of(self, tensor: torch.Tensor) -> str:
        """The qualified name of one of the segment's parameters or buffers (for errors)."""
        for module_name, module in self.rt.named_modules:
            for tensors in (module._parameters, module._buffers):
                for name, t in tensors.items():
                    if t is tensor:
                        return f"{module_name}.{name}" if module_name else name
        return "?"

    def _recompute(self, x: Any) -> Any:
        rt, old = self.rt, self.old
        assert old is not None
        self._check_state()
        if not rt.buffers and self.recorder is None:
            with recomputing():
                return self._body(x)
        live = read_buffers(rt.buffers)
        seen = [old[i] if i in old else t for i, t in enumerate(live)]  # what the forward saw
        put_buffers(rt.buffers, private_copies(seen))
        try:
            with recomputing():
                if self.recorder is None:
                    return self._body(x)
                with OpRecorder(rt.description, self.recorder.ops):
                    return self._body(x)
        finally:
            put_buffers(rt.buffers, live)


def _named_modules(stages: Sequence[Stage]) -> tuple[tuple[str, nn.Module], ...]:
    """Every module of the stages once, by its qualified name (``"3"``, ``"layer1.0.conv1"``)."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []
    roots: dict[int, dict[int, str]] = {}  # per traced model: module id -> qualified name
    for stage in stages:
        for unit in stage.units:
            named = [n for top in unit.modules for n in top.named_modules(prefix=_top_name(unit, top, roots))]
            named += [(_top_name(unit, owner, roots), owner) for owner in unit.reads]  # not its children
            for sub, module in named:
                if id(module) not in seen:
                    seen.add(id(module))
                    out.append((sub, module))
    return tuple(out)


def _top_name(unit: Unit, top: nn.Module, roots: dict[int, dict[int, str]]) -> str:
    """The qualified name of one of ``unit``'s modules."""
    model = unit.names_root
    if model is not None:
        names = roots.setdefault(id(model), {})
        if not names:
            names.update((id(m), n) for n, m in reversed(list(model.named_modules())))
        return names.get(id(top), f"{unit.name}:{type(top).__name__}")
    return unit.name if len(unit.modules) == 1 else f"{unit.name}:{type(top).__name__}"
