"""CIFAR-10 as the reference notebook loads it, with an offline fallback.

The notebook's ``get_dataloaders_cifar10(batch_size, validation_fraction=0.1)``: the 50,000
training images are split in order, the last 10% for validation; the training subset is
drawn by a seeded ``SubsetRandomSampler`` and keeps its last partial batch (176 batches of
256). Images are scaled to [0, 1] by ``ToTensor`` and normalised to [-1, 1] per channel.

Where no copy is on disk and no network is reachable, ``torchvision.datasets.FakeData``
stands in: the same shapes, sizes and class count, deterministic per index, and said so in
:attr:`Loaders.source`.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset, SubsetRandomSampler
from torchvision import datasets, transforms

NUM_IMAGES = 50_000
MEAN = STD = (0.5, 0.5, 0.5)


class _CIFAR10OnDisk(datasets.CIFAR10):
    """``CIFAR10`` reading an existing copy: every file present is enough.

    torchvision verifies MD5 sums when it downloads; a copy the user points at with
    ``--data-dir`` (or a test writes) is read as it is.
    """

    def _check_integrity(self) -> bool:
        folder = Path(self.root) / self.base_folder
        names = [name for name, _ in (*self.train_list, *self.test_list)] + [self.meta["filename"]]
        return all((folder / name).is_file() for name in names)

    def _load_meta(self) -> None:
        with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
            self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}


@dataclass
class Loaders:
    """The notebook's training and validation loaders, and where their images come from."""

    train: DataLoader[Any]
    valid: DataLoader[Any]
    source: str


def transform() -> transforms.Compose:
    return transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])


def training_set(data_dir: str | os.PathLike[str], *, download: bool = True) -> tuple[Dataset[Any], str]:
    """CIFAR-10's training images from ``data_dir``, downloaded if allowed, else FakeData.

    Returns the data set and one line saying which it is.
    """
    root = Path(data_dir)
    try:
        return _CIFAR10OnDisk(str(root), train=True, transform=transform()), f"CIFAR-10 from {root}"
    except RuntimeError:
        pass
    if download:
        try:
            data = datasets.CIFAR10(str(root), train=True, transform=transform(), download=True)
            return data, f"CIFAR-10 downloaded to {root}"
        except Exception as err:
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    else:
        reason = "download disabled"
    fake = datasets.FakeData(size=NUM_IMAGES, image_size=(3, 32, 32), num_classes=10, transform=transform())
    line = (
        f"CIFAR-10 not found in {root} and not downloadable ({reason}); using CIFAR-shaped "
        f"synthetic data (torchvision FakeData, {NUM_IMAGES} images), so accuracies mean nothing"
    )
    return fake, line


def loaders(
    data: Dataset[Any],
    source: str,
    *,
    batch_size: int,
    validation_fraction: float = 0.1,
    seed: int = 1,
    num_workers: int = 0,
) -> Loaders:
    """The notebook's split of ``data``: last ``validation_fraction`` for validation.

    The training order comes from a generator seeded with ``seed``, so every call yields
    the same batches in the same order.
    """
    n = len(data)  # type: ignore[arg-type]
    n_valid = int(validation_fraction * n)
    train_idx = list(range(n - n_valid))
    valid_idx = list(range(n - n_valid, n))
    order = torch.Generator().manual_seed(seed)
    train = DataLoader(
        data,
        batch_size=batch_size,
        sampler=SubsetRandomSampler(train_idx, generator=order),
        num_workers=num_workers,
    )
    # validation in index order: accuracy does not depend on the order, and no RNG is used
    valid = DataLoader(Subset(data, valid_idx), batch_size=batch_size, num_workers=num_workers)
    return Loaders(train, valid, source)
