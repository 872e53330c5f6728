"""Lightning integration: ``AutoCheckpoint`` in ``lightning.Trainer``."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

lightning = pytest.importorskip("lightning")

import autockpt  # noqa: E402
from autockpt.integrations.lightning import AutoCheckpoint  # noqa: E402


class Classifier(lightning.LightningModule):  # type: ignore[misc]
    """A deep MLP with dropout, trained on random data: activations dominate its step."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, 256)]
        for _ in range(12):
            layers += [nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256)]
        self.model = nn.Sequential(*layers, nn.GELU(), nn.Linear(256, 4))
        self.plans: list[Any] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Watch(lightning.pytorch.callbacks.Callback):  # type: ignore[misc]
    """Notes the plan each training step ran with."""

    def __init__(self, ac: AutoCheckpoint | None) -> None:
        self.ac, self.plans = ac, []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.plans.append(self.ac.plan if self.ac is not None else None)


def fit(model: Classifier, callbacks: list[Any]) -> int:
    """Three steps of ``Trainer.fit``; the allocator-level peak of the last two."""
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(768, 64, generator=gen), torch.randint(0, 4, (768,), generator=gen)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=256)
    steps: list[int] = []

    class Peaks(lightning.pytorch.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, *args: Any) -> None:
            self.mem = autockpt.track_memory()
            self.stats = self.mem.__enter__()

        def on_train_batch_end(self, *args: Any) -> None:
            self.mem.__exit__(None, None, None)
            steps.append(self.stats.peak_bytes)

    trainer = lightning.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*callbacks, Peaks()],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning.seed_everything(0, verbose=False)
        trainer.fit(model, loader)
    return max(steps[1:])


@pytest.mark.parametrize("budget", [None, 0.7])
def test_fit_with_the_callback_trains_the_same_parameters_in_less_memory(budget: float | None) -> None:
    torch.manual_seed(0)
    base = Classifier()
    plain, checkpointed = copy.deepcopy(base), copy.deepcopy(base)
    callback = AutoCheckpoint(budget=budget, module="model")
    watch = Watch(callback)
    peak_plain = fit(plain, [])
    peak_checkpointed = fit(checkpointed, [callback, watch])
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert "forward" not in vars(checkpointed.model) and callback.plan is None  # restored at teardown
    assert all(plan is not None and plan.checkpointed_segments >= 2 for plan in watch.plans)
    if budget is not None:  # step one ran "sqrt" while its inputs were kept; then the budget plan
        assert watch.plans[0].strategy == "sqrt" and watch.plans[1].strategy.startswith("budget=")
    assert peak_checkpointed < 0.8 * peak_plain


class NoForward(lightning.LightningModule):  # type: ignore[misc]
    """Its training_step calls self.net; the class has no forward of its own."""

    def __init__(self, second: bool = False) -> None:
        super().__init__()
        self.net = Classifier().model
        if second:
            self.head = nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_without_forward_has_its_one_child_checkpointed() -> None:
    """NOTE [A LightningModule without a forward]: its only child is checkpointed, the
    same parameters come out, and with two children the error names module=."""
    torch.manual_seed(0)
    plain, ours = NoForward(), NoForward()
    ours.load_state_dict(plain.state_dict())
    ac = AutoCheckpoint()
    watch = Watch(ac)
    fit(plain, [])
    fit(ours, [ac, watch])
    assert watch.plans[0] is not None and watch.plans[0].checkpointed_segments > 0
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), ours.parameters(), strict=True))
    with pytest.raises(ValueError, match=r"module=.*'net', 'head'"):
        fit(NoForward(second=True), [AutoCheckpoint()])
