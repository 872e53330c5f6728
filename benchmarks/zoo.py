"""The model zoo: one training step of many real models, unwrapped vs autockpt.

For every timm family (the smallest variant with fewer than 40M parameters, ``test_*``
models left out, at the smallest of 64..224 pixels it accepts), Hugging Face decoders,
encoders, encoder-decoders and speech/vision models from tiny configs (trained with their
own loss, and the text models once more with a padded batch), and torchvision
classification, detection and segmentation models in train mode (``weights=None``), each
in a fresh worker process with a timeout:

* ``auto_checkpoint(model, example_inputs=...)`` (``"sqrt"``) and ``budget=0.6``: the walker,
  stages, segments and checkpointed segments of the plan; whether the parameter gradients,
  buffers and loss after one step are bitwise those of the unwrapped model (same seeds, so
  the same dropout masks); the allocator-level peak of one step after a warm-up, over the
  unwrapped step's (parameters, buffers and inputs excluded; also with gradients kept
  between steps); planning time and step time over the unwrapped step time (medians of
  interleaved steps, process CPU time because the machine is shared; wall time in the JSON).
* ``first_step_ratio``: a model checkpointed without example inputs (the dry run happens in
  its first training forward), peak of the first step over the peak of its next one.
* Hugging Face models: the same figures for ``activation_checkpointing_enable()``
  (``gradient_checkpointing_enable()`` before transformers 5), the target being autockpt's
  ``"sqrt"`` peak within 2% of it at no more step time, within the run's noise (a copy of
  HF's model timed beside it, NOTE [Zoo HF time noise]). The text models run twice: once
  unpadded, once with right-padded rows (``attention_mask`` zeros, labels -100 there).

The unwrapped model is also stepped twice from the same state: where the two disagree, the
model is not deterministic on this machine and exactness is not judged ("nondet"). No
weights are downloaded. A full run writes ``results/zoo.json`` and ``results/zoo.md``
(rewritten after each model); a run restricted by ``--only``, ``--suite`` or ``--limit``
writes ``zoo_subset.json`` and ``zoo_subset.md`` instead. The timm choices are cached in
``results/zoo_timm_models.json``.

    python benchmarks/zoo.py [--only NAME ...] [--suite timm|hf|torchvision] [--limit N]
                             [--timeout 300] [--out results] [--repeats 3] [--resume]

Each model runs in a spawned worker process (a few models per process, a fresh one after a
crash or a timeout), so a model that crashes, hangs or runs out of memory (``--memory-gib``
caps a worker's data size) is recorded as an error with its last finished phase. Errors
keep their type, first line, innermost autockpt frame and traceback in the JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from _common import setup
from torch import nn
from torch.nn import functional
from torch.utils._pytree import tree_leaves

import autockpt
from autockpt.measure.tensors import static_bytes

MAX_PARAMS = 40_000_000
IMAGE_SIZES = (64, 96, 112, 128, 160, 192, 224)
BUDGET = 0.6
# NOTE [Zoo budget fallback]
#     budget=0.6 is a fraction of the whole step, parameters and inputs included; where the
#     planner's floor lies above it (small models whose parameters, or one stage's working
#     set, are most of the step), the zoo records the floor and plans again at the budget
#     halfway between the floor and the unwrapped step, so every model still shows a budget
#     plan run, exact and within its budget. The error carries the unwrapped step's predicted
#     peak (``unwrapped_bytes``), so the retry is the only second call: the planning time is
#     that of both calls together, the profile measured once.
# NOTE [Zoo HF time noise]
#     "At no more step time than HF's checkpointing" is a comparison of two steps that run
#     the same kernels within a percent or two of each other, and two deep copies of one
#     model can differ by as much (HF's model against a copy of itself: 0.1% on Mistral,
#     3% on Qwen2 in one run), from where their tensors lie in memory. So a copy of HF's
#     checkpointed model is timed in the same interleaving, and autockpt's step counts as
#     no slower when its ratio to HF's is within 1 + |copy / HF - 1|, the run's own noise,
#     which the table and the JSON state (``hf_time_noise``) beside the raw ratio.
# NOTE [Zoo planning times]
#     Each planning call is timed after a full ``gc.collect()``, as ``timeit`` keeps the
#     collector out of its timings: with timm and transformers loaded a full collection takes
#     about 0.2 s, several steps of a small model, and one falls wherever the objects that
#     building and copying models left behind cross the collector's threshold, often inside
#     the next call. After the collect, one that falls inside a planning call is that call's
#     own (the collector stays on).
LOWER = 0.99  # a peak ratio below this counts as lower
FIRST_STEP_SLACK = 1.05
ACTIVATIONS_OVER_PARAMETERS = 1.5  # NOTE [Zoo input size]
HF_PEAK_SLACK = 1.02
PLAN_TARGET = 3.0  # auto_checkpoint with example inputs, in training steps
BUDGET_PLAN_TARGET = 10.0  # the same with a budget (profile included)
Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass
class Case:
    """One model to run: ``suite``, ``family`` (a timm module, an HF model, a torchvision task)
    and ``name``; ``choice`` is a cached timm choice."""

    suite: str
    family: str
    name: str
    choice: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        return f"{self.suite}/{self.name}"


@dataclasses.dataclass
class Built:
    model: nn.Module
    inputs: Inputs
    loss_fn: Callable[[Any], torch.Tensor]
    info: dict[str, Any]
    hf: bool = False


# ---------------------------------------------------------------------------------- timm


def timm_choose(family: str, batch: int) -> dict[str, Any]:
    """The smallest variant of a timm family under MAX_PARAMS that runs, and its input size."""
    import timm

    counts: list[tuple[int, str]] = []
    for name in timm.list_models(module=family):
        if name.startswith("test_"):
            continue
        try:
            with torch.device("meta"):
                m = timm.create_model(name, pretrained=False)
            counts.append((sum(p.numel() for p in m.parameters()), name))
        except Exception:  # counted on the CPU below if it is ever a candidate
            continue
    counts.sort()
    if not counts:
        return {"model": None, "skip": "no variant builds on the meta device"}
    under = [(n, name) for n, name in counts if n < MAX_PARAMS]
    if not under:
        n, name = counts[0]
        return {"model": None, "skip": f"smallest variant {name} has {n / 1e6:.1f}M parameters"}
    tried = []
    for n, name in under[:3]:
        found = timm_probe(name, batch)
        if found is not None:
            return {"model": name, "params": n, **found, "not_running": tried}
        tried.append(name)
    return {"model": None, "skip": f"none of {tried} runs a forward at any size"}


def timm_probe(name: str, batch: int) -> dict[str, Any] | None:
    """The input size for a timm model: the smallest square size it runs a train-mode
    forward at where its activations outweigh its parameters enough (NOTE [Zoo input
    size]), else the largest size tried (its default)."""
    import timm

    def runs(model: nn.Module, chans: int, size: int) -> bool:
        try:
            with torch.no_grad():
                model(torch.randn(batch, chans, size, size))
            return True
        except Exception:
            return False

    plain = timm.create_model(name, pretrained=False).train()
    chans, h, w = plain.pretrained_cfg.get("input_size", (3, 224, 224))
    sizes = sorted({s for s in IMAGE_SIZES if s <= max(h, w)} | {max(h, w)})
    found: dict[str, Any] | None = None
    for size in sizes:
        model, kwargs = plain, {}
        if not runs(plain, chans, size):
            try:
                model, kwargs = (
                    timm.create_model(name, pretrained=False, img_size=size).train(),
                    {"img_size": size},
                )
            except Exception:
                continue
            if not runs(model, chans, size):
                continue
        found = {"input": [batch, chans, size, size], "kwargs": kwargs}
        try:
            if activations_outweigh_parameters(model, torch.randn(batch, chans, size, size)):
                return found
        except Exception:  # a train-mode step that fails is reported by the run itself
            return found
    return found


# NOTE [Zoo input size]
#     At 64x64 a ViT has 16 tokens; its activations are then smaller than its parameters'
#     gradients, the unwrapped step's peak is the gradients at the end of backward, and no
#     checkpointing can lower it (every such model measured 1.00x here, and 0.23-0.58x with
#     gradients allocated before the step). Nobody checkpoints a model there. So the zoo runs
#     each model at the smallest input at which the tensors its forward saves for backward
#     weigh at least 1.5 times its parameters: where checkpointing has something to save
#     (at 1x, the peak is still the gradients whenever a plan halves the activations: ViTs
#     measured 0.86-1.00x, and 0.10-0.19x with gradients allocated before the step).
#     torchvision's classifiers grow by the same rule from their listed size.


def activations_outweigh_parameters(model: nn.Module, x: torch.Tensor) -> bool:
    """Whether one train-mode forward saves for backward (parameters excluded) at least
    ACTIVATIONS_OVER_PARAMETERS times the bytes of the model's parameters."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(saved.values()) >= ACTIVATIONS_OVER_PARAMETERS * weights


def build_timm(case: Case, batch: int) -> Built:
    import timm

    choice = case.choice or timm_choose(case.family, batch)
    case.choice = choice
    if choice["model"] is None:
        raise NothingToRunError(choice["skip"])
    torch.manual_seed(0)
    model = timm.create_model(choice["model"], pretrained=False, **choice["kwargs"]).train()
    x = torch.randn(*choice["input"])
    return Built(
        model,
        ((x,), {}),
        classification_loss(x.shape[0]),
        {"model": choice["model"], "input": "x".join(map(str, choice["input"]))},
    )


class NothingToRunError(Exception):
    """The family has no model to run under the zoo's rules."""


def classification_loss(batch: int, classes_seed: int = 3) -> Callable[[Any], torch.Tensor]:
    """Cross-entropy on every (batch, classes) output, the mean square of any other output."""
    gen = torch.Generator().manual_seed(classes_seed)
    labels = torch.randint(0, 1 << 20, (batch,), generator=gen)

    def loss(out: Any) -> torch.Tensor:
        total = torch.zeros(())
        for t in tree_leaves(out):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad):
                continue
            if t.dim() == 2 and t.shape[0] == batch:
                total = total + functional.cross_entropy(t.float(), labels % t.shape[1])
            else:
                total = total + t.float().square().mean()
        return total

    return loss


# ---------------------------------------------------------------------------- Hugging Face

HF_MODELS = (
    "gpt2",
    "bert",
    "distilbert",
    "t5",
    "bart",
    "llama",
    "mistral",
    "qwen2",
    "vit",
    "whisper",
    "wav2vec2",
)
HF_PADDED = ("gpt2", "bert", "distilbert", "t5", "bart", "llama", "mistral", "qwen2")
VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 1000, 32, 64, 4, 4
ATTN = "sdpa"


def hf_model(family: str) -> nn.Module:
    import transformers as tr

    small = {"vocab_size": VOCAB, "attn_implementation": ATTN}
    decoder = {
        **small,
        "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2 * SEQ,
        "pad_token_id": 0,
    }
    seq2seq = {
        **small,
        "d_model": HIDDEN,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": HEADS,
        "decoder_attention_heads": HEADS,
        "encoder_ffn_dim": 2 * HIDDEN,
        "decoder_ffn_dim": 2 * HIDDEN,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "decoder_start_token_id": 1,
    }
    if family == "gpt2":
        cfg = tr.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_positions=2 * SEQ, **small)
        return tr.GPT2LMHeadModel(cfg)
    if family == "bert":
        cfg = tr.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=2 * SEQ,
            **small,
        )
        return tr.BertForMaskedLM(cfg)
    if family == "distilbert":
        cfg = tr.DistilBertConfig(
            dim=HIDDEN,
            n_layers=LAYERS,
            n_heads=HEADS,
            hidden_dim=2 * HIDDEN,
            max_position_embeddings=2 * SEQ,
            **small,
        )
        return tr.DistilBertForMaskedLM(cfg)
    if family == "t5":
        cfg = tr.T5Config(
            d_model=HIDDEN,
            d_kv=HIDDEN // HEADS,
            d_ff=2 * HIDDEN,
            num_layers=LAYERS,
            num_decoder_layers=LAYERS,
            num_heads=HEADS,
            decoder_start_token_id=0,
            pad_token_id=0,
            **small,
        )
        return tr.T5ForConditionalGeneration(cfg)
    if family == "bart":
        return tr.BartForConditionalGeneration(tr.BartConfig(max_position_embeddings=2 * SEQ, **seq2seq))
    if family in ("llama", "mistral", "qwen2"):
        names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}[family]
        cfg = getattr(tr, f"{names}Config")(**decoder)
        return getattr(tr, f"{names}ForCausalLM")(cfg)
    if family == "vit":
        cfg = tr.ViTConfig(
            image_size=32,
            patch_size=4,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            num_labels=10,
            attn_implementation=ATTN,
        )
        return tr.ViTForImageClassification(cfg)
    if family == "whisper":
        cfg = tr.WhisperConfig(
            num_mel_bins=80, max_source_positions=64, max_target_positions=2 * SEQ, **seq2seq
        )
        return tr.WhisperForConditionalGeneration(cfg)
    if family == "wav2vec2":
        cfg = tr.Wav2Vec2Config(
            vocab_size=32,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            conv_dim=(32, 32, 32),
            conv_stride=(5, 2, 2),
            conv_kernel=(10, 3, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=4,
            ctc_zero_infinity=True,
            attn_implementation=ATTN,
        )
        return tr.Wav2Vec2ForCTC(cfg)
    raise ValueError(f"zoo: unknown Hugging Face model {family!r}")


def hf_inputs(family: str, padded: bool, batch: int) -> tuple[dict[str, Any], str]:
    gen = torch.Generator().manual_seed(5)
    if family == "vit":
        return {
            "pixel_values": torch.randn(batch, 3, 32, 32, generator=gen),
            "labels": torch.randint(0, 10, (batch,), generator=gen),
        }, f"{batch}x3x32x32"
    if family == "whisper":
        feats = torch.randn(batch, 80, 128, generator=gen)
        labels = torch.randint(3, VOCAB, (batch, SEQ // 2), generator=gen)
        return {
            "input_features": feats,
            "labels": labels,
            "use_cache": False,
        }, f"{batch}x80x128, labels {SEQ // 2}"
    if family == "wav2vec2":
        wav = torch.randn(batch, 4000, generator=gen)
        return {
            "input_values": wav,
            "labels": torch.randint(1, 32, (batch, 10), generator=gen),
        }, f"{batch}x4000"
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    if padded:  # right padding: row i ends 5 * i tokens early
        for i in range(batch):
            if i:
                mask[i, SEQ - 5 * i :] = 0
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    kw: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if padded:
        kw["attention_mask"] = mask
    if family not in ("bert", "distilbert"):
        kw["use_cache"] = False
    return kw, f"{batch}x{SEQ}" + (" padded" if padded else "")


def build_hf(case: Case, batch: int) -> Built:
    padded = case.name.endswith(" padded")
    torch.manual_seed(0)
    model = hf_model(case.family).train()
    kwargs, shape = hf_inputs(case.family, padded, batch)
    return Built(
        model, ((), kwargs), hf_loss, {"model": type(model).__name__, "input": shape, "attn": ATTN}, hf=True
    )


def hf_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------ torchvision

TV_CLASSIFICATION: dict[str, tuple[int, dict[str, Any]]] = {
    "resnet18": (64, {}),
    "resnet50": (64, {}),
    "resnext50_32x4d": (64, {}),
    "wide_resnet50_2": (64, {}),
    "mobilenet_v2": (64, {}),
    "mobilenet_v3_small": (64, {}),
    "mobilenet_v3_large": (64, {}),
    "efficientnet_b0": (64, {}),
    "efficientnet_v2_s": (64, {}),
    "regnet_x_400mf": (64, {}),
    "regnet_y_400mf": (64, {}),
    "convnext_tiny": (64, {}),
    "swin_t": (64, {}),
    "swin_v2_t": (64, {}),
    "maxvit_t": (224, {}),
    "vit_b_16": (224, {}),  # NOTE [Zoo input size]: at 64 its activations weigh less than its parameters
    "densenet121": (64, {}),
    "shufflenet_v2_x0_5": (64, {}),
    "squeezenet1_1": (64, {}),
    "googlenet": (64, {}),
    "inception_v3": (299, {}),
    "mnasnet0_5": (64, {}),
    "alexnet": (64, {}),
    "vgg11_bn": (64, {}),
}
SMALL_DETECTION = {"min_size": 160, "max_size": 160}
TV_DETECTION: dict[str, dict[str, Any]] = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": {},
    "fasterrcnn_resnet50_fpn": SMALL_DETECTION,
    "retinanet_resnet50_fpn": SMALL_DETECTION,
    "fcos_resnet50_fpn": SMALL_DETECTION,
    "maskrcnn_resnet50_fpn": SMALL_DETECTION,
    "keypointrcnn_resnet50_fpn": SMALL_DETECTION,
    "ssdlite320_mobilenet_v3_large": {},
}
TV_SEGMENTATION: dict[str, dict[str, Any]] = {
    "deeplabv3_mobilenet_v3_large": {"aux_loss": True},
    "deeplabv3_resnet50": {"aux_loss": True},
    "fcn_resnet50": {"aux_loss": True},
    "lraspp_mobilenet_v3_large": {},
}


def build_torchvision(case: Case, batch: int) -> Built:
    import torchvision

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    name = case.name
    if case.family == "classification":
        size, kw = TV_CLASSIFICATION[name]
        model = torchvision.models.get_model(name, weights=None, **kw).train()
        b = batch if size <= 128 else 2  # inception_v3 at 299
        for grown in [s for s in IMAGE_SIZES if s > size] if size <= 128 else []:
            if activations_outweigh_parameters(model, torch.randn(b, 3, size, size)):
                break
            size = grown  # NOTE [Zoo input size]
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, **kw).train()
        x = torch.randn(b, 3, size, size, generator=gen)
        return Built(
            model, ((x,), {}), classification_loss(b), {"model": name, "input": f"{b}x3x{size}x{size}"}
        )
    if case.family == "detection":
        model = torchvision.models.get_model(name, weights=None, weights_backbone=None, **TV_DETECTION[name])
        images = [torch.rand(3, 160, 160, generator=gen) for _ in range(2)]
        targets = []
        for _ in images:
            t: dict[str, torch.Tensor] = {
                "boxes": torch.tensor([[10.0, 20.0, 80.0, 90.0], [30.0, 30.0, 120.0, 140.0]]),
                "labels": torch.tensor([1, 1] if name.startswith("keypointrcnn") else [1, 2]),
            }
            if name.startswith("maskrcnn"):
                masks = torch.zeros(2, 160, 160, dtype=torch.uint8)
                masks[0, 20:90, 10:80] = 1
                masks[1, 30:140, 30:120] = 1
                t["masks"] = masks
            if name.startswith("keypointrcnn"):
                kp = torch.rand(2, 17, 3, generator=gen) * 60 + 30
                kp[..., 2] = 1
                t["keypoints"] = kp
            targets.append(t)
        return Built(
            model.train(), ((images, targets), {}), sum_losses, {"model": name, "input": "2x3x160x160"}
        )
    if case.family == "segmentation":
        model = torchvision.models.get_model(
            name, weights=None, weights_backbone=None, **TV_SEGMENTATION[name]
        )
        b = min(batch, 2)  # dilated backbones at 128x128: slow on a CPU
        x = torch.randn(b, 3, 128, 128, generator=gen)
        target = torch.randint(0, 21, (b, 128, 128), generator=gen)
        return Built(
            model.train(),
            ((x,), {}),
            segmentation_loss(target),
            {"model": name, "input": f"{b}x3x128x128"},
        )
    raise ValueError(f"zoo: unknown torchvision task {case.family!r}")


def sum_losses(out: Any) -> torch.Tensor:
    return sum(out.values())  # type: ignore[no-any-return]


def segmentation_loss(target: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    def loss(out: Any) -> torch.Tensor:
        total = functional.cross_entropy(out["out"], target)
        if "aux" in out:
            total = total + 0.5 * functional.cross_entropy(out["aux"], target)
        return total

    return loss


# ------------------------------------------------------------------------------ the cases


def all_cases(cache: dict[str, Any]) -> list[Case]:
    import timm

    cases = []  # the quick suites first: a run cut short has them (--resume goes on)
    for fam in HF_MODELS:
        cases.append(Case("hf", fam, fam))
        if fam in HF_PADDED:
            cases.append(Case("hf", fam, f"{fam} padded"))
    for task, names in (
        ("classification", TV_CLASSIFICATION),
        ("detection", TV_DETECTION),
        ("segmentation", TV_SEGMENTATION),
    ):
        cases.extend(Case("torchvision", task, name) for name in names)
    return cases + [Case("timm", fam, fam, cache.get(fam)) for fam in timm.list_modules()]


def selected(case: Case, only: list[str] | None, suite: str | None) -> bool:
    if suite is not None and case.suite != suite:
        return False
    if not only:
        return True
    names = [
        case.family,
        case.name,
        *([case.choice["model"]] if case.choice and case.choice.get("model") else []),
    ]
    return any(n.lower().startswith(o.lower()) for o in only for n in names)


# ---------------------------------------------------------------------------- one model


def interleaved_times(fns: list[Callable[[], None]], repeats: int) -> tuple[list[float], list[float]]:
    """Median wall and process CPU seconds of each function, run in turn (the models have all
    run steps before, so no warm-up).

    CPU time (all threads of the process) is what the ratios use: on a shared machine it
    moves far less with the load than wall time does.
    """
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for k in range(len(fns)):  # each round starts with the next variant: no position bias
            i = (r + k) % len(fns)
            t0, c0 = time.perf_counter(), time.process_time()
            fns[i]()
            wall[i].append(time.perf_counter() - t0)
            cpu[i].append(time.process_time() - c0)
    return [statistics.median(t) for t in wall], [statistics.median(t) for t in cpu]


def seed_all(seed: int) -> None:
    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def train_step(model: nn.Module, built: Built, seed: int | None = None) -> torch.Tensor:
    """Forward, the model's loss, backward; returns the loss."""
    args, kwargs = built.inputs
    if seed is not None:
        seed_all(seed)
    loss = built.loss_fn(model(*args, **kwargs))
    loss.backward()
    return loss.detach()


def snapshot(model: nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor | None]:
    state: dict[str, torch.Tensor | None] = {"loss": loss.clone()}
    for name, p in model.named_parameters():
        state[f"grad {name}"] = None if p.grad is None else p.grad.detach().clone()
    for name, b in model.named_buffers():
        state[f"buffer {name}"] = b.detach().clone()
    return state


def mismatches(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> list[str]:
    """Names whose tensors are not bitwise equal (max difference where comparable)."""
    out = []
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            out.append(f"{name} (missing or shape/dtype)")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            out.append(f"{name} (max abs diff {diff:.3g})")
    return sorted(out)


def exact_step(model: nn.Module, built: Built, ref: dict[str, Any] | None) -> dict[str, Any]:
    """One seeded step from the pristine state; compared with the reference step."""
    loss = train_step(model, built, seed=1)
    if ref is None:
        return {}
    bad = mismatches(ref, snapshot(model, loss))
    return {"exact": not bad, "mismatches": bad[:20], "n_mismatches": len(bad)}


def peak_of_step(model: nn.Module, built: Built, seed: int = 2, *, keep_grads: bool = False) -> int:
    """Allocator-level peak of one step; gradients set to None first, or zeroed in place."""
    if keep_grads:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
    else:
        zero_grads(model)
    inputs = copy.deepcopy(built.inputs)
    args, kwargs = inputs
    with autockpt.track_memory("cpu", tensors=False) as mem:
        seed_all(seed)
        built.loss_fn(model(*args, **kwargs)).backward()
    return mem.peak_bytes


def describe_plan(plan: autockpt.Plan) -> dict[str, Any]:
    return {
        "walker": plan.walker,
        "strategy": plan.strategy,
        "stages": plan.n_stages,
        "segments": len(plan.segments),
        "checkpointed": plan.checkpointed_segments,
        "recomputed_stages": plan.recomputed_stages,
        "notes": list(plan.notes),
    }


def error_info(err: BaseException) -> dict[str, Any]:
    """Type, one-line message, the innermost autockpt frame and the traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if f"{os.sep}autockpt{os.sep}" in f.filename and "benchmarks" not in f.filename]
    frame = ours[-1] if ours else (frames[-1] if frames else None)
    where = ""
    if frame is not None:
        path = (
            frame.filename.split(f"{os.sep}autockpt{os.sep}", 1)[-1]
            if ours
            else os.path.basename(frame.filename)
        )
        where = f"{'autockpt/' if ours else ''}{path}:{frame.lineno} in {frame.name}"
    message = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return {
        "type": type(err).__name__,
        "message": message[:300],
        "frame": where,
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-6000:],
    }


def has_plan(model: nn.Module) -> autockpt.Plan | None:
    fwd = model.__dict__.get("forward")
    return getattr(fwd, "plan", None)


class Phases:
    """Runs the phases of one model: times each, keeps its error, reports the record after it."""

    def __init__(self, rec: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
        self.rec, self.report = rec, report
        rec.setdefault("phase_s", {})

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        except NothingToRunError:
            raise
        except Exception as err:
            self.rec["errors"][name] = error_info(err)
        finally:
            self.rec["phase_s"][name] = round(time.perf_counter() - t0, 2)
            self.report(self.rec)


def run_case(
    case: Case, opts: argparse.Namespace, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """All measurements of one model; ``report`` receives the record after each phase."""
    rec: dict[str, Any] = {"suite": case.suite, "family": case.family, "name": case.name, "errors": {}}
    rec["autockpt_commit"] = getattr(opts, "autockpt_commit", None)
    phase = Phases(rec, report)
    builders = {"timm": build_timm, "hf": build_hf, "torchvision": build_torchvision}
    built: Built | None = None
    try:
        with phase("build"):
            built = builders[case.suite](case, opts.batch)
    except NothingToRunError as why:
        rec["skipped"] = str(why)
    rec["choice"] = case.choice
    if built is None:
        return rec
    rec.update(built.info)
    base = built.model
    rec["params"] = sum(p.numel() for p in base.parameters())
    args, kwargs = built.inputs
    example = {"example_inputs": args if args else None, "example_kwargs": kwargs or None}
    models: dict[str, nn.Module] = {}
    ref: dict[str, Any] | None = None

    with phase("reference"):  # twice: is the unwrapped model deterministic here?
        none = copy.deepcopy(base)
        ref = snapshot(none, train_step(none, built, seed=1))
        again = copy.deepcopy(base)
        bad = mismatches(ref, snapshot(again, train_step(again, built, seed=1)))
        del again
        rec["deterministic"] = not bad
        if bad:
            rec["nondeterministic"] = bad[:5]
            ref = None
        models["none"] = none
    if "none" not in models:
        return rec

    # autockpt "sqrt" and budget=0.6, with example inputs
    variants: dict[str, dict[str, Any]] = {"sqrt": {}, "budget": {"budget": BUDGET, "loss_fn": built.loss_fn}}
    for label, extra in variants.items():
        with phase(label):
            model = copy.deepcopy(base)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                gc.collect()  # NOTE [Zoo planning times]
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    try:
                        autockpt.auto_checkpoint(model, **example, **extra)
                    except autockpt.PlanInfeasibleError as err:
                        rec["budget_floor_bytes"] = err.min_budget_bytes
                        if err.min_budget_bytes is None:
                            raise
                        # NOTE [Zoo budget fallback]: halfway between the floor and no checkpointing
                        whole = err.unwrapped_bytes
                        assert whole is not None
                        rec["budget_fallback_bytes"] = (err.min_budget_bytes + whole) // 2
                        rec["budget_fraction"] = rec["budget_fallback_bytes"] / whole
                        extra = {**extra, "budget": rec["budget_fallback_bytes"]}
                        autockpt.auto_checkpoint(model, **example, **extra)
                finally:
                    rec[f"{label}_plan_s"] = time.perf_counter() - t0
                    rec[f"{label}_plan_cpu_s"] = time.process_time() - c0
                    rec[f"{label}_warnings"] = sorted(
                        {str(w.message)[:300] for w in caught if "autockpt" in str(w.filename)}
                    )
            plan = has_plan(model)
            if plan is not None:
                rec[f"{label}_plan"] = describe_plan(plan)
                if label == "budget":
                    rec["budget_bytes"] = plan.budget_bytes
                    rec["budget_predicted_bytes"] = plan.predicted_peak_bytes
            rec.update({f"{label}_{k}": v for k, v in exact_step(model, built, ref).items()})
            models[label] = model

    with phase("first_step"):  # checkpointed without example inputs: first step vs the next
        lazy = autockpt.auto_checkpoint(copy.deepcopy(base))
        inputs = copy.deepcopy(built.inputs)
        with autockpt.track_memory("cpu", tensors=False) as first:
            seed_all(1)
            loss = built.loss_fn(lazy(*inputs[0], **inputs[1]))
            loss.backward()
        if ref is not None:
            bad = mismatches(ref, snapshot(lazy, loss.detach()))
            rec.update(first_exact=not bad, first_mismatches=bad[:20], first_n_mismatches=len(bad))
        del loss
        plan = has_plan(lazy)
        if plan is not None:
            rec["first_plan"] = describe_plan(plan)
        steady = peak_of_step(lazy, built)
        rec.update(
            first_peak_bytes=first.peak_bytes,
            first_steady_bytes=steady,
            first_step_ratio=first.peak_bytes / steady if steady else None,
        )
        del lazy

    again: nn.Module | None = None  # a copy of HF's checkpointed model, timed too
    if built.hf:  # Hugging Face's own gradient checkpointing
        with phase("hf"):
            model = copy.deepcopy(base)
            enable = getattr(model, "activation_checkpointing_enable", None)
            rec["hf_method"] = (
                "activation_checkpointing_enable" if enable else "gradient_checkpointing_enable"
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (enable or model.gradient_checkpointing_enable)()
            model.train()
            rec.update({f"hf_{k}": v for k, v in exact_step(model, built, ref).items()})
            models["hf"] = model
            again = copy.deepcopy(model)  # NOTE [Zoo HF time noise]
            train_step(again, built)  # its warm-up step
            zero_grads(again)
    del base

    for label, model in list(models.items()):  # peaks, the exactness step being the warm-up
        with phase(f"{label}_peak"):
            del models[label]
            rec[f"{label}_peak_bytes"] = peak_of_step(model, built)
            rec[f"{label}_peak_grads_kept_bytes"] = peak_of_step(model, built, keep_grads=True)
            if label == "budget":
                rec["budget_total_bytes"] = (
                    static_bytes(model, [list(args), kwargs]) + rec["budget_peak_bytes"]
                )
            models[label] = model
    if "none" not in models:
        return rec
    rec["static_bytes"] = static_bytes(models["none"], [list(args), kwargs])

    with phase("timing"):  # interleaved step times
        names = list(models)

        def stepper(m: nn.Module) -> Callable[[], None]:
            def step() -> None:
                train_step(m, built)
                zero_grads(m)

            return step

        step_s = rec["phase_s"]["reference"] / 2  # two unwrapped steps (and two deep copies)
        # HF's targets compare autockpt with HF's checkpointing within a few percent on steps of
        # tens of ms: they get up to 200 steps each
        cap = 200 if built.hf else 20
        repeats = max(
            opts.repeats, min(cap, int(opts.time_per_variant * (10 if built.hf else 1) / max(step_s, 1e-3)))
        )
        rec["timed_steps"] = repeats
        if again is not None:
            names.append("hf_again")
            models["hf_again"] = again
        wall, cpu = interleaved_times([stepper(models[n]) for n in names], repeats)
        rec.update({f"{n}_step_s": t for n, t in zip(names, wall)})
        rec.update({f"{n}_step_cpu_s": t for n, t in zip(names, cpu)})
    derive(rec)
    return rec


def derive(rec: dict[str, Any]) -> None:
    """Ratios from the raw figures."""
    none_peak = rec.get("none_peak_bytes")
    for label in ("sqrt", "budget", "hf"):
        peak = rec.get(f"{label}_peak_bytes")
        if none_peak and peak is not None:
            rec[f"{label}_peak_ratio"] = peak / none_peak
        kept, none_kept = rec.get(f"{label}_peak_grads_kept_bytes"), rec.get("none_peak_grads_kept_bytes")
        if none_kept and kept is not None:
            rec[f"{label}_peak_ratio_grads_kept"] = kept / none_kept
        for clock, suffix in (("cpu_", ""), ("", "_wall")):  # ratios of CPU time, and of wall time
            t, none_t = rec.get(f"{label}_step_{clock}s"), rec.get(f"none_step_{clock}s")
            if none_t and t is not None:
                rec[f"{label}_time_ratio{suffix}"] = t / none_t
            if none_t and rec.get(f"{label}_plan_{clock}s") is not None:
                rec[f"{label}_plan_ratio{suffix}"] = rec[f"{label}_plan_{clock}s"] / none_t
    if rec.get("budget_floor_bytes") and rec.get("static_bytes") is not None and none_peak:
        rec["budget_floor_ratio"] = rec["budget_floor_bytes"] / (rec["static_bytes"] + none_peak)
    if rec.get("budget_bytes") and rec.get("budget_total_bytes") is not None:
        rec["budget_kept"] = rec["budget_total_bytes"] <= rec["budget_bytes"]
        if rec.get("static_bytes") is not None and none_peak:
            rec["budget_total_ratio"] = rec["budget_total_bytes"] / (rec["static_bytes"] + none_peak)
    if rec.get("hf_peak_bytes") and rec.get("sqrt_peak_bytes") is not None:
        rec["sqrt_vs_hf_peak"] = rec["sqrt_peak_bytes"] / rec["hf_peak_bytes"]
        if rec.get("hf_step_cpu_s") and rec.get("sqrt_step_cpu_s"):
            rec["sqrt_vs_hf_time"] = rec["sqrt_step_cpu_s"] / rec["hf_step_cpu_s"]
            rec["sqrt_vs_hf_time_wall"] = rec["sqrt_step_s"] / rec["hf_step_s"]
            noise = 0.0  # NOTE [Zoo HF time noise]
            if rec.get("hf_again_step_cpu_s"):
                noise = abs(rec["hf_again_step_cpu_s"] / rec["hf_step_cpu_s"] - 1)
                rec["hf_time_noise"] = noise
            rec["meets_hf_target"] = (
                rec["sqrt_vs_hf_peak"] <= HF_PEAK_SLACK and rec["sqrt_vs_hf_time"] <= 1.0 + noise
            )


# ------------------------------------------------------------------------------- workers


def autockpt_commit() -> str:
    """The checkout's commit, ``+dirty`` when autockpt/ has changes (others edit it meanwhile)."""
    import subprocess

    root = Path(autockpt.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        return run.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--", "autockpt") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def worker_main(conn: Connection, opts: argparse.Namespace) -> None:
    """Run cases sent over ``conn`` until ``None`` arrives; partial records as they grow."""
    import resource

    if opts.memory_gib:
        limit = int(opts.memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    torch.set_flush_denormal(True)
    warnings.filterwarnings("ignore")
    opts.autockpt_commit = autockpt_commit()
    import logging

    logging.disable(logging.WARNING)
    while True:
        case = conn.recv()
        if case is None:
            return
        try:
            rec = run_case(case, opts, lambda r: conn.send(("partial", r)))
        except BaseException as err:  # MemoryError included: report and go on
            rec = {
                "suite": case.suite,
                "family": case.family,
                "name": case.name,
                "errors": {"worker": error_info(err)},
            }
        rec["choice"] = case.choice if case.suite == "timm" else None
        conn.send(("done", rec))


class Worker:
    """A spawned worker process that runs cases one at a time."""

    def __init__(self, ctx: Any, opts: argparse.Namespace) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, opts), daemon=True)
        self.proc.start()
        child.close()
        self.done = 0

    def run(self, case: Case, timeout: float) -> tuple[dict[str, Any], bool]:
        """The case's record, and whether the worker is still usable."""
        latest: dict[str, Any] = {"suite": case.suite, "family": case.family, "name": case.name, "errors": {}}
        self.conn.send(case)
        start = time.monotonic()
        deadline = start + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                phase = last_phase(latest)
                latest["errors"]["timeout"] = {
                    "type": "Timeout",
                    "message": f"no result within {timeout:.0f} s (after phase {phase})",
                    "frame": "",
                    "traceback": "",
                }
                derive(latest)
                latest["seconds"] = time.monotonic() - start
                return latest, False
            try:
                if self.conn.poll(min(left, 1.0)):
                    kind, rec = self.conn.recv()
                    latest = rec
                    if kind == "done":
                        self.done += 1
                        rec["seconds"] = time.monotonic() - start
                        return rec, True
                elif not self.proc.is_alive():
                    raise EOFError
            except (EOFError, OSError):
                code = self.proc.exitcode
                self.kill()
                latest["errors"]["worker"] = {
                    "type": "WorkerDied",
                    "message": f"worker exited with code {code} (after phase {last_phase(latest)})",
                    "frame": "",
                    "traceback": "",
                }
                derive(latest)
                latest["seconds"] = time.monotonic() - start
                return latest, False

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(30)
        except (OSError, BrokenPipeError):
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def last_phase(rec: dict[str, Any]) -> str:
    """The last phase that finished."""
    done = list(rec.get("phase_s", {}))
    return done[-1] if done else "none"


# ------------------------------------------------------------------------------- reports


def failures(rec: dict[str, Any]) -> dict[str, Any]:
    """The errors of a record, but for a budget the planner declared infeasible (an answer)."""
    return {
        ph: e
        for ph, e in rec["errors"].items()
        if not (ph == "budget" and e["type"] == "PlanInfeasibleError")
    }


def status(rec: dict[str, Any]) -> str:
    """One word: skipped, WRONG, error, nondet, exact or '?'."""
    if rec.get("skipped"):
        return "skipped"
    if any(rec.get(f"{v}_exact") is False for v in ("sqrt", "budget", "first", "hf")):
        return "WRONG"
    if failures(rec):
        return "error"
    if rec.get("deterministic") is False:
        return "nondet"
    return "exact" if rec.get("sqrt_exact") else "?"


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in records if not r.get("skipped")]
    wrong = [r["name"] for r in records if status(r) == "WRONG"]
    ratios = [r["sqrt_peak_ratio"] for r in ran if r.get("sqrt_peak_ratio") is not None]
    budget = [r["budget_peak_ratio"] for r in ran if r.get("budget_peak_ratio") is not None]
    first = [r["first_step_ratio"] for r in ran if r.get("first_step_ratio") is not None]
    hf = [r for r in ran if r.get("meets_hf_target") is not None]
    timm = [r for r in ran if r["suite"] == "timm"]
    hf_all = [r for r in ran if r["suite"] == "hf"]
    return {
        "models": len(records),
        "skipped": len(records) - len(ran),
        "ran": len(ran),
        "exact": sum(1 for r in ran if r.get("sqrt_exact")),
        "wrong": wrong,
        "nondeterministic": sum(1 for r in ran if r.get("deterministic") is False),
        "checkpointed": sum(1 for r in ran if (r.get("sqrt_plan") or {}).get("checkpointed", 0) > 0),
        "lower_peak": sum(1 for x in ratios if x < LOWER),
        "failing": [r["name"] for r in ran if failures(r)],
        "budget_infeasible": sum(1 for r in ran if r.get("budget_floor_bytes") is not None),
        "median_sqrt_peak_ratio": statistics.median(ratios) if ratios else None,
        "median_budget_peak_ratio": statistics.median(budget) if budget else None,
        "budget_kept": sum(1 for r in ran if r.get("budget_kept")),
        "first_step_ok": sum(1 for x in first if x <= FIRST_STEP_SLACK),
        "first_step_measured": len(first),
        "hf_target_met": sum(1 for r in hf if r["meets_hf_target"]),
        "hf_peak_met": sum(1 for r in hf if r["sqrt_vs_hf_peak"] <= HF_PEAK_SLACK),
        "hf_compared": len(hf),
        "autockpt_commits": dict(collections.Counter(str(r.get("autockpt_commit")) for r in records)),
        "timm_ran": len(timm),
        "timm_good": sum(1 for r in timm if good(r)),
        "timm_not_good": [r["name"] for r in timm if not good(r)],
        "hf_budget_good": sum(1 for r in hf_all if r.get("budget_kept") and r.get("budget_exact")),
        "hf_ran": len(hf_all),
        "plan_within": sum(1 for r in ran if (r.get("sqrt_plan_ratio") or math.inf) <= PLAN_TARGET),
        "budget_plan_within": sum(
            1 for r in ran if (r.get("budget_plan_ratio") or math.inf) <= BUDGET_PLAN_TARGET
        ),
        "plan_measured": sum(1 for r in ran if r.get("sqrt_plan_ratio") is not None),
        "budget_plan_measured": sum(1 for r in ran if r.get("budget_plan_ratio") is not None),
    }


def good(r: dict[str, Any]) -> bool:
    """Exact, checkpointed and lower in peak, with no failure: the zoo's target per timm family."""
    return (
        status(r) == "exact"
        and (r.get("sqrt_plan") or {}).get("checkpointed", 0) > 0
        and (r.get("sqrt_peak_ratio") or 1.0) < LOWER
    )


def summary_line(s: dict[str, Any], elapsed: float) -> str:
    def med(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    wrong = f"WRONG gradients/buffers: {len(s['wrong'])}" + (
        f" ({', '.join(s['wrong'])})" if s["wrong"] else ""
    )
    return (
        f"zoo: {s['models']} models ({s['skipped']} skipped), {s['ran']} ran: {s['exact']} exact, "
        f"{s['checkpointed']} checkpointed, {s['lower_peak']} lower peak (<{LOWER}), "
        f"{len(s['failing'])} failing, {s['nondeterministic']} nondeterministic; {wrong}; "
        f"median peak ratio sqrt {med(s['median_sqrt_peak_ratio'])}, "
        f"budget {BUDGET} {med(s['median_budget_peak_ratio'])} "
        f"(kept {s['budget_kept']}, infeasible {s['budget_infeasible']}); "
        f"first step <= steady +5%: {s['first_step_ok']}/{s['first_step_measured']}; "
        f"HF target (peak <= GC +2%, time <= GC within the run's noise): "
        f"{s['hf_target_met']}/{s['hf_compared']} "
        f"(peak alone {s['hf_peak_met']}); HF budget plans kept and exact: "
        f"{s['hf_budget_good']}/{s['hf_ran']}; timm exact, checkpointed and lower: "
        f"{s['timm_good']}/{s['timm_ran']}; plan <= {PLAN_TARGET:.0f}x a step: "
        f"{s['plan_within']}/{s['plan_measured']}, budget plan <= {BUDGET_PLAN_TARGET:.0f}x: "
        f"{s['budget_plan_within']}/{s['budget_plan_measured']}; {elapsed / 60:.1f} min"
    )


def fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def error_cell(rec: dict[str, Any]) -> str:
    if rec.get("skipped"):
        return rec["skipped"]
    parts = [
        f"{phase}: {e['type']}: {e['message'][:120]}" + (f" [{e['frame']}]" if e.get("frame") else "")
        for phase, e in rec["errors"].items()
    ]
    for v in ("sqrt", "budget", "first", "hf"):
        if rec.get(f"{v}_exact") is False:
            parts.append(
                f"{v} NOT EXACT: {rec[f'{v}_n_mismatches']} tensors, e.g. {rec[f'{v}_mismatches'][0]}"
            )
    return "; ".join(parts).replace("|", "\\|").replace("\n", " ")


def yes_no(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def mib_cell(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def budget_cell(r: dict[str, Any]) -> str:
    if r.get("budget_peak_ratio") is not None and r.get("budget_fraction") is not None:
        floor = r.get("budget_floor_ratio")
        return (
            f"{fmt(r['budget_peak_ratio'])} at budget {r['budget_fraction']:.2f} ({BUDGET} infeasible, "
            f"floor {fmt(floor)})"
        )
    if r.get("budget_peak_ratio") is not None:
        return fmt(r["budget_peak_ratio"])
    if r.get("budget_floor_ratio") is not None:
        return f"infeasible (floor {r['budget_floor_ratio']:.2f})"
    return "-"


MAIN_COLUMNS = (
    ("suite", lambda r: r["suite"]),
    ("model", lambda r: model_cell(r)),
    ("input", lambda r: r.get("input", "-")),
    ("params", lambda r: "-" if r.get("params") is None else f"{r['params'] / 1e6:.1f}M"),
    ("walker", lambda r: (r.get("sqrt_plan") or {}).get("walker", "-")),
    ("stages", lambda r: (r.get("sqrt_plan") or {}).get("stages", "-")),
    (
        "segs / ckpt",
        lambda r: "{} / {}".format(
            *((r.get("sqrt_plan") or {}).get(k, "-") for k in ("segments", "checkpointed"))
        ),
    ),
    ("exact", lambda r: status(r)),
    ("peak sqrt", lambda r: fmt(r.get("sqrt_peak_ratio"))),
    ("peak sqrt, grads kept", lambda r: fmt(r.get("sqrt_peak_ratio_grads_kept"))),
    ("time sqrt", lambda r: fmt(r.get("sqrt_time_ratio"))),
    ("plan/step", lambda r: fmt(r.get("sqrt_plan_ratio"), ".1f")),
    (f"ckpt {BUDGET}", lambda r: (r.get("budget_plan") or {}).get("checkpointed", "-")),
    (f"peak {BUDGET}", budget_cell),
    ("kept", lambda r: yes_no(r.get("budget_kept"))),
    (f"time {BUDGET}", lambda r: fmt(r.get("budget_time_ratio"))),
    (f"plan/step {BUDGET}", lambda r: fmt(r.get("budget_plan_ratio"), ".1f")),
    ("first step", lambda r: fmt(r.get("first_step_ratio"))),
    ("error", lambda r: error_cell(r)),
)
HF_COLUMNS = (
    ("model", lambda r: r["name"]),
    ("attn", lambda r: r.get("attn", "-")),
    ("peak unwrapped MiB", lambda r: mib_cell(r.get("none_peak_bytes"))),
    ("peak sqrt", lambda r: fmt(r.get("sqrt_peak_ratio"))),
    ("peak HF GC", lambda r: fmt(r.get("hf_peak_ratio"))),
    ("sqrt / HF peak", lambda r: fmt(r.get("sqrt_vs_hf_peak"))),
    ("time sqrt", lambda r: fmt(r.get("sqrt_time_ratio"))),
    ("time HF GC", lambda r: fmt(r.get("hf_time_ratio"))),
    ("sqrt / HF time", lambda r: fmt(r.get("sqrt_vs_hf_time"), ".3f")),
    ("sqrt / HF wall time", lambda r: fmt(r.get("sqrt_vs_hf_time_wall"))),
    ("noise (HF copy / HF - 1)", lambda r: fmt(r.get("hf_time_noise"), ".3f")),
    ("sqrt, HF GC exact", lambda r: f"{status(r)}, {yes_no(r.get('hf_exact'))}"),
    ("target met", lambda r: yes_no(r.get("meets_hf_target"))),
)


def model_cell(r: dict[str, Any]) -> str:
    model = r.get("model") or r["name"]
    if r["suite"] == "timm":
        return f"{r['family']}: {model}"
    if r["suite"] == "hf":
        return r["name"] + (f" ({r['model']})" if r.get("model") else "")
    return str(model)


def table(records: list[dict[str, Any]], columns: Any) -> list[str]:
    out = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(cell(r)) for _, cell in columns) + " |" for r in records]
    return out


def markdown(records: list[dict[str, Any]], s: dict[str, Any], line: str, meta: dict[str, Any]) -> str:
    commits = ", ".join(f"{c} ({n} models)" for c, n in s["autockpt_commits"].items())
    out = [
        "# Model zoo: unwrapped vs autockpt",
        "",
        "Every timm family (its smallest variant under 40M parameters), eleven Hugging Face "
        "architectures from tiny configs (with padded batches), and torchvision's classification, "
        "detection and segmentation models, one training step each in train mode, unwrapped and with "
        "`auto_checkpoint(model, example_inputs=...)`. Made by `python benchmarks/zoo.py --docs "
        "docs/zoo.md` (27 to 45 minutes on 2 idle cores with `--repeats 1 --time-per-variant "
        "0.5`; `--only NAME` runs one family, `--resume` goes on after an interruption). Inputs "
        "grow until the activations outweigh the parameters 1.5 times (NOTE [Zoo input size] in "
        "`benchmarks/zoo.py`).",
        "",
        f"{meta['header']}; autockpt {commits}",
        "",
    ]
    out += [f"**{line}**", ""]
    if s["wrong"]:
        out += [
            f"**WRONG (gradients or buffers differ from the unwrapped model): {', '.join(s['wrong'])}**",
            "",
        ]
    out += [
        "peak: allocator-level peak of one training step after a warm-up, over the unwrapped step's "
        "(parameters, buffers and inputs excluded; gradients are set to None before the step, so "
        "they are allocated in it); grads kept: the same with gradients zeroed in place instead. "
        "time: median process CPU time of interleaved steps over the unwrapped step's (the machine "
        "is shared; wall times are in the JSON). plan/step: CPU time of auto_checkpoint with example "
        "inputs over one unwrapped step. first step: peak of the first step of a model checkpointed "
        "without example inputs over its next step's. exact: gradients, buffers and loss bitwise "
        f"equal to the unwrapped model's for sqrt, budget={BUDGET}, the first step and (HF) the "
        f"model's gradient checkpointing; nondet: the unwrapped model itself differs between two "
        f"runs. {BUDGET} is a fraction of the whole step (parameters and inputs included) as "
        "`budget=` defines it; infeasible: the planner's floor, as the same fraction.",
        "",
        *table(records, MAIN_COLUMNS),
    ]
    hf = [r for r in records if r["suite"] == "hf"]
    if hf:
        out += [
            "",
            "## Hugging Face: autockpt sqrt vs the model's own gradient checkpointing",
            "",
            f"Target: autockpt's sqrt peak <= gradient checkpointing's peak "
            f"+{(HF_PEAK_SLACK - 1) * 100:.0f}% at no more step time (CPU time) than gradient "
            "checkpointing's, within the run's noise: |HF copy / HF - 1|, a copy of HF's model timed "
            "in the same interleaving. Peaks and times over the unwrapped step's.",
            "",
            *table(hf, HF_COLUMNS),
        ]
    return "\n".join(out) + "\n"


def write(
    out_dir: Path,
    stem: str,
    records: list[dict[str, Any]],
    meta: dict[str, Any],
    elapsed: float,
    docs: Path | None = None,
) -> str:
    s = summarize(records)
    meta["elapsed_s"] = elapsed
    line = summary_line(s, elapsed)
    (out_dir / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "summary": s, "records": records}, indent=1, default=str)
    )
    (out_dir / f"{stem}.md").write_text(markdown(records, s, line, meta))
    if docs is not None:
        docs.write_text(markdown(records, s, line, meta))
    return line


def short(rec: dict[str, Any]) -> str:
    """One progress line for a finished model."""
    p = rec.get("sqrt_plan") or {}
    bits = [f"{rec['suite']}/{rec['name']}", status(rec)]
    if rec.get("model") and rec["model"] != rec["name"]:
        bits.append(rec["model"])
    if p:
        bits.append(f"{p['walker']} {p['stages']} stages {p['checkpointed']} ckpt")
    for label in ("sqrt", "budget", "hf"):
        if rec.get(f"{label}_peak_ratio") is not None:
            bits.append(
                f"{label} peak {rec[f'{label}_peak_ratio']:.2f} time {fmt(rec.get(f'{label}_time_ratio'))}"
            )
    if rec.get("first_step_ratio") is not None:
        bits.append(f"first {rec['first_step_ratio']:.2f}")
    if rec.get("seconds") is not None:
        bits.append(f"{rec['seconds']:.0f} s")
    err = error_cell(rec)
    return ", ".join(bits) + (f" | {err[:300]}" if err else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="family or model names, or prefixes of them")
    parser.add_argument("--suite", choices=("timm", "hf", "torchvision"), default=None)
    parser.add_argument("--limit", type=int, default=None, help="run the first N selected models")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--repeats", type=int, default=3, help="least interleaved timed steps per variant")
    parser.add_argument(
        "--time-per-variant",
        type=float,
        default=2.0,
        help="more timed steps (up to 20) for fast models, to spend about this many seconds",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--per-worker", type=int, default=4, help="models run by one worker process")
    parser.add_argument("--resume", action="store_true", help="skip the models the JSON already has")
    parser.add_argument("--docs", type=Path, default=None, help="also write the table here (docs/zoo.md)")
    parser.add_argument(
        "--memory-gib", type=float, default=12.0, help="data size limit of a worker (0: none)"
    )
    opts = parser.parse_args()
    setup()
    import timm
    import torchvision
    import transformers
    from tqdm import tqdm

    opts.out.mkdir(parents=True, exist_ok=True)
    cache_path = opts.out / "zoo_timm_models.json"
    rule = f"activations > {ACTIVATIONS_OVER_PARAMETERS}x parameters"  # NOTE [Zoo input size]
    cache_key = f"timm {timm.__version__}, batch {opts.batch}, < {MAX_PARAMS / 1e6:.0f}M, {rule}"
    cache: dict[str, Any] = {}
    if cache_path.exists():
        stored = json.loads(cache_path.read_text())
        cache = stored.get("choices", {}) if stored.get("key") == cache_key else {}
    cases = [c for c in all_cases(cache) if selected(c, opts.only, opts.suite)]
    if opts.limit is not None:
        cases = cases[: opts.limit]
    subset = bool(opts.only or opts.suite or opts.limit is not None)
    stem = "zoo_subset" if subset else "zoo"
    meta = {
        "torch": torch.__version__,
        "timm": timm.__version__,
        "transformers": transformers.__version__,
        "torchvision": torchvision.__version__,
        "threads": torch.get_num_threads(),
        "batch": opts.batch,
        "repeats": opts.repeats,
        "timeout_s": opts.timeout,
        "argv": sys.argv[1:],
        "header": (
            f"torch {torch.__version__}, timm {timm.__version__}, transformers {transformers.__version__}, "
            f"torchvision {torchvision.__version__}; CPU, {torch.get_num_threads()} threads; batch "
            f"{opts.batch}; at least {opts.repeats} timed steps per variant; `python benchmarks/zoo.py "
            f"{' '.join(sys.argv[1:])}`".rstrip()
        ),
    }
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if opts.resume and (opts.out / f"{stem}.json").exists():  # keep what a killed run finished
        stored = json.loads((opts.out / f"{stem}.json").read_text())
        wanted = {(c.suite, c.name) for c in cases}
        records = [r for r in stored["records"] if (r["suite"], r["name"]) in wanted]
        done = {(r["suite"], r["name"]) for r in records}
        cases = [c for c in cases if (c.suite, c.name) not in done]
        t0 -= stored["meta"].get("elapsed_s", 0.0)
        print(f"# resuming: {len(records)} models done", flush=True)
    print(f"# {len(cases)} models -> {opts.out / stem}.json, .md", flush=True)
    ctx = mp.get_context("spawn")
    worker: Worker | None = None
    bar = tqdm(cases, unit="model", dynamic_ncols=True, file=sys.stdout)
    for case in bar:
        bar.set_postfix_str(case.key)
        if worker is None:
            worker = Worker(ctx, opts)
        rec, usable = worker.run(case, opts.timeout)
        if not usable or worker.done >= opts.per_worker:
            worker.close() if usable else worker.kill()
            worker = None
        if case.suite == "timm" and rec.get("choice"):
            cache[case.family] = rec["choice"]
            cache_path.write_text(json.dumps({"key": cache_key, "choices": cache}, indent=1))
        records.append(rec)
        bar.write(short(rec))
        write(opts.out, stem, records, meta, time.perf_counter() - t0, opts.docs)
    if worker is not None:
        worker.close()
    line = write(opts.out, stem, records, meta, time.perf_counter() - t0, opts.docs)
    print(line, flush=True)
    wrong = summarize(records)["wrong"]
    if wrong:
        print("!!! WRONG gradients or buffers: " + ", ".join(wrong), flush=True)


if __name__ == "__main__":
    main()
