"""The forward a checkpointed model runs, stored on the model object.

NOTE [The one-time dry run]
    Whether a module modifies its input in place cannot always be read off its
    attributes, so autockpt runs the model's modules once on a real input and watches
    tensor version counters (see NOTE [In-place boundaries] in ``walkers/chain.py``). With
    ``example_inputs`` this happens at planning time; without, on the first forward pass
    that records gradients. The dry run is invisible: buffers and RNG are restored and
    :func:`autockpt.is_recomputing` is true during it. If it finds a module that the
    plan put right after a boundary, the plan is made again with the same strategy.

NOTE [A trace of another call checkpoints nothing]
    A graph-walked model is traced for one pattern of ``None`` arguments (NOTE [Optional
    arguments] in ``walkers/graph.py``). Without example inputs that is its defaults', and
    where every argument defaults to ``None`` (open_clip's ``CLIP.forward(image=None,
    text=None)``) the trace is one stage that checkpoints nothing. So the call pattern is
    checked before the "nothing checkpointed" shortcut, and a call the trace does not fit
    is traced again for its own pattern, whatever the first plan checkpointed.

NOTE [One compiled frame per model]
    Under ``torch.compile(model)`` the first frame dynamo compiles is the model's
    ``forward``, and with autockpt installed that is ``CheckpointedForward.__call__``: one
    code object for every checkpointed model in the process. Dynamo keeps its state per
    code object (cache entries and their guards, the recompile limit) and per code location
    (automatic dynamic shapes), so a model compiled after another checkpointed one was
    checked against the other's guards, recompiled as its "recompile" and, its input shape
    differing from the other's, compiled with every input size symbolic (dynamic shapes,
    seen with ``TORCH_LOGS=recompiles,dynamic``: "tensor 'args[0]' rank mismatch", then
    "marking L['args'][0] as dynamic"); after 8 models, dynamo would give up on the rest.
    Unwrapped, each model class has its own ``forward`` frame. So each installed forward
    is an instance of a subclass made for it, whose ``__call__`` is the same function with
    a code object (and name) of its own: one model's compilation cannot change another's,
    and dynamo's entries go with the model's forward. Pickles and copies name the base
    class and get a subclass of their own when rebuilt.

NOTE [Planned once, compiled whole]
    Under ``torch.compile`` dynamo traces the installed forward as part of the model's
    frame, so whatever it does per call is either traced into the graph or breaks it. The
    segments themselves are torch ``checkpoint`` regions (NOTE [Under torch.compile] in
    ``execution/runtime.py``); around them the forward only reads state that was decided
    before (the plan, the runtime, the cache switch looked up at install time) and writes
    none: a write into the forward object is a guard that fails on the next call, a
    recompile every step. Hence: the dry run does not run inside a compiled call (it
    measures eager tensors); a plan made without example inputs stays the walk's plan there,
    balanced by stage count, and is refined by the first eager training call if one comes;
    compiled code needs no in-place boundary fusion, as functionalization copies what an op
    writes. A walk or trace made again (hooks added to a flattened container or traced-
    through module, another pattern of ``None`` arguments) runs outside the graph
    (``torch.compiler.disable``): a break and a recompile, once, where the model changed.
    Logging that a block runs without its cache is skipped while compiling (a logging call
    breaks the graph). The graph walker's program reads no fx object per call (NOTE
    [Traces under torch.compile] in ``walkers/graph.py``). Counted in
    ``tests/test_compile_graphs.py``: no graph, break or frame more than the unwrapped
    model's, in either wrapping order.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from autockpt.errors import AutockptError
from autockpt.execution.outside_graphs import outside_compiled_graphs
from autockpt.execution.policies import OpPolicy
from autockpt.execution.runtime import SegmentRuntime, build_runtime, checkpoint_segment, run_segments
from autockpt.measure.dry_run import probe_units
from autockpt.measure.sandbox import dry_run_state
from autockpt.plan import Plan
from autockpt.planning.prepare import SegmentsSpec
from autockpt.walkers import Walked, walk
from autockpt.walkers.blocks import BlockCall
from autockpt.walkers.chain import Chain, DryRun, Unit, build_chain
from autockpt.walkers.graph import UnbindableError, none_pattern
from autockpt.walkers.kv_caches import cache_switch, without_caches, without_model_cache

__all__ = ["BlockForward", "CheckpointedForward", "install", "installed", "uninstall", "uninstall_within"]

logger = logging.getLogger(__name__)

_HOOKED = "hooks were added to a module it went through"


class Replanning(Protocol):
    """Makes the plan again when the chain changes under an installed forward
    (``autockpt.planning.prepare.Replanner``, handed over by ``auto_checkpoint``)."""

    def after_walk(
        self, chain: Chain, spec: SegmentsSpec, *, why: str, model: str
    ) -> tuple[Plan, SegmentsSpec]: ...

    def after_dry_run(self, chain: Chain, spec: SegmentsSpec, *, notes: Sequence[str]) -> Plan: ...


class BlockForward:
    """What a checkpointed block's ``forward`` is: a checkpoint around its own forward."""

    _autockpt_forward = True
    told_caches = False

    def __init__(self, runtime: SegmentRuntime, call: BlockCall) -> None:
        self.runtime = runtime
        self.call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.call((args, kwargs))
        block = self.call.block
        if block.training and getattr(block, "gradient_checkpointing", False) is True:
            raise AutockptError(  # NOTE [Never two checkpointings] in integrations/transformers.py
                f"auto_checkpoint: block {type(block).__name__} has Hugging Face's gradient "
                f"checkpointing switched on as well as autockpt's, so it would be checkpointed twice "
                f"(two recomputes, nothing saved). Call model.gradient_checkpointing_disable(), or "
                f"autockpt.restore(model) to keep Hugging Face's."
            )
        args, kwargs, changed = without_caches(args, kwargs)
        if changed and not BlockForward.told_caches and not torch.compiler.is_compiling():
            BlockForward.told_caches = True
            logger.info("autockpt: checkpointed blocks run without a cache (%s)", ", ".join(changed))
        return checkpoint_segment(self.runtime, (args, kwargs))


class CheckpointedForward:
    """What ``model.forward`` is while a model is checkpointed (picklable, deep-copyable)."""

    _autockpt_forward = True
    debug = False  # check every op of each recompute (also for objects pickled before it existed)
    policy_fn: OpPolicy | None = None
    _cache_switch: int | bool | None = False  # False: not looked up yet (caches.cache_switch)

    def __init__(
        self,
        model: nn.Module,
        walked: Walked,
        chain: Chain,
        plan: Plan,
        spec: SegmentsSpec,
        probe: DryRun | None,
        original_forward: Callable[..., Any] | None,
        replanner: Replanning,
        debug: bool = False,
        policy_fn: OpPolicy | None = None,
    ) -> None:
        self.model = model
        self.replanner = replanner
        self.debug = debug
        self.policy_fn = policy_fn  # the function behind plan.policy (execution/policies.py)
        self.walked = walked
        self.plan = plan
        self.spec = spec
        self.probe = probe
        self.original_forward = original_forward
        self.warned_unbindable = False
        # other patterns of None arguments traced before: (walked, plan, runtime, dry run)
        self.traced: dict[frozenset[str], tuple[Walked, Plan, tuple[SegmentRuntime, ...], DryRun | None]] = {}
        self.runtime: tuple[SegmentRuntime, ...] = ()
        if walked.walker == "blocks":  # looked up now: a lookup inside a compiled call recompiles it
            self._cache_switch = cache_switch(original_forward or type(model).forward.__get__(model))
        self._bind(chain)
        self.__class__ = _own_class(type(model).__name__)  # NOTE [One compiled frame per model]

    @property
    def units(self) -> tuple[Unit, ...]:
        """The walker's units, before fusion."""
        return self.walked.units

    def _bind(self, chain: Chain) -> None:
        """Build the runtime for the current plan; for blocks, install their forwards."""
        self.remove_blocks()
        self.runtime = build_runtime(
            self.plan.segments, chain.stages, debug=self.debug, policy=(self.plan.policy, self.policy_fn)
        )
        for rt, call in self._block_runtimes():
            call.block.__dict__["forward"] = BlockForward(rt, call)

    def _block_runtimes(self) -> list[tuple[SegmentRuntime, BlockCall]]:
        """The checkpointed blocks of the block walker's plan, with their runtimes."""
        if self.walked.walker != "blocks":
            return []
        out = []
        for rt in self.runtime:
            unit = rt.stages[0].units[0]
            if rt.segment.checkpoint and isinstance(unit.fn, BlockCall):
                out.append((rt, unit.fn))
        return out

    def remove_blocks(self) -> None:
        """Give checkpointed blocks their own forward back.

        The blocks are found from the plan's runtime, not from a list kept on the side, so
        a forward put back by ``verify`` (``autockpt.measure.sandbox.preserved``) is still found.
        """
        for rt, call in self._block_runtimes():
            fwd = call.block.__dict__.get("forward")
            if isinstance(fwd, BlockForward) and fwd.runtime is rt:
                del call.block.__dict__["forward"]
                if call.original is not None:
                    call.block.__dict__["forward"] = call.original

    def _plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.original_forward is not None:
            return self.original_forward(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def _training_blocks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A block-walked model's call: its blocks checkpoint themselves; no cache is built
        while it trains (NOTE [No cache built while training] in ``walkers/kv_caches.py``)."""
        if self.model.training:
            if self._cache_switch is False:
                plain = self.original_forward or type(self.model).forward.__get__(self.model)
                self._cache_switch = cache_switch(plain)
            kwargs, overridden = without_model_cache(args, kwargs, self._cache_switch)  # type: ignore[arg-type]
            if overridden and not BlockForward.told_caches and not torch.compiler.is_compiling():
                BlockForward.told_caches = True
                logger.info("autockpt: checkpointed blocks run without a cache (use_cache=False)")
        return self._plain(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program = self.walked.program
        if not torch.is_grad_enabled() or (self.plan.checkpointed_segments == 0 and program is None):
            return self._plain(*args, **kwargs)
        if self.walked.walker == "blocks":
            return self._training_blocks(args, kwargs)
        if program is None:
            if len(args) != 1 or kwargs:
                return self._plain(*args, **kwargs)  # let the model raise its own TypeError
            if self.walked.stale():  # NOTE [Flattened containers] in walkers/sequential.py
                self._walk_again(walk(self.model, "sequential", where="auto_checkpoint"), _HOOKED)
            x = args[0]
        else:
            if self.walked.stale():
                self._retrace(program.none_args, _HOOKED)
                program = self.walked.program
                assert program is not None
            bound, mismatch = program.try_bind(args, kwargs)  # no exception raised in a compiled call
            if mismatch is not None:  # NOTE [Optional arguments] in walkers/graph.py
                bound = self._bind_traced_again(args, kwargs, f"argument {mismatch[0]!r} {mismatch[1]}")
                if bound is None:
                    return self._plain(*args, **kwargs)
                program = self.walked.program
                assert program is not None
            x = bound
            if self.plan.checkpointed_segments == 0:  # NOTE [A trace of another call checkpoints nothing]
                return self._plain(*args, **kwargs)
        if self.probe is None and not torch.compiler.is_compiling():  # NOTE [Planned once, compiled whole]
            self._dry_run(x)
        out = run_segments(self.runtime, x)
        return out if program is None else program.result(out)

    @outside_compiled_graphs  # NOTE [Planned once, compiled whole]
    def _bind_traced_again(self, args: tuple[Any, ...], kwargs: dict[str, Any], why: str) -> Any:
        """Trace again for this call's pattern of ``None`` arguments and bind the call; ``None``
        (with a warning, once) when it cannot be traced: the model then runs plainly."""
        try:
            self._retrace(none_pattern(self.model, args, kwargs), why)
            program = self.walked.program
            assert program is not None
            return program.bind(args, kwargs)
        except (UnbindableError, AutockptError) as err:
            if not self.warned_unbindable:
                self.warned_unbindable = True
                warnings.warn(
                    f"auto_checkpoint: {type(self.model).__name__} cannot be traced for this "
                    f"call ({err}); it runs without checkpointing. Checkpoint with "
                    f"mode='blocks' to cover such calls.",
                    UserWarning,
                    stacklevel=4,
                )
            return None

    def _retrace(self, none_args: frozenset[str], why: str) -> None:
        """Trace again (hooks were added inside a traced module, or a call's optional
        arguments differ from the trace's) and plan again; a pattern of ``None`` arguments
        traced before is switched back to, not traced again."""
        current = self.walked.program
        if current is not None and not self.walked.stale():
            self.traced[current.none_args] = (self.walked, self.plan, self.runtime, self.probe)
        known = self.traced.pop(none_args, None)
        if known is not None and not known[0].stale():
            self.walked, self.plan, self.runtime, self.probe = known
            return
        self._walk_again(walk(self.model, "graph", where="auto_checkpoint", none_args=none_args), why)

    @outside_compiled_graphs
    def _walk_again(self, walked: Walked, why: str) -> None:
        """Take a new walk of the model and plan it again with the same strategy."""
        logger.info("autockpt: walking %s again: %s", type(self.model).__name__, why)
        self.walked, self.probe = walked, None
        chain = build_chain(walked.walker, walked.units)
        spec = self.spec if self.spec is not None and not isinstance(self.spec, Plan) else self.plan.strategy
        plan, self.spec = self.replanner.after_walk(chain, spec, why=why, model=type(self.model).__name__)
        self.plan = dataclasses.replace(plan, policy=self.plan.policy)
        self._bind(chain)

    def _dry_run(self, x: Any) -> None:
        with dry_run_state(self.model, x):
            self.probe = probe_units(self.units, x)
        chain = build_chain(self.plan.walker, self.units, self.probe)
        if isinstance(self.spec, Plan) or self.spec is None:
            if chain.names == self.plan.stage_names and not (
                chain.first_unit_unsafe and self.plan.segments[0].checkpoint
            ):
                return
            raise AutockptError(
                f"auto_checkpoint: the dry run found modules that modify their input in place "
                f"at units {sorted(self.probe.unsafe)}, which the given plan puts after a boundary. "
                f"Make the plan with autockpt.make_plan(model, example_inputs=(x,))."
            )
        # Re-plan with what the dry run found: fused stages and boundary sizes.
        plan = self.replanner.after_dry_run(chain, self.spec, notes=self.walked.notes)
        plan = dataclasses.replace(plan, policy=self.plan.policy)
        if plan != self.plan:
            logger.info("autockpt: re-planned %r after the dry run", self.spec)
            self.plan = plan
            self._bind(chain)

    def __reduce__(self) -> tuple[Callable[[str], CheckpointedForward], tuple[str], dict[str, Any]]:
        # by the base class's name, not the subclass's (NOTE [One compiled frame per model])
        return _blank_forward, (type(self.model).__name__,), self.__getstate__()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        spec = state["spec"]
        if callable(spec) and not isinstance(spec, Plan):
            try:
                pickle.dumps(spec)
            except Exception:  # a lambda or local function: keep the plan, drop the recipe
                state["spec"] = None
        return state


_FORWARD_NUMBERS = itertools.count(1)


def _own_class(model_name: str) -> type[CheckpointedForward]:
    """A subclass of :class:`CheckpointedForward` whose ``__call__`` has a code object of
    its own, named after the model (NOTE [One compiled frame per model])."""
    call = CheckpointedForward.__call__
    name = f"autockpt_forward_{model_name}_{next(_FORWARD_NUMBERS)}"
    own = types.FunctionType(
        call.__code__.replace(co_name=name),
        call.__globals__,
        call.__name__,
        call.__defaults__,
        call.__closure__,
    )
    own.__qualname__, own.__doc__, own.__kwdefaults__ = call.__qualname__, call.__doc__, call.__kwdefaults__
    attrs = {"__call__": own, "__module__": __name__, "__qualname__": CheckpointedForward.__qualname__}
    return type(CheckpointedForward.__name__, (CheckpointedForward,), attrs)


def _blank_forward(model_name: str) -> CheckpointedForward:
    """An empty installed forward, for pickle and ``copy`` to fill with its state."""
    return object.__new__(_own_class(model_name))


def installed(model: nn.Module) -> CheckpointedForward | None:
    """The checkpointed forward installed on ``model``, if any."""
    fwd = model.__dict__.get("forward")
    return fwd if isinstance(fwd, CheckpointedForward) else None


def uninstall(model: nn.Module) -> bool:
    """Remove every forward autockpt installed on ``model`` and its blocks; put back the
    user's own instance forwards. Returns whether anything was installed."""
    fwd = installed(model)
    if fwd is None:
        return False
    fwd.remove_blocks()
    del model.__dict__["forward"]
    if fwd.original_forward is not None:
        model.__dict__["forward"] = fwd.original_forward
    return True


def uninstall_within(model: nn.Module) -> bool:
    """Remove autockpt's forwards from ``model``'s submodules, for a model that was
    checkpointed as part of another (PEFT's ``merge_and_unload()`` returns the inner model,
    whose blocks still carry the outer model's checkpoints). Returns whether any was found."""
    found = False
    for module in model.modules():
        fwd = module.__dict__.get("forward")
        if isinstance(fwd, CheckpointedForward):
            found = uninstall(module) or found
        elif isinstance(fwd, BlockForward):
            del module.__dict__["forward"]
            if fwd.call.original is not None:
                module.__dict__["forward"] = fwd.call.original
            found = True
    return found


def install(
    model: nn.Module,
    walked: Walked,
    chain: Chain,
    plan: Plan,
    spec: SegmentsSpec,
    probe: DryRun | None,
    *,
    replanner: Replanning,
    debug: bool = False,
    policy_fn: OpPolicy | None = None,
) -> None:
    """Install a :class:`CheckpointedForward` for ``plan`` on ``model``, replacing any earlier one.

    ``replanner`` makes the plan again if the chain changes (a walk again, the first dry run);
    ``debug`` compares every op of each recompute with the forward (``auto_checkpoint(debug=)``);
    ``policy_fn`` is the function of ``plan.policy``.
    """
    previous = installed(model)
    if previous is not None:
        previous.remove_blocks()
    original = previous.original_forward if previous is not None else model.__dict__.get("forward")
    model.__dict__["forward"] = CheckpointedForward(
        model, walked, chain, plan, spec, probe, original, replanner, debug, policy_fn
    )
