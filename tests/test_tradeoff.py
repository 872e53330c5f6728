"""``autockpt.tradeoff``: the sweep, its figure and ``autockpt tradeoff``."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import autockpt

MIB = 2**20


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(128, 128), nn.GELU())))


class Loop(nn.Module):
    """Blocks run by a loop with data-dependent control flow: the block walker's."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x) if x.sum() > -1e9 else x
        return x


def test_the_sweep_spans_floor_to_unwrapped_and_more_budget_never_recomputes_more() -> None:
    sweep = autockpt.tradeoff(chain(), (torch.randn(512, 128),))
    kinds = [p.kind for p in sweep.points]
    assert kinds[:2] == ["unwrapped", "sqrt"] and "count" in kinds and kinds.count("budget") >= 8
    base = sweep.unwrapped
    budgets = sorted((p for p in sweep.points if p.kind == "budget"), key=lambda p: p.plan.budget_bytes or 0)
    for p in budgets:
        assert sweep.floor_bytes <= p.predicted_peak_bytes <= (p.plan.budget_bytes or 0)
    recompute = [p.predicted_step_ms for p in budgets]
    assert all(a >= b for a, b in itertools.pairwise(recompute))  # more budget, no more recompute
    assert budgets[-1].predicted_peak_bytes == base.predicted_peak_bytes
    sqrt = next(p for p in sweep.points if p.kind == "sqrt")
    assert sqrt.predicted_peak_bytes < 0.8 * base.predicted_peak_bytes
    text = str(sweep)
    assert text.splitlines()[0].startswith("plan") and "floor: no plan peaks below" in text


def test_the_figure_has_every_series_and_the_floor_where_it_is(tmp_path: Path) -> None:
    sweep = autockpt.tradeoff(chain(), (torch.randn(512, 128),))
    fig = sweep.figure()
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for series in (
        "budget front (predicted)",
        "segment counts (predicted)",
        "sqrt (predicted)",
        "unwrapped (predicted)",
    ):
        assert series in labels
    floor = next(line for line in ax.get_lines() if line.get_label() == "floor")
    assert floor.get_xdata()[0] == pytest.approx(sweep.floor_bytes / MIB)
    unwrapped = next(line for line in ax.get_lines() if line.get_label() == "unwrapped (predicted)")
    assert unwrapped.get_xdata()[0] == pytest.approx(sweep.unwrapped.predicted_peak_bytes / MIB)
    files = sweep.plot(tmp_path / "t")
    assert [f.suffix for f in files] == [".png", ".svg"] and all(f.stat().st_size > 1000 for f in files)


def test_measured_points_and_a_block_walked_model() -> None:
    x = torch.randn(256, 64)
    sweep = autockpt.tradeoff(Loop(), (x,), budgets=[0.7], counts=[3], measure=True, progress=False)
    assert sweep.points[0].plan.walker == "blocks"
    for p in sweep.points:
        assert p.measured_peak_bytes is not None and p.measured_step_ms is not None
        assert abs(p.measured_peak_bytes - p.predicted_peak_bytes) <= 0.1 * p.predicted_peak_bytes
    sqrt = next(p for p in sweep.points if p.kind == "sqrt")
    assert sqrt.measured_peak_bytes is not None and sweep.unwrapped.measured_peak_bytes is not None
    assert sqrt.measured_peak_bytes < 0.8 * sweep.unwrapped.measured_peak_bytes
    labels = [t.get_text() for t in sweep.figure().axes[0].get_legend().get_texts()]
    assert "sqrt (measured)" in labels and "budget front (measured)" in labels


def test_the_command_prints_the_table_and_writes_the_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from autockpt.cli import main

    code = main(["tradeoff", "autockpt.models:NiN", "--input", "4x3x32x32", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("plan") and "unwrapped" in out and "budget" in out
    assert (tmp_path / "tradeoff.png").exists() and (tmp_path / "tradeoff.svg").exists()


def test_the_command_without_matplotlib_prints_the_table_and_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autockpt.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import matplotlib.figure fails
    code = main(["tradeoff", "autockpt.models:NiN", "--input", "4x3x32x32", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.startswith("plan") and "unwrapped" in captured.out
    assert "autockpt[plot]" in captured.err and not list(tmp_path.iterdir())
