"""What torch's ``checkpoint`` is handed for one segment call: the tensors it learns
devices from, and whether it must stash and restore the RNG.

Both are per call and cheap on purpose: a checkpointed call runs once per segment per step,
and on small transformer layers every microsecond of it shows (NOTE [Segment inputs] in
``execution/runtime.py``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from autockpt.walkers.chain import Stage

__all__ = ["device_hints", "may_use_rng", "rng_free_modules"]


# Stock torch.nn modules whose forward draws no random numbers: a segment of only these (exact
# types, no hooks) skips torch's RNG stash (a 5 KiB CPU state kept until the segment's backward,
# and the fork on recompute). Anything else (Dropout, RReLU, custom modules) may use the RNG.
_RNG_FREE: frozenset[type] = frozenset(
    t
    for name in (
        "Linear Bilinear Identity Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d "
        "BatchNorm1d BatchNorm2d BatchNorm3d LayerNorm GroupNorm InstanceNorm1d InstanceNorm2d "
        "InstanceNorm3d LocalResponseNorm RMSNorm ReLU ReLU6 LeakyReLU PReLU ELU SELU CELU GELU SiLU "
        "Mish Sigmoid Tanh Hardtanh Hardswish Hardsigmoid Softplus Softmax LogSoftmax Softsign "
        "Tanhshrink Threshold MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d "
        "AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d "
        "AdaptiveMaxPool3d Flatten Unflatten Embedding ZeroPad2d ConstantPad1d ConstantPad2d "
        "ConstantPad3d PixelShuffle PixelUnshuffle Sequential"
    ).split()
    if isinstance(t := getattr(nn, name, None), type)
)


def rng_free_modules(stages: Sequence[Stage]) -> tuple[nn.Module, ...] | None:
    """The modules of ``stages`` if all are stock RNG-free types, else ``None``."""
    units = [unit for stage in stages for unit in stage.units]
    mods = [m for unit in units for top in unit.modules for m in top.modules()]
    if all(u.pure for u in units) and all(type(m) in _RNG_FREE and "forward" not in m.__dict__ for m in mods):
        return tuple(mods)
    return None


def may_use_rng(rng_free: tuple[nn.Module, ...] | None) -> bool:
    """Whether a segment of these modules (:func:`rng_free_modules`; ``None``: not all
    RNG-free) may draw random numbers: checked at every call, since hooks may be added after
    planning."""
    if rng_free is None:
        return True
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in rng_free)


_DEVICE = operator.attrgetter("device")


def device_hints(x: Any) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """One tensor of ``x`` per device it uses, from which ``checkpoint`` learns the devices
    whose RNG states and autocast settings it keeps (from the top-level tensors, or from
    every one when none is at the top), and the other top-level tensors, whose versions the
    segment call keeps instead (NOTE [Segment inputs])."""
    if isinstance(x, torch.Tensor):
        return (x,), ()
    top = x
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) and isinstance(x[1], dict):
        top = (*x[0], *x[1].values())  # a block's (args, kwargs)
    tensors = [t for t in top if isinstance(t, torch.Tensor)] if isinstance(top, (tuple, list)) else []
    if not tensors:
        return tuple(t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)), ()
    if len(tensors) == 1 or len(set(map(_DEVICE, tensors))) == 1:  # the usual call: one device
        return (tensors[0],), tuple(tensors[1:])
    first = {t.device: t for t in reversed(tensors)}
    hints = tuple(first.values())
    return hints, tuple(t for t in tensors if not any(t is h for h in hints))
