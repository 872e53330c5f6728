"""Smoke test over a zoo: timm families and Hugging Face models, exact and lower.

Every model is built from code or a config (``pretrained=False``, no downloads) at a tiny
size, in training mode, with its dropout and stochastic depth on, and checkpointed with
``auto_checkpoint(model, example_inputs=..., example_kwargs=...)``. Two claims per model:

* exact: after one training step from the same seed, the outputs, the RNG stream afterwards,
  every parameter gradient and every buffer equal those of an unwrapped deep copy, bitwise.
  The plan must checkpoint something, or the claim would be empty.
* lower: the allocator-level peak of a training step (``autockpt.track_memory``, after one
  unmeasured warm-up step) is below the unwrapped model's. These steps use a larger batch
  than the exact ones, so that activations, which checkpointing drops, are a real part of
  the step next to parameters and gradients, which it cannot drop.

The timm families cover convnets with BatchNorm (ResNet, RegNet, DenseNet's concatenations,
MobileNetV3's squeeze-excite), ConvNeXt, ViTs (DeiT called with and without its optional
``attn_mask``, EVA-02 with rotary embeddings), hybrids (CoAtNet, LeViT with a BatchNorm
after every linear layer, attention included), an MLP-mixer, Swin's shifted windows,
EfficientViM and a BYOB net. The Hugging Face list: GPT-2, BERT, DistilBERT, T5, BART,
Llama, Mistral, Qwen2, ViT, Whisper and Wav2Vec2, each given labels so that it computes
its own loss, which the step trains with; the decoders also with right-padded rows
(``attention_mask`` zero, labels -100 there).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_same_state
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.utils._pytree import tree_leaves

import autockpt

Kwargs = dict[str, Any]
Inputs = tuple[tuple[Any, ...], Kwargs, Callable[[Any], torch.Tensor]]


def leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor in a model's output (a tensor, a tuple, a Hugging Face ``ModelOutput``)."""
    if isinstance(out, dict):
        out = list(out.values())
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def seed(n: int) -> None:
    torch.manual_seed(n)
    np.random.seed(n)  # Wav2Vec2 draws its time masks (SpecAugment) from numpy


# --- timm ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vision:
    """A timm model: its factory, the image size, the batch of the memory test, and whether
    it is called with an attention mask that hides the last token of row 0."""

    factory: Callable[[], nn.Module]
    size: int
    lower_batch: int = 8
    attn_mask: bool = False

    def exact_inputs(self) -> Inputs:
        return self.inputs(2)

    def lower_inputs(self) -> Inputs:
        return self.inputs(self.lower_batch)

    def inputs(self, batch: int) -> Inputs:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 3, self.size, self.size, generator=gen)
        labels = torch.randint(0, 10, (batch,), generator=gen)
        kwargs: Kwargs = {}
        if self.attn_mask:
            tokens = 1 + (self.size // 16) ** 2  # the class token and 16-pixel patches
            mask = torch.ones(batch, 1, tokens, tokens, dtype=torch.bool)
            mask[0, :, :, -1] = False
            kwargs["attn_mask"] = mask
        return (x,), kwargs, lambda out: F.cross_entropy(out, labels)


def timm_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs)

    return build


def mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(
        num_classes=10, img_size=64, patch_size=16, num_blocks=4, embed_dim=64, drop_path_rate=0.1
    )


def densenet() -> nn.Module:
    from timm.models.densenet import DenseNet

    return DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_classes=10, drop_rate=0.1)


def swin() -> nn.Module:
    from timm.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        img_size=56, patch_size=4, num_classes=10, embed_dim=32, depths=(1, 1, 2, 1),
        num_heads=(1, 2, 4, 8), window_size=7, drop_path_rate=0.1,
    )  # fmt: skip


DEIT = timm_model("deit_tiny_patch16_224", img_size=64, depth=4, drop_path_rate=0.1, attn_drop_rate=0.1)

# Memory-test batches are large enough that activations outweigh the parameters' gradients
# (regnetx_002 at batch 16: 8.9 MiB of gradients set the peak, and a checkpoint cannot
# lower it); the tiny ViTs need more rows for the same reason.
TIMM: dict[str, Vision] = {
    "resnet": Vision(timm_model("test_resnet"), 32),
    "regnet": Vision(timm_model("regnetx_002"), 32, lower_batch=32),
    "densenet": Vision(densenet, 32),
    "mobilenetv3": Vision(timm_model("mobilenetv3_small_050", drop_path_rate=0.1), 32),
    "convnext": Vision(timm_model("test_convnext", drop_path_rate=0.1), 32),
    "deit": Vision(DEIT, 64, lower_batch=16),
    "deit_attn_mask": Vision(DEIT, 64, lower_batch=16, attn_mask=True),
    "eva02": Vision(
        timm_model("eva02_tiny_patch14_224", img_size=28, depth=4, drop_path_rate=0.1), 28, lower_batch=32
    ),
    "coatnet": Vision(timm_model("test_coatnet", img_size=32, drop_path_rate=0.1), 32),
    "levit": Vision(timm_model("levit_128s", img_size=64), 64),
    "mixer": Vision(mixer, 64, lower_batch=32),
    "swin": Vision(swin, 56, lower_batch=4),
    "efficientvim": Vision(timm_model("efficientvim_m1"), 64),
    "byobnet": Vision(timm_model("test_byobnet", drop_path_rate=0.1), 32),
}


# --- Hugging Face ----------------------------------------------------------------------

V = 256  # vocabulary of the text models


@dataclass(frozen=True)
class Hub:
    """A Hugging Face model from a tiny config, and its inputs (labels included) for a batch."""

    factory: Callable[[], nn.Module]
    inputs_of: Callable[[torch.Generator, int], Kwargs]
    lower_batch: int = 8

    def exact_inputs(self) -> Inputs:
        return self.inputs(2)

    def lower_inputs(self) -> Inputs:
        return self.inputs(self.lower_batch)

    def inputs(self, batch: int) -> Inputs:
        return (), self.inputs_of(torch.Generator().manual_seed(batch), batch), own_loss


def own_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def hf(config: str, model: str, **cfg: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**cfg))  # type: ignore[no-any-return]

    return build


def tokens(padded: bool = False, t: int = 32) -> Callable[[torch.Generator, int], Kwargs]:
    """Token ids, an attention mask and labels; ``padded``: row 0 ends in 5 padding tokens and
    row 2, where the batch has one, in 11; row 1 has none."""

    def make(gen: torch.Generator, batch: int) -> Kwargs:
        ids = torch.randint(3, V, (batch, t), generator=gen)
        mask = torch.ones(batch, t, dtype=torch.long)
        if padded:
            mask[0, t - 5 :] = 0
            mask[2:3, t - 11 :] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


def seq2seq(gen: torch.Generator, batch: int) -> Kwargs:
    kw = tokens()(gen, batch)
    kw["labels"] = torch.randint(3, V, (batch, 16), generator=gen)
    return kw


def images(gen: torch.Generator, batch: int) -> Kwargs:
    return {
        "pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 10, (batch,), generator=gen),
    }


def mel(gen: torch.Generator, batch: int) -> Kwargs:
    return {
        "input_features": torch.randn(batch, 8, 32, generator=gen),
        "labels": torch.randint(3, V, (batch, 16), generator=gen),
    }


def waveform(gen: torch.Generator, batch: int) -> Kwargs:
    return {
        "input_values": torch.randn(batch, 800, generator=gen),
        "labels": torch.randint(1, 32, (batch, 12), generator=gen),
    }


TOKENS = {"vocab_size": V, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
DECODER = {
    **TOKENS, "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
GPT2 = {**TOKENS, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 64}
ENC_DEC = {
    "encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
}  # fmt: skip

HF: dict[str, Hub] = {
    "gpt2": Hub(hf("GPT2Config", "GPT2LMHeadModel", **GPT2), tokens()),
    "gpt2_padded": Hub(hf("GPT2Config", "GPT2LMHeadModel", **GPT2), tokens(padded=True)),
    "bert": Hub(
        hf(
            "BertConfig",
            "BertForMaskedLM",
            **TOKENS,
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        tokens(),
    ),
    "distilbert": Hub(
        hf(
            "DistilBertConfig",
            "DistilBertForMaskedLM",
            vocab_size=V,
            pad_token_id=0,
            n_layers=2,
            dim=64,
            hidden_dim=128,
            n_heads=4,
            max_position_embeddings=64,
        ),
        tokens(),
    ),
    "t5": Hub(
        hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=V,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
            num_layers=2,
            num_decoder_layers=2,
            d_model=64,
            d_ff=128,
            d_kv=16,
            num_heads=4,
        ),
        seq2seq,
    ),
    "bart": Hub(
        hf(
            "BartConfig",
            "BartForConditionalGeneration",
            **TOKENS,
            **ENC_DEC,
            max_position_embeddings=64,
            decoder_start_token_id=2,
            forced_eos_token_id=2,
        ),
        seq2seq,
    ),
    "llama": Hub(hf("LlamaConfig", "LlamaForCausalLM", **DECODER), tokens()),
    "llama_padded": Hub(hf("LlamaConfig", "LlamaForCausalLM", **DECODER), tokens(padded=True)),
    "mistral": Hub(hf("MistralConfig", "MistralForCausalLM", **DECODER), tokens()),
    "mistral_padded": Hub(hf("MistralConfig", "MistralForCausalLM", **DECODER), tokens(padded=True)),
    "qwen2": Hub(hf("Qwen2Config", "Qwen2ForCausalLM", **DECODER), tokens()),
    "qwen2_padded": Hub(hf("Qwen2Config", "Qwen2ForCausalLM", **DECODER), tokens(padded=True)),
    "vit": Hub(
        hf(
            "ViTConfig",
            "ViTForImageClassification",
            image_size=32,
            patch_size=8,
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_labels=10,
        ),
        images,
    ),
    "whisper": Hub(
        hf(
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            **TOKENS,
            **ENC_DEC,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=1,
        ),
        mel,
    ),
    "wav2vec2": Hub(
        hf(
            "Wav2Vec2Config",
            "Wav2Vec2ForCTC",
            vocab_size=32,
            pad_token_id=0,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            conv_dim=(32, 32),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            mask_time_length=2,
            ctc_zero_infinity=True,
        ),
        waveform,
    ),
}

CASES: dict[str, Vision | Hub] = {
    **{f"timm-{k}": v for k, v in TIMM.items()},
    **{f"hf-{k}": v for k, v in HF.items()},
}


def build(name: str) -> nn.Module:
    pytest.importorskip("timm" if name.startswith("timm-") else "transformers")
    torch.manual_seed(0)
    return CASES[name].factory().train()


# --- the two claims ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_exact(name: str) -> None:
    model = build(name)
    args, kwargs, loss_fn = CASES[name].exact_inputs()
    ref = copy.deepcopy(model)
    autockpt.auto_checkpoint(model, example_inputs=args, example_kwargs=kwargs)
    plan = model.forward.plan
    assert plan.checkpointed_segments >= 1, f"nothing checkpointed:\n{plan}"
    results = []
    for m in (ref, model):
        seed(1)
        out = m(*args, **kwargs)
        loss_fn(out).backward()
        results.append((leaves(out), torch.rand(1)))
    (a, rng_a), (b, rng_b) = results
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs: {(x - y).abs().max()}"
    assert torch.equal(rng_a, rng_b), "RNG stream after the step differs"
    assert_same_state(ref, model)


def peak(
    model: nn.Module, args: tuple[Any, ...], kwargs: Kwargs, loss_fn: Callable[[Any], torch.Tensor]
) -> int:
    """Allocator-level peak of a training step, after an unmeasured warm-up step."""
    for measured in (False, True):
        for p in model.parameters():
            p.grad = None
        seed(0)
        with autockpt.track_memory("cpu", tensors=False) if measured else contextlib.nullcontext() as mem:
            out = model(*args, **kwargs)
            loss_fn(out).backward()
            del out
    assert isinstance(mem, autockpt.MemoryStats)
    return mem.peak_bytes


# The most of the unwrapped peak the checkpointed step may reach: 0.9, or where activations are
# a smaller share of the step, a bound above the ratio measured (torch 2.14, CPU) with headroom.
LOWER_AT_MOST = {
    "timm-byobnet": 0.95,  # measured 0.91
    "timm-coatnet": 0.96,  # 0.93
    "timm-efficientvim": 0.99,  # 0.97
    "timm-levit": 0.98,  # 0.96
    "timm-regnet": 0.97,  # 0.94
    "timm-swin": 0.95,  # 0.91; all others 0.82 or less
}


@pytest.mark.parametrize("name", list(CASES))
def test_lower(name: str) -> None:
    model = build(name)
    args, kwargs, loss_fn = CASES[name].lower_inputs()
    plain = peak(model, args, kwargs, loss_fn)
    autockpt.auto_checkpoint(model, example_inputs=args, example_kwargs=kwargs)
    wrapped = peak(model, args, kwargs, loss_fn)
    at_most = LOWER_AT_MOST.get(name, 0.9)
    assert wrapped <= at_most * plain, (
        f"peak {wrapped} B checkpointed, {plain} B unwrapped ({wrapped / plain:.3f}, at most {at_most}):\n"
        f"{model.forward.plan}"
    )
