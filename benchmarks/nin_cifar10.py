"""NiN on CIFAR-10, unwrapped and checkpointed side by side: the reference benchmark.

Reproduces Sebastian Raschka's gradient-checkpointing notebook (``shared/reference``): NiN,
Adam with lr 1e-4, batch 256, seed 1, the last 10% of the training images for validation,
deterministic algorithms. Every strategy trains its own copy of the same initial weights
on the same batches, in turn, batch by batch, each with its own RNG stream, so the losses
must be bitwise identical on CPU; the script checks that.

Measured properly, unlike the notebook (whose ``checkpoint_sequential(..., segments=1)``
checkpoints nothing and whose ``tracemalloc`` counts Python objects, not tensors):

* peak memory of one training step (the second, so Adam's state already exists) above
  what was allocated before it, at allocator level (the CUDA caching allocator; on CPU the
  profiler's allocation events, which see oneDNN's workspaces) with the tensor-level figure
  beside it;
* time per epoch as the median step time times the batches per epoch (steps from the third
  on: the first warms up, the second is measured for memory), interleaved with the other
  strategies in the same process, and its ratio to the unwrapped model's;
* where the peak falls, from the per-stage profile.

Both memory formats run: in NCHW, oneDNN's convolution backward in the first block
allocates large internal buffers that set the CPU peak whatever is checkpointed; in
channels_last they do not.

    python benchmarks/nin_cifar10.py              # a few batches per strategy, < 3 min on 2 cores
    python benchmarks/nin_cifar10.py --full       # the notebook's 2 epochs
    python benchmarks/nin_cifar10.py --device cuda --data-dir ~/data
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts

import torch
import torch.nn.functional as F  # noqa: N812
from _common import setup
from cifar10_data import loaders, training_set
from torch import nn
from tqdm import tqdm

import autockpt
from autockpt.cli import budget_arg
from autockpt.plan import Segment, format_bytes
from autockpt.planners.cost_model import predict
from autockpt.planning.budget_costs import describe_peak

FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}


@dataclass
class Ranks:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without ``--ddp``)."""

    rank: int = 0
    world: int = 1


RANKS = Ranks()


def say(*args: Any) -> None:
    """Print on rank 0 only."""
    if RANKS.rank == 0:
        print(*args, flush=True)


@dataclass
class Run:
    """One strategy in one memory format: its model, optimizer, RNG and figures."""

    name: str
    model: nn.Module
    net: nn.Module  # what trains: the model, or its DistributedDataParallel wrapper
    optimizer: torch.optim.Optimizer
    rng: dict[str, torch.Tensor]
    plan: str = "unwrapped"
    segments: tuple[Segment, ...] = ()
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    tensor_peak_bytes: int = 0
    epochs: list[dict[str, float]] = field(default_factory=list)
    elapsed_s: float = 0.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="the notebook's 2 epochs over all batches")
    p.add_argument("--epochs", type=int, default=None, help="default 1, or 2 with --full")
    p.add_argument(
        "--batches", type=int, default=None, help="training batches per epoch (default 4; all with --full)"
    )
    p.add_argument(
        "--valid-batches", type=int, default=None, help="validation batches (default 2; all with --full)"
    )
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--strategies",
        nargs="+",
        default=["none", "sqrt", "4", "budget"],
        help="autockpt strategies besides the unwrapped model: none, sqrt, an int, budget",
    )
    p.add_argument("--budget", default="0.9", help="for the budget strategy: a fraction, bytes or '300MiB'")
    p.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-dir", default="data", help="where CIFAR-10 is, or is downloaded to")
    p.add_argument("--no-download", action="store_true", help="never try the network")
    p.add_argument("--out", default="results/nin_cifar10", help="folder for JSON, Markdown and PNG")
    p.add_argument("--log-every", type=int, default=50, help="log the batch loss every N batches")
    p.add_argument(
        "--ddp",
        action="store_true",
        help="under torchrun: DistributedDataParallel, each rank trains on its share of every batch",
    )
    p.add_argument(
        "--train-accuracy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate on the whole training split after each epoch (default: with --full)",
    )
    args = p.parse_args()
    args.epochs = args.epochs or (2 if args.full else 1)
    if args.batches is None:
        args.batches = 0 if args.full else 4
    if args.train_accuracy is None:
        args.train_accuracy = args.full
    if args.valid_batches is None:
        args.valid_batches = 0 if args.full else 2
    if 0 < args.batches < 3:
        p.error("--batches must be at least 3: step 0 warms up, step 1 is measured, later steps are timed")
    return args


def deterministic(device: torch.device) -> None:
    """The notebook's seeds and deterministic kernels."""
    torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def own_rng(run: Run, device: torch.device) -> Iterator[None]:
    """Give ``run`` its own RNG stream, as if it trained alone."""
    torch.set_rng_state(run.rng["cpu"])
    if "cuda" in run.rng:
        torch.cuda.set_rng_state(run.rng["cuda"], device)
    try:
        yield
    finally:
        run.rng = rng_state(device)


def build_runs(
    args: argparse.Namespace, fmt: str, device: torch.device, example: torch.Tensor
) -> tuple[list[Run], autockpt.Profile, list[str]]:
    """The unwrapped model and one checkpointed copy per strategy, from the same weights.

    The reference model is profiled once; the budget plan is made from that profile and
    applied to its copy as a :class:`autockpt.Plan`.
    """
    torch.manual_seed(args.seed)
    reference = autockpt.models.NiN(10).to(device, memory_format=FORMATS[fmt])
    start_rng = rng_state(device)
    labels = torch.zeros(example.shape[0], dtype=torch.long, device=device)  # bytes need only the shape

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:  # the training loss, for the memory plan
        return F.cross_entropy(logits, labels)

    profile = autockpt.profile(reference, (example,), loss_fn=loss_fn)
    messages: list[str] = []
    runs: list[Run] = []
    for name in ["unwrapped", *args.strategies]:
        model = copy.deepcopy(reference)
        plan_text, segments = "unwrapped", (Segment(0, len(profile.costs), False),)
        if name != "unwrapped":
            spec: int | str | autockpt.Plan = int(name) if name.isdigit() else name
            if name == "budget":
                spec = budget_plan(reference, args.budget, example, loss_fn, fmt, messages)
            model = autockpt.auto_checkpoint(model, spec, example_inputs=(example,))
            plan = model.forward.plan  # the installed plan
            segments = plan.segments
            plan_text = (
                f"{plan.strategy}: {len(segments)} segments, {plan.checkpointed_segments} checkpointed"
            )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        net = model
        if args.ddp:
            from torch.nn.parallel import DistributedDataParallel

            net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        runs.append(Run(name, model, net, optimizer, dict(start_rng), plan_text, segments))
    return runs, profile, messages


def budget_plan(
    model: nn.Module,
    budget: str,
    example: torch.Tensor,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    fmt: str,
    messages: list[str],
) -> autockpt.Plan:
    """The budget plan, or, when the budget is infeasible, the plan at the smallest feasible one."""
    try:
        spec = budget_arg(budget)
        return autockpt.make_plan(model, budget=spec, example_inputs=(example,), loss_fn=loss_fn)
    except autockpt.PlanInfeasibleError as err:
        if err.min_budget_bytes is None:
            raise
        messages.append(f"{fmt}, budget={budget}: {err}")
        messages.append(f"{fmt}: the budget strategy runs at the smallest feasible budget instead")
        return autockpt.make_plan(
            model, budget=err.min_budget_bytes, example_inputs=(example,), loss_fn=loss_fn
        )


def step(
    run: Run, x: torch.Tensor, y: torch.Tensor, device: torch.device, measure: bool, timed: bool
) -> None:
    """One training step of ``run``: measured under ``track_memory``, or run and maybe timed."""
    run.net.train()
    with own_rng(run, device):
        if measure:
            with autockpt.track_memory(device) as mem:
                loss = _train_step(run, x, y)
            run.peak_bytes, run.tensor_peak_bytes = mem.peak_bytes, mem.tensor_peak_bytes
        else:
            _sync(device)
            t0 = time.perf_counter()
            loss = _train_step(run, x, y)
            _sync(device)
            if timed:
                run.step_s.append(time.perf_counter() - t0)
    run.losses.append(loss)


def _train_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.cross_entropy(run.net(x), y)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    run.optimizer.step()
    return float(loss.detach())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Accuracy (%) and mean loss, in eval mode as the notebook's ``compute_accuracy``."""
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    for x, y in batches:
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        total += y.numel()
    model.train()
    return 100.0 * correct / total, loss_sum / total


def prepare(batch: Any, device: torch.device, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a batch (all of it without ``--ddp``), on the device."""
    x, y = batch
    x, y = x[RANKS.rank :: RANKS.world], y[RANKS.rank :: RANKS.world]
    return x.to(device, memory_format=FORMATS[fmt]), y.to(device)


def train_format(
    args: argparse.Namespace, fmt: str, device: torch.device, data: Any, source: str
) -> dict[str, Any]:
    """Train every strategy in one memory format; return its figures."""
    t0 = time.perf_counter()
    local = len(range(RANKS.rank, args.batch_size, RANKS.world))  # this rank's share of a batch
    example = torch.randn(local, 3, 32, 32).to(device, memory_format=FORMATS[fmt])
    runs, profile, messages = build_runs(args, fmt, device, example)
    for line in messages:
        say(line)
    for run in runs:
        say(f"{fmt} | {run.name:9} | {run.plan}")
    say(f"{fmt} | profiled and planned in {time.perf_counter() - t0:.1f} s")
    n_train = len(loaders(data, source, batch_size=args.batch_size).train)
    per_epoch = min(args.batches or n_train, n_train)
    valid = _take(loaders(data, source, batch_size=args.batch_size).valid, args.valid_batches, device, fmt)
    global_step = 0
    for epoch in range(args.epochs):
        # the same seeded sampler for every strategy: a fresh loader per epoch, seed + epoch
        train = loaders(data, source, batch_size=args.batch_size, seed=args.seed + epoch).train
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        bar = tqdm(
            total=per_epoch,
            desc=f"{fmt} epoch {epoch + 1}/{args.epochs}",
            leave=False,
            disable=RANKS.rank != 0,
        )
        for b, batch in enumerate(train):
            if b >= per_epoch:
                break
            x, y = prepare(batch, device, fmt)
            seen.append((x, y))
            order = runs[b % len(runs) :] + runs[: b % len(runs)]  # spread warm-up and cache effects
            for run in order:
                t0 = time.perf_counter()
                step(run, x, y, device, measure=global_step == 1, timed=global_step >= 2)
                run.elapsed_s += time.perf_counter() - t0
            global_step += 1
            bar.update()
            if b % args.log_every == 0:
                losses = {run.losses[-1] for run in runs}
                same = "all equal" if len(losses) == 1 else f"{len(losses)} different values"
                say(
                    f"{fmt} | Epoch: {epoch + 1:03d}/{args.epochs:03d} | Batch {b:04d}/{n_train:04d} | "
                    f"Loss: {runs[0].losses[-1]:.4f} ({len(runs)} models, {same})"
                )
        bar.close()
        t_eval = time.perf_counter()
        train_eval = _take(train, 0, device, fmt) if args.train_accuracy else []
        for run in runs:
            valid_acc, valid_loss = evaluate(run.net, valid)
            figures = {"valid_acc": valid_acc, "valid_loss": valid_loss}
            train_text = "Train.: not evaluated (--train-accuracy)"
            if train_eval:
                figures["train_acc"], figures["train_loss"] = evaluate(run.net, train_eval)
                train_text = f"Train. Acc.: {figures['train_acc']:.3f}% | Loss: {figures['train_loss']:.3f}"
            run.epochs.append(figures)
            say(
                f"{fmt} | {run.name:9} | ***Epoch: {epoch + 1:03d}/{args.epochs:03d} | {train_text} | "
                f"Valid. Acc.: {valid_acc:.3f}% | Loss: {valid_loss:.3f} | "
                f"Time elapsed: {run.elapsed_s / 60:.2f} min"
            )
        say(f"{fmt} | evaluated in {time.perf_counter() - t_eval:.1f} s")
    return summarise(runs, fmt, per_epoch, profile, messages)


def _take(loader: Any, limit: int, device: torch.device, fmt: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i, batch in enumerate(loader):
        if limit and i >= limit:
            break
        out.append(prepare(batch, device, fmt))
    return out


def summarise(
    runs: list[Run], fmt: str, per_epoch: int, profile: autockpt.Profile, messages: list[str]
) -> dict[str, Any]:
    base = runs[0]
    base_step = statistics.median(base.step_s) if base.step_s else float("nan")
    rows = []
    for run in runs:
        segments = run.segments
        prediction = predict(segments, profile.costs, loss_bytes=profile.loss_bytes)
        where = describe_peak(prediction.peak_at, profile.stage_names)
        med = statistics.median(run.step_s) if run.step_s else float("nan")
        params_equal = all(
            torch.equal(a, b)
            for a, b in zip(base.model.state_dict().values(), run.model.state_dict().values())
        )
        rows.append(
            {
                "format": fmt,
                "strategy": run.name,
                "plan": run.plan,
                "checkpointed_segments": sum(s.checkpoint for s in run.segments),
                "peak_bytes": run.peak_bytes,
                "rank_peak_bytes": _gather(run.peak_bytes),
                "peak_ratio": run.peak_bytes / base.peak_bytes if base.peak_bytes else float("nan"),
                "tensor_peak_bytes": run.tensor_peak_bytes,
                "epoch_s": med * per_epoch,
                "time_ratio": med / base_step,
                "final_loss": run.losses[-1],
                "losses": run.losses,
                "identical_losses": run.losses == base.losses,
                "identical_parameters": params_equal,
                "max_loss_difference": max(abs(a - b) for a, b in zip(run.losses, base.losses)),
                "predicted_peak_in": where,
                "epochs": run.epochs,
            }
        )
    return {
        "format": fmt,
        "batches_per_epoch": per_epoch,
        "notes": [*messages, where_the_peak_sits(rows)],
        "rows": rows,
    }


def where_the_peak_sits(rows: list[dict[str, Any]]) -> str:
    """One sentence on what sets the peak in this format, from the measured figures."""
    checkpointed = [r for r in rows if r["checkpointed_segments"] > 0] or rows
    base, best = rows[0], min(checkpointed, key=lambda r: r["peak_bytes"])
    hidden = base["peak_bytes"] - base["tensor_peak_bytes"]
    text = (
        f"{base['format']}: unwrapped peak {format_bytes(base['peak_bytes'])} at allocator level, "
        f"{format_bytes(base['tensor_peak_bytes'])} in tensors (so {format_bytes(max(hidden, 0))} are "
        f"op workspaces no tensor owns), predicted in {base['predicted_peak_in']}. Lowest checkpointed "
        f"peak: {best['strategy']}, {best['peak_ratio']:.2f} of unwrapped at allocator level, "
        f"{best['tensor_peak_bytes'] / max(base['tensor_peak_bytes'], 1):.2f} in tensors."
    )
    if best["peak_ratio"] > 0.97 > best["tensor_peak_bytes"] / max(base["tensor_peak_bytes"], 1):
        text += (
            " Checkpointing lowers the tensors but not the real peak: the workspaces of one "
            "stage's backward set it whatever is checkpointed."
        )
    return text


def _gather(value: int) -> list[int]:
    """``value`` from every rank, in rank order."""
    if RANKS.world == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * RANKS.world
    dist.all_gather_object(out, value)
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# NiN on CIFAR-10: {results['data']}",
        "",
        f"{results['config']}",
        "",
        "| format | strategy | plan | peak (allocator) | ratio | peak (tensors) | time/epoch | time ratio "
        "| final loss | valid acc | losses identical | predicted peak in |"
        + (" peak per rank |" if RANKS.world > 1 else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if RANKS.world > 1 else ""),
    ]
    for fmt in results["formats"]:
        for r in fmt["rows"]:
            same = "yes" if r["identical_losses"] else f"no (max diff {r['max_loss_difference']:.2e})"
            lines.append(
                f"| {r['format']} | {r['strategy']} | {r['plan']} | {format_bytes(r['peak_bytes'])} | "
                f"{r['peak_ratio']:.2f} | {format_bytes(r['tensor_peak_bytes'])} | {r['epoch_s']:.1f} s | "
                f"{r['time_ratio']:.2f} | {r['final_loss']:.4f} | {r['epochs'][-1]['valid_acc']:.2f}% | "
                f"{same} | "
                f"{r['predicted_peak_in']} |"
                + (
                    f" {' / '.join(format_bytes(b) for b in r['rank_peak_bytes'])} |"
                    if RANKS.world > 1
                    else ""
                )
            )
    for fmt in results["formats"]:
        lines.extend(f"\n{n}" for n in fmt["notes"])
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-.", (0, (1, 3)), (0, (5, 1))]
    for fmt in results["formats"]:
        for i, r in enumerate(fmt["rows"]):
            ax_loss.plot(
                r["losses"], linestyle=styles[i % len(styles)], label=f"{r['format']} {r['strategy']}"
            )
            marker = "o" if r["format"] == "nchw" else "s"
            ax_mem.scatter(r["time_ratio"], r["peak_bytes"] / 2**20, marker=marker)
            ax_mem.annotate(f"{r['format']} {r['strategy']}", (r["time_ratio"], r["peak_bytes"] / 2**20),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")  # fmt: skip
    ax_loss.set(xlabel="training step", ylabel="batch loss", title="Loss trajectories (overlaid)")
    ax_loss.legend(fontsize=7)
    ax_mem.set(xlabel="step time / unwrapped", ylabel="peak MiB (allocator)", title="Peak memory vs time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def start_ddp(device: torch.device) -> torch.device:
    """Join the ``torchrun`` job: gloo on CPU, nccl on CUDA (one GPU per local rank)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        raise SystemExit(
            "--ddp runs under torchrun, e.g. torchrun --nproc_per_node 2 benchmarks/nin_cifar10.py --ddp"
        )
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    RANKS.rank, RANKS.world = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    say(f"# DistributedDataParallel: {RANKS.world} ranks on {backend}, 1/{RANKS.world} of each batch")
    return device


def main() -> None:
    args = parse_args()
    setup()
    device = torch.device(args.device)
    if args.ddp:
        device = start_ddp(device)
    deterministic(device)
    data, source = training_set(args.data_dir, download=not args.no_download)
    say(f"# data: {source}")
    subset = (
        "all batches"
        if not args.batches
        else f"the first {args.batches} batches of each epoch (--full for all)"
    )
    config = (
        f"NiN, Adam lr {args.lr}, batch {args.batch_size}, seed {args.seed}, {args.epochs} epoch(s), "
        f"{subset}, device {device}, torch {torch.__version__}"
        + (f", DDP over {RANKS.world} ranks" if RANKS.world > 1 else "")
    )
    say(f"# {config}")
    formats = [train_format(args, fmt, device, data, source) for fmt in args.formats]
    results = {"data": source, "config": config, "formats": formats}
    if RANKS.rank != 0:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    (out / "results.md").write_text(table)
    plot(results, out / "nin_cifar10.png")
    say()
    say(table)
    verdict = all(r["identical_losses"] for f in formats for r in f["rows"])
    say(f"loss trajectories identical to the unwrapped model's: {'yes' if verdict else 'NO'}")
    say(f"results written to {out.resolve()}")


if __name__ == "__main__":
    main()
