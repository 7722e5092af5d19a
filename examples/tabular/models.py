"""Models for the tabular examples: small MLPs written as a user would write them."""

from __future__ import annotations

import torch
from torch import nn


class Regressor(nn.Module):
    """An MLP with one output per row: ``(N, 1)``, the shape people write for regression.

    The output is de-standardised (``target_mean + target_std * net(x)``) so the network
    learns on a unit scale while the loss and the metrics read the target's own units.
    Inputs pass a BatchNorm first: CSV columns come on whatever scale the file has.
    """

    def __init__(
        self,
        in_features: int,
        *,
        hidden: int = 64,
        dropout: float = 0.1,
        target_mean: float = 0.0,
        target_std: float = 1.0,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.BatchNorm1d(in_features),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, 1),
        )
        self.register_buffer("target_mean", torch.tensor(float(target_mean)))
        self.register_buffer("target_std", torch.tensor(float(target_std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.target_mean + self.target_std * self.net(x)


class Classifier(nn.Module):
    """An MLP over raw-scale features (BatchNorm first), one logit per class."""

    def __init__(self, in_features: int, num_classes: int, *, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.BatchNorm1d(in_features),
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
