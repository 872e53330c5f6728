"""Package hygiene: a cheap import, a small public surface."""

from __future__ import annotations

import subprocess
import sys

import autockpt


def test_import_pulls_in_no_optional_dependency_and_no_cuda() -> None:
    code = (  # torch itself may import tqdm; autockpt must add none of these
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import autockpt\n"
        "new = set(sys.modules) - before\n"
        "bad = [m for m in new if m.split('.')[0] in ('torchvision', 'matplotlib', 'tqdm')]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_public_names_have_docstrings() -> None:
    for name in autockpt.__all__:
        obj = getattr(autockpt, name)
        assert obj.__doc__, name


def test_nin_is_the_notebooks_network() -> None:
    import torch

    model = autockpt.models.NiN(10)
    assert isinstance(model, torch.nn.Sequential) and len(model) == 24
    assert sum(p.numel() for p in model.parameters()) == 966_986
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
