"""The dry run: run a chain's units once to learn what no attribute says.

Which units write into their input in place (no segment boundary may sit in front of them,
NOTE [In-place boundaries] in ``walkers/chain.py``), how many bytes each unit's input holds (what a
checkpoint starting there keeps) and how many bytes each unit saves for backward. Callers
run it inside :func:`autockpt.measure.sandbox.dry_run_state`, so buffers and the RNG are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autockpt.measure.sandbox import dry_run_state
from autockpt.measure.tensors import (
    cloned,
    detached,
    requiring_grad,
    saved_storages,
    storage_bytes,
    storage_key,
    tensors_in,
)
from autockpt.walkers import Walked
from autockpt.walkers.chain import DryRun, Unit

__all__ = ["dry_run", "probe_units"]


def dry_run(
    model: nn.Module,
    walked: Walked,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    where: str,
    saved: bool = True,
) -> DryRun | None:
    """The dry run of ``model`` on these inputs, leaving no trace (``None`` for the block
    walker, which has none: each block is checkpointed alone and keeps its own inputs).
    ``saved=False`` leaves out the bytes each unit saves, a second pass over the units that
    a budget plan does not need: its profile measures them (NOTE [Dry run bytes])."""
    if walked.walker == "blocks":
        return None
    x = walked.entry_value(args, kwargs, where=where)
    with dry_run_state(model, x):
        return probe_units(walked.units, x, saved=saved)


# NOTE [Dry run bytes]
#     The saved bytes per unit are what plans without measured costs ("sqrt", the "saves
#     little" warning, the figures of Plan.explain) stand on. A budget plan stands on its
#     profile, which measures every stage's bytes at the allocator, so its dry run skips that
#     pass: about 0.8 training steps of a 78-stage timm mobileone_s1, per call. Such a dry run
#     is not reused by a later plan made without example inputs (``reused_dry_run``): that
#     plan's first forward dry-runs the model in full.


def probe_units(units: Sequence[Unit], x: Any, *, saved: bool = True) -> DryRun:
    """Dry-run ``units`` on ``x``: find inputs modified in place, and measure every input.

    Index ``j`` is returned when running any unit ``i >= j`` changes the version counter
    of unit ``j``'s input (directly or through a view of the same storage). The run keeps
    only tensors that share storage with the current value, so it needs about one
    activation of memory, not the whole forward pass. Gradients stay enabled (so modules
    take their training paths) but the graph is cut after every unit.

    The caller restores buffers and RNG around this call.
    """
    unsafe: set[int] = set()
    sizes: list[int] = []
    watched: list[tuple[int, torch.Tensor, int]] = []  # (unit index, tensor, version)
    value = cloned(x)  # never mutate the caller's input
    inputs: list[torch.Tensor] = []
    for i, unit in enumerate(units):
        inputs = tensors_in(value)
        keys = {storage_key(t) for t in inputs}
        sizes.append(storage_bytes(inputs))
        watched = [w for w in watched if storage_key(w[1]) in keys]
        watched.extend((i, t, t._version) for t in inputs)
        value = detached(unit.fn(value))
        for j, t, version in watched:
            if t._version != version:
                unsafe.add(j)
        watched = [(j, t, t._version) for j, t, _ in watched]
    del value, watched, inputs  # NOTE [A light dry run]
    return DryRun(frozenset(unsafe), tuple(sizes), _saved_bytes(units, x) if saved else ())


# NOTE [A light dry run]
#     Without example inputs the dry run happens inside the first training forward, so its
#     peak is that step's too. The probe's last value (the model's output) and the tensors
#     it watched lived on through the saved-bytes pass: torchvision's
#     lraspp_mobilenet_v3_large (2x3x128x128) peaked at 26.5 MiB in its dry run, 2.6 MiB of
#     it that output, against 25.1 MiB for a checkpointed step (1.056x).


def _saved_bytes(units: Sequence[Unit], x: Any) -> tuple[int, ...]:
    """Bytes each unit saves for backward (its input included when it keeps it).

    A second pass, because autograd only saves what a gradient needs: every floating input
    is made a fresh non-leaf that requires grad (a copy, so aliasing is not watched here).
    """
    out: list[int] = []
    value = detached(x)
    for unit in units:
        value, _ = requiring_grad(value)
        with saved_storages() as saved:
            result = unit.fn(value)
        params = {storage_key(p) for p in unit.parameters()}
        out.append(sum(n for k, n in saved.items() if k not in params))
        value = detached(result)
        del result  # its graph holds what the unit saved: free it before the next unit runs
    return tuple(out)
