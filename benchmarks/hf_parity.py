"""autockpt against Hugging Face's own checkpointing on HF GPT-2, at the size issue 15 names.

    python benchmarks/hf_parity.py [--rounds 10] [--layers 12 --embd 256 --batch 8 --seq 256]

``GPT2LMHeadModel`` (12 layers, n_embd 256, 4 heads, batch 8 x 256 tokens, the model's own LM
loss from labels): the unwrapped model, ``auto_checkpoint(model, example_kwargs=...)`` and
``gradient_checkpointing_enable()`` (``activation_checkpointing_enable`` since transformers
5). Prints each one's allocator-level peak of a step and its median wall and CPU time over
interleaved rounds (each round starts with the next variant), and autockpt's ratios to HF.
The zoo (``benchmarks/zoo.py``) makes the same comparison on tiny configurations, where
steps last milliseconds and autockpt's bookkeeping per block shows.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any

import torch
from _common import setup

import autockpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    opts = parser.parse_args()
    setup()
    import transformers

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=opts.layers, n_embd=opts.embd, n_head=4, n_positions=opts.seq)
    base = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(
        0, config.vocab_size, (opts.batch, opts.seq), generator=torch.Generator().manual_seed(1)
    )
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids, "use_cache": False}
    hf = copy.deepcopy(base)
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    models = {
        "unwrapped": copy.deepcopy(base),
        "autockpt": autockpt.auto_checkpoint(copy.deepcopy(base), example_kwargs=batch),
        "HF": hf,
    }

    def step(model: torch.nn.Module) -> None:
        for p in model.parameters():
            p.grad = None
        model(**batch).loss.backward()

    peaks = {}
    for name, model in models.items():
        step(model)  # warm-up
        with autockpt.track_memory() as mem:
            step(model)
        peaks[name] = mem.peak_bytes
    names = list(models)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(opts.rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            t0, c0 = time.perf_counter(), time.process_time()
            step(models[name])
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    print(f"# GPT2LMHeadModel {opts.layers} layers, n_embd {opts.embd}, batch {opts.batch}x{opts.seq}")
    for name in names:
        print(
            f"{name:10} peak {peaks[name] / 2**20:8.1f} MiB ({peaks[name] / peaks['unwrapped']:.3f}x)  "
            f"wall {statistics.median(wall[name]):.3f} s  CPU {statistics.median(cpu[name]):.3f} s"
        )
    ratio_wall = statistics.median(wall["autockpt"]) / statistics.median(wall["HF"])
    ratio_cpu = statistics.median(cpu["autockpt"]) / statistics.median(cpu["HF"])
    rounds = ", ".join(f"{a / b:.3f}" for a, b in zip(wall["autockpt"], wall["HF"]))
    peak = peaks["autockpt"] / peaks["HF"]
    print(f"autockpt / HF: peak {peak:.3f}, wall {ratio_wall:.3f}, CPU {ratio_cpu:.3f}")
    print(f"per round (wall): {rounds}")


if __name__ == "__main__":
    main()
