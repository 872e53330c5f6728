"""``verify``: does checkpointing change anything but memory?

One training step of the unwrapped model and one of the checkpointed model, from the same
weights, buffers, inputs and RNG state, compared output by output and gradient by
gradient, with the peak memory of each step measured by :func:`track_memory`. The model
is left exactly as it was: forward, buffers, ``.grad`` and RNG state.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autockpt.api import auto_checkpoint
from autockpt.errors import AutockptError
from autockpt.execution.forward import installed, uninstall
from autockpt.execution.lm_head import head_parameters, installed_head, set_head
from autockpt.execution.policies import OpPolicy
from autockpt.measure.losses import LossFn
from autockpt.measure.sandbox import preserved
from autockpt.measure.step import StepResult, run_step
from autockpt.measure.tensors import as_args
from autockpt.plan import Plan, format_bytes
from autockpt.planning.prepare import SegmentsSpec

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
        note: what was verified when it is not simply the installed plan (empty otherwise).
        head_grad_rel_diff: with ``head="chunked"``, the largest relative difference of the
            head's gradients (its weight, bias and a tied embedding), which are summed over
            token chunks in another order; ``None`` otherwise. Every other gradient is
            held to ``atol``/``rtol`` as usual.
        head_grad_bound: the bound it is held to: 1e-12 in float64, 1e-5 in float32, 1e-2
            in 16-bit types.
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
    note: str = ""
    head_grad_rel_diff: float | None = None
    head_grad_bound: float | None = None

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
                *([f"  note: {self.note}"] if self.note else []),
                *self._head_line(),
            ]
        )

    def _head_line(self) -> list[str]:
        if self.head_grad_rel_diff is None:
            return []
        return [
            f"  head gradients (summed over token chunks): relative difference "
            f"{self.head_grad_rel_diff:.3g}, bound {self.head_grad_bound:g}"
        ]


def verify(
    model: nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    example_kwargs: dict[str, Any] | None = None,
    segments: SegmentsSpec | None = None,
    loss_fn: LossFn | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    policy: str | OpPolicy | None = None,
    head: str | None = None,
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
        policy: the op policy to check (see :func:`auto_checkpoint`); by default the
            installed plan's. Under a policy the checkpointed model first runs one step
            unmeasured: a segment's first forward keeps nothing while it learns.
        head: ``"chunked"`` or ``"whole"`` (see :func:`auto_checkpoint`); by default the
            model's own. With ``"chunked"`` the unwrapped step has the whole head, the loss
            is the model's ``out.loss`` unless ``loss_fn`` is given, the logits the chunked
            step does not return are not compared, and the head's gradients are held to
            ``head_grad_bound`` (reported in ``head_grad_rel_diff``).

    Returns:
        a :class:`VerifyReport`; ``report.ok`` tells whether everything matched.

    Examples:
        >>> import autockpt, torch
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]).double()
        >>> autockpt.verify(model, (torch.randn(2, 4, dtype=torch.float64),)).ok
        True
    """
    args, kwargs = as_args(example_inputs), dict(example_kwargs or {})
    current = installed(model)
    spec: SegmentsSpec = segments if segments is not None else (current.plan if current else "sqrt")
    note = ""
    provisional = current is not None and current.probe is None and not isinstance(current.spec, Plan)
    if segments is None and provisional and current is not None and current.spec is not None:
        # made without example inputs, the installed plan is replaced by the first training
        # step's dry run: check the plan that step installs, made the same way from these inputs
        spec = current.spec
        note = (
            "the installed plan was provisional (made without example inputs); verified is the "
            "plan the first training step on inputs like these installs"
        )
    if policy is None and segments is None and current is not None and current.policy_fn is not None:
        policy = current.policy_fn  # the installed plan's, which may be a function
    if head is None:
        head = "chunked" if installed_head(model) is not None else "whole"
    if head == "chunked" and loss_fn is None:
        loss_fn = _model_loss
    with preserved(model, [list(args), kwargs]) as fresh:
        uninstall(model)
        set_head(model, "whole", where="verify")
        fresh()
        run_step(model, args, kwargs, loss_fn)  # warm-up: lazy initialisation stays out of the figures
        fresh()
        reference = run_step(model, args, kwargs, loss_fn)
        auto_checkpoint(model, spec, example_inputs=args, example_kwargs=kwargs, policy=policy, head=head)
        checked = installed(model)
        if checked is None:  # auto_checkpoint always installs a plan
            raise AutockptError("verify: auto_checkpoint installed no plan; please report this.")
        plan = checked.plan
        if checked.policy_fn is not None:  # the segments learn in their first forward
            fresh()
            run_step(model, args, kwargs, loss_fn)
        fresh()
        checkpointed = run_step(model, args, kwargs, loss_fn)
        heads = head_parameters(model) if head == "chunked" else ()
    report = _compare(plan, reference, checkpointed, atol, rtol, tuple(f"grad of {n}" for n in heads))
    return dataclasses.replace(report, note=note)


def _model_loss(out: Any) -> torch.Tensor:
    return out["loss"]  # type: ignore[no-any-return]


def _head_bound(dtype: torch.dtype) -> float:
    """How far a head gradient summed over chunks may be from the whole sum, relatively."""
    return {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (
        float((a.double() - b.double()).abs().max())
        if a.is_floating_point()
        else float((a.long() - b.long()).abs().max())
    )


def _compare(
    plan: Plan, ref: StepResult, ckpt: StepResult, atol: float, rtol: float, heads: tuple[str, ...] = ()
) -> VerifyReport:
    """Every tensor of both steps; with ``heads`` (the chunked head's gradients), outputs
    only the reference has are its logits, and those gradients are held to the head bound."""
    groups = {"output": 0.0, "grad of input": 0.0, "grad of": 0.0, "buffer": 0.0}
    mismatches = []
    head_diff: float | None = 0.0 if heads else None
    bound: float | None = None
    for name in ref.tensors.keys() | ckpt.tensors.keys():
        a, b = ckpt.tensors.get(name), ref.tensors.get(name)
        if a is None or b is None:
            if (a is None) != (b is None) and not (heads and name.startswith("output") and a is None):
                mismatches.append(name)
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            mismatches.append(name)
            continue
        if name in heads:
            bound = _head_bound(b.dtype)
            scale = float(b.double().abs().max()) or 1.0
            relative = _max_diff(a, b) / scale
            head_diff = max(head_diff or 0.0, relative)
            if not relative <= bound:
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
        head_grad_rel_diff=head_diff,
        head_grad_bound=bound,
    )
