"""Memory through one step: ``Profile.timeline``/``plot``, measured curves, ``profile --plot``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import autockpt
from autockpt.measure.step import measure_step
from autockpt.measure.timeline import measured_curve
from autockpt.plan import format_bytes
from autockpt.planners.cost_model import memory_events

MIB = 2**20


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(128, 128), nn.GELU())))


def test_events_run_forward_loss_then_backward_with_each_recompute() -> None:
    x = torch.randn(512, 128)
    prof = autockpt.profile(chain(), (x,))
    plan = autockpt.make_plan(chain(), 4, example_inputs=(x,))
    events = memory_events(plan.segments, prof.costs, loss_bytes=prof.loss_bytes)
    phases = [e.phase for e in events]
    n = plan.n_stages
    assert phases[:n] == ["forward"] * n and phases[n] == "loss"
    assert phases.count("backward") == n and phases.count("recompute") == plan.recomputed_stages
    last = plan.segments[-2]  # the last checkpointed segment: its recompute comes first in backward
    assert last.checkpoint
    after = events[n + 1 : n + 1 + len(plan.segments[-1])]  # the plain last segment's backwards
    assert [e.stage for e in after] == list(range(n - 1, last.stop - 1, -1))
    recompute = [e for e in events if e.segment == (last.start, last.stop)][len(last) :]
    assert [e.phase for e in recompute[: len(last)]] == ["recompute"] * len(last)
    assert [e.stage for e in recompute[: len(last)]] == list(range(last.start, last.stop))
    assert [e.stage for e in recompute[len(last) :]] == list(range(last.stop - 1, last.start - 1, -1))


def test_the_timeline_peaks_where_the_plan_predicts_and_lasts_its_recompute() -> None:
    x = torch.randn(512, 128)
    prof = autockpt.profile(chain(), (x,))
    plan = autockpt.make_plan(chain(), budget=0.6, example_inputs=(x,))
    unwrapped, planned = prof.timeline(plan).curves
    assert plan.predicted_peak_bytes is not None and plan.predicted_recompute_ms is not None
    assert planned.peak_bytes == plan.predicted_peak_bytes
    none = autockpt.make_plan(chain(), budget=1.0, example_inputs=(x,))
    assert unwrapped.peak_bytes == none.predicted_peak_bytes
    step_ms = sum(c.fwd_ms + c.bwd_ms for c in prof.costs)
    assert unwrapped.times_ms[-1] == pytest.approx(step_ms)
    recompute = sum(  # the recompute stops early in each segment's last stage
        prof.costs[i].fwd_ms - prof.costs[i].tail_ms * (i == s.stop - 1)
        for s in plan.segments
        if s.checkpoint
        for i in range(s.start, s.stop)
    )
    assert recompute > 0 and planned.times_ms[-1] == pytest.approx(step_ms + recompute)
    assert unwrapped.bytes[0] == planned.bytes[0] == prof.static_bytes
    assert "(checkpointed segment" in planned.peak_at or planned.peak_at.startswith("the loss")
    text = str(prof.timeline(plan))
    assert "unwrapped (predicted): peak" in text and "plan budget=" in text


def test_a_block_walked_plan_is_drawn_over_its_profiled_stages() -> None:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x) if x.sum() > -1e9 else x
            return x

    torch.manual_seed(0)
    model, x = Loop(), torch.randn(256, 64)
    prof = autockpt.profile(model, (x,))
    plan = autockpt.make_plan(model, "sqrt", example_inputs=(x,))
    assert plan.walker == "blocks" and prof.stage_of is not None
    unwrapped, planned = prof.timeline(plan).curves
    assert planned.peak_bytes < 0.8 * unwrapped.peak_bytes
    wrapped = autockpt.auto_checkpoint(copy.deepcopy(model), plan)
    measured = measured_curve("sqrt (measured)", wrapped, (x,))
    assert abs(measured.peak_bytes - planned.peak_bytes) <= 0.1 * planned.peak_bytes


def test_the_measured_curve_is_the_allocators_step() -> None:
    x = torch.randn(512, 128)
    model = chain()
    curve = measured_curve("unwrapped (measured)", model, (x,))
    assert curve.measured and curve.peak_bytes == measure_step(model, (x,))
    assert list(curve.times_ms) == sorted(curve.times_ms) and curve.times_ms[-1] > 0
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was
    wrapped = autockpt.auto_checkpoint(chain(), 4, example_inputs=(x,))
    assert measured_curve("4 (measured)", wrapped, (x,)).peak_bytes < 0.8 * curve.peak_bytes


def test_the_figure_draws_every_curve_and_marks_each_peak(tmp_path: Path) -> None:
    x = torch.randn(512, 128)
    prof = autockpt.profile(chain(), (x,))
    plan = autockpt.make_plan(chain(), 4, example_inputs=(x,))
    measured = measured_curve("unwrapped (measured)", chain(), (x,))
    timeline = prof.timeline(plan, measured=[measured])
    ax = timeline.figure().axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    for curve in timeline.curves:
        assert list(lines[curve.label].get_ydata()) == pytest.approx([b / MIB for b in curve.bytes])
        peak = lines[f"peak {format_bytes(curve.peak_bytes)}: {curve.peak_at}"]
        assert (peak.get_xdata()[0], peak.get_ydata()[0]) == pytest.approx(
            (curve.peak_ms, curve.peak_bytes / MIB)
        )
    assert lines["unwrapped (measured)"].get_linestyle() == ":"
    assert prof.plot(plan).axes[0].get_legend() is not None
    files = timeline.plot(tmp_path / "step")
    assert [f.suffix for f in files] == [".png", ".svg"] and all(f.stat().st_size > 1000 for f in files)


def test_a_plan_of_another_model_is_refused() -> None:
    prof = autockpt.profile(chain(), (torch.randn(8, 128),))
    other = autockpt.make_plan(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 2)
    with pytest.raises(ValueError, match="the plan has 2 stages, the profile 16"):
        prof.timeline(other)


def test_profile_plot_writes_the_pictures_and_names_each_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autockpt.cli import main

    code = main(
        [
            "profile",
            "autockpt.models:NiN",
            "--input",
            "4x3x32x32",
            "--plot",
            str(tmp_path / "nin"),
            "--measure",
            "--loss",  # the loss a measured curve runs; the plan (no budget) does not take it
            "cross-entropy",
        ]
    )
    err = capsys.readouterr().err
    assert code == 0
    for label in (
        "unwrapped (predicted)",
        "plan sqrt (predicted)",
        "unwrapped (measured)",
        "plan sqrt (measured)",
    ):
        assert f"{label}: peak" in err
    assert (tmp_path / "nin.png").exists() and (tmp_path / "nin.svg").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--measure"], "add --plot FILE"),
        (["--snapshot", "s.pickle"], "needs --device cuda"),
    ],
)
def test_profile_options_that_cannot_work_exit_2(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from autockpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "autockpt.models:NiN", "--input", "2x3x32x32", *extra])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("command", [["profile"], ["tradeoff", "--measure"]])
def test_a_cuda_snapshot_is_written_for_the_memory_viewer(command: list[str], tmp_path: Path) -> None:
    """``tradeoff --measure`` runs checkpointed backwards while the history records: with
    free-time stacks they fail on torch 2.11 (NOTE [Snapshots record allocations' stacks only])."""
    import pickle

    from autockpt.cli import main

    out = tmp_path / "snap.pickle"
    args = [*command, "autockpt.models:NiN", "--input", "4x3x32x32", "--device", "cuda"]
    args += ["--snapshot", str(out)]
    if command[0] == "tradeoff":
        args += ["--out", str(tmp_path)]
    assert main(args) == 0
    snapshot = pickle.loads(out.read_bytes())
    assert snapshot["device_traces"] and any(e["action"] == "alloc" for e in snapshot["device_traces"][0])


def test_a_snapshot_records_allocation_stacks_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Free-time stacks break checkpointed backwards on CUDA (NOTE [Snapshots record
    allocations' stacks only]); this pins the recording the CUDA run above needs."""
    import argparse

    from autockpt import cli

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: None)
    with cli._snapshot(argparse.Namespace(snapshot=tmp_path / "s.pickle")):
        pass
    assert calls[0]["context"] == "alloc" and calls[0]["stacks"] == "python"
    assert calls[-1] == {"enabled": None}
