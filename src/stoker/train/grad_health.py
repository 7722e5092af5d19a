"""Per-layer gradient health, sampled every N steps: grad norms, update ratios, clip advice."""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from stoker.checkpoint.export import unwrap_model
from stoker.train.grads import whole_tensor

__all__ = [
    "ADAM_KINDS",
    "GradHealth",
    "layer_grad_norms",
    "snapshot_weights",
    "update_to_weight_ratios",
]

# Optimizers whose update divides by a running estimate of the gradient's scale.
ADAM_KINDS = frozenset({"adam", "adamw", "nadam", "radam", "adamax"})
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    # torch.compile and DDP wrap the model and prefix its names; report the model's own.
    return [
        (name, parameter)
        for name, parameter in unwrap_model(model).named_parameters()
        if parameter.requires_grad
    ]


def _norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor, as float32 tensors on its device (no sync).

    ``torch.linalg.vector_norm`` per tensor (one kernel each, on sampled steps only);
    half-precision tensors are reduced in float32 so a large norm does not overflow to inf.
    """
    norms: list[torch.Tensor] = []
    for tensor in tensors:
        values = tensor.coalesce().values() if tensor.is_sparse else tensor
        reduce_as = torch.float32 if values.dtype in _LOW_PRECISION else None
        norms.append(torch.linalg.vector_norm(values, dtype=reduce_as).float())
    return norms


def layer_grad_norms(model: nn.Module) -> dict[str, torch.Tensor]:
    """The L2 norm of each parameter's ``.grad``, on its device (no CPU–GPU sync).

    Args:
        model: Any module; parameters without a gradient (frozen, or unused this step) are
            left out.

    Returns:
        ``{parameter name: 0-d float32 tensor}`` in registration order.
    """
    named = [(name, p.grad) for name, p in _named_parameters(model) if p.grad is not None]
    return dict(zip([name for name, _ in named], _norms([g for _, g in named]), strict=True))


def snapshot_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every trainable parameter: the ``before`` of an update ratio.

    It costs as much memory, on the same device, as the trainable parameters themselves
    (a 1B-parameter bf16 model: 2 GB). :class:`GradHealth` takes one only on the steps it
    samples and drops it right after the optimizer step.
    """
    return {name: p.detach().clone() for name, p in _named_parameters(model)}


def update_to_weight_ratios(
    model: nn.Module, before: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``||w_after - w_before|| / ||w_before||`` for each parameter in ``before``.

    How far one optimizer step moved each tensor, relative to its size; around 1e-3 is the
    usual healthy figure, far above means the lr is too high for that layer, far below that
    it barely learns. Computed on the device, without a sync.

    Args:
        model: The model after ``optimizer.step()``.
        before: From :func:`snapshot_weights`, taken before the step. Keeping it costs a
            copy of the trainable parameters, which is why :class:`GradHealth` takes it only
            every ``every_n_steps`` steps.

    Returns:
        ``{parameter name: 0-d float32 tensor}``; NaN where ``w_before`` was all zeros (a
        zero-initialized bias on its first step), since the ratio is undefined there.
    """
    ratios: dict[str, torch.Tensor] = {}
    for name, parameter in _named_parameters(model):
        old = before.get(name)
        if old is None:
            continue
        # One parameter at a time: the temporary difference is the size of one tensor,
        # not a second copy of the whole model.
        moved = torch.linalg.vector_norm(parameter.detach() - old, dtype=torch.float32)
        size = torch.linalg.vector_norm(old, dtype=torch.float32)
        ratios[name] = torch.where(size > 0, moved / size, torch.full_like(size, math.nan))
    return ratios


def _read(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Plain floats from 0-d tensors: one transfer (a CPU–GPU sync point) per device.

    Under FSDP the norms are DTensors over every rank's shard: gathered whole first (a
    collective; every rank samples the same steps).
    """
    tensors = [whole_tensor(tensor) for tensor in tensors]
    values: list[float] = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        by_device[tensor.device].append(index)
    for indices in by_device.values():
        stacked = torch.stack([tensors[index].detach().float().reshape(()) for index in indices])
        for index, value in zip(indices, stacked.tolist(), strict=True):
            values[index] = value
    return values


class GradHealth:
    """Samples per-layer gradient health every N steps and watches how often clipping acts.

    The loop calls, in step order::

        health.before_step(model, step)   # after backward/unscale_, before clipping
        clipper.apply_(params, norm)      # then health.observe_clip(clipper.last_clipped)
        optimizer.step()
        record = health.after_step(model) # {} unless this step was sampled

    Off a sampled step every call is a cheap no-op. On one, ``before_step`` queues the
    per-layer norms on the device and copies the weights (memory: one copy of the trainable
    parameters, held until ``after_step``), and ``after_step`` reads everything in one
    transfer per device: the step's only extra CPU–GPU sync. Its record holds
    ``grad/layer/<name>`` (pre-clip L2 norms) and ``update_ratio/<name>``
    (``||Δw|| / ||w||``).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        *,
        optimizer_kind: str,
        update_ratios: bool = True,
        clip_window: int = 100,
        min_clip_steps: int = 20,
        clip_rate_threshold: float = 0.9,
    ) -> None:
        """Sets how often to sample and when clipping is worth a warning.

        Args:
            every_n_steps: Sample steps 0, N, 2N, ... (by optimizer step count); 0 never
                samples, but the clip rate is still watched.
            optimizer_kind: The optimizer's name (``adamw``, ``sgd``, ...), for the advice.
            update_ratios: Also record ``update_ratio/<name>``; off saves the weight copy.
            clip_window: How many recent steps the clip rate covers.
            min_clip_steps: Steps observed before the clip rate is judged.
            clip_rate_threshold: The share of clipped steps that counts as "nearly every".
        """
        if every_n_steps < 0:
            raise ValueError(f"GradHealth(every_n_steps={every_n_steps}): must be 0 or more")
        if clip_window < min_clip_steps:
            raise ValueError(
                f"GradHealth(clip_window={clip_window}) is shorter than "
                f"min_clip_steps={min_clip_steps}: the clip rate would never be judged"
            )
        self.every_n_steps = every_n_steps
        self.optimizer_kind = optimizer_kind.lower()
        self.update_ratios = update_ratios
        self.min_clip_steps = min_clip_steps
        self.clip_rate_threshold = clip_rate_threshold
        self._clips: deque[bool | torch.Tensor] = deque(maxlen=clip_window)
        self._grad_norms: dict[str, torch.Tensor] | None = None
        self._before: dict[str, torch.Tensor] | None = None

    def should_sample(self, step: int) -> bool:
        """Whether ``step`` (optimizer steps done before it, from 0) is a sampled one."""
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def before_step(self, model: nn.Module, step: int) -> None:
        """On a sampled step, queues the per-layer grad norms and snapshots the weights.

        Call it once the gradients are final (after backward and the scaler's ``unscale_``)
        and before clipping, so the norms are those of the true, unclipped gradient.

        Args:
            model: The model being trained.
            step: Optimizer steps done so far (``state.step`` before this step's increment).
        """
        if not self.should_sample(step):
            self._grad_norms = self._before = None
            return
        self._grad_norms = layer_grad_norms(model)
        self._before = snapshot_weights(model) if self.update_ratios else None

    def after_step(self, model: nn.Module) -> dict[str, float]:
        """The sampled step's record, read after ``optimizer.step()``; ``{}`` on other steps.

        Returns:
            ``{"grad/layer/<name>": norm, "update_ratio/<name>": ratio, ...}``.
        """
        if self._grad_norms is None:
            return {}
        norms, before = self._grad_norms, self._before
        # Drop the weight copy as soon as it has been used.
        self._grad_norms = self._before = None
        ratios = update_to_weight_ratios(model, before) if before is not None else {}
        keys = [f"grad/layer/{name}" for name in norms]
        keys += [f"update_ratio/{name}" for name in ratios]
        # CPU–GPU sync point, only on sampled steps.
        values = _read([*norms.values(), *ratios.values()])
        return dict(zip(keys, values, strict=True))

    def observe_clip(self, clipped: bool | torch.Tensor) -> None:
        """Records whether clipping acted on this step.

        Args:
            clipped: A bool, or a 0-d bool tensor on the device (e.g. ``norm > max_norm``);
                a tensor is kept as is and only read by :meth:`clip_rate`, so calling this
                every step adds no sync.
        """
        self._clips.append(clipped.detach() if isinstance(clipped, torch.Tensor) else clipped)

    def clip_rate(self) -> float | None:
        """The share of the recent steps (up to ``clip_window``) on which clipping acted.

        ``None`` before any step was observed. Reads the device flags: a sync point.
        """
        if not self._clips:
            return None
        tensors = [flag for flag in self._clips if isinstance(flag, torch.Tensor)]
        clipped = sum(1 for flag in self._clips if not isinstance(flag, torch.Tensor) and flag)
        if tensors:
            device = tensors[0].device
            stacked = torch.stack([t.to(device).reshape(()).long() for t in tensors])
            clipped += int(stacked.sum().item())  # CPU–GPU sync point.
        return clipped / len(self._clips)

    def warnings(self) -> list[str]:
        """Advice about the recent steps; empty when there is none.

        Warns when clipping acted on at least ``clip_rate_threshold`` of the last
        ``min_clip_steps`` or more steps while an Adam-type optimizer is used.
        """
        if self.optimizer_kind not in ADAM_KINDS or len(self._clips) < self.min_clip_steps:
            return []
        rate = self.clip_rate()
        if rate is None or rate < self.clip_rate_threshold:
            return []
        return [
            f"gradient clipping acted on {rate:.0%} of the last {len(self._clips)} steps with "
            f"optimizer {self.optimizer_kind}. Adam-type optimizers divide each update by a "
            "running estimate of the gradient's own scale, so scaling the gradient down by "
            "its norm on every step barely changes the step they take: the clipping does "
            "little but hide that the raw gradients are large. Lower optim.lr instead (e.g. "
            "3-10x), or raise train.clip_grad_norm so that it only catches rare spikes."
        ]
