"""The LM head and loss alone: whole, torch's ``F.linear_cross_entropy``, autockpt's chunks.

One forward and backward of ``cross_entropy(linear(hidden, W), target)`` (the GPT-2 of
``frontier.py``: 2048 tokens, width 256, vocabulary 50257, by default), measured side by side
in one process: the allocator-level peak above what exists before the step, the median step
time of interleaved repeats over the whole head's, and how far each gradient is from the whole
head's (``hidden``: bitwise or not; the weight: largest relative difference).

    python benchmarks/head.py [--tokens 2048] [--width 256] [--vocab 50257] [--repeats 7]
        [--chunks auto 4 8 16 32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _common import interleaved_medians, mib, setup
from torch.nn import functional as F  # noqa: N812

import autockpt

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def variants(chunks: list[str]) -> dict[str, Loss]:
    out: dict[str, Loss] = {"whole": lambda h, w, t: F.cross_entropy(F.linear(h, w), t)}
    if hasattr(F, "linear_cross_entropy"):
        for size in (256, None):
            options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=size)
            out[f"torch linear_cross_entropy batch_chunk_size={size or 'default'}"] = (
                lambda h, w, t, o=options: F.linear_cross_entropy(h, w, t, options=o)
            )
    for c in chunks:
        count: int | str = c if c == "auto" else int(c)
        chunked = autockpt.linear_cross_entropy
        out[f"autockpt chunks={c}"] = lambda h, w, t, n=count, f=chunked: f(h, w, t, chunks=n)
    return out


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunks", nargs="*", default=["auto", "4", "8", "16", "32"])
    args = parser.parse_args()
    setup()
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.width)
    weight = (torch.randn(args.vocab, args.width) * 0.02).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,))
    grads: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(fn: Loss, name: str | None = None) -> Callable[[], None]:
        def run() -> None:
            h = hidden.clone().requires_grad_()
            fn(h, weight, target).backward()
            if name is not None:
                assert h.grad is not None and weight.grad is not None
                grads[name] = (h.grad, weight.grad)
            weight.grad = None

        return run

    table = variants(args.chunks)
    print(f"# head alone: {args.tokens} tokens, width {args.width}, vocabulary {args.vocab}, float32")
    peaks = {}
    for name, fn in table.items():
        step(fn, name)()
        with autockpt.track_memory("cpu", tensors=False) as mem:
            step(fn)()
        peaks[name] = mem.peak_bytes
    times = interleaved_medians([step(fn) for fn in table.values()], args.repeats)
    ref_h, ref_w = grads["whole"]
    print("| loss | peak MiB | time / whole | hidden grad bitwise | weight grad rel. diff |")
    print("|---|---|---|---|---|")
    for (name, _), t in zip(table.items(), times, strict=True):
        h, w = grads[name]
        rel = float((w - ref_w).abs().max() / ref_w.abs().max())
        print(f"| {name} | {mib(peaks[name])} | {t / times[0]:.2f} | {torch.equal(h, ref_h)} | {rel:.1e} |")


if __name__ == "__main__":
    main()
