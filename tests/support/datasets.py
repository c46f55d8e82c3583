"""A dataset the trainer reads from files, made here (nothing is downloaded): MNIST's four IDX
files, gzipped, with images a small CNN learns in an epoch (each class lights a block of its
own, over noise). Used where data must travel as files: through a bucket (spec.dataset.uri)."""

from __future__ import annotations

import gzip
import random
import struct

MNIST_NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")  # fmt: skip


def _idx(shape: tuple[int, ...], values: bytes) -> bytes:
    """An IDX file of unsigned bytes, gzipped (``mtime=0``: the same bytes every time)."""
    header = struct.pack(">I", 0x0800 | len(shape)) + b"".join(struct.pack(">I", n) for n in shape)
    return gzip.compress(header + values, mtime=0)


def _images(count: int, rng: random.Random) -> tuple[bytes, bytes]:
    pixels, labels = bytearray(), bytearray()
    for _ in range(count):
        label = rng.randrange(10)
        image = bytearray(rng.randrange(0, 60) for _ in range(28 * 28))
        top, left = (label // 4) * 9, (label % 4) * 7
        for row in range(top, top + 7):
            for col in range(left, left + 7):
                image[row * 28 + col] = 255
        pixels += image
        labels.append(label)
    return bytes(pixels), bytes(labels)


def mnist_files(train: int = 1437, test: int = 360, seed: int = 0) -> dict[str, bytes]:
    """MNIST's files by name; by default as many images as the digits dataset has (so a run's
    steps per epoch are the kind example's)."""
    rng = random.Random(seed)
    x_train, y_train = _images(train, rng)
    x_test, y_test = _images(test, rng)
    parts = (_idx((train, 28, 28), x_train), _idx((train,), y_train), _idx((test, 28, 28), x_test),
             _idx((test,), y_test))  # fmt: skip
    return dict(zip(MNIST_NAMES, parts, strict=True))
