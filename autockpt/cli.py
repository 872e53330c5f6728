"""The ``autockpt`` command: profile, plan, weigh and verify any importable model factory.

    autockpt plan torchvision.models:resnet50 --input 8x3x224x224 --budget 0.6
    autockpt verify autockpt.models:NiN --input 16x3x32x32 --segments sqrt
    autockpt profile mypkg.nets:build --kwargs '{"depth": 12}' --input 4x256:int64 --json
    autockpt tradeoff autockpt.models:NiN --input 64x3x32x32 --measure --out plots
    autockpt profile autockpt.models:NiN --input 64x3x32x32 --plot step --measure
    autockpt plan mypkg.nets:gpt --input 8x1024:int64 --device meta --budget 40GiB --loss cross-entropy

Tables for people by default, ``--json`` for machines. Exit codes: 0 success, 1 when
``verify`` finds a mismatch or a budget is infeasible, 2 for a bad command line (unknown
module, bad shape string) as argparse does, 3 when building, planning or running the model
raises (printed as one line saying whether the model's code or autockpt raised it;
``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autockpt.errors import PlanInfeasibleError

__all__ = ["budget_arg", "cross_entropy_loss", "load_factory", "main", "parse_input"]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "bool": torch.bool,
}  # fmt: skip


class CommandLineError(ValueError):
    """A bad spec on the command line; reported by argparse with exit code 2."""


def parse_input(spec: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"8x3x224x224"`` or ``"4x256:int64"`` to a shape and a dtype (default float32).

    Examples:
        >>> parse_input("8x3x32x32")
        ((8, 3, 32, 32), torch.float32)
        >>> parse_input("4x256:int64")
        ((4, 256), torch.int64)
    """
    shape_text, _, dtype_text = spec.partition(":")
    dtype_name = dtype_text.strip().lower() or "float32"
    if dtype_name not in _DTYPES:
        raise CommandLineError(
            f"--input {spec!r}: unknown dtype {dtype_text!r}; use one of {', '.join(sorted(_DTYPES))}."
        )
    try:
        shape = tuple(int(part) for part in shape_text.lower().split("x"))
    except ValueError:
        raise CommandLineError(
            f"--input {spec!r} is not a shape; write sizes joined by 'x', e.g. 8x3x224x224 "
            f"(optionally ':int64' for integer inputs such as token ids)."
        ) from None
    if not shape or any(n <= 0 for n in shape):
        raise CommandLineError(f"--input {spec!r}: every size must be a positive integer.")
    return shape, _DTYPES[dtype_name]


def load_factory(spec: str) -> Callable[..., Any]:
    """``"package.module:name"`` to the callable it names.

    Examples:
        >>> load_factory("autockpt.models:NiN").__name__
        'NiN'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CommandLineError(
            f"model {spec!r}: write MODULE:FACTORY, e.g. torchvision.models:resnet50 or autockpt.models:NiN."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CommandLineError(f"model {spec!r}: cannot import module {module_name!r} ({err}).") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CommandLineError(f"model {spec!r}: module {module_name!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CommandLineError(f"model {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable factory.")
    return obj  # type: ignore[no-any-return]


def _example(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, channels_last: bool
) -> torch.Tensor:
    """A seeded random input: normal floats, or zeros for integers (a valid index for any embedding)."""
    if device.type == "meta":
        x = torch.empty(shape, dtype=dtype, device=device)
    elif dtype.is_floating_point:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    else:
        x = torch.zeros(shape, dtype=dtype, device=device)
    return x.to(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def _build(args: argparse.Namespace) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    factory = load_factory(args.model)
    try:
        kwargs = json.loads(args.kwargs) if args.kwargs else {}
    except json.JSONDecodeError as err:
        raise CommandLineError(
            f"--kwargs {args.kwargs!r} is not JSON ({err.msg}); e.g. '{{\"num_classes\": 10}}'."
        ) from None
    if not isinstance(kwargs, dict):
        raise CommandLineError(f"--kwargs {args.kwargs!r} must be a JSON object of keyword arguments.")
    device = torch.device(args.device)
    specs = [parse_input(s) for s in args.input]
    # on the meta device nothing is allocated, so models larger than this machine can be planned
    with torch.device("meta") if device.type == "meta" else contextlib.nullcontext():
        model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise CommandLineError(f"model {args.model!r} returned a {type(model).__name__}, not an nn.Module.")
    model = model.to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model.train(not args.eval)
    floating = {dtype for _, dtype in specs if dtype.is_floating_point}
    if len(floating) == 1 and floating != {torch.float32}:
        model = model.to(floating.pop())
    return model, tuple(_example(shape, dtype, device, args.channels_last) for shape, dtype in specs)


def _segments(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def budget_arg(text: str | None) -> int | float | str | None:
    """A ``--budget`` string as ``budget=`` takes it: an int of bytes, a fraction, or text with units.

    Raises:
        CommandLineError: the text is not a budget (checked here, so a typo is a usage error).
    """
    from autockpt.plan import parse_budget

    if text is None:
        return None
    value: int | float | str
    try:
        value = int(text) if text.isdigit() else float(text)
    except ValueError:
        value = text
    try:
        parse_budget(value, unwrapped_bytes=2**40, where="--budget")
    except (TypeError, ValueError) as err:
        raise CommandLineError(str(err)) from None
    return value


def cross_entropy_loss(out: Any) -> torch.Tensor:
    """Cross-entropy of the first floating-point output, taken as logits over its last
    dimension (``(N, C)``, or ``(B, T, V)`` for a language model), against class 0.

    Examples:
        >>> cross_entropy_loss(torch.zeros(2, 3, 5)).item() == torch.log(torch.tensor(5.0)).item()
        True
    """
    from torch.nn import functional as F  # noqa: N812
    from torch.utils._pytree import tree_leaves

    floating = (t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    logits = next(floating, None)
    if logits is None or logits.dim() < 2:
        got = "no floating-point output" if logits is None else f"an output of shape {tuple(logits.shape)}"
        raise CommandLineError(f"--loss cross-entropy needs logits of shape (N, C) or (B, T, V); got {got}.")
    flat = logits.flatten(0, -2)
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


_LOSSES: dict[str, Callable[[Any], torch.Tensor] | None] = {
    "default": None,
    "cross-entropy": cross_entropy_loss,
}


def _cmd_profile(args: argparse.Namespace) -> int:
    import autockpt

    if args.measure and args.plot is None:
        raise CommandLineError("--measure draws measured curves beside the predicted ones; add --plot FILE.")
    _check_measurable(args)
    model, inputs = _build(args)
    with _snapshot(args):
        prof = autockpt.profile(
            model, inputs, mode=args.mode, loss_fn=_LOSSES[args.loss], repeats=args.repeats, ops=args.ops
        )
        print(prof.to_json() if args.json else prof)
        if args.plot is not None:
            _plot_timeline(args, model, inputs, prof)
    return 0


def _plot_timeline(args: argparse.Namespace, model: nn.Module, inputs: tuple[Any, ...], prof: Any) -> None:
    """``profile --plot``: the predicted timeline, unwrapped and with the plan the planning
    options make; with ``--measure``, both measured beside them."""
    import autockpt
    from autockpt.measure.timeline import measured_curve

    plan = autockpt.make_plan(
        model, _segments(args.segments), budget=budget_arg(args.budget), example_inputs=inputs,
        mode=args.mode, loss_fn=_loss_for_plan(args),
    )  # fmt: skip
    measured = []
    if args.measure:
        loss = _LOSSES[args.loss]
        measured.append(measured_curve("unwrapped (measured)", model, inputs, loss_fn=loss))
        wrapped = autockpt.auto_checkpoint(copy.deepcopy(model), plan)
        measured.append(measured_curve(f"plan {plan.strategy} (measured)", wrapped, inputs, loss_fn=loss))
    timeline = prof.timeline(plan, measured=measured)
    print(timeline, file=sys.stderr)
    files = timeline.plot(args.plot)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)


def _check_measurable(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "meta" and args.measure:
        raise CommandLineError(
            "--measure runs training steps, which the meta device cannot; use cpu or cuda."
        )
    if args.snapshot is not None and device.type != "cuda":
        raise CommandLineError(
            f"--snapshot writes a CUDA memory snapshot; it needs --device cuda, not {args.device!r}."
        )


@contextlib.contextmanager
def _snapshot(args: argparse.Namespace) -> Iterator[None]:
    """With ``--snapshot FILE``: record the CUDA allocator's history (with Python stacks)
    through the command and dump it for PyTorch's memory viewer (pytorch.org/memory_viz)."""
    if args.snapshot is None:
        yield
        return
    # NOTE [Snapshots record allocations' stacks only]: with free-time stacks too (torch's
    # default context="all"), torch 2.11 on CUDA fails the backward of any non-reentrant
    # checkpoint that stops its recompute early ("SystemError: run_backward returned NULL
    # without setting an exception"; plain torch.utils.checkpoint as well; seen on an H200).
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="alloc", stacks="python")
    try:
        yield
        torch.cuda.memory._dump_snapshot(str(args.snapshot))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"wrote {args.snapshot} (open it at https://pytorch.org/memory_viz)", file=sys.stderr)


def _cmd_plan(args: argparse.Namespace) -> int:
    import autockpt

    budget = budget_arg(args.budget)
    model, inputs = _build(args)
    plan = autockpt.make_plan(
        model, _segments(args.segments), budget=budget, example_inputs=inputs,
        mode=args.mode, loss_fn=_loss_for_plan(args),
    )  # fmt: skip
    print(plan.to_json() if args.json else plan.explain() if args.explain else plan)
    return 0


def _cmd_tradeoff(args: argparse.Namespace) -> int:
    import autockpt

    _check_measurable(args)
    model, inputs = _build(args)
    with _snapshot(args):
        sweep = autockpt.tradeoff(
            model, inputs, mode=args.mode, loss_fn=_LOSSES[args.loss], measure=args.measure
        )
    if args.json:
        rows = [
            {
                "kind": p.kind, "label": p.label, "segments": len(p.plan.segments),
                "checkpointed": p.plan.checkpointed_segments, "predicted_peak_bytes": p.predicted_peak_bytes,
                "predicted_step_ms": p.predicted_step_ms, "measured_peak_bytes": p.measured_peak_bytes,
                "measured_step_ms": p.measured_step_ms,
            }
            for p in sweep.points
        ]  # fmt: skip
        print(json.dumps({"floor_bytes": sweep.floor_bytes, "points": rows}, indent=2))
    else:
        print(sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        files = sweep.plot(args.out / "tradeoff")
    except ImportError:  # the table above is the answer; the picture is extra
        print(
            "autockpt: the figure needs matplotlib, which is not installed: pip install 'autockpt[plot]'",
            file=sys.stderr,
        )
        return 0
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import autockpt

    if torch.device(args.device).type == "meta":
        raise CommandLineError("verify runs a training step, which the meta device cannot; use cpu or cuda.")
    budget = budget_arg(args.budget)
    model, inputs = _build(args)
    model = autockpt.auto_checkpoint(
        model, _segments(args.segments), budget=budget, example_inputs=inputs,
        mode=args.mode, loss_fn=_loss_for_plan(args),
    )  # fmt: skip
    report = autockpt.verify(model, inputs, loss_fn=_LOSSES[args.loss], atol=args.atol, rtol=args.rtol)
    print(report.to_json() if args.json else report)
    return 0 if report.ok else MISMATCH_EXIT


def _loss_for_plan(args: argparse.Namespace) -> Callable[[Any], torch.Tensor] | None:
    """The loss to plan a budget for; without a budget the loss plays no part in a plan."""
    return _LOSSES[args.loss] if args.budget is not None else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autockpt", description="Profile, plan and verify activation checkpointing for a model."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{profile,plan,verify}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", help="MODULE:FACTORY, e.g. torchvision.models:resnet50")
    common.add_argument(
        "--input", action="append", required=True, metavar="SHAPE[:DTYPE]",
        help="an example input, e.g. 8x3x224x224 or 4x256:int64; repeat for several",
    )  # fmt: skip
    common.add_argument("--kwargs", default=None, help="JSON keyword arguments for the factory")
    common.add_argument("--device", default="cpu")
    common.add_argument("--channels-last", action="store_true", help="model and 4-d inputs in channels_last")
    common.add_argument("--eval", action="store_true", help="eval mode (default: training mode)")
    common.add_argument(
        "--mode", choices=["sequential", "graph", "blocks"], default=None, help="force a walker"
    )
    common.add_argument(
        "--loss", choices=list(_LOSSES), default="default",
        help="the training loss whose memory a budget covers: 'default' (a weighted sum of the "
        "outputs) or 'cross-entropy' (of the first output, logits over its last dimension)",
    )  # fmt: skip
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--debug", action="store_true", help="show the traceback of an error")
    planning = argparse.ArgumentParser(add_help=False)
    planning.add_argument("--segments", default="sqrt", help="'sqrt' (default), 'none' or a number")
    planning.add_argument("--budget", default=None, help="bytes, '2GiB', or a fraction such as 0.5")
    snapshot = argparse.ArgumentParser(add_help=False)
    snapshot.add_argument(
        "--snapshot", type=Path, default=None, metavar="FILE",
        help="CUDA only: dump the allocator's history through the command for PyTorch's memory viewer",
    )  # fmt: skip
    p = sub.add_parser(
        "profile", parents=[common, planning, snapshot], help="per-stage time and bytes of one training step"
    )
    p.add_argument("--repeats", type=int, default=3, help="timing repeats per stage")
    p.add_argument("--ops", action="store_true", help="also every op of each stage (bytes, time, FLOPs)")
    p.add_argument(
        "--plot", type=Path, default=None, metavar="FILE",
        help="draw memory through one step, unwrapped and with the plan --segments/--budget make "
        "(FILE.png and FILE.svg)",
    )  # fmt: skip
    p.add_argument("--measure", action="store_true", help="with --plot: the measured curves beside them")
    p.set_defaults(run=_cmd_profile)
    p = sub.add_parser("plan", parents=[common, planning], help="the plan auto_checkpoint would apply")
    p.add_argument("--explain", action="store_true", help="per segment: bytes kept and freed, recompute time")
    p.set_defaults(run=_cmd_plan)
    p = sub.add_parser(
        "tradeoff", parents=[common, snapshot], help="peak and time of plans from the floor to none"
    )
    p.add_argument("--measure", action="store_true", help="also run every plan (peak and step time)")
    p.add_argument("--out", type=Path, default=Path("."), help="where tradeoff.png and .svg go")
    p.set_defaults(run=_cmd_tradeoff)
    p = sub.add_parser("verify", parents=[common, planning], help="gradients and peak vs the unwrapped model")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.set_defaults(run=_cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Exit codes: 0 done; 1 ``verify`` found a mismatch; 2 a bad command line (argparse's
    usage error); 3 an error while building, planning or running the model, printed as one
    ``autockpt: error:`` line that says whether the model's code or autockpt raised it
    (``--debug`` lets the traceback through instead); 4 no plan fits the budget (the
    message names the smallest one that does).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "budget", None) is not None and args.segments != "sqrt":
        parser.error("pass --segments or --budget, not both")
    try:
        code: int = args.run(args)
    except CommandLineError as err:
        parser.error(str(err))
    except PlanInfeasibleError as err:  # an answer, not a failure: no plan fits
        print(f"autockpt: {err}", file=sys.stderr)
        return INFEASIBLE_EXIT
    except Exception as err:
        if args.debug:
            raise
        print(f"autockpt: error: {_raised_by(err)} {type(err).__name__}: {err}", file=sys.stderr)
        return ERROR_EXIT
    return code


MISMATCH_EXIT = 1  # verify: checkpointing changed an output, gradient or buffer
ERROR_EXIT = 3  # building, planning or running the model raised
INFEASIBLE_EXIT = 4  # no plan fits the budget


def _raised_by(err: BaseException) -> str:
    """Who raised ``err``: the innermost frame inside autockpt's package, or outside it (the
    model's code, the factory, torch)."""
    package = Path(__file__).resolve().parent
    frames = traceback.extract_tb(err.__traceback__)
    inside = bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(package)
    return "autockpt raised" if inside else "the model (or the code it calls) raised"


if __name__ == "__main__":
    sys.exit(main())
