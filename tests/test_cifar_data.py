"""The benchmark's CIFAR-10 loading path, on a tiny copy in the real file format."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from cifar10_data import loaders, training_set

PER_BATCH = 4  # images per data_batch_i file


def write_cifar10(root: Path) -> tuple[np.ndarray, list[int]]:
    """CIFAR-10's python layout: five training pickles, a test pickle and the label names."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5 * PER_BATCH, 3 * 32 * 32), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, size=5 * PER_BATCH)]
    for i in range(5):
        part = slice(i * PER_BATCH, (i + 1) * PER_BATCH)
        batch = {"batch_label": f"training batch {i + 1} of 5", "data": images[part], "labels": labels[part]}
        (folder / f"data_batch_{i + 1}").write_bytes(pickle.dumps(batch))
    test = {"batch_label": "testing batch 1 of 1", "data": images[:PER_BATCH], "labels": labels[:PER_BATCH]}
    (folder / "test_batch").write_bytes(pickle.dumps(test))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    return images, labels


def test_reads_a_copy_in_the_cifar10_format(tmp_path: Path) -> None:
    images, labels = write_cifar10(tmp_path)
    data, source = training_set(tmp_path, download=False)
    assert source == f"CIFAR-10 from {tmp_path}"
    assert len(data) == 5 * PER_BATCH  # type: ignore[arg-type]
    x, y = data[7]
    assert x.shape == (3, 32, 32) and y == labels[7]
    # ToTensor then Normalize(0.5, 0.5): a byte v becomes v / 255 * 2 - 1, channels first
    expected = torch.from_numpy(images[7].reshape(3, 32, 32)).float() / 255 * 2 - 1
    torch.testing.assert_close(x, expected)


def test_split_and_order_follow_the_notebook(tmp_path: Path) -> None:
    write_cifar10(tmp_path)
    data, source = training_set(tmp_path, download=False)
    first = loaders(data, source, batch_size=3, validation_fraction=0.1, seed=1)
    again = loaders(data, source, batch_size=3, validation_fraction=0.1, seed=1)
    # 20 images: the last 2 validate, 18 train in batches of 3, the same order every time
    train_batches = [y.tolist() for _, y in first.train]
    assert len(train_batches) == 6 and sum(map(len, train_batches)) == 18
    assert train_batches == [y.tolist() for _, y in again.train]
    assert [y.tolist() for _, y in first.valid] == [[data[18][1], data[19][1]]]
    other = loaders(data, source, batch_size=3, seed=2)
    assert [y.tolist() for _, y in other.train] != train_batches


def test_falls_back_to_synthetic_data_and_says_so(tmp_path: Path) -> None:
    data, source = training_set(tmp_path / "missing", download=False)
    assert "not found" in source and "synthetic" in source
    assert len(data) == 50_000  # type: ignore[arg-type]
    x, y = data[0]
    assert x.shape == (3, 32, 32) and 0 <= int(y) < 10
    assert torch.equal(x, data[0][0])  # deterministic per index


@pytest.mark.parametrize("missing", ["batches.meta", "data_batch_3"])
def test_an_incomplete_copy_is_not_read(tmp_path: Path, missing: str) -> None:
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / missing).unlink()
    _, source = training_set(tmp_path, download=False)
    assert "synthetic" in source
