"""Key/value caches must not cross a recompute: a checkpointed block runs without one.

A transformer layer handed a cache object (Hugging Face's ``Cache`` and its subclasses)
appends its keys and values to it. Recomputing the layer in backward appends them a
second time: the attention then sees twice the positions (a shape error with a padded
mask, a differing number of saved tensors in T5 and Whisper) and the cache the model
returns is corrupted. A cache is of no use while training anyway, so a checkpointed
block is called as Hugging Face's own ``gradient_checkpointing_enable`` calls it: with
``use_cache=False`` and its cache arguments set to ``None``. Blocks run without
gradients (generation) keep their cache.

NOTE [No cache built while training]
    Hugging Face's forward also turns ``use_cache`` off for the whole model when its
    checkpointing is on and the model trains, so no cache object is built at all. A cache
    built and never filled (every checkpointed block gets ``None``) is returned empty, and
    building it is not free: in transformers 5 a config attribute read goes through a
    Python ``__getattribute__``, and a tiny Llama spent about 0.2 ms a step on the cache
    and its mask arguments, 1% of its step. So a block-walked model whose ``forward`` takes
    ``use_cache`` is called with ``use_cache=False`` while it trains with gradients and has
    checkpointed blocks (:func:`cache_switch`), as Hugging Face's checkpointing calls it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["cache_switch", "without_caches", "without_model_cache"]

logger = logging.getLogger(__name__)

# the names Hugging Face layers give their cache argument, across versions and models
CACHE_ARGUMENTS = frozenset({"cache", "layer_past", "past_key_value", "past_key_values"})


_NEVER_CACHES = (torch.Tensor, bool, int, float, str, tuple, list, dict)  # checked before the MRO


def is_cache(value: object) -> bool:
    """Whether ``value`` is a key/value cache object: a class named ``Cache`` in its MRO
    (how Hugging Face's caches are recognised without importing transformers)."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _cache_like(name: str, value: object) -> bool:
    """Whether a block's argument ``name=value`` is a cache to drop (``None`` is not)."""
    if value is None or type(value) in _NEVER_CACHES:  # the common case, without walking the MRO
        return False
    if isinstance(value, (torch.Tensor, bool, int, float, str)):
        return False
    return is_cache(value) or name in CACHE_ARGUMENTS


def without_caches(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """``(args, kwargs)`` with caching switched off, and the names of what was changed.

    Runs once per checkpointed block call, so the usual call (nothing to change) copies
    nothing and calls nothing for the usual values (tensors, ``None``, flags)."""
    changes: dict[str, Any] = {}
    for name, value in kwargs.items():
        if value is None or (type(value) in _NEVER_CACHES and value is not True):
            continue
        if name == "use_cache" and value is True:
            changes[name] = False
        elif _cache_like(name, value):
            changes[name] = None
    caches = [i for i, a in enumerate(args) if a is not None and type(a) not in _NEVER_CACHES and is_cache(a)]
    if not changes and not caches:
        return args, kwargs, []
    changed = [f"{name}={value}" for name, value in changes.items()]
    new_kwargs = {**kwargs, **changes} if changes else kwargs
    new_args = tuple(None if i in caches else a for i, a in enumerate(args)) if caches else args
    changed.extend(f"argument {i}=None" for i in caches)
    return new_args, new_kwargs, changed


def cache_switch(forward: Callable[..., Any]) -> int | None:
    """The position of ``forward``'s ``use_cache`` parameter, or ``None`` when it has none
    (NOTE [No cache built while training]); ``forward`` is bound (no ``self``)."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or a C callable: no signature to read
        return None
    if params and params[0].name == "self" and not inspect.ismethod(forward):
        params = params[1:]  # a function wrapping a class's forward: the signature followed it there
    for i, p in enumerate(params):
        if p.name == "use_cache" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return i if p.kind is p.POSITIONAL_OR_KEYWORD else len(params)
    return None


def without_model_cache(
    args: tuple[Any, ...], kwargs: dict[str, Any], switch: int | None
) -> tuple[dict[str, Any], bool]:
    """``kwargs`` with ``use_cache=False`` for a model whose forward takes it at position
    ``switch`` (unless given positionally), and whether a ``use_cache=True`` was overridden."""
    if switch is None or len(args) > switch or kwargs.get("use_cache") is False:
        return kwargs, False
    return {**kwargs, "use_cache": False}, kwargs.get("use_cache") is True
