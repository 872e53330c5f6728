"""Non-Sequential models: autockpt "sqrt" vs torch's apply_activation_checkpointing.

For each model: the unwrapped step, autockpt's default plan (graph walker), and
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``
on every repeated block (BasicBlock/Bottleneck, ViT EncoderBlock, GPT Block), all measured
in one process: allocator-level peak of one training step after a warm-up, and the median
of interleaved step times.

    python benchmarks/any_model.py [--repeats 3] [--models resnet18 resnet50 vit gpt]
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from _common import interleaved_medians, mib, setup
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import autockpt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models_for_tests import GPT, Block


def cases() -> dict[str, tuple[Callable[[], nn.Module], tuple[Any, ...], dict[str, Any], tuple[type, ...]]]:
    tv = torchvision.models
    idx = torch.randint(0, 50, (8, 256))
    return {
        "resnet18 32x3x64x64": (tv.resnet18, (torch.randn(32, 3, 64, 64),), {},
                                (tv.resnet.BasicBlock,)),
        "resnet50 32x3x64x64": (tv.resnet50, (torch.randn(32, 3, 64, 64),), {},
                                (tv.resnet.Bottleneck,)),
        "vit_b_16 48x3x64x64": (functools.partial(tv.vit_b_16, image_size=64),
                                (torch.randn(48, 3, 64, 64),), {}, (tv.vision_transformer.EncoderBlock,)),
        "GPT 12x256, seq 256, batch 8": (
            functools.partial(GPT, width=256, layers=12, heads=8, context=256),
            (idx,), {"attention_mask": torch.ones(8, 256)}, (Block,),
        ),
    }  # fmt: skip


def _is_block(module: nn.Module, types: tuple[type, ...]) -> bool:
    return isinstance(module, types)


def train(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    out = model(*args, **kwargs)
    (out[0] if isinstance(out, tuple) else out).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None


def peak(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    train(model, args, kwargs)
    with autockpt.track_memory("cpu", tensors=False) as mem:
        train(model, args, kwargs)
    return mem.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=None, help="substrings of model names")
    args = parser.parse_args()
    setup()
    print(
        "| model | walker, stages | peak none MiB | autockpt sqrt MiB (ratio) | torch per-block MiB (ratio) "
        "| time autockpt/none | time torch/none |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (factory, inputs, kwargs, block_types) in cases().items():
        if args.models and not any(m in name for m in args.models):
            continue
        torch.manual_seed(0)
        plain = factory().train()
        ours = autockpt.auto_checkpoint(copy.deepcopy(plain), example_inputs=inputs, example_kwargs=kwargs)
        theirs = copy.deepcopy(plain)
        apply_activation_checkpointing(
            theirs,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
            check_fn=functools.partial(_is_block, types=block_types),
        )
        peaks = [peak(m, inputs, kwargs) for m in (plain, ours, theirs)]
        times = interleaved_medians(
            [functools.partial(train, m, inputs, kwargs) for m in (plain, ours, theirs)], args.repeats
        )
        plan = ours.forward.plan
        print(
            f"| {name} | {plan.walker}, {plan.n_stages} | {mib(peaks[0])} | {mib(peaks[1])} "
            f"({peaks[1] / peaks[0]:.2f}) | {mib(peaks[2])} ({peaks[2] / peaks[0]:.2f}) | "
            f"{times[1] / times[0]:.2f} | {times[2] / times[0]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
