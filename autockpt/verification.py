"""``verify``: does checkpointing change anything but memory?

One training step of the unwrapped model and one of the checkpointed model, from the same
weights, buffers, inputs and RNG state, compared output by output and gradient by
gradient, with the peak memory of each step measured by :func:`track_memory`. The model
is left exactly as it was: forward, buffers, ``.grad`` and RNG state.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autockpt.apply import auto_checkpoint, restore
from autockpt.forward import installed as _installed
from autockpt.losses import LossFn, step_loss
from autockpt.memory import MemoryStats, track_memory
from autockpt.plan import Plan, format_bytes
from autockpt.planning import SegmentsSpec, _as_args
from autockpt.runtime import buffer_slots, install_buffer_clones, reinstall_buffers

__all__ = ["VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of :func:`verify`.

    Attributes:
        plan: the plan that was checked.
        output_max_abs_diff: largest absolute difference over all output tensors.
        input_grad_max_abs_diff: same for gradients of floating-point inputs.
        param_grad_max_abs_diff: same over every parameter gradient.
        buffer_max_abs_diff: same over every buffer after the step.
        mismatches: names of tensors that differ beyond the tolerance (or exist in only
            one run), e.g. ``"grad of 3.weight"``.
        peak_bytes_unwrapped: allocator-level peak of the unwrapped step.
        peak_bytes_checkpointed: allocator-level peak of the checkpointed step.
        tensor_peak_bytes_unwrapped: tensor-level peak of the unwrapped step.
        tensor_peak_bytes_checkpointed: tensor-level peak of the checkpointed step.
        atol: absolute tolerance used.
        rtol: relative tolerance used.
    """

    plan: Plan
    output_max_abs_diff: float
    input_grad_max_abs_diff: float
    param_grad_max_abs_diff: float
    buffer_max_abs_diff: float
    mismatches: tuple[str, ...]
    peak_bytes_unwrapped: int
    peak_bytes_checkpointed: int
    tensor_peak_bytes_unwrapped: int
    tensor_peak_bytes_checkpointed: int
    atol: float
    rtol: float

    @property
    def ok(self) -> bool:
        """Whether every output, gradient and buffer matched within the tolerance."""
        return not self.mismatches

    @property
    def peak_ratio(self) -> float:
        """Checkpointed over unwrapped allocator-level peak."""
        return self.peak_bytes_checkpointed / max(1, self.peak_bytes_unwrapped)

    def to_json(self) -> str:
        """The report as JSON: ``ok``, every figure, and the plan as :meth:`Plan.to_json` has it."""
        figures = {k: v for k, v in self.__dict__.items() if k != "plan"}
        figures["mismatches"] = list(self.mismatches)
        return json.dumps({"ok": self.ok, **figures, "plan": json.loads(self.plan.to_json())}, indent=2)

    def __str__(self) -> str:
        verdict = "OK" if self.ok else f"MISMATCH in {len(self.mismatches)}: {', '.join(self.mismatches[:5])}"
        tol = f"atol={self.atol:g}, rtol={self.rtol:g}"
        return "\n".join(
            [
                f"autockpt verify: {verdict} ({tol}; plan {self.plan.strategy!r}, "
                f"{self.plan.checkpointed_segments} of {len(self.plan.segments)} segments checkpointed)",
                f"  max |diff|  outputs {self.output_max_abs_diff:.3g}, input grads "
                f"{self.input_grad_max_abs_diff:.3g}, parameter grads {self.param_grad_max_abs_diff:.3g}, "
                f"buffers {self.buffer_max_abs_diff:.3g}",
                f"  peak (allocator)  unwrapped {format_bytes(self.peak_bytes_unwrapped)}, "
                f"checkpointed {format_bytes(self.peak_bytes_checkpointed)} ({self.peak_ratio:.2f}x)",
                f"  peak (tensors)    unwrapped {format_bytes(self.tensor_peak_bytes_unwrapped)}, "
                f"checkpointed {format_bytes(self.tensor_peak_bytes_checkpointed)}",
            ]
        )


@dataclass
class _Step:
    tensors: dict[str, torch.Tensor | None]
    memory: MemoryStats


def verify(
    model: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    example_kwargs: dict[str, Any] | None = None,
    segments: SegmentsSpec | None = None,
    loss_fn: LossFn | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> VerifyReport:
    """Compare one training step of ``model`` with and without checkpointing.

    The loss is ``loss_fn``, by default a fixed random weighting of every floating-point
    output, so every output element gets a gradient. Floating-point inputs are made to
    require gradients (on copies) so that input gradients are compared too.

    Args:
        model: a model, checkpointed or not. It is left exactly as it was.
        example_inputs: positional inputs for one forward pass.
        example_kwargs: keyword inputs for it (an attention mask, say).
        segments: the plan to check, as for :func:`auto_checkpoint`; by default the
            model's installed plan, or ``"sqrt"`` for a model that is not checkpointed.
        loss_fn: the loss you train with (output -> scalar); it also sets the measured peaks.
        atol: absolute tolerance (0: bitwise, as expected on CPU).
        rtol: relative tolerance.

    Returns:
        a :class:`VerifyReport`; ``report.ok`` tells whether everything matched.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]).double()
        >>> autockpt.verify(model, (torch.randn(2, 4, dtype=torch.float64),)).ok
        True
    """
    args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
    installed = _installed(model)
    spec: SegmentsSpec = segments if segments is not None else (installed.plan if installed else "sqrt")
    device = _device_of(model, args)
    with _preserved(model) as fresh:
        _unwrap(model)
        fresh()
        _step(model, args, device, kwargs, loss_fn)  # warm-up: lazy initialisation stays out of the figures
        fresh()
        reference = _step(model, args, device, kwargs, loss_fn)
        auto_checkpoint(model, spec, example_inputs=args, example_kwargs=kwargs)
        installed_now = _installed(model)
        assert installed_now is not None
        plan = installed_now.plan
        fresh()
        checkpointed = _step(model, args, device, kwargs, loss_fn)
    return _compare(plan, reference, checkpointed, atol, rtol)


def _device_of(model: nn.Module, args: Sequence[Any]) -> torch.device:
    for t in (*model.parameters(), *tree_leaves(list(args))):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _unwrap(model: nn.Module) -> None:
    if _installed(model) is not None:
        restore(model)


@contextlib.contextmanager
def _preserved(model: nn.Module) -> Iterator[Any]:
    """Keep forward, buffers, grads and RNG; yield a function that resets to the start."""
    had_forward = "forward" in model.__dict__
    forward = model.__dict__.get("forward")
    slots = buffer_slots(model)
    grads = [(p, p.grad) for p in model.parameters()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def fresh() -> None:
        install_buffer_clones(slots)
        for p, _ in grads:
            p.grad = None
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    try:
        yield fresh
    finally:
        model.__dict__.pop("forward", None)
        if had_forward:
            model.__dict__["forward"] = forward
        reinstall_buffers(slots)
        for p, g in grads:
            p.grad = g
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _requires_grad_copy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().clone()
        return y.requires_grad_(True) if y.is_floating_point() or y.is_complex() else y
    return x


def _step(
    model: nn.Module,
    args: Sequence[Any],
    device: torch.device,
    kwargs: dict[str, Any] | None = None,
    loss_fn: LossFn | None = None,
    *,
    input_grads: bool = True,
) -> _Step:
    # on copies, so the caller's tensors get no .grad; without input_grads, only the inputs
    # that require gradients already get one, as in the caller's own step
    inputs = [
        _requires_grad_copy(a) if input_grads or (isinstance(a, torch.Tensor) and a.requires_grad) else a
        for a in args
    ]
    with track_memory(device) as mem:
        out = model(*inputs, **(kwargs or {}))
        loss = step_loss(out, loss_fn, where="verify")
        if loss.requires_grad:
            loss.backward()
        del loss
    tensors: dict[str, torch.Tensor | None] = {}
    for i, t in enumerate(tree_leaves(out)):
        if isinstance(t, torch.Tensor):
            tensors[f"output {i}"] = t.detach()
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            tensors[f"grad of input {i}"] = x.grad
    for name, p in model.named_parameters():
        tensors[f"grad of {name}"] = p.grad
    for name, b in model.named_buffers():
        tensors[f"buffer {name}"] = b.detach().clone()
    return _Step(tensors, mem)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (
        float((a.double() - b.double()).abs().max())
        if a.is_floating_point()
        else float((a.long() - b.long()).abs().max())
    )


def _compare(plan: Plan, ref: _Step, ckpt: _Step, atol: float, rtol: float) -> VerifyReport:
    groups = {"output": 0.0, "grad of input": 0.0, "grad of": 0.0, "buffer": 0.0}
    mismatches = []
    for name in ref.tensors.keys() | ckpt.tensors.keys():
        a, b = ckpt.tensors.get(name), ref.tensors.get(name)
        if a is None or b is None:
            if (a is None) != (b is None):
                mismatches.append(name)
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            mismatches.append(name)
            continue
        diff = _max_diff(a, b)
        group = next(g for g in groups if name.startswith(g))
        groups[group] = max(groups[group], diff)
        close = (
            torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)
            if (a.is_floating_point() or a.is_complex())
            else torch.equal(a, b)
        )
        if not close:
            mismatches.append(name)
    return VerifyReport(
        plan=plan,
        output_max_abs_diff=groups["output"],
        input_grad_max_abs_diff=groups["grad of input"],
        param_grad_max_abs_diff=groups["grad of"],
        buffer_max_abs_diff=groups["buffer"],
        mismatches=tuple(sorted(mismatches)),
        peak_bytes_unwrapped=ref.memory.peak_bytes,
        peak_bytes_checkpointed=ckpt.memory.peak_bytes,
        tensor_peak_bytes_unwrapped=ref.memory.tensor_peak_bytes,
        tensor_peak_bytes_checkpointed=ckpt.memory.tensor_peak_bytes,
        atol=atol,
        rtol=rtol,
    )


def measure_step(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any] | None = None, loss_fn: LossFn | None = None
) -> int:
    """Allocator-level peak of one training step of ``model`` as it is now, parameters,
    buffers and inputs included; the model is left exactly as it was. The inputs are used as
    they are: unlike :func:`verify`, no input gradient is computed unless one is asked for."""
    from autockpt.planning import _static_bytes

    device = _device_of(model, args)
    with _preserved(model) as fresh:
        fresh()
        _step(model, args, device, kwargs, loss_fn, input_grads=False)  # warm-up
        fresh()
        step = _step(model, args, device, kwargs, loss_fn, input_grads=False)
    values = [*args, *(kwargs or {}).values()]
    return _static_bytes(model, values) + step.memory.peak_bytes
