"""Built-in models: small, plain ``nn.Module`` s that a config can name."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def mlp(
    in_features: int,
    out_features: int,
    *,
    hidden: int | Sequence[int] = (128,),
    dropout: float = 0.0,
) -> nn.Sequential:
    """A multi-layer perceptron: Linear → ReLU (→ Dropout) per hidden layer, then Linear.

    Args:
        in_features: Size of each input vector.
        out_features: Number of outputs (classes for classification).
        hidden: Width of each hidden layer (one number: one layer); empty for a linear
            model.
        dropout: Dropout probability after each hidden activation.
    """
    if isinstance(hidden, int):
        hidden = (hidden,)  # `hidden: 16` in a config means one layer of 16
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
    """Token embedding, an encoder over the padded batch, masked pooling, a linear head.

    Takes the padded batch that ``stoker.data.PadCollate`` makes: ``input_ids`` [B, T]
    and ``attention_mask`` [B, T] (right padding). The encoder runs on the padded batch
    as it is — one dense op per layer, no packed sequences (whose backward measured 5x
    slower on a CPU) — and the mask keeps padding out of the pooled vector, so a text's
    prediction does not depend on how much padding its batch needed:

    - ``cnn`` (the fastest): a 1-D convolution per kernel width, ReLU, max over the real
      positions. Padding embeds to zeros (``padding_idx=0``), which is what a convolution
      sees past the end of a text anyway.
    - ``gru``: a forward GRU over the text and a second one over the text reversed
      within its length (a reverse GRU over right-padded input would read the padding
      first), mean- and max-pooled over the real positions.
    - ``transformer``: an encoder with a key padding mask, mean-pooled.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        *,
        embed_dim: int = 64,
        hidden: int = 128,
        kind: str = "cnn",
        layers: int = 1,
        kernel_sizes: Sequence[int] = (3, 5, 7),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if kind not in ("cnn", "gru", "transformer"):
            raise ValueError(f"kind must be 'cnn', 'gru' or 'transformer', got {kind!r}")
        self.kind = kind
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        if kind == "cnn":
            self.convs = nn.ModuleList(
                nn.Conv1d(embed_dim, hidden, k, padding=k // 2) for k in kernel_sizes
            )
            width = hidden * len(kernel_sizes)
        elif kind == "gru":
            self.forward_gru = nn.GRU(embed_dim, hidden, num_layers=layers, batch_first=True)
            self.backward_gru = nn.GRU(embed_dim, hidden, num_layers=layers, batch_first=True)
            width = 4 * hidden  # (mean, max) x (forward, backward)
        else:
            layer = nn.TransformerEncoderLayer(
                embed_dim, nhead=4, dim_feedforward=hidden, dropout=dropout, batch_first=True
            )
            # No nested-tensor fast path: a prototype API that warns on every eval.
            self.encoder = nn.TransformerEncoder(
                layer, num_layers=layers, enable_nested_tensor=False
            )
            width = embed_dim
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(width, num_classes))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Class logits ``[batch, classes]``; padding (``attention_mask == 0``) does not count."""
        mask = attention_mask.bool()
        embedded = self.embed(input_ids)
        if self.kind == "cnn":
            features = embedded.transpose(1, 2)  # [B, C, T], what Conv1d takes
            keep = mask.unsqueeze(1)
            # After ReLU every value is >= 0, so zeroing the padding leaves the max of the
            # real positions (and 0 for an empty text).
            pooled = torch.cat(
                [
                    torch.relu(conv(features)).masked_fill(~keep, 0).amax(dim=2)
                    for conv in self.convs
                ],
                dim=1,
            )
        elif self.kind == "gru":
            forward_out, _ = self.forward_gru(embedded)
            backward_out, _ = self.backward_gru(embedded.gather(1, _reverse_index(mask, embedded)))
            pooled = torch.cat([_mean_max(forward_out, mask), _mean_max(backward_out, mask)], dim=1)
        else:
            encoded = self.encoder(embedded, src_key_padding_mask=~mask)
            pooled = _masked_mean(encoded, mask.unsqueeze(-1))
        return self.head(pooled)


def _reverse_index(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Gather index that reverses each right-padded row within its length.

    Position t < length reads length - 1 - t; padding stays where it is (after the text),
    so a GRU run over the result reads each text backwards before any padding.
    """
    lengths = mask.sum(dim=1, keepdim=True)
    steps = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    index = torch.where(steps < lengths, lengths - 1 - steps, steps)
    return index.unsqueeze(-1).expand_as(values)


def _mean_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean and max of ``values`` [B, T, D] over the real positions, ``[B, 2D]``."""
    keep = mask.unsqueeze(-1)
    mean = _masked_mean(values, keep)
    # An empty text (no real position) pools to 0 rather than -inf.
    peak = values.masked_fill(~keep, float("-inf")).amax(dim=1).nan_to_num(0.0, neginf=0.0)
    return torch.cat([mean, peak], dim=1)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` [B, T, D] over the positions where ``keep`` [B, T, 1] is set."""
    return values.masked_fill(~keep, 0).sum(dim=1) / keep.sum(dim=1).clamp(min=1)


MODELS["text_classifier"] = TextClassifier


class _DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, dim = x.shape
        # [B, T, 3, H, D/H] -> three [B, H, T, D/H]: the layout SDPA takes.
        q, k, v = (
            self.qkv(self.norm1(x)).view(batch, steps, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        )
        attended = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, steps, dim)))
        return x + self.drop(self.mlp(self.norm2(x)))


class CausalLM(nn.Module):
    """A tiny GPT-style decoder: token and position embeddings, causal blocks, tied head.

    Takes ``input_ids`` [B, T] (T <= ``block_size``) and, optionally, ``position_ids``
    [B, T] (``PackedBlocks(position_ids=True)``: positions that restart at each
    document); returns next-token logits as ``[B, vocab_size, T]``, the layout
    ``nn.CrossEntropyLoss`` takes for per-token targets ``[B, T]``, so the built-in
    ``cross_entropy`` loss and token accuracy apply as they are. Attention is
    ``scaled_dot_product_attention(is_causal=True)``: the fused causal kernel, no mask
    tensor. The output layer shares the token embedding's weights (as GPT-2), and
    weights start at N(0, 0.02): PyTorch's default N(0, 1) embedding, tied to the
    output, makes logits so large that a small model stalls near the bigram level.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int,
        *,
        dim: int = 128,
        layers: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
        self.block_size = block_size
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(block_size, dim)
        self.blocks = nn.Sequential(
            *(_DecoderBlock(dim, heads, mlp_ratio, dropout) for _ in range(layers))
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tokens.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Next-token logits ``[batch, positions, vocab]``."""
        if input_ids.shape[1] > self.block_size:
            raise ValueError(
                f"input_ids has {input_ids.shape[1]} positions; this model has "
                f"block_size={self.block_size} (set model.args.block_size to the data's)"
            )
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.tokens(input_ids) + self.positions(position_ids)
        logits = self.head(self.norm(self.blocks(hidden)))
        return logits.transpose(1, 2)


MODELS["causal_lm"] = CausalLM
