"""Small tensor helpers every step of the pipeline uses, each implemented once.

Walking, measuring, planning and verifying all need to find the tensors in a nested
input, count the bytes of distinct storages, make an input require gradients, and decide
which device a step runs on. Doing each in one place keeps their answers consistent: the
planner's "input bytes" and the verifier's are the same number because they are computed by
the same function.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "arguments_key",
    "as_args",
    "cloned",
    "detached",
    "device_of",
    "requiring_grad",
    "saved_storages",
    "signature",
    "static_bytes",
    "storage_bytes",
    "storage_key",
    "storage_sizes",
    "tensors_in",
    "written_storages",
]


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure (tuples, lists, dicts), in pytree order."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def signature(tree: Any) -> tuple[Hashable, ...]:
    """The shapes, dtypes, devices, strides and ``requires_grad`` of the tensors in ``tree``:
    what a measurement of them depends on, as a cache key."""
    leaves = tensors_in(tree)
    return tuple((tuple(v.shape), v.dtype, str(v.device), v.stride(), v.requires_grad) for v in leaves)


def arguments_key(tree: Any) -> tuple[Hashable, ...]:
    """A cache key for arguments: :func:`signature` of their tensors, and the other leaves
    by value where plain (flags, numbers, strings, ``None``), else by type."""
    others = tuple(
        (type(v), v) if isinstance(v, _PLAIN) else type(v)
        for v in tree_leaves(tree)
        if not isinstance(v, torch.Tensor)
    )
    return signature(tree), others


_PLAIN = (bool, int, float, str, type(None))


def storage_key(t: torch.Tensor) -> int:
    """Identifies the memory behind ``t``: views and aliases share it."""
    return int(t.untyped_storage()._cdata)


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors``, skipping storage keys in ``exclude``.

    A tensor and its views count once, at the size of the whole storage: that is what stays
    allocated while any of them is alive.
    """
    skip = set(exclude)
    return sum(n for k, n in storage_sizes(tensors).items() if k not in skip)


def storage_sizes(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Bytes of each distinct storage behind ``tensors``, by :func:`storage_key`."""
    return {storage_key(t): t.untyped_storage().nbytes() for t in tensors}


_WRITTEN_ARGUMENTS: dict[torch._ops.OpOverload, tuple[tuple[int, str], ...]] = {}


def written_storages(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> list[int]:
    """Storage keys an op writes into: those of its arguments the schema marks as mutable
    (``x.add_(y)``'s ``x``, ``out=`` tensors). Called for every op of a segment under a
    policy, so each op's mutable arguments are read from its schema once."""
    written = _WRITTEN_ARGUMENTS.get(op)
    if written is None:
        written = tuple(
            (i, a.name)
            for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN_ARGUMENTS[op] = written
    out = []
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                out.append(storage_key(t))
    return out


def static_bytes(model: nn.Module, inputs: Any) -> int:
    """Parameters, buffers and inputs: what a training step needs before it starts."""
    return storage_bytes([*model.parameters(), *model.buffers(), *tensors_in(inputs)])


def _differentiable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def requiring_grad(x: Any, *, as_given: bool = False) -> tuple[Any, list[torch.Tensor]]:
    """``x`` with every floating-point tensor replaced by a copy that requires gradients.

    With ``as_given``, only tensors that require gradients already get such a copy (a
    block's hidden states do, its attention mask does not); the others are detached.

    Returns ``(value, leaves)``. Each copy is a non-leaf made from a fresh leaf (in
    ``leaves``, where its gradient accumulates), so a first module that writes into its input
    in place (``ReLU(inplace=True)``) works as it does in a real network, where the input is
    an activation; an in-place op on a leaf that requires grad would raise. The caller's
    tensors are never changed.
    """
    leaves: list[torch.Tensor] = []

    def make(t: torch.Tensor) -> torch.Tensor:
        if not _differentiable(t) or (as_given and not t.requires_grad):
            return t.detach()
        leaf = t.detach().requires_grad_()
        leaves.append(leaf)
        return leaf.clone()

    return tree_map_only(torch.Tensor, make, x), leaves


def detached(x: Any) -> Any:
    """``x`` with every tensor detached (sharing storage)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach(), x)


def cloned(x: Any) -> Any:
    """``x`` with every tensor detached and copied."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), x)


def device_of(
    model: nn.Module | None, inputs: Any = (), device: str | torch.device | None = None
) -> torch.device:
    """The device a step of ``model`` on ``inputs`` runs on.

    One precedence everywhere: an explicit ``device``, else the first input tensor's device,
    else the first parameter's, else the first buffer's, else the CPU. CUDA being initialized
    says nothing about where this model runs, so it is never consulted.
    """
    if device is not None:
        return torch.device(device)
    owned = [*model.parameters(), *model.buffers()] if model is not None else []
    for t in (*tensors_in(inputs), *owned):
        return t.device
    return torch.device("cpu")


def as_args(example_inputs: Sequence[Any] | torch.Tensor | None) -> tuple[Any, ...]:
    """``example_inputs`` as a tuple of positional arguments (a lone tensor becomes ``(x,)``)."""
    if example_inputs is None:
        return ()
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


@contextlib.contextmanager
def saved_storages() -> Iterator[dict[int, int]]:
    """The storages autograd saves for backward inside the block, by :func:`storage_key`,
    with their bytes; the dict fills as the block runs."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.update(storage_sizes([t]))
        return t.detach()  # the tensor itself would make a cycle through its grad_fn: a leak

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpacked):
        yield saved


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t
