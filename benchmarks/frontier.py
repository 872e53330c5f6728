"""The memory/time frontier: autockpt's budget plans and op policies against the peers.

For each model, one process measures side by side (interleaved steps, ratios of their
median process CPU time to the unwrapped model's, wall time in the JSON; allocator-level
peaks of one training step, parameters and inputs included):

* autockpt with a budget at ``--budgets`` levels from the planner's floor to the unwrapped
  peak, and at the measured peak of per-block checkpointing, once recomputing whole
  segments and once with ``policy="auto"`` (the planner chooses the ops each checkpointed
  segment keeps), and the default ``"sqrt"`` plan under each named policy;
* ``torch.utils.checkpoint.checkpoint_sequential`` at segment counts 2..16 and a few more
  (models that are an ``nn.Sequential``);
* per-block ``torch.utils.checkpoint`` (Hugging Face's ``gradient_checkpointing_enable``
  for GPT-2, every residual block otherwise);
* per-block selective checkpointing with torchtitan's op list (keep the outputs of
  matmuls and attention, recompute the rest);
* ``torch.compile`` with ``activation_memory_budget`` (``--compile-budgets``), with its
  largest gradient difference from the eager unwrapped model;
* language models (``gpt2``, ``llama-128k``): autockpt with ``head="chunked"`` (the default
  plan and budgets; NOTE [The head inside the model's own forward]), and Hugging Face's
  per-block checkpointing with torch's ``F.linear_cross_entropy`` for the head and loss
  (``batch_chunk_size=256`` and default options). Each point's largest gradient
  difference from the unwrapped model is in the JSON (``max grad difference``, and the
  count of parameters whose gradient is not bitwise).

``--only`` keeps the points whose system name contains one of its words.

``--compile`` compiles every point (inductor): autockpt's plans and the per-block peers are
wrapped in ``torch.compile`` (no memory budget of compile's own), beside compile's
``activation_memory_budget`` at ``--compile-budgets`` (default 0.1, 0.3, 0.5 and 0.7 with
``--compile``); peaks and times are taken against the compiled unwrapped model, gradients
compared with it (``max grad difference``) and with the eager one (``eager grad
difference``); ``checkpoint_sequential`` is left out. Files are named ``frontier_<model>_compile.*``.

Writes ``frontier_<model>.json`` and ``frontier_<model>.png`` (peak ratio against time
ratio, one series per system) into ``--out`` and prints a table, the run's noise (the
spread of the unwrapped step's repeats) and whether autockpt's front dominates.

    python benchmarks/frontier.py --model chain|gpt2|llama-128k|resnet50 [--out results]
        [--repeats 7] [--device cuda] [--only chunked linear_cross_entropy] [--compile]

On CUDA the times are wall times of synchronized steps, the peaks the CUDA caching
allocator's, and the files are named ``frontier_<model>_cuda.*``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import statistics
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import SequentialCheckpoint, mib, setup
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import autockpt
from autockpt.execution.policies import MATMUL_OPS, resolve_policy
from autockpt.planners.budget import min_feasible_budget

Step = Callable[[nn.Module], torch.Tensor]  # model -> loss


class Case:
    """A model, its inputs and loss, and how its peers are built."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        torch.manual_seed(0)
        if name == "chain":
            self.title = "deep chain 64 x (Linear 512 + GELU), batch 2048"
            # nested pairs, so that a "block" is a module; autockpt flattens nested Sequentials
            self.model: nn.Module = nn.Sequential(
                *[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(64)]
            )
            self.args: tuple[Any, ...] = (torch.randn(2048, 512),)
            self.kwargs: dict[str, Any] = {}
            self.loss_fn: Callable[[Any], torch.Tensor] = lambda out: out.square().mean()
            self.block_names = [str(i) for i in range(64)]
        elif name == "resnet50":
            import torchvision

            self.title = "resnet50 channels_last, batch 32, 64x64"
            self.model = torchvision.models.resnet50().to(memory_format=torch.channels_last)
            self.args = (torch.randn(32, 3, 64, 64).to(memory_format=torch.channels_last),)
            self.kwargs = {}
            self.loss_fn = lambda out: out.square().mean()
            self.block_names = [
                f"{layer}.{i}" for layer in ("layer1", "layer2", "layer3", "layer4")
                for i in range(len(getattr(self.model, layer)))
            ]  # fmt: skip
        elif name == "gpt2":
            self.title = "HF GPT2LMHeadModel, 12 layers, n_embd 256, 4 heads, batch 8 x 256, LM loss"
            self.model = autockpt.models.gpt2_decoder(layers=12, embd=256, heads=4, positions=256)
            ids = torch.randint(0, 50257, (8, 256))
            self.args = ()
            self.kwargs = {"input_ids": ids, "labels": ids}
            self.loss_fn = lambda out: out.loss
            self.block_names = [f"transformer.h.{i}" for i in range(12)]
        elif name == "llama-128k":
            from transformers import LlamaConfig, LlamaForCausalLM

            self.title = ("HF LlamaForCausalLM, 4 layers, hidden 256, vocabulary 128256, batch 2 x 512, "
                          "25% of labels -100, LM loss")  # fmt: skip
            config = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                 num_attention_heads=4, num_key_value_heads=4, vocab_size=128256,
                                 max_position_embeddings=512)  # fmt: skip
            self.model = LlamaForCausalLM(config)
            ids = torch.randint(0, 128256, (2, 512))
            labels = ids.clone()
            labels[:, :128] = -100
            self.args = ()
            self.kwargs = {"input_ids": ids, "labels": labels}
            self.loss_fn = lambda out: out.loss
            self.block_names = [f"model.layers.{i}" for i in range(4)]
        else:
            raise SystemExit(f"unknown --model {name!r}: chain, gpt2, llama-128k or resnet50")
        self.model.train().to(device)
        self.args = tuple(a.to(device) for a in self.args)
        self.kwargs = {k: v.to(device) for k, v in self.kwargs.items()}
        self.stem = name if device.type == "cpu" else f"{name}_{device.type}"
        if device.type != "cpu":
            self.title += f", {device.type}"

    def fresh(self) -> nn.Module:
        return copy.deepcopy(self.model)

    @property
    def language_model(self) -> bool:
        return self.name in ("gpt2", "llama-128k")

    def sequential(self) -> nn.Sequential | None:
        if isinstance(self.model, nn.Sequential):
            return self.model
        if self.name == "resnet50":
            m, named = self.model, dict(self.model.named_modules())
            blocks = [named[n] for n in self.block_names]
            return nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, *blocks, m.avgpool, nn.Flatten(), m.fc)  # type: ignore[arg-type]
        return None


def train(model: nn.Module, case: Case) -> None:
    out = model(*case.args, **case.kwargs)  # kept through backward, as in a training loop
    case.loss_fn(out).backward()
    for p in model.parameters():
        p.grad = None
    if case.device.type == "cuda":
        torch.cuda.synchronize(case.device)


def clock(case: Case) -> float:
    """Seconds for step timing: process CPU time on the CPU (NOTE [CPU time on a shared
    machine]), wall time on CUDA (``train`` synchronizes, so a step's kernels are in it)."""
    return time.process_time() if case.device.type == "cpu" else time.perf_counter()


def peak(model: nn.Module, case: Case) -> int:
    static = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    static += sum(t.numel() * t.element_size() for t in (*case.args, *case.kwargs.values()))
    train(model, case)
    train(model, case)
    with autockpt.track_memory(case.device, tensors=False) as mem:
        train(model, case)
    return static + mem.peak_bytes


def _titan_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op.overloadpacket in MATMUL_OPS
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def per_block(model: nn.Module, blocks: list[nn.Module], selective: bool) -> nn.Module:
    """Every block's forward under non-reentrant checkpoint (torchtitan's op list if selective)."""
    for block in blocks:
        inner = type(block).forward.__get__(block)
        context = (
            functools.partial(create_selective_checkpoint_contexts, _titan_policy) if selective else None
        )

        def forward(self: nn.Module, *a: Any, _inner: Any = inner, _ctx: Any = context, **k: Any) -> Any:
            extra = {"context_fn": _ctx} if _ctx is not None else {}
            return checkpoint(_inner, *a, use_reentrant=False, **extra, **k)

        block.forward = types.MethodType(forward, block)  # type: ignore[method-assign]
    return model


def per_block_peer(case: Case, selective: bool = False) -> nn.Module:
    """Every block checkpointed: whole (Hugging Face's ``gradient_checkpointing_enable`` for
    GPT-2, ``torch.utils.checkpoint`` around each block otherwise), or with torchtitan's op
    list (``selective``)."""
    model = case.fresh()
    if case.language_model and not selective:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        return model
    named = dict(model.named_modules())
    return per_block(model, [named[n] for n in case.block_names], selective)


class TorchLinearCrossEntropy(nn.Module):
    """Hugging Face's per-block checkpointing, and torch's ``F.linear_cross_entropy`` for the
    head and the loss (Hugging Face's label shift and ``ignore_index``), called with
    ``options`` (``batch_chunk_size``) or its default chunked options."""

    def __init__(self, case: Case, batch_chunk_size: int | None) -> None:
        super().__init__()
        self.lm = per_block_peer(case)
        self.options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=batch_chunk_size)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> types.SimpleNamespace:
        hidden = self.lm.base_model(input_ids=input_ids).last_hidden_state  # type: ignore[operator]
        target = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        flat = hidden.reshape(-1, hidden.shape[-1])
        loss = nn.functional.linear_cross_entropy(flat, head.weight, target, options=self.options)
        return types.SimpleNamespace(loss=loss)


Point = tuple[str, str, Callable[[], nn.Module], dict[str, Any]]  # system, setting, build, facts


def head_points(case: Case, example: dict[str, Any], levels: list[int]) -> list[Point]:
    """autockpt with a chunked head (default plan, budgets) and torch's linear_cross_entropy."""
    chunked = functools.partial(autockpt.auto_checkpoint, head="chunked")
    out: list[Point] = [("autockpt sqrt head=chunked", "sqrt", functools.partial(chunked, case.fresh()), {})]
    for level in levels:
        build = functools.partial(chunked, case.fresh(), budget=level, **example)
        out.append(("autockpt budget head=chunked", mib(level), build, {"budget": level}))
    if hasattr(nn.functional, "linear_cross_entropy"):
        for size in (256, None):
            build = functools.partial(TorchLinearCrossEntropy, case, size)
            out.append(("per-block checkpoint (HF) + torch linear_cross_entropy",
                        f"batch_chunk_size={size or 'default'}", build, {}))  # fmt: skip
    return out


_FRAMES = itertools.count()


def _calling(model: nn.Module) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    return call


class Compiled(nn.Module):
    """``model`` under ``torch.compile`` with ``activation_memory_budget=budget``.

    NOTE [One frame per compiled point]: dynamo keeps compiled code per code object, and a
    new instance of a class compiled before passes the old entry's guards, so
    ``torch.compile(copy)`` runs the graph compiled for the first copy, whatever budget was
    set since (a 16-layer chain compiled at 1.0 then at 0.1: 36 MiB both; in a fresh process
    0.1 gives 31 MiB). Earlier runs of this benchmark measured every compiled point with the
    graph of the first one compiled. Each compiled point therefore calls its model from a
    function with a code object of its own, and sets its budget before each call (compile
    reads it when it compiles; the budget is in no guard).
    """

    def __init__(self, model: nn.Module, budget: float = 1.0) -> None:
        super().__init__()
        self.model = model
        self.budget = budget
        fn = _calling(model)
        code = fn.__code__.replace(co_name=f"compiled_point_{next(_FRAMES)}")
        own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        self.call = torch.compile(own)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = self.budget
        return self.call(*args, **kwargs)


def compiled(case: Case, budget: float) -> nn.Module:
    """The model under ``torch.compile`` with ``activation_memory_budget=budget``."""
    return Compiled(case.fresh(), budget)


def compiled_plain(case: Case) -> nn.Module:
    """The model compiled with no activation memory budget (1.0), warmed up."""
    model = compiled(case, 1.0)
    train(model, case)
    return model


def compiled_point(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()``'s model under ``torch.compile`` with no memory budget of compile's own."""
    return Compiled(build())


def grads(model: nn.Module, case: Case) -> list[torch.Tensor]:
    torch.manual_seed(1)
    out = model(*case.args, **case.kwargs)
    case.loss_fn(out).backward()
    g = [p.grad.detach().clone() if p.grad is not None else torch.zeros(()) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return g


def policy_runs(policy: str) -> bool:
    """Whether this torch can run ``policy`` (named policies need a recent torch)."""
    try:
        resolve_policy(policy, where="frontier.py")
    except autockpt.AutockptError:
        return False
    return True


def systems(
    case: Case, args: argparse.Namespace
) -> list[tuple[str, str, Callable[[], nn.Module], dict[str, Any]]]:
    """(system, setting, build, extra facts) for every point of the sweep."""
    out: list[tuple[str, str, Callable[[], nn.Module], dict[str, Any]]] = []
    example = {"example_inputs": case.args, "example_kwargs": case.kwargs, "loss_fn": case.loss_fn}
    prof = autockpt.profile(case.model, case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    floor = min_feasible_budget(prof.costs, loss_bytes=prof.loss_bytes, spans=prof.checkpoint_spans)
    floor += prof.static_bytes
    top = autockpt.make_plan(case.model, budget=1.0, **example).predicted_peak_bytes or floor
    levels = [int(floor + (top - floor) * i / (args.budgets - 1)) for i in range(args.budgets)]
    # and one more at the measured peak of per-block checkpointing: same memory, who is faster
    levels = sorted({*levels, peak(per_block_peer(case), case)})
    whole: dict[int, tuple[autockpt.Segment, ...]] = {}
    for policy in ("recompute-all", "auto"):
        for level in levels:
            try:
                plan = autockpt.make_plan(case.model, budget=level, policy=policy, **example)
            except autockpt.PlanInfeasibleError:
                continue
            except autockpt.AutockptError as err:  # a policy this torch cannot run
                print(f"# skipped policy {policy!r}: {err}")
                break
            if policy == "recompute-all":
                whole[level] = plan.segments
            elif not any(s.keep for s in plan.segments) and whole.get(level) == plan.segments:
                continue  # "auto" kept no op: the same plan, measured once
            facts = {"predicted": plan.predicted_peak_bytes, "budget": level,
                     "kept ops": sum(len(s.keep) for s in plan.segments)}  # fmt: skip
            out.append((f"autockpt {policy}", mib(level), functools.partial(plan.apply, case.fresh()), facts))
    for policy in ("recompute-all", "save-matmuls", "save-compute"):
        if policy != "recompute-all" and not policy_runs(policy):
            print(f"# skipped sqrt with policy {policy!r}: this torch cannot run it")
            continue
        build = functools.partial(autockpt.auto_checkpoint, case.fresh(), "sqrt", policy=policy,
                                  example_inputs=case.args, example_kwargs=case.kwargs)  # fmt: skip
        out.append((f"autockpt sqrt {policy}", "sqrt", build, {}))
    body = case.sequential() if not args.compile else None
    if body is not None:
        n = len(body)
        for k in sorted({*range(2, 17), 24, 32, n // 2, n}):
            if 2 <= k <= n:
                out.append(
                    (
                        "checkpoint_sequential",
                        str(k),
                        lambda k=k: SequentialCheckpoint(copy.deepcopy(body), k),
                        {},
                    )
                )

    if case.language_model:
        out.extend(head_points(case, example, levels))
    name = "per-block checkpoint (HF)" if case.language_model else "per-block checkpoint"
    out.append((name, "every block", functools.partial(per_block_peer, case), {}))
    selective = functools.partial(per_block_peer, case, selective=True)
    out.append(("per-block selective (torchtitan ops)", "every block", selective, {}))
    for b in args.compile_budgets:
        build = functools.partial(compiled, case, b)
        out.append(("torch.compile activation_memory_budget", str(b), build, {"compile": b}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="chain", choices=["chain", "gpt2", "llama-128k", "resnet50"])
    parser.add_argument("--only", nargs="*", default=None, help="keep the systems naming one of these")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budgets", type=int, default=10)
    parser.add_argument("--compile-budgets", type=float, nargs="*", default=None)
    parser.add_argument("--compile", action="store_true", help="compile every point (see above)")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    args = parser.parse_args()
    if args.compile_budgets is None:
        args.compile_budgets = [0.1, 0.3, 0.5, 0.7] if args.compile else [0.5]
    setup()
    warnings.simplefilter("ignore", UserWarning)
    case = Case(args.model, args.device)
    plain = case.fresh()
    eager_reference = grads(case.fresh(), case)
    reference = eager_reference
    compiled_reference: nn.Module | None = None
    if args.compile:
        # each point has a frame of its own (NOTE [One frame per compiled point]), but code a
        # graph break leaves to dynamo (a library's function) is shared: past the default
        # limit of 8 recompiles dynamo would run it uncompiled
        torch._dynamo.config.recompile_limit = 10_000
        torch._dynamo.config.accumulated_recompile_limit = 100_000
        compiled_reference = compiled_plain(case)
        reference = grads(compiled_reference, case)
        case.stem += "_compile"
        case.title += ", torch.compile"
    base_peak = peak(compiled_reference or plain, case)
    rows: list[dict[str, Any]] = []
    spreads: list[float] = []
    points = systems(case, args)
    if args.compile:
        points = [
            (system, setting, build if "compile" in f else functools.partial(compiled_point, build), f)
            for system, setting, build, f in points
        ]
    if args.only:
        points = [p for p in points if any(word in p[0] for word in args.only)]
    print(f"# {case.title}: unwrapped peak {mib(base_peak)} MiB; {len(points)} points")
    for i, (system, setting, build, facts) in enumerate(points):
        t0 = time.perf_counter()
        try:
            model = build()
            p = peak(model, case)
            # NOTE [Compiled peers' time]: a compiled model runs faster than the eager one
            # before it recomputes anything (fusion), so its time is taken against the same
            # model compiled without a memory budget; the eager ratio is reported beside it.
            compiled_ref = compiled_reference or (compiled_plain(case) if "compile" in facts else None)
            timed = [plain, model] + ([compiled_ref] if compiled_ref is not None else [])
            # NOTE [CPU time on a shared machine]: process CPU time, not wall time: it leaves
            # out the time this VM's cores were lent elsewhere (wall-time repeats of the same
            # step spread by 10-15% here); both threads stay busy (OpenMP spins between
            # kernels), so it is proportional to the wall time of an idle machine.
            times: list[list[float]] = [[] for _ in timed]
            walls: list[list[float]] = [[] for _ in timed]
            for _ in range(args.repeats):
                for j, m in enumerate(timed):
                    s, w = clock(case), time.perf_counter()
                    train(m, case)
                    times[j].append(clock(case) - s)
                    walls[j].append(time.perf_counter() - w)
            spreads.append(max(times[0]) / min(times[0]) - 1)
            median = [statistics.median(t) for t in times]
            wall = [statistics.median(t) for t in walls]
            ref = -1 if compiled_ref is not None else 0
            row = {"system": system, "setting": setting, "peak": p, "peak ratio": p / base_peak,
                   "time ratio": median[1] / median[ref], "wall time ratio": wall[1] / wall[ref],
                   "unwrapped step s": median[0], **facts}  # fmt: skip
            if compiled_ref is not None:
                row["eager time ratio"] = median[1] / median[0]
            if compiled_ref is not None or case.language_model:
                mine = grads(model, case)
                row["max grad difference"] = max(float((a - b).abs().max()) for a, b in zip(mine, reference))
                row["not bitwise"] = sum(not torch.equal(a, b) for a, b in zip(mine, reference))
                if args.compile:
                    row["eager grad difference"] = max(
                        float((a - b).abs().max()) for a, b in zip(mine, eager_reference)
                    )
        except Exception as err:  # a peer that fails is reported, not fatal
            row = {"system": system, "setting": setting, "error": f"{type(err).__name__}: {str(err)[:100]}"}
        rows.append(row)
        shown = (f"peak {row['peak ratio']:.3f}x  time {row['time ratio']:.3f}x" if "error" not in row
                 else row["error"])  # fmt: skip
        print(
            f"[{i + 1}/{len(points)}] {system} {setting}: {shown} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    noise = statistics.median(spreads) if spreads else 0.0
    report(case, base_peak, rows, noise, args.out)


def _point(r: dict[str, Any] | None) -> str:
    if r is None:
        return "none"
    return f"{r['system']} {r['setting']}: {r['peak ratio']:.3f}x peak, {r['time ratio']:.3f}x time"


def report(case: Case, base_peak: int, rows: list[dict[str, Any]], noise: float, out: Path) -> None:
    ok = [r for r in rows if "error" not in r]
    ours = [r for r in ok if r["system"].startswith("autockpt")]
    peers = [r for r in ok if not r["system"].startswith("autockpt")]
    print(f"\n### {case.title}\n\nunwrapped peak {mib(base_peak)} MiB; noise (median spread of the unwrapped "
          f"step's repeats): {100 * noise:.1f}%\n")  # fmt: skip
    print("| system | setting | peak / unwrapped | time / unwrapped | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['system']} | {r['setting']} | fails | | {r['error']} |")
            continue
        note = []
        if "kept ops" in r:
            note.append(f"{r['kept ops']} ops kept, predicted {r['predicted'] / r['peak']:.3f}x of measured")
        if "eager time ratio" in r:
            note.append(f"time against the compiled unwrapped model ({r['eager time ratio']:.3f}x the eager "
                        "one)")  # fmt: skip
        if "max grad difference" in r:
            note.append(f"max grad difference {r['max grad difference']:.2e} "
                        f"({r['not bitwise']} parameters not bitwise)")  # fmt: skip
        figures = f"{r['peak ratio']:.3f} | {r['time ratio']:.3f}"
        print(f"| {r['system']} | {r['setting']} | {figures} | {'; '.join(note)} |")
    dominated = strictly = 0
    for p in peers:
        fits = [o["time ratio"] for o in ours if o["peak"] <= p["peak"]]
        dominated += bool(fits) and min(fits, default=0.0) <= p["time ratio"] * (1 + noise)
        strictly += bool(fits) and min(fits, default=0.0) <= p["time ratio"]
    print(
        "\nautockpt at or below the peer's time at equal or lower peak: "
        f"{dominated}/{len(peers)} peer points within the noise, {strictly}/{len(peers)} strictly"
    )
    for level in (0.15, 0.3, 0.5, 0.7, 0.9):
        best_ours = min(
            (o for o in ours if o["peak ratio"] <= level), key=lambda o: o["time ratio"], default=None
        )
        best_peer = min(
            (p for p in peers if p["peak ratio"] <= level), key=lambda p: p["time ratio"], default=None
        )
        print(f"at <= {level:.2f}x peak: autockpt {_point(best_ours)}; best peer {_point(best_peer)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"frontier_{case.stem}.json").write_text(
        json.dumps({"model": case.title, "unwrapped_peak": base_peak, "noise": noise, "rows": rows}, indent=2)
    )
    from autockpt.measure.figures import new_figure, save

    try:
        fig, ax = new_figure("frontier.py", (7, 4.5))
    except ImportError:
        return
    for system in dict.fromkeys(r["system"] for r in ok):
        pts = sorted((r["peak ratio"], r["time ratio"]) for r in ok if r["system"] == system)
        swept = system in ("autockpt recompute-all", "autockpt auto")
        marker = "o" if system.startswith("autockpt") else "x"
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=marker,
            linestyle="-" if swept else "none",
            label=system,
        )
    ax.plot([1.0], [1.0], marker="*", color="black", linestyle="none", label="unwrapped")
    ax.set_xlabel("peak / unwrapped")
    ax.set_ylabel("step time / unwrapped")
    ax.set_title(case.title, fontsize=9)
    ax.legend(fontsize=7)
    files = save(fig, out / f"frontier_{case.stem}", ("png",))
    print("wrote " + ", ".join(str(f) for f in files))


if __name__ == "__main__":
    main()
