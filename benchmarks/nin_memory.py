"""NiN training-step peak memory on CPU, per memory format and segment count.

Shows where the notebook's network really peaks: in NCHW, oneDNN's convolution backward in
the first block allocates workspaces that set the peak whatever is checkpointed; in
channels_last they vanish and checkpointing lowers the peak. Allocator-level and
tensor-level peaks of one training step after a warm-up, from ``autockpt.track_memory``.

    python benchmarks/nin_memory.py [--batch 128] [--segments none sqrt 2 5 8 15]
"""

from __future__ import annotations

import argparse
import warnings

import torch
from _common import mib, setup

import autockpt


def measure(model: torch.nn.Module, x: torch.Tensor) -> autockpt.MemoryStats:
    for _ in range(2):  # the first step is a warm-up
        for p in model.parameters():
            p.grad = None
        with autockpt.track_memory("cpu") as mem:
            model(x).square().mean().backward()
    return mem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--segments", nargs="+", default=["none", "sqrt", "2", "5", "8", "15"])
    args = parser.parse_args()
    setup()
    print("| format | segments | peak MiB (allocator) | ratio | tensor peak MiB | peak after op (tensors) |")
    print("|---|---|---|---|---|---|")
    for fmt_name, fmt in (("NCHW", torch.contiguous_format), ("channels_last", torch.channels_last)):
        torch.manual_seed(0)
        model = autockpt.models.NiN(10).to(memory_format=fmt)
        x = torch.randn(args.batch, 3, 32, 32).to(memory_format=fmt)
        base = measure(model, x).peak_bytes
        for spec in args.segments:
            segments = int(spec) if spec.isdigit() else spec
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                autockpt.auto_checkpoint(model, segments, example_inputs=(x,))
            mem = measure(model, x)
            print(
                f"| {fmt_name} | {spec} | {mib(mem.peak_bytes)} | {mem.peak_bytes / base:.3f} | "
                f"{mib(mem.tensor_peak_bytes)} | {mem.tensor_peak_op} |",
                flush=True,
            )
        autockpt.restore(model)


if __name__ == "__main__":
    main()
