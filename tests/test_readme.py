"""The README's first example runs as shown and shows what it says: the plan training uses,
exact gradients and a lower peak (issue 38, point 10)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_first_example_runs_and_shows_a_saving(capsys: pytest.CaptureFixture[str]) -> None:
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    exec(compile(block.group(1), str(README), "exec"), {})  # our own README
    out = capsys.readouterr().out
    printed = re.match(r"autockpt plan: strategy='sqrt'.* in (\d+) segments, (\d+) checkpointed", out)
    verified = re.search(r"autockpt verify: OK .* (\d+) of (\d+) segments checkpointed", out)
    assert printed and verified
    # the plan printed is the one the training step and verify ran, not a provisional one
    assert (printed.group(1), printed.group(2)) == (verified.group(2), verified.group(1))
    ratio = float(re.search(r"peak \(allocator\).*\((\d\.\d+)x\)", out).group(1))  # type: ignore[union-attr]
    assert ratio <= 0.95
