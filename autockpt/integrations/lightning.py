"""Lightning: ``Trainer(callbacks=[AutoCheckpoint()])`` checkpoints the model for ``fit``.

NOTE [A LightningModule without a forward]
    Many ``LightningModule``s define no ``forward``: ``training_step`` calls ``self.net(x)``.
    Checkpointing the module itself would then walk a forward that only raises. So a module
    whose class leaves ``forward`` to ``LightningModule`` is not the target: its one child
    with parameters is, and with several the error lists them for ``module=``. Finding what
    ``training_step`` calls would mean running it, which draws random numbers and logs.

NOTE [Example inputs from the first batch]
    A budget is planned from a profile, which needs the checkpointed module's inputs. A
    training batch is not that: ``training_step`` unpacks it, moves it, maybe augments it.
    So the first training step runs with the ``"sqrt"`` plan while a forward pre-hook on the
    module keeps its first call's arguments, and the budget plan replaces it before the
    second step. Running ``training_step`` once beforehand to see the inputs would draw
    random numbers and log metrics the real run then does not match.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils._pytree import tree_map_only

from autockpt.api import auto_checkpoint, restore
from autockpt.planning.prepare import SegmentsSpec

__all__ = ["AutoCheckpoint"]


def _target(pl_module: nn.Module) -> nn.Module:
    """The module to checkpoint when ``module=`` is not given (NOTE [A LightningModule
    without a forward])."""
    from lightning.pytorch import LightningModule

    if type(pl_module).forward is not LightningModule.forward:
        return pl_module
    children = [(n, m) for n, m in pl_module.named_children() if any(True for _ in m.parameters())]
    if len(children) == 1:
        return children[0][1]
    names = ", ".join(repr(n) for n, _ in children) or "none"
    raise ValueError(
        f"AutoCheckpoint: {type(pl_module).__name__} has no forward of its own, so there is nothing "
        f"to checkpoint in it; name the submodule its training_step calls with module=... (children "
        f"with parameters: {names})."
    )


class AutoCheckpoint(Callback):  # type: ignore[misc]
    """Checkpoint the ``LightningModule`` (or its submodule ``module``) with autockpt while
    it is fitted, and restore it afterwards.

    Args:
        segments: what :func:`autockpt.auto_checkpoint` takes; ``"sqrt"`` by default.
        budget: plan for a memory budget instead (bytes, ``"2GiB"``, or a fraction of the
            unwrapped step); the example inputs come from the first training step (NOTE
            [Example inputs from the first batch]), which runs with the ``"sqrt"`` plan.
        module: the dotted name of the submodule to checkpoint (``"model"``,
            ``"backbone.encoder"``); by default the ``LightningModule`` itself, or, when it
            has no ``forward`` of its own (its ``training_step`` calls ``self.net``), its
            one child with parameters (NOTE [A LightningModule without a forward]).
        mode: force a walker (``"sequential"``, ``"graph"``, ``"blocks"``).
        head: ``"chunked"`` computes a Hugging Face causal LM's loss (``module``, called with
            ``labels=``) without whole logits, as :func:`autockpt.auto_checkpoint` does.

    Attributes:
        plan: the plan installed now (``None`` before ``fit`` and after it).
    """

    def __init__(
        self,
        segments: SegmentsSpec = "sqrt",
        *,
        budget: int | float | str | None = None,
        module: str | None = None,
        mode: str | None = None,
        head: str = "whole",
    ) -> None:
        self.segments = segments
        self.budget = budget
        self.module = module
        self.mode = mode
        self.head = head
        self.plan: Any = None
        self._target: nn.Module | None = None
        self._inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._handle: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        target = _target(pl_module) if self.module is None else pl_module.get_submodule(self.module)
        self._target = target
        auto_checkpoint(
            target, "sqrt" if self.budget is not None else self.segments, mode=self.mode, head=self.head
        )
        if self.budget is not None:
            self._handle = target.register_forward_pre_hook(self._keep_inputs, with_kwargs=True)
        self.plan = getattr(target.forward, "plan", None)

    def _keep_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inputs is None and torch.is_grad_enabled():
            self._inputs = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._handle is None or self._inputs is None or self._target is None:
            return
        self._handle.remove()
        self._handle = None
        args, kwargs = self._inputs
        self._inputs = None
        auto_checkpoint(
            self._target,
            budget=self.budget,
            example_inputs=args,
            example_kwargs=kwargs or None,
            mode=self.mode,
            head=self.head,
        )
        self.plan = getattr(self._target.forward, "plan", None)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self._target is None:
            return
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        restore(self._target)
        self._target, self.plan = None, None
