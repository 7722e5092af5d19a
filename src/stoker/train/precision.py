"""Autocast and GradScaler as one object; a no-op when training in fp32."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from stoker.config import Precision as PrecisionName
from stoker.config import TrainConfig
from stoker.errors import ConfigError

logger = logging.getLogger("stoker")

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # stateless: one serves every call


def build_precision(train: TrainConfig, device: torch.device) -> Precision:
    """The run's precision on ``device``, refusing fp16 where it cannot pay off.

    fp16 on the CPU is an error when ``train.device`` is ``auto``: the config was
    written for a GPU and this machine has none. PyTorch runs CPU autocast in float16
    for real, but in software: a 256×256 linear layer measured 6–8× slower than in
    fp32 on the development machine, with no memory saved that matters on a host, so
    running it would honour the letter of the config and defeat its purpose. Falling
    back to bf16 or fp32 instead would train in another precision than the config, its
    checkpoints and the run's records say.
    An error costs one override (its hint names it). With ``train.device=cpu`` asked
    for explicitly, fp16 runs — loss scaling included, which is how its code path is
    tested without a GPU — after a warning.

    Raises:
        ConfigError: fp16 with ``train.device=auto`` resolved to the CPU; fp16 on MPS.
    """
    if train.precision == "fp16" and device.type == "cpu":
        if str(train.device).strip().lower() == "auto":
            raise ConfigError(
                "train.precision=fp16: float16 autocast and loss scaling need a CUDA "
                "device, and this machine has none (train.device=auto chose the CPU)",
                hint="set train.precision=bf16 (CPU autocast; fast only on CPUs with "
                "bfloat16 instructions, such as AMX) or fp32 (precision='bf16' or 'fp32' in "
                "stoker.fit); to run fp16 on the CPU anyway (slow: software float16, e.g. to "
                "test loss scaling), set train.device=cpu",
            )
        logger.warning(
            "train.precision=fp16 on the CPU runs float16 in software, several times "
            "slower than fp32; use train.precision=bf16 or fp32 unless you are testing "
            "fp16 loss scaling"
        )
    return Precision(train.precision, device)


class Precision:
    """Maps one-to-one onto ``torch.autocast`` and ``torch.amp.GradScaler``.

    fp32: autocast is a null context and the scaler is disabled (``scale`` returns the
    loss, ``step`` calls ``optimizer.step()``). bf16: autocast only — bf16 has fp32's
    exponent range, so no scaling. fp16: autocast plus dynamic loss scaling.

    The object itself takes fp16 on any device but MPS (unit tests drive the scaler on
    the CPU); a run gets it through :func:`build_precision`, which refuses fp16 on a
    CPU the run did not ask for.
    """

    def __init__(self, name: PrecisionName, device: torch.device) -> None:
        if name not in _DTYPES:
            raise ConfigError(f"train.precision: {name!r} is not one of fp32, bf16, fp16")
        if name == "fp16" and device.type == "mps":
            raise ConfigError(
                "train.precision: fp16 loss scaling is not supported on mps",
                hint="set train.precision=bf16 or fp32",
            )
        self.name = name
        self.device = device
        self.dtype = _DTYPES[name]
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
        if not self.scaler.is_enabled():
            self._bind_unscaled()

    def _bind_unscaled(self) -> None:
        """fp32 and bf16: bind what the disabled scaler's methods come down to, once.

        ``GradScaler(enabled=False)`` returns the loss from ``scale`` and returns at once
        from ``unscale_``: the same, without its checks on every micro-batch. (``step``
        keeps the scaler's: unscaled, the loop steps through ``OptimizerCalls`` instead.)
        """
        self.backward = torch.Tensor.backward  # type: ignore[method-assign]
        self.unscale_ = _nothing  # type: ignore[method-assign]

    @property
    def scaling(self) -> bool:
        """Whether gradients are scaled (fp16), so a non-finite gradient may be a skip."""
        return self.scaler.is_enabled()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Run the forward pass and loss in the reduced dtype (nothing in fp32).

        fp32 gets one shared null context: no generator to build on every micro-batch.
        """
        if self.dtype is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the scaler when scaling."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale in place, so clipping sees true norms."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` (skipped by the scaler when a gradient is inf/NaN), then update."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def skip_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop this step: no ``optimizer.step()``, and the loss scale stays as it was.

        ``unscale_`` already ran, so the scaler must still close the step (else the next
        ``unscale_`` fails); ``update(new_scale=...)`` does that without counting the step
        as an overflow. Reading the scale is a sync, on this rare path only.
        """
        if self.scaling:
            self.scaler.update(new_scale=self.scaler.get_scale())

    def loss_scale(self) -> float | None:
        """The current loss scale (a CPU–GPU sync point), or None when not scaling."""
        return float(self.scaler.get_scale()) if self.scaling else None

    def state_dict(self) -> dict[str, Any]:
        """The precision's name and the loss scaler's state, for the checkpoint."""
        return {"name": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler; a checkpoint of another precision is a ConfigError naming the fix."""
        if state.get("name") != self.name:
            raise ConfigError(
                f"train.precision: the checkpoint was trained with {state.get('name')!r}, "
                f"this run asks for {self.name!r}",
                hint=f"set train.precision={state.get('name')} to resume it",
            )
        self.scaler.load_state_dict(state["scaler"])


def _nothing(optimizer: torch.optim.Optimizer) -> None:
    """``unscale_`` without scaling: the gradients are already true."""
