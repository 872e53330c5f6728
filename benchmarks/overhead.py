"""Cost of the machinery itself: ``segments="none"`` applied vs the raw model.

With nothing checkpointed, autockpt's forward hands straight to the original one, so the
time ratio should be 1 within noise. Medians of interleaved training steps, one process.

    python benchmarks/overhead.py [--repeats 21]
"""

from __future__ import annotations

import argparse
import copy
from functools import partial

import torch
from _common import interleaved_medians, setup
from torch import nn

import autockpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    setup()
    torch.manual_seed(0)
    cases = {
        "NiN batch 64": (autockpt.models.NiN(10), torch.randn(64, 3, 32, 32)),
        "64 x (Linear 256 + GELU) batch 1024": (
            nn.Sequential(*[m for _ in range(64) for m in (nn.Linear(256, 256), nn.GELU())]),
            torch.randn(1024, 256),
        ),
    }
    print("| model | raw s/step | none applied s/step | ratio |")
    print("|---|---|---|---|")
    for name, (raw, x) in cases.items():
        wrapped = autockpt.auto_checkpoint(copy.deepcopy(raw), "none")

        def train(model: nn.Module, x: torch.Tensor = x) -> None:
            model(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None

        t_raw, t_none = interleaved_medians([partial(train, raw), partial(train, wrapped)], args.repeats)
        print(f"| {name} | {t_raw:.4f} | {t_none:.4f} | {t_none / t_raw:.3f} |", flush=True)


if __name__ == "__main__":
    main()
