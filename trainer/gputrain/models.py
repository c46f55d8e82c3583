"""The networks the built-in trainer trains: a tutorial-style CNN and torchvision ResNets."""

from __future__ import annotations

from torch import nn

from gputrain.contract import ModelName


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        # Pool, then ReLU: the same function as the usual ReLU-then-pool (a max commutes with
        # any non-decreasing map), with the ReLU and its backward on a quarter of the values:
        # about 1.3 ms of a 56 ms step on 2 CPU cores at 28x28, batch 64 (the ReLU's forward and
        # backward took 1.34 ms at 64x32x28x28 and 0.37 ms at 64x64x14x14 there). No parameters
        # move, so checkpoints of the other order load unchanged.
        nn.MaxPool2d(2),
        nn.ReLU(inplace=True),
    )


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks that halve the image, an adaptive pool, and a small MLP head.

    Works for any image of at least 4x4 pixels (digits' 8x8 up to ImageNet's 224x224).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            _block(in_channels, width), _block(width, width * 2), nn.AdaptiveAvgPool2d(1)
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(width * 2, width * 4),
            nn.ReLU(inplace=True),
            nn.Linear(width * 4, num_classes),
        )

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.head(self.features(x))


def build_model(name: ModelName, in_channels: int, num_classes: int, image_size: int) -> nn.Module:
    """A randomly initialised model for images of ``in_channels`` x ``image_size``^2."""
    if name == "cnn":
        return ConvNet(in_channels, num_classes)
    from gputrain.vision import import_torchvision

    models = import_torchvision().models
    model: nn.Module = (models.resnet18 if name == "resnet18" else models.resnet50)(
        weights=None, num_classes=num_classes
    )
    if image_size < 64 or in_channels != 3:
        # Small images (CIFAR, MNIST) lose too much to the 7x7/2 stem and max pool: use a
        # 3x3/1 stem without pooling, the usual CIFAR adaptation.
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        if image_size < 64:
            model.maxpool = nn.Identity()
    return model
