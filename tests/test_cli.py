"""The ``autockpt`` command line: profile, plan, verify, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autockpt.cli import CommandLineError, load_factory, main, parse_input


@pytest.mark.parametrize(
    ("spec", "shape", "dtype"),
    [("8x3x224x224", (8, 3, 224, 224), torch.float32), ("4x256:int64", (4, 256), torch.int64),
     ("2X5:double", (2, 5), torch.float64), ("7", (7,), torch.float32)],
)  # fmt: skip
def test_input_specs(spec: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    assert parse_input(spec) == (shape, dtype)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("8x3xfoo", "is not a shape"),
        ("8x0x2", "positive"),
        ("8x3:float128", "unknown dtype"),
        ("", "not a shape"),
    ],
)
def test_bad_input_specs_say_what_to_write(spec: str, message: str) -> None:
    with pytest.raises(CommandLineError, match=message):
        parse_input(spec)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("autockpt.models", "write MODULE:FACTORY"),
        ("autockpt.models:Nope", "has no attribute 'Nope'"),
        ("autockpt:__version__", "not a callable factory"),
    ],
)
def test_bad_model_specs_say_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(CommandLineError, match=message):
        load_factory(spec)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_the_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["plan", "autockpt.models:NiN", "--input", "2x3x32x32"], capsys)
    assert code == 0 and out.startswith("autockpt plan: strategy='sqrt', walker='sequential'")
    code, out, _ = run(
        ["plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--segments", "3", "--json"], capsys
    )
    plan = json.loads(out)
    assert code == 0 and plan["strategy"] == "3" and len(plan["segments"]) == 3
    code, out, _ = run(["plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--explain"], capsys)
    assert code == 0 and "segment 0: " in out and "keeps its input" in out and "in all: " in out


def test_plan_with_a_budget_and_factory_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "autockpt.models:NiN", "--kwargs", '{"num_classes": 4}', "--input", "8x3x32x32",
            "--budget", "1.0", "--json"]  # fmt: skip
    code, out, _ = run(argv, capsys)
    plan = json.loads(out)
    assert code == 0 and plan["strategy"].startswith("budget=") and plan["budget_bytes"] > 0


def test_profile_prints_per_stage_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["profile", "autockpt.models:NiN", "--input", "2x3x32x32", "--repeats", "1", "--json"], capsys
    )
    prof = json.loads(out)
    assert code == 0 and len(prof["stages"]) == 15
    assert prof["stages"][0]["name"] == "0+1" and prof["stages"][0]["bwd_peak_bytes"] > 0
    assert "ops" not in prof["stages"][0]
    code, out, _ = run(
        ["profile", "autockpt.models:NiN", "--input", "2x3x32x32", "--repeats", "1", "--ops"], capsys
    )
    assert code == 0 and "aten.convolution.default" in out and "keepable" in out


def test_verify_passes_on_an_exact_model(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["verify", "autockpt.models:NiN", "--input", "4x3x32x32:float64"], capsys)
    assert code == 0 and out.startswith("autockpt verify: OK")
    code, out, _ = run(["verify", "autockpt.models:NiN", "--input", "4x3x32x32:float64", "--json"], capsys)
    assert code == 0 and json.loads(out)["ok"] is True


def test_verify_exits_1_when_gradients_differ(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["verify", "models_for_tests:drifting_chain", "--input", "4x8", "--segments", "2"], capsys
    )
    assert code == 1 and "MISMATCH" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "autockpt.models:NiN", "--input", "2x3xtwo"], "is not a shape"),
        (["plan", "nope_module:f", "--input", "2"], "cannot import module"),
        (["plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--budget", "12 parsecs"], "parsecs"),
        (
            ["plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--budget", "0.5", "--segments", "2"],
            "not both",
        ),
        (["plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--kwargs", "{nope"], "is not JSON"),
    ],
)
def test_bad_command_lines_exit_2_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_an_infeasible_budget_exits_4_naming_the_floor(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """4, not verify's 1 for a mismatch: no plan fits, nothing was found wrong."""
    code, _, err = run([command, "autockpt.models:NiN", "--input", "8x3x32x32", "--budget", "1KiB"], capsys)
    assert code == 4 and "smallest achievable peak" in err


def test_python_dash_m_runs_the_same_command() -> None:
    argv = [sys.executable, "-m", "autockpt", "plan", "autockpt.models:NiN", "--input", "2x3x32x32", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["walker"] == "sequential"


def test_plans_on_the_meta_device_and_refuses_to_verify_there(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "autockpt.models:NiN",
        "--input",
        "4096x3x32x32",
        "--device",
        "meta",
        "--budget",
        "0.9",
        "--json",
    ]
    code, out, _ = run(argv, capsys)
    assert code == 0 and json.loads(out)["budget_bytes"] > 8 * 2**30  # far beyond what CI allocates
    code, _, err = run(["verify", "autockpt.models:NiN", "--input", "2x3x32x32", "--device", "meta"], capsys)
    assert code == 2 and "meta device" in err


def test_the_loss_a_budget_covers_can_be_named(capsys: pytest.CaptureFixture[str]) -> None:
    logits = 4 * 16 * 1000 * 4  # batch 4, 16 tokens, vocabulary 1000, float32
    argv = ["profile", "models_for_tests:tiny_lm", "--input", "4x16:int64", "--device", "meta", "--json"]
    _, out, _ = run(argv, capsys)
    default = json.loads(out)["loss_bytes"]
    code, out, _ = run([*argv, "--loss", "cross-entropy"], capsys)
    cross_entropy = json.loads(out)["loss_bytes"]
    assert code == 0 and default == pytest.approx(2 * logits, abs=64)
    assert cross_entropy >= 2 * logits  # log-softmax output and the logits' gradient, at least
    plans = [
        json.loads(run(["plan", *argv[1:], "--budget", "1.0", "--loss", loss], capsys)[1])
        for loss in ("default", "cross-entropy")
    ]
    assert plans[1]["predicted_peak_bytes"] - plans[0]["predicted_peak_bytes"] == cross_entropy - default


def test_cross_entropy_needs_logits(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "autockpt.models:NiN",
        "--input",
        "2x3x32x32",
        "--budget",
        "1.0",
        "--loss",
        "cross-entropy",
    ]
    code, _, _ = run(argv, capsys)
    assert code == 0  # NiN's output is (N, 10) logits
    argv = ["profile", "models_for_tests:drifting_chain", "--kwargs", '{"width": 4}', "--input", "4",
            "--loss", "cross-entropy"]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 2 and "needs logits of shape (N, C)" in err
