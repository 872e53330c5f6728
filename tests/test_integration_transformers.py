"""Hugging Face integration: ``enable``/``disable`` and ``AutoCheckpointCallback`` in ``Trainer``."""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import autockpt  # noqa: E402
from autockpt.integrations.transformers import AutoCheckpointCallback, disable, enable, hf_checkpointing  # noqa: E402

SEQ, BATCH = 128, 4
# Trainer needs accelerate (the ``transformers`` extra); transformers' own check, minimum version included
needs_accelerate = pytest.mark.skipif(
    not transformers.utils.is_accelerate_available(), reason="transformers' Trainer needs accelerate"
)


def gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=SEQ, n_embd=64, n_layer=4, n_head=4)
    return transformers.GPT2LMHeadModel(config).train()


def hf_on(model: Any) -> None:
    """Hugging Face's own checkpointing (``activation_`` since v5, ``gradient_`` before)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def test_enable_checkpoints_every_block_and_disable_puts_everything_back() -> None:
    model = gpt2()
    assert model.config.use_cache is True
    enable(model)
    assert model.forward.plan.walker == "blocks" and model.forward.plan.checkpointed_segments == 4
    assert model.config.use_cache is False
    model(**batch()).loss.backward()
    disable(model)
    assert "forward" not in vars(model) and model.config.use_cache is True


def test_enable_switches_hugging_faces_own_checkpointing_off() -> None:
    model = gpt2()
    hf_on(model)
    with pytest.warns(UserWarning, match="switched off so that layers are not checkpointed twice"):
        enable(model)
    assert not hf_checkpointing(model)
    ref = gpt2()
    enable(ref)
    torch.manual_seed(3)  # the same dropout masks
    model(**batch()).loss.backward()
    torch.manual_seed(3)
    ref(**batch()).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_hugging_faces_checkpointing_switched_on_under_autockpt_raises() -> None:
    model = enable(gpt2())
    hf_on(model)
    with pytest.raises(autockpt.AutockptError, match=r"checkpointed twice.*gradient_checkpointing_disable"):
        model(**batch())


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(2))
        self.rows = [{"input_ids": r, "labels": r.clone()} for r in ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def train(model: Any, callbacks: list[Any], **overrides: Any) -> int:
    """Two steps through ``Trainer``; the allocator-level peak of ``train()``."""
    with tempfile.TemporaryDirectory() as out:
        options = {
            "output_dir": out, "max_steps": 2, "per_device_train_batch_size": BATCH, "learning_rate": 1e-3,
            "report_to": [], "save_strategy": "no", "logging_strategy": "no", "use_cpu": True, "seed": 0,
            "disable_tqdm": True, "dataloader_num_workers": 0, **overrides,
        }  # fmt: skip
        trainer = transformers.Trainer(
            model=model,
            args=transformers.TrainingArguments(**options),
            train_dataset=Rows(16),
            callbacks=callbacks,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()  # a warm-up: the allocator's first step holds more
        with autockpt.track_memory() as mem, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    return mem.peak_bytes


@needs_accelerate
@pytest.mark.parametrize("budget", [None, 0.6])
def test_trainer_with_the_callback_trains_the_same_parameters_in_less_memory(budget: float | None) -> None:
    base = gpt2()
    plain, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    callback = AutoCheckpointCallback(budget=budget)
    peak_plain = train(plain, [])
    peak_checkpointed = train(checkpointed, [callback])
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert "forward" not in vars(checkpointed)  # restored when training ended
    assert peak_checkpointed < 0.8 * peak_plain


@needs_accelerate
def test_the_callback_refuses_hugging_faces_checkpointing_as_well() -> None:
    fields = transformers.TrainingArguments.__dataclass_fields__
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    with pytest.raises(ValueError, match=r"gradient_checkpointing=True.*twice"):
        train(gpt2(), [AutoCheckpointCallback()], **{flag: True})
