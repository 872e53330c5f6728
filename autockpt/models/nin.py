"""Network-in-Network for CIFAR-10, as in the reference notebook.

Lin, Chen and Yan 2014, "Network In Network", in the layout of Sebastian Raschka's
gradient-checkpointing notebook (``../shared/reference``): three mlpconv blocks, each a
spatial convolution followed by two 1x1 convolutions, with in-place ReLUs, pooling and
dropout. The notebook's ``x.view(N, num_classes)`` is the final ``nn.Flatten`` here, so
the whole network is one ``nn.Sequential``.
"""

from __future__ import annotations

from torch import nn

__all__ = ["NiN"]


class NiN(nn.Sequential):
    """The notebook's NiN: 3x32x32 images in, ``num_classes`` logits out.

    Args:
        num_classes: number of output classes (10 for CIFAR-10).

    Examples:
        >>> import torch
        >>> NiN(10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Conv2d(3, 192, kernel_size=5, stride=1, padding=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 160, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.Conv2d(160, 96, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            nn.Dropout(0.5),
            nn.Conv2d(96, 192, kernel_size=5, stride=1, padding=2),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.AvgPool2d(kernel_size=3, stride=2, padding=1),
            nn.Dropout(0.5),
            nn.Conv2d(192, 192, kernel_size=3, stride=1, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, 192, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.Conv2d(192, num_classes, kernel_size=1, stride=1, padding=0),
            nn.ReLU(inplace=True),
            nn.AvgPool2d(kernel_size=8, stride=1, padding=0),
            nn.Flatten(),
        )
        self.num_classes = num_classes
