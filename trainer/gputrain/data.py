"""Datasets, sharded across ranks.

Small datasets (digits, MNIST, CIFAR-10) live as one tensor on the training device and are
batched by indexing, with augmentation done per batch on the device: no per-sample PIL
transforms, no worker processes, no host-to-device copy per step. ImageFolder data goes
through a DataLoader with workers, pinned memory and prefetching. Nothing is ever
downloaded: a missing dataset is a :class:`DatasetMissingError` naming the files expected.

Sharding follows DistributedSampler: each epoch a permutation seeded by (seed, epoch),
padded to a multiple of the world size, rank r taking every world-th index from r. Every
rank thus runs the same number of steps, and a resumed run sees the same batches.
"""

from __future__ import annotations

import gzip
import importlib
import math
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch

from gputrain.contract import TrainerSettings

Batch = tuple[torch.Tensor, torch.Tensor]


class DatasetMissingError(Exception):
    """The dataset's files are not where the settings say; the message says what to put there."""


class DataSource(Protocol):
    """What the training loop needs from a dataset."""

    @property
    def num_classes(self) -> int: ...

    @property
    def in_channels(self) -> int: ...

    @property
    def image_size(self) -> int: ...

    def batches_per_epoch(self) -> int: ...

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]: ...

    def eval_batches(self) -> Iterator[Batch]: ...


def shard_indices(n: int, epoch: int, seed: int, rank: int, world: int, shuffle: bool = True) -> torch.Tensor:
    """This rank's sample indices for an epoch (DistributedSampler's arithmetic)."""
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 100003 + epoch)
        order = torch.randperm(n, generator=generator)
    else:
        order = torch.arange(n)
    total = math.ceil(n / world) * world
    if total > n:
        order = torch.cat([order, order[: total - n]])
    return order[rank::world]


@dataclass
class TensorData:
    """A dataset held as normalised float tensors on the training device."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    batch_size: int
    rank: int
    world: int
    seed: int
    crop_padding: int = 0  # random-crop augmentation with this padding, plus horizontal flips
    channels_last: bool = False

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1])

    def _per_rank(self) -> int:
        return math.ceil(len(self.x_train) / self.world)

    def batches_per_epoch(self) -> int:
        return math.ceil(self._per_rank() / self.batch_size)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        indices = shard_indices(len(self.x_train), epoch, self.seed, self.rank, self.world)
        indices = indices.to(self.x_train.device)
        for b in range(start, self.batches_per_epoch()):
            take = indices[b * self.batch_size : (b + 1) * self.batch_size]
            x = self.x_train.index_select(0, take)
            if self.crop_padding:
                # Seeded by position, not by a running generator: a resumed run augments
                # exactly as the uninterrupted one would have.
                x = self._augment(x, seed=((self.seed * 1000 + epoch) * 100000 + b) * 64 + self.rank)
            yield self._layout(x), self.y_train.index_select(0, take)

    def eval_batches(self) -> Iterator[Batch]:
        # No padding: rank r evaluates samples r, r+world, ...; sums are reduced exactly.
        take = torch.arange(self.rank, len(self.x_test), self.world, device=self.x_test.device)
        for start in range(0, len(take), self.batch_size * 4):
            part = take[start : start + self.batch_size * 4]
            yield self._layout(self.x_test.index_select(0, part)), self.y_test.index_select(0, part)

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def _augment(self, x: torch.Tensor, seed: int) -> torch.Tensor:
        """Random crop after zero padding, and random horizontal flip, for the whole batch at once."""
        generator = torch.Generator(device=x.device).manual_seed(seed)
        n, _, h, w = x.shape
        p = self.crop_padding
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=generator)
        dx = torch.randint(0, 2 * p + 1, (n,), device=x.device, generator=generator)
        rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])[:, None, :, None]
        cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])[:, None, None, :]
        batch = torch.arange(n, device=x.device)[:, None, None, None]
        channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        cropped = padded[batch, channel, rows, cols]
        flip = torch.rand(n, device=x.device, generator=generator) < 0.5
        return torch.where(flip[:, None, None, None], cropped.flip(-1), cropped)


def _normalise(
    train: np.ndarray, test: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel standardisation with the training set's statistics."""
    x_train = torch.from_numpy(train).float()
    x_test = torch.from_numpy(test).float()
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return ((x_train - mean) / std).to(device), ((x_test - mean) / std).to(device)


def _tensor_data(
    arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    num_classes: int,
    settings: TrainerSettings,
    rank: int,
    world: int,
    device: torch.device,
    crop_padding: int = 0,
) -> TensorData:
    x_train, y_train, x_test, y_test = arrays
    train, test = _normalise(x_train, x_test, device)
    return TensorData(
        x_train=train,
        y_train=torch.from_numpy(y_train.astype(np.int64)).to(device),
        x_test=test,
        y_test=torch.from_numpy(y_test.astype(np.int64)).to(device),
        num_classes=num_classes,
        batch_size=settings.batch_size,
        rank=rank,
        world=world,
        seed=settings.seed,
        crop_padding=crop_padding,
        channels_last=settings.channels_last,
    )


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (1797 images, shipped inside the package), split 80/20."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    order = np.random.default_rng(0).permutation(len(images))  # a fixed split, whatever the seed
    cut = int(len(images) * 0.8)
    train, test = order[:cut], order[cut:]
    return images[train], digits.target[train], images[test], digits.target[test]


_MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _find(root: Path, names: list[str], dataset: str, expected: str) -> Path:
    for directory in (root, root / "MNIST" / "raw", root / "raw"):
        for name in names:
            if (directory / name).is_file():
                return directory / name
    raise DatasetMissingError(
        f"dataset {dataset}: {names[0]} not found under {root} (expected {expected}); the trainer never "
        "downloads data: put the files on the dataset volume"
    )


def _read_idx(path: Path) -> np.ndarray:
    """An IDX file (MNIST's format), optionally gzipped."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # unsigned bytes
        raise DatasetMissingError(f"{path}: not an IDX file of unsigned bytes (magic {magic:#x})")
    ndim = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist_arrays(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    expected = ", ".join(_MNIST_FILES.values()) + " (or .gz)"
    arrays = {
        key: _read_idx(_find(root, [name, name + ".gz"], "mnist", expected))
        for key, name in _MNIST_FILES.items()
    }
    scale = np.float32(1 / 255)
    return (
        arrays["x_train"][:, None, :, :] * scale,
        arrays["y_train"],
        arrays["x_test"][:, None, :, :] * scale,
        arrays["y_test"],
    )


class _CifarUnpickler(pickle.Unpickler):
    """Reads a CIFAR-10 batch and nothing else: a pickle may name any callable to run while it
    loads, and a file on a dataset volume is not ours. The format needs only numpy's array
    reconstruction (and, for Python 2's byte strings, a codec)."""

    _ADMITTED = frozenset({
        ("numpy", "ndarray"), ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
        ("_codecs", "encode"),
    })  # fmt: skip

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        super().__init__(handle, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ADMITTED:
            raise DatasetMissingError(
                f"{self.path} is not a CIFAR-10 batch: it refers to {module}.{name}, which the format "
                "never needs (not loaded)"
            )
        return super().find_class(module, name)


def load_cifar10_arrays(root: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The python-pickle CIFAR-10 release (cifar-10-batches-py/data_batch_1..5, test_batch)."""
    expected = "cifar-10-batches-py/data_batch_1..5 and test_batch"
    directory = root / "cifar-10-batches-py" if (root / "cifar-10-batches-py").is_dir() else root

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        path = _find(directory, [name], "cifar10", expected)
        with path.open("rb") as handle:
            batch = _CifarUnpickler(handle, path).load()
        images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        return images, np.asarray(batch[b"labels"])

    parts = [read(f"data_batch_{i}") for i in range(1, 6)]
    x_test, y_test = read("test_batch")
    scale = np.float32(1 / 255)
    return (
        np.concatenate([p[0] for p in parts]) * scale,
        np.concatenate([p[1] for p in parts]),
        x_test * scale,
        y_test,
    )


@dataclass
class SyntheticData:
    """Random images and labels made on the device, for throughput benchmarks."""

    num_classes: int
    in_channels: int
    image_size: int
    batch_size: int
    device: torch.device
    rank: int
    samples: int = 12800
    channels_last: bool = False

    def batches_per_epoch(self) -> int:
        return max(1, self.samples // self.batch_size)

    def _batch(self, seed: int) -> Batch:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        shape = (self.batch_size, self.in_channels, self.image_size, self.image_size)
        x = torch.randn(shape, device=self.device, generator=generator)
        y = torch.randint(0, self.num_classes, (self.batch_size,), device=self.device, generator=generator)
        return (x.contiguous(memory_format=torch.channels_last) if self.channels_last else x), y

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        # A few distinct batches reused: generating fresh noise each step would measure the RNG.
        pool = [self._batch(self.rank * 7 + i) for i in range(4)]
        for b in range(start, self.batches_per_epoch()):
            yield pool[b % len(pool)]

    def eval_batches(self) -> Iterator[Batch]:
        yield self._batch(10**6 + self.rank)


class FolderData:
    """An ImageFolder tree (root/train/<class>/*, root/val/<class>/*) through DataLoader workers."""

    def __init__(self, settings: TrainerSettings, rank: int, world: int, device: torch.device) -> None:
        from gputrain.vision import import_torchvision

        torchvision = import_torchvision()
        transforms = importlib.import_module("torchvision.transforms.v2")  # a submodule: import it
        root = Path(settings.data_dir)
        for split in ("train", "val"):
            if not (root / split).is_dir():
                raise DatasetMissingError(
                    f"dataset imagefolder: {root / split} not found (expected {root}/train/<class>/<image> "
                    f"and {root}/val/<class>/<image>); the trainer never downloads data: put the files on "
                    "the dataset volume"
                )
        self.image_size = 224
        self.in_channels = 3
        normalise = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        to_tensor = [transforms.ToImage(), transforms.ToDtype(torch.float32, scale=True)]
        train_tf = transforms.Compose(
            [transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), *to_tensor, normalise]
        )
        val_tf = transforms.Compose(
            [transforms.Resize(256), transforms.CenterCrop(224), *to_tensor, normalise]
        )
        self.train_set = torchvision.datasets.ImageFolder(str(root / "train"), transform=train_tf)
        self.val_set = torchvision.datasets.ImageFolder(str(root / "val"), transform=val_tf)
        self.num_classes = len(self.train_set.classes)
        self.settings = settings
        self.rank, self.world, self.device = rank, world, device

    def _loader(
        self, dataset: torch.utils.data.Dataset[Batch], shuffle: bool, epoch: int
    ) -> torch.utils.data.DataLoader[Batch]:
        sampler: torch.utils.data.DistributedSampler[Batch] = torch.utils.data.DistributedSampler(
            dataset, num_replicas=self.world, rank=self.rank, shuffle=shuffle, seed=self.settings.seed
        )
        sampler.set_epoch(epoch)
        workers = self.settings.loader_workers
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.settings.batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            prefetch_factor=4 if workers else None,
            persistent_workers=False,
        )

    def batches_per_epoch(self) -> int:
        return math.ceil(math.ceil(len(self.train_set) / self.world) / self.settings.batch_size)

    def train_batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        for b, (x, y) in enumerate(self._loader(self.train_set, True, epoch)):
            if b >= start:
                yield self._to_device(x, y)

    def eval_batches(self) -> Iterator[Batch]:
        for x, y in self._loader(self.val_set, False, 0):
            yield self._to_device(x, y)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        x = x.to(self.device, non_blocking=True)
        if self.settings.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.device, non_blocking=True)


def build_data(settings: TrainerSettings, rank: int, world: int, device: torch.device) -> DataSource:
    """The dataset the settings name, sharded for this rank."""
    root = Path(settings.data_dir)
    if settings.dataset == "digits":
        return _tensor_data(load_digits_arrays(), 10, settings, rank, world, device)
    if settings.dataset == "mnist":
        return _tensor_data(load_mnist_arrays(root), 10, settings, rank, world, device)
    if settings.dataset == "cifar10":
        return _tensor_data(load_cifar10_arrays(root), 10, settings, rank, world, device, crop_padding=4)
    if settings.dataset == "imagefolder":
        return FolderData(settings, rank, world, device)
    # synthetic: MNIST-shaped for the CNN, ImageNet-shaped for the ResNets.
    small = settings.model == "cnn"
    return SyntheticData(
        num_classes=10 if small else 1000,
        in_channels=1 if small else 3,
        image_size=28 if small else 224,
        batch_size=settings.batch_size,
        device=device,
        rank=rank,
        channels_last=settings.channels_last,
    )
