"""Built-in models: small, plain ``nn.Module`` s that a config can name."""

from __future__ import annotations

from collections.abc import Sequence

import torch
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


class TextClassifier(nn.Module):
    """Token embedding + a bidirectional GRU (or a small transformer encoder), pooled.

    Takes the padded batch that ``stoker.data.PadCollate`` makes: ``input_ids`` [B, T]
    and ``attention_mask`` [B, T] (right padding); padding never reaches the pooled
    vector (packed sequences for the GRU, a key padding mask for the transformer).
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        embed_dim: int = 64,
        hidden: int = 128,
        kind: str = "gru",
        layers: int = 1,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if kind not in ("gru", "transformer"):
            raise ValueError(f"kind must be 'gru' or 'transformer', got {kind!r}")
        self.kind = kind
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        if kind == "gru":
            self.encoder = nn.GRU(
                embed_dim, hidden, num_layers=layers, batch_first=True, bidirectional=True
            )
            width = 2 * hidden
        else:
            layer = nn.TransformerEncoderLayer(
                embed_dim, nhead=4, dim_feedforward=hidden, dropout=dropout, batch_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, num_layers=layers)
            width = embed_dim
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, num_classes))

    def forward(self, input_ids, attention_mask):
        mask = attention_mask.bool()
        lengths = mask.sum(dim=1).clamp(min=1)
        embedded = self.embed(input_ids)
        if self.kind == "gru":
            packed = nn.utils.rnn.pack_padded_sequence(
                embedded, lengths.cpu(), batch_first=True, enforce_sorted=False
            )
            _, last = self.encoder(packed)  # [layers * 2, B, hidden]
            pooled = torch.cat([last[-2], last[-1]], dim=1)
        else:
            encoded = self.encoder(embedded, src_key_padding_mask=~mask)
            pooled = (encoded * mask.unsqueeze(-1)).sum(dim=1) / lengths.unsqueeze(-1)
        return self.head(pooled)


MODELS["text_classifier"] = TextClassifier
