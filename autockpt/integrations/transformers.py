"""Hugging Face: ``enable(model)`` in place of ``model.gradient_checkpointing_enable()``.

NOTE [Never two checkpointings]
    Hugging Face's own checkpointing wraps each decoder layer's class ``forward``; autockpt
    installs its own ``forward`` on the same layers. Both at once would checkpoint every layer
    twice: two recomputes, nothing saved. So ``enable`` switches Hugging Face's off first
    (with a warning), the callback refuses ``TrainingArguments(gradient_checkpointing=True)``
    with a message that says which to drop, and a block that finds Hugging Face's switched on
    under autockpt at run time raises (``execution/forward.py``).

NOTE [Caches while training]
    Hugging Face's checkpointing also sets ``use_cache=False`` for the layers it wraps; the
    checkpointed blocks here do the same per call (``walkers/kv_caches.py``). ``enable`` also
    sets ``model.config.use_cache = False`` while training, so no cache is built for layers
    that are not checkpointed either (what Hugging Face's forward does when its checkpointing
    is on), and ``disable`` puts the old value back.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from autockpt.api import auto_checkpoint, restore
from autockpt.planning.prepare import SegmentsSpec

__all__ = ["AutoCheckpointCallback", "disable", "enable", "hf_checkpointing"]

_CACHE_SETTING = "_autockpt_use_cache"  # the config's use_cache before enable()


def hf_checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face's own gradient (activation) checkpointing is on for ``model``."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # v5, v4
        flag = getattr(model, name, None)
        if isinstance(flag, bool):
            return flag
    return False


def _hf_checkpointing_off(model: nn.Module) -> None:
    off: Any = getattr(model, "activation_checkpointing_disable", None)  # v5; v4 below
    (off or getattr(model, "gradient_checkpointing_disable"))()  # noqa: B009


def enable(
    model: nn.Module,
    segments: SegmentsSpec = "sqrt",
    *,
    budget: int | float | str | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    mode: str | None = None,
    check: bool = False,
    head: str | None = None,
) -> nn.Module:
    """Checkpoint a Hugging Face model with autockpt: the one-line replacement for
    ``model.gradient_checkpointing_enable()``.

    Hugging Face's own checkpointing is switched off first if it is on (NOTE [Never two
    checkpointings]), and ``config.use_cache`` is set to ``False`` until :func:`disable`
    (NOTE [Caches while training]). The arguments are :func:`autockpt.auto_checkpoint`'s;
    with a budget, the loss is the model's own ``out.loss`` when the example inputs carry
    labels. ``head="chunked"`` computes a causal LM's loss without whole logits
    (``docs/head.md``); by default the model keeps what it has.

    Returns:
        ``model``, checkpointed in place.

    Examples:
        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> from autockpt.integrations.transformers import enable
        >>> model = enable(GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2)))
        >>> model.forward.plan.checkpointed_segments
        2
    """
    if hf_checkpointing(model):
        warnings.warn(
            "autockpt.integrations.transformers.enable: the model had Hugging Face's own gradient "
            "checkpointing on; it is switched off so that layers are not checkpointed twice.",
            UserWarning,
            stacklevel=2,
        )
        _hf_checkpointing_off(model)
    config = getattr(model, "config", None)
    if config is not None and _CACHE_SETTING not in vars(model):
        vars(model)[_CACHE_SETTING] = getattr(config, "use_cache", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
    has_labels = example_kwargs is not None and example_kwargs.get("labels") is not None
    return auto_checkpoint(
        model,
        segments,
        budget=budget,
        example_inputs=example_inputs,
        example_kwargs=example_kwargs,
        mode=mode,
        loss_fn=_model_loss if budget is not None and has_labels else None,
        check=check,
        head=head,
    )


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`: the original forward and ``config.use_cache`` are back."""
    restore(model)
    if _CACHE_SETTING in vars(model):
        setting = vars(model).pop(_CACHE_SETTING)
        if setting is not None:
            config: Any = getattr(model, "config")  # noqa: B009
            config.use_cache = setting
    return model


def _model_loss(out: Any) -> torch.Tensor:
    return out["loss"]  # type: ignore[no-any-return]


class AutoCheckpointCallback(TrainerCallback):  # type: ignore[misc]
    """``Trainer(..., callbacks=[AutoCheckpointCallback()])``: the model is checkpointed by
    autockpt when training begins and restored when it ends.

    With a ``budget``, the example inputs are the first ``per_device_train_batch_size``
    examples of the training set, collated as the trainer collates them, without touching
    the training dataloader (so the order and random state of training stay as they were);
    pass ``example_kwargs`` for a dataset that cannot be indexed. ``head="chunked"`` as for
    :func:`enable`. Do not also set
    ``TrainingArguments(gradient_checkpointing=True)`` (NOTE [Never two checkpointings]).
    """

    def __init__(
        self,
        segments: SegmentsSpec = "sqrt",
        *,
        budget: int | float | str | None = None,
        example_kwargs: dict[str, Any] | None = None,
        mode: str | None = None,
        head: str = "whole",
    ) -> None:
        self.segments = segments
        self.budget = budget
        self.example_kwargs = example_kwargs
        self.mode = mode
        self.head = head

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
            raise ValueError(
                "AutoCheckpointCallback: TrainingArguments has gradient_checkpointing=True, which "
                "checkpoints every layer with Hugging Face's own checkpointing; with autockpt as well "
                "each layer would be checkpointed twice. Set gradient_checkpointing=False (or remove "
                "the callback)."
            )
        model = kwargs["model"]
        example = self.example_kwargs
        if self.budget is not None and example is None:
            example = _first_batch(kwargs.get("train_dataloader"), args.per_device_train_batch_size)
        if example is not None:
            device = next(model.parameters()).device
            example = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example.items()}
        enable(
            model, self.segments, budget=self.budget, example_kwargs=example, mode=self.mode, head=self.head
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        disable(kwargs["model"])


def _first_batch(loader: Any, batch_size: int) -> dict[str, Any]:
    """The first ``batch_size`` training examples, collated as ``loader`` collates them."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    try:
        items = [dataset[i] for i in range(min(batch_size, len(dataset)))]  # type: ignore[index,arg-type]
    except TypeError as err:
        raise ValueError(
            "AutoCheckpointCallback: a budget needs example inputs, and the training dataset cannot "
            "be indexed to take them. Pass example_kwargs= (one batch, as the model receives it)."
        ) from err
    batch = collate(items) if collate is not None else items
    if not isinstance(batch, dict):
        batch = dict(batch)
    return batch
