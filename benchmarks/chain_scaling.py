"""Peak memory and time of a deep chain: none vs sqrt vs one stage per segment.

A chain of n blocks, Linear(256, 256) + GELU at batch 4096, so activations dominate.
Peaks are allocator-level bytes from ``autockpt.track_memory`` for one training step
after a warm-up; times are medians of interleaved steps in one process.

    python benchmarks/chain_scaling.py [--sizes 16 64 256] [--repeats 5] [--out results]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
from pathlib import Path

import torch
from _common import interleaved_medians, mib, setup
from torch import nn

import autockpt


def chain(n: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(width, width), nn.GELU())])


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    for p in model.parameters():
        p.grad = None


def peak(model: nn.Module, x: torch.Tensor) -> int:
    train_step(model, x)
    with autockpt.track_memory("cpu", tensors=False) as mem:
        train_step(model, x)
    return mem.peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    setup()
    rows = []
    print(
        "| n blocks | stages | peak none MiB | peak sqrt MiB | peak per-stage MiB | sqrt/none peak | "
        "sqrt/none time |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.sizes:
        x = torch.randn(args.batch, args.width)
        plain = chain(n, args.width)
        stages = 2 * n
        sqrt = autockpt.auto_checkpoint(copy.deepcopy(plain), "sqrt", example_inputs=(x,))
        every = autockpt.auto_checkpoint(copy.deepcopy(plain), stages, example_inputs=(x,))
        peaks = [peak(m, x) for m in (plain, sqrt, every)]
        t_none, t_sqrt = interleaved_medians(
            [functools.partial(train_step, plain, x), functools.partial(train_step, sqrt, x)], args.repeats
        )
        row = {
            "n_blocks": n,
            "stages": stages,
            "segments_sqrt": math.isqrt(stages - 1) + 1,
            "peak_none": peaks[0],
            "peak_sqrt": peaks[1],
            "peak_per_stage": peaks[2],
            "time_none_s": t_none,
            "time_sqrt_s": t_sqrt,
        }
        rows.append(row)
        print(
            f"| {n} | {stages} | {mib(peaks[0])} | {mib(peaks[1])} | {mib(peaks[2])} | "
            f"{peaks[1] / peaks[0]:.3f} | {t_sqrt / t_none:.3f} |",
            flush=True,
        )
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        growth = (b["peak_sqrt"] / a["peak_sqrt"]) / math.sqrt(b["stages"] / a["stages"])
        print(
            f"\nsqrt peak growth from n={a['n_blocks']} to n={b['n_blocks']}, "
            f"relative to sqrt(n): {growth:.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "chain_scaling.json"
    path.write_text(json.dumps(rows, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
