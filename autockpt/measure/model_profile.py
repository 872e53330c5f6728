"""Profiling a whole model: every stage of its chain, the loss, and a cache of both.

:func:`profile` is the public entry point; planning calls :func:`model_profile` with the
chain it already has. A chain of the sequential or graph walker is measured stage by stage
(``autockpt.measure.stage_profile``); the block walker's model is measured as its blocks and
the code between them (``autockpt.measure.blocks``), since only the model itself can run
that code.

Profiles are cached per model object and keyed by everything bytes depend on (stages,
input and parameter shapes, dtypes, strides and devices, train/eval mode, a forward set on
the instance such as ``head="chunked"``'s), so
``make_plan(budget=...)`` followed by ``auto_checkpoint(budget=...)``, a retry at another
budget, or a plan after :func:`profile` measure once. The loss is cached per ``loss_fn``
object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from autockpt.measure.blocks import profile_blocks
from autockpt.measure.dry_run import dry_run
from autockpt.measure.losses import LossFn, measure_loss
from autockpt.measure.profile import Profile
from autockpt.measure.stage_profile import profile_chain
from autockpt.measure.tensors import as_args, signature, static_bytes
from autockpt.walkers import Walked, walk
from autockpt.walkers.chain import Chain, build_chain
from autockpt.walkers.graph import none_pattern

__all__ = ["model_profile", "profile"]

_PROFILES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Profile]] = weakref.WeakKeyDictionary()
_LOSSES: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, int]] = weakref.WeakKeyDictionary()


def model_profile(
    model: nn.Module,
    walked: Walked,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    loss_fn: LossFn | None,
    where: str,
    repeats: int = 3,
    cached: bool = True,
    ops: bool = False,
) -> Profile:
    """The profile of ``chain`` on these inputs, with the loss's bytes, measured once
    (``ops``: with the op-level profile; one with ops serves a request without)."""
    key = _key(model, chain, [list(args), kwargs])
    per_model = _PROFILES.setdefault(model, {})
    prof = per_model.get(key) if cached else None
    if prof is not None and ops and not prof.has_ops:
        prof = None
    with old_garbage_kept():
        if prof is None:
            prof = _measure(model, walked, chain, args, kwargs, repeats, where, ops)
            per_model[key] = prof
        return dataclasses.replace(prof, loss_bytes=_loss_bytes(model, key, args, kwargs, loss_fn, where))


@contextlib.contextmanager
def old_garbage_kept() -> Iterator[None]:
    """Measure with the collector's automatic runs paused, the young generations collected.

    Garbage from before a measurement must not be freed inside it (its size may be unknown
    to the allocator session). A full ``gc.collect()`` guarantees that but walks every
    Python object, about 0.2 s once transformers is imported, more than ten steps of a small
    model; pausing the automatic runs keeps old garbage alive just as surely, and each
    session still collects the young generations when it opens.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _measure(
    model: nn.Module,
    walked: Walked,
    chain: Chain,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    repeats: int,
    where: str,
    ops: bool,
) -> Profile:
    static = static_bytes(model, [list(args), kwargs])
    if walked.walker == "blocks":
        return profile_blocks(model, chain, args, kwargs, static, repeats=repeats, ops=ops)
    x = walked.entry_value(args, kwargs, where=where)
    return profile_chain(model, chain, x, static, repeats=repeats, ops=ops)


def _loss_bytes(
    model: nn.Module,
    key: Hashable,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: LossFn | None,
    where: str,
) -> int:
    """The loss's bytes (:attr:`Profile.loss_bytes`), measured once per loss function object
    (a new lambda is measured again: one forward)."""
    per_model = _LOSSES.setdefault(model, {})
    try:
        return per_model[(key, loss_fn)]
    except TypeError:  # an unhashable loss_fn: measure every time
        return measure_loss(model, args, kwargs, loss_fn, where=where)
    except KeyError:
        per_model[(key, loss_fn)] = measure_loss(model, args, kwargs, loss_fn, where=where)
        return per_model[(key, loss_fn)]


def _key(model: nn.Module, chain: Chain, inputs: Any) -> Hashable:
    return (
        chain.walker,
        chain.names,
        signature(inputs),
        signature(list(model.parameters())),
        model.training,
        _own_forward(model),
    )


def _own_forward(model: nn.Module) -> Hashable:
    """The forward set on the model object beneath autockpt's checkpointed one, if any (a
    user's, or the chunked head's, which changes the step's bytes): its ``profile_key``,
    else its identity; and the ``profile_key`` of any forward set on a submodule (the
    chunked head of the model inside a PEFT wrapper)."""
    fwd = model.__dict__.get("forward")
    if getattr(fwd, "_autockpt_forward", False):
        fwd = getattr(fwd, "original_forward", None)
    own = None if fwd is None else getattr(fwd, "profile_key", id(fwd))
    inner = tuple(
        key
        for m in model.modules()
        if m is not model and (key := getattr(m.__dict__.get("forward"), "profile_key", None)) is not None
    )
    return own, inner


def profile(
    model: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    loss_fn: LossFn | None = None,
    repeats: int = 3,
    ops: bool = False,
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

    A model walked by blocks (one fx cannot trace) is profiled as its blocks, each alone on
    the inputs the model hands it, and the code before, between and after them, measured
    in one step of the model with every block checkpointed.

    Args:
        model: any model ``auto_checkpoint`` accepts (checkpointed or not).
        example_inputs: positional inputs, a batch of the size you train with.
        example_kwargs: keyword inputs.
        mode: force a walker, as for :func:`auto_checkpoint`.
        loss_fn: the loss you train with, from the model's output to a scalar
            (``lambda out: F.cross_entropy(out, labels)``); its bytes are measured too,
            because the loss runs when every saved activation is alive. By default a
            weighted sum of the outputs (:func:`~autockpt.measure.losses.default_loss`).
        repeats: timing repeats per stage (times are medians; bytes are exact).
        ops: also profile every op of each stage's forward (:class:`~autockpt.planners.OpCost`:
            its output bytes, time, FLOPs, whether autograd keeps its output, whether a
            policy may keep it), shown by ``print`` and in the JSON. One more forward per
            stage, under a dispatch mode.

    Returns:
        a :class:`Profile`; ``print`` it for a table, ``.to_json()`` for machines.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> prof = autockpt.profile(model, (torch.randn(4, 8),))
        >>> [c.in_bytes for c in prof.costs]
        [128, 128, 128]
    """
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    walked = walk(model, mode, where="profile", none_args=none_pattern(model, args, kwargs))
    chain = build_chain(
        walked.walker, walked.units, dry_run(model, walked, args, kwargs, where="profile", saved=False)
    )
    return model_profile(
        model, walked, chain, args, kwargs, loss_fn=loss_fn, where="profile", repeats=repeats, cached=False,
        ops=ops,
    )  # fmt: skip
