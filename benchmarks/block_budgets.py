"""Budgets on block-walked models: Hugging Face decoders, predicted vs measured peak.

Hugging Face transformers are walked by their repeated layers (fx cannot trace them), so a
budget plan comes from the block profile (each layer alone, and the code around the layers
in one step with every layer checkpointed). For each model and budget: the plan's predicted
peak, the measured allocator-level peak of one training step with the model's own loss, the
budget, and whether gradients are bitwise equal to the unwrapped model's.

    pip install transformers && python benchmarks/block_budgets.py [--budgets 0.6 0.8]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import mib, setup
from torch import nn

import autockpt
from autockpt.measure.step import measure_step


def models() -> dict[str, Callable[[], nn.Module]]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    return {
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=128)
        ),
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=4,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=500,
            )
        ),
    }


def own_loss(out: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.6, 0.8])
    args = parser.parse_args()
    setup()
    print("model  walker  budget  planned in  unwrapped  budget bytes  predicted  measured  meas/pred  exact")
    for name, build in models().items():
        torch.manual_seed(0)
        model = build().train()
        ids = torch.randint(0, 500, (4, 64))
        kw = {"input_ids": ids, "labels": ids, "use_cache": False}
        unwrapped = measure_step(model, (), kw, own_loss)
        for fraction in args.budgets:
            t0 = time.perf_counter()
            plan = autockpt.make_plan(model, budget=fraction, example_kwargs=kw, loss_fn=own_loss)
            planned = time.perf_counter() - t0
            checkpointed = autockpt.auto_checkpoint(copy.deepcopy(model), plan)
            measured = measure_step(checkpointed, (), kw, own_loss)
            ref = copy.deepcopy(model)
            for m in (ref, checkpointed):
                torch.manual_seed(1)
                own_loss(m(**kw)).backward()
            exact = all(
                (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
                for a, b in zip(ref.parameters(), checkpointed.parameters())
            )
            assert plan.budget_bytes is not None and plan.predicted_peak_bytes is not None
            print(
                f"{name:6} {plan.walker:7} {fraction:6.2f}  {planned:8.1f} s  {mib(unwrapped):>9}  "
                f"{mib(plan.budget_bytes):>12}  {mib(plan.predicted_peak_bytes):>9}  {mib(measured):>8}  "
                f"{measured / plan.predicted_peak_bytes:9.3f}  {exact}"
            )


if __name__ == "__main__":
    main()
