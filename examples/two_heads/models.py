"""A two-headed model trained with a user's own step, optimizer and callback.

Everything here is plain PyTorch: stoker imports it by the paths in two_heads.yaml
(``models.py:TwoHeads``, ``models.py:step`` ...), which resolve from this folder.
"""

from __future__ import annotations

import torch
from torch import nn

import stoker


def parcels(size: int = 1200, seed: int = 0) -> stoker.ArrayDataset:
    """Synthetic parcels: 8 measurements -> a kind (3 classes) and a weight in kg.

    A sample is ``(features, kind, weight_kg)``: more than the (inputs, targets) pair the
    built-in loss takes, which is what ``step_fn`` is for.
    """
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 8, generator=generator)
    kind = (features[:, 0] > 0.5).long() + (features[:, 1] > 0).long()
    weight_kg = 2.0 + features[:, 2] - 0.5 * features[:, 3] + 0.1 * kind.float()
    return stoker.ArrayDataset(features, kind, weight_kg)


class TwoHeads(nn.Module):
    """A shared body and two heads: class scores for the kind, one number for the weight."""

    def __init__(self, in_features: int = 8, kinds: int = 3, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.kind = nn.Linear(hidden, kinds)
        self.weight = nn.Linear(hidden, 1)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(features)
        return self.kind(hidden), self.weight(hidden).squeeze(1)


def step(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """One micro-batch: the summed loss of both heads, and each head's own figures.

    stoker backpropagates ``loss``; the other values are logged as ``train/<name>``
    (``val/<name>`` in validation, where this function runs too: there is no eval_fn).
    """
    features, kind, weight_kg = batch
    kind_scores, weight_pred = model(features)
    kind_loss = nn.functional.cross_entropy(kind_scores, kind)
    weight_loss = nn.functional.mse_loss(weight_pred, weight_kg)
    return {
        "loss": kind_loss + weight_loss,
        "kind_loss": kind_loss,
        "weight_loss": weight_loss,
        "kind_accuracy": (kind_scores.argmax(1) == kind).float().mean(),
        "weight_mae_kg": (weight_pred - weight_kg).abs().mean(),
    }


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum; not in torch.optim."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                avg = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(avg.lerp(p.grad, 1 - beta1).sign_(), alpha=-group["lr"])
                avg.lerp_(p.grad, 1 - beta2)


class LossBalance:
    """A callback: how the two heads share the loss, as a running mean, logged every N steps.

    Its state (the running sums) is saved in each checkpoint, so a resumed run logs the
    same figures as one that was never stopped.
    """

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self.kind_share_sum = 0.0
        self.steps = 0

    def on_step_end(self, loop, step) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        # Reading the tensors waits for the device: done every N steps, not every step.
        kind = float(step.metrics["train/kind_loss"])
        self.kind_share_sum += kind / max(float(step.loss), 1e-12)
        loop.log({"balance/kind_share": self.kind_share_sum / (self.steps // self.every)})

    def state_dict(self) -> dict:
        return {"kind_share_sum": self.kind_share_sum, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.kind_share_sum, self.steps = state["kind_share_sum"], state["steps"]
