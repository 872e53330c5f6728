"""Key/value caches must not cross a recompute: a checkpointed block runs without one.

A transformer layer handed a cache object (Hugging Face's ``Cache`` and its subclasses)
appends its keys and values to it. Recomputing the layer in backward appends them a
second time: the attention then sees twice the positions (a shape error with a padded
mask, a differing number of saved tensors in T5 and Whisper) and the cache the model
returns is corrupted. A cache is of no use while training anyway, so a checkpointed
block is called as Hugging Face's own ``gradient_checkpointing_enable`` calls it: with
``use_cache=False`` and its cache arguments set to ``None``. Blocks run without
gradients (generation) keep their cache.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["without_caches"]

logger = logging.getLogger(__name__)

# the names Hugging Face layers give their cache argument, across versions and models
CACHE_ARGUMENTS = frozenset({"cache", "layer_past", "past_key_value", "past_key_values"})


def is_cache(value: object) -> bool:
    """Whether ``value`` is a key/value cache object: a class named ``Cache`` in its MRO
    (how Hugging Face's caches are recognised without importing transformers)."""
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def without_caches(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """``(args, kwargs)`` with caching switched off, and the names of what was changed."""
    changed: list[str] = []
    new_kwargs = dict(kwargs)
    if new_kwargs.get("use_cache") is True:
        new_kwargs["use_cache"] = False
        changed.append("use_cache=False")
    for name, value in kwargs.items():
        if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
            continue
        if is_cache(value) or (name in CACHE_ARGUMENTS and not isinstance(value, (bool, int))):
            new_kwargs[name] = None
            changed.append(f"{name}=None")
    caches = [
        i for i, a in enumerate(args) if not isinstance(a, torch.Tensor) and a is not None and is_cache(a)
    ]
    new_args = tuple(None if i in caches else a for i, a in enumerate(args)) if caches else args
    changed.extend(f"argument {i}=None" for i in caches)
    return new_args, new_kwargs, changed
