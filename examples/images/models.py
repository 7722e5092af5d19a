"""A small convolutional classifier for the image examples, named as ``models.py:SmallCNN``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Blocks of conv 3×3 → batch norm → ReLU → max-pool 2×2, then a linear head.

    The head max-pools the last feature map to a ``grid``×``grid`` grid: ``grid: 1`` asks
    only whether a feature is present anywhere (a shape's corner, wherever the shape is),
    ``grid: 2`` also keeps roughly where (a digit's strokes). ``in_channels`` must match
    the images: 1 for ``mode: L`` (or ``keep`` on grayscale files), 3 for RGB.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        *,
        widths: Sequence[int] = (16, 32),
        grid: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        blocks: OrderedDict[str, nn.Module] = OrderedDict()
        channels = in_channels
        for number, width in enumerate(widths, start=1):
            blocks[f"conv{number}"] = nn.Sequential(
                nn.Conv2d(channels, width, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            )
            channels = width
        self.features = nn.Sequential(blocks)
        self.head = nn.Sequential(
            nn.AdaptiveMaxPool2d(grid),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(channels * grid * grid, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))
