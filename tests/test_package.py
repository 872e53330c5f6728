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
        "bad = [m for m in new if m.split('.')[0] in ('torchvision', 'matplotlib', 'tqdm', 'transformers')]\n"
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


def test_the_gpt2_decoder_is_hugging_faces_at_the_size_asked() -> None:
    import torch
    import transformers

    model = autockpt.models.gpt2_decoder(layers=2, embd=32, heads=2, positions=16)
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert (model.config.n_layer, model.config.n_embd, model.config.n_head) == (2, 32, 2)
    out = model.train()(torch.zeros(2, 16, dtype=torch.long))
    assert out.logits.shape == (2, 16, 50257) and out.past_key_values is None
    full = autockpt.models.gpt2_decoder().config
    assert (full.n_layer, full.n_embd, full.n_head, full.n_positions) == (12, 256, 4, 256)
