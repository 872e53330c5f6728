"""Time overhead against measured peak: the budget planner vs uniform splits.

For each model: ``torch.utils.checkpoint.checkpoint_sequential`` at every segment count
(it puts boundaries in front of in-place ReLUs, so on NiN some counts fail in backward; they
are reported), autockpt's uniform int-k plans, and the budget planner at 8 budgets between
the smallest feasible peak and the unwrapped one. Peaks are allocator-level bytes of one
training step (parameters, buffers and input included); overheads are step-time ratios to
the unwrapped model, medians of interleaved runs in this process. Besides the 8 budgets,
the budget planner also plans for every peak a uniform split reached, so each uniform split
is compared with a budget plan made for its own memory level. Writes a Markdown table,
a JSON file and a PNG plot per model into ``--out``.

    python benchmarks/pareto.py [--out results] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from _common import SequentialCheckpoint, interleaved_medians, mib, setup
from torch import nn

import autockpt
from autockpt.plan import Segment
from autockpt.planners.budget import min_feasible_budget


def models() -> dict[str, tuple[Callable[[], nn.Sequential], torch.Tensor]]:
    def chain() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(256, 256), nn.GELU())])

    def nin() -> nn.Sequential:
        return autockpt.models.NiN(10).to(memory_format=torch.channels_last)

    return {
        "deep chain 16x(Linear 256+GELU), batch 4096": (chain, torch.randn(4096, 256)),
        "NiN channels_last, batch 64": (
            nin,
            torch.randn(64, 3, 32, 32).to(memory_format=torch.channels_last),
        ),
    }


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def train(model: nn.Module, x: torch.Tensor) -> None:
    out = model(x)  # kept through backward, as in a training loop
    loss_fn(out).backward()
    for p in model.parameters():
        p.grad = None


def total_peak(model: nn.Module, x: torch.Tensor) -> int:
    static = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers(), x))
    train(model, x)
    with autockpt.track_memory("cpu", tensors=False) as mem:
        train(model, x)
    return static + mem.peak_bytes


def measure(plain: nn.Module, model: nn.Module, x: torch.Tensor, repeats: int) -> tuple[int, float]:
    peak = total_peak(model, x)
    runs = [functools.partial(train, plain, x), functools.partial(train, model, x)]
    t_plain, t_model = interleaved_medians(runs, repeats)
    return peak, t_model / t_plain


def run(name: str, factory: Callable[[], nn.Sequential], x: torch.Tensor, repeats: int, out: Path) -> None:
    torch.manual_seed(0)
    plain = factory()
    base = total_peak(plain, x)
    n_modules = len(plain)
    rows: list[dict[str, object]] = []
    for k in range(1, n_modules + 1):
        try:
            peak, ratio = measure(plain, SequentialCheckpoint(copy.deepcopy(plain), k), x, repeats)
            rows.append({"kind": "checkpoint_sequential", "setting": k, "peak": peak, "overhead": ratio})
        except RuntimeError as err:
            rows.append(
                {"kind": "checkpoint_sequential", "setting": k, "error": str(err).split("\n")[0][:80]}
            )
    n_stages = autockpt.make_plan(plain, "none", example_inputs=(x,)).n_stages
    for k in range(2, n_stages + 1):
        model = autockpt.auto_checkpoint(copy.deepcopy(plain), k, example_inputs=(x,))
        peak, ratio = measure(plain, model, x, repeats)
        rows.append({"kind": "autockpt uniform", "setting": k, "peak": peak, "overhead": ratio})
    prof = autockpt.profile(plain, (x,), loss_fn=loss_fn)  # later plans of `plain` reuse it
    floor = min_feasible_budget(prof.costs, loss_bytes=prof.loss_bytes) + prof.static_bytes
    plan = autockpt.make_plan(plain, budget=1.0, example_inputs=(x,), loss_fn=loss_fn)
    unwrapped = plan.predicted_peak_bytes or base
    # 8 budgets from the floor to unwrapped, plus every peak a uniform split reached, so that
    # each uniform split meets a budget plan made for exactly its memory level
    grid = {int(floor + (unwrapped - floor) * i / 7) for i in range(8)}
    levels = {int(r["peak"]) for r in rows if "error" not in r and floor <= int(r["peak"]) <= unwrapped}  # type: ignore[call-overload]
    measured: dict[tuple[Segment, ...], tuple[int, float]] = {}
    for budget in sorted(grid | levels):
        plan = autockpt.make_plan(plain, budget=budget, example_inputs=(x,), loss_fn=loss_fn)
        if plan.segments not in measured:
            model = autockpt.auto_checkpoint(copy.deepcopy(plain), plan, example_inputs=(x,))
            measured[plan.segments] = measure(plain, model, x, repeats)
        peak, ratio = measured[plan.segments]
        rows.append({"kind": "autockpt budget", "setting": budget, "peak": peak, "overhead": ratio,
                     "predicted": plan.predicted_peak_bytes})  # fmt: skip
    report(name, base, rows, out)


def report(name: str, base: int, rows: list[dict[str, object]], out: Path) -> None:
    print(f"\n### {name} (unwrapped peak {mib(base)} MiB)\n")
    print("| plan | setting | peak MiB | peak / unwrapped | time / unwrapped |")
    print("|---|---|---|---|---|")
    for r in rows:
        setting = mib(r["setting"]) + " MiB" if r["kind"] == "autockpt budget" else str(r["setting"])  # type: ignore[arg-type]
        if "error" in r:
            print(f"| {r['kind']} | {setting} | fails: {r['error']} | | |")
        else:
            peak = int(r["peak"])  # type: ignore[call-overload]
            print(f"| {r['kind']} | {setting} | {mib(peak)} | {peak / base:.3f} | {r['overhead']:.3f} |")
    budget = [r for r in rows if r["kind"] == "autockpt budget"]
    uniform = [r for r in rows if r["kind"] != "autockpt budget" and "error" not in r]
    verdicts = []
    for u in uniform:
        fits = [b for b in budget if b["peak"] <= u["peak"]]  # type: ignore[operator]
        best = min((b["overhead"] for b in fits), default=None)  # type: ignore[type-var]
        verdicts.append(best is not None and best <= u["overhead"] + 0.03)  # type: ignore[operator]
    errors = [abs(int(b["predicted"]) - int(b["peak"])) / int(b["peak"]) for b in budget]  # type: ignore[call-overload]
    print(f"\nbudget plans: predicted peak within {100 * max(errors):.2f}% of the measured one (worst case)")
    lowest_uniform = min(int(u["peak"]) for u in uniform)  # type: ignore[call-overload]
    lowest_budget = min(int(b["peak"]) for b in budget)  # type: ignore[call-overload]
    print(
        f"\nbudget plan at least as fast (within 0.03) as every uniform split at its peak or lower: "
        f"{sum(verdicts)}/{len(verdicts)}; lowest peak: budget {mib(lowest_budget)} MiB, "
        f"uniform {mib(lowest_uniform)} MiB"
    )
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in name.split(",")[0]).strip("_").lower()
    (out / f"pareto_{slug}.json").write_text(json.dumps({"unwrapped": base, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, marker in (("checkpoint_sequential", "x"), ("autockpt uniform", "o"), ("autockpt budget", "s")):
        pts = sorted((int(r["peak"]) / 2**20, float(r["overhead"])) for r in rows  # type: ignore[call-overload, arg-type]
                     if r["kind"] == kind and "error" not in r)  # fmt: skip
        if pts:
            ax.plot(*zip(*pts), marker=marker, linestyle="-" if kind == "autockpt budget" else "", label=kind)
    ax.axvline(base / 2**20, color="grey", linestyle=":", label="unwrapped peak")
    ax.set_xlabel("measured peak (MiB, allocator level)")
    ax.set_ylabel("step time / unwrapped")
    ax.set_title(name, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"pareto_{slug}.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup()
    warnings.simplefilter("ignore", UserWarning)
    for name, (factory, x) in models().items():
        run(name, factory, x, args.repeats, args.out)


if __name__ == "__main__":
    main()
