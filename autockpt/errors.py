"""The exception family raised by autockpt.

Every error autockpt raises on purpose is an :class:`AutockptError` (or a plain
``TypeError``/``ValueError`` for an argument of the wrong type or value), so callers can
catch the whole family with one ``except``.
"""

from __future__ import annotations

__all__ = ["AutockptError", "MutationError", "PlanInfeasibleError"]


class AutockptError(RuntimeError):
    """Base class of the errors autockpt raises on purpose."""


class PlanInfeasibleError(AutockptError):
    """No plan satisfies the request (for example a memory budget below the minimum).

    Attributes:
        min_budget_bytes: the smallest budget that has a plan, when the planner knows it.
        unwrapped_bytes: the predicted peak of the step without checkpointing, when known:
            with ``min_budget_bytes``, the range a budget can usefully take, so a retry needs
            no second call to find it.
    """

    def __init__(
        self, message: str, *, min_budget_bytes: int | None = None, unwrapped_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes
        self.unwrapped_bytes = unwrapped_bytes


class MutationError(AutockptError):
    """A parameter or buffer changed in place, or a module changed train/eval mode, between
    the forward and the backward of a checkpointed segment, which would make its recompute
    give wrong gradients."""
