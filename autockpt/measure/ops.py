"""The op-level profile: every op a stage's forward runs, what it outputs, costs and saves.

Segment checkpointing only needs per-stage figures; choosing *which ops* a checkpointed
segment keeps (``policy=``) needs them per op: the bytes a kept output would hold, the time
its recompute would cost, and whether autograd keeps that output anyway. One forward of the
stage runs under a dispatch mode that sees each op (below autograd, as selective
checkpointing's policy does, and skipping the same ops it skips), with saved-tensor hooks
that see what autograd keeps.

Times are per op around its kernel (host clock on CPU, CUDA events on a GPU), the smaller of
two runs; they include the dispatch overhead of the mode itself, so tiny ops read high.
On the meta device nothing runs: times are nominal from FLOPs and output bytes, as stage
times are (``timing.nominal_times``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autockpt.measure.tensors import requiring_grad, storage_key, storage_sizes, tensors_in, written_storages
from autockpt.measure.timing import NOMINAL_BYTES_PER_MS, NOMINAL_FLOPS_PER_MS
from autockpt.planners import OpCost

__all__ = ["measure_ops", "op_name"]

try:  # ops selective checkpointing never asks its policy about, so positions line up
    from torch.utils.checkpoint import SAC_IGNORED_OPS as _IGNORED
except ImportError:  # pragma: no cover - older torch
    _IGNORED = {torch.ops.aten.detach.default}


def op_name(op: torch._ops.OpOverload) -> str:
    """``"aten.addmm.default"``: how profiles and plans name an op."""
    return str(op)


class _Recorder(TorchDispatchMode):
    """One forward's ops: name, new output storages, time, FLOPs, and later writes."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.meta = device.type == "meta"
        self.rows: list[dict[str, Any]] = []
        self.owner: dict[int, int] = {}  # storage key -> the row that created it
        self.events: list[tuple[Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        for key in written_storages(func, args, kwargs):
            if key in self.owner:
                self.rows[self.owner[key]]["changed"] = True
        before = {storage_key(t) for t in tensors_in((args, kwargs))}
        start = self._now()
        out = func(*args, **kwargs)
        stop = self._now()
        new = {k: n for k, n in storage_sizes(tensors_in(out)).items() if k not in before}
        row = len(self.rows)
        for k in new:
            self.owner[k] = row
        self.rows.append(
            {
                "op": func,
                "storages": set(new),
                "out_bytes": sum(new.values()),
                "span": (start, stop),
                "flops": _flops(func, args, kwargs, out),
                "changed": False,
            }
        )
        return out

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def times(self) -> list[float]:
        if self.meta:
            return [
                r["flops"] / NOMINAL_FLOPS_PER_MS + r["out_bytes"] / NOMINAL_BYTES_PER_MS for r in self.rows
            ]
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in (r["span"] for r in self.rows)]
        return [(b - a) * 1e3 for a, b in (r["span"] for r in self.rows)]


def _run(
    stage: Any, x: Any, device: torch.device, grads_as_given: bool
) -> tuple[_Recorder, list[float], set[int], set[int], int]:
    """One recorded forward: its ops, their times, the storages autograd saved, those of
    the stage's output, and where its tail starts: the first op that runs after the last
    save. Autograd sits above the dispatch mode, so it saves an op's inputs before the mode
    sees the op, and its outputs after: the ops recorded when the last save happens are
    the ones a recompute stopping there runs."""
    saved: set[int] = set()
    recorder = _Recorder(device)
    tail = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(storage_key(t))
        tail[0] = len(recorder.rows)
        return t.detach()

    inputs, _ = requiring_grad(x, as_given=grads_as_given)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
        out = stage(inputs)
    outputs = {storage_key(t) for t in tensors_in(out)}
    del out
    return recorder, recorder.times(), saved, outputs, tail[0]


def _flops(func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> int:
    """The op's FLOPs by torch's formulas (``torch.utils.flop_counter``), 0 where it has none."""
    from torch.utils import flop_counter

    formula = getattr(flop_counter, "flop_registry", {}).get(func.overloadpacket)
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not fit this overload: no estimate
        return 0


def measure_ops(
    stage: Any, x: Any, device: torch.device, *, grads_as_given: bool = False
) -> tuple[OpCost, ...]:
    """The ops of one forward of ``stage`` on ``x`` (see the module docstring); the caller
    puts buffers and the RNG back (``sandbox.dry_run_state``)."""
    runs = [_run(stage, x, device, grads_as_given) for _ in range(1 if device.type == "meta" else 2)]
    recorder, _, saved, outputs, tail = runs[-1]
    sequence = [r["op"] for r in recorder.rows]
    alike = [times for rec, times, *_ in runs if [r["op"] for r in rec.rows] == sequence]
    fastest = [min(times[i] for times in alike) for i in range(len(recorder.rows))]
    return tuple(
        OpCost(
            op=op_name(r["op"]),
            out_bytes=r["out_bytes"],
            ms=ms,
            flops=r["flops"],
            saved=bool(r["storages"] & saved),
            keepable=r["out_bytes"] > 0
            and not r["changed"]
            and torch.Tag.nondeterministic_seeded not in r["op"].tags,
            output=bool(r["storages"] & outputs),
            tail=i >= tail,
        )
        for i, (r, ms) in enumerate(zip(recorder.rows, fastest))
    )
