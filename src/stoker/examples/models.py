"""Built-in models: small, plain ``nn.Module`` s that a config can name."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def mlp(
    in_features: int,
    out_features: int,
    *,
    hidden: Sequence[int] = (128,),
    dropout: float = 0.0,
) -> nn.Sequential:
    """A multi-layer perceptron: Linear → ReLU (→ Dropout) per hidden layer, then Linear.

    Args:
        in_features: Size of each input vector.
        out_features: Number of outputs (classes for classification).
        hidden: Width of each hidden layer; empty for a linear model.
        dropout: Dropout probability after each hidden activation.
    """
    layers: list[nn.Module] = []
    width = in_features
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = size
    layers.append(nn.Linear(width, out_features))
    return nn.Sequential(*layers)


MODELS = {"mlp": mlp}
