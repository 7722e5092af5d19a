"""Running training and validation metrics, kept on the device until they are read."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from stoker.data.samplers import rank_and_world_size
from stoker.errors import DataError
from stoker.train.losses import (
    aligned_shapes,
    is_plain_cross_entropy,
    loss_ignore_index,
    shape_mismatch,
)

Task = Literal["classification", "regression", "none"]

#: On the CPU, how many steps' outputs and losses are held before they are folded into
#: the sums, and the most output elements held. A fold is ~10 tensor ops whatever the
#: number of steps (a tensor op costs microseconds on a small model), so holding a few
#: hundred small batches takes the metrics' cost per step from ~25 µs to ~1 µs.
_HOLD_STEPS = 256
_HOLD_ELEMENTS = 1 << 18

#: One held batch: detached outputs, targets, mean loss (detached, or a host number), count.
_Held = tuple[torch.Tensor, Any, torch.Tensor | float, int]

#: The running sums, in this order in snapshots and in the distributed all-reduce.
_SUMS = ("loss_sum", "correct", "scored", "abs_err", "sq_err", "nll_sum", "tokens")


class TaskMetrics:
    """Sums of loss, correct predictions, errors and token log-likelihoods over an epoch.

    Every figure has its own denominator, counted from the same batches as its sum:
    the loss is averaged over ``count`` (samples, or real tokens), accuracy over the
    predictions scored (positions equal to the loss's ``ignore_index`` left out), MSE
    and MAE over every predicted value, perplexity over real tokens. A batch whose
    predictions cannot be scored as the run's earlier ones were is an error, never a
    batch counted in the denominator and left out of the sum; a run whose first batch
    cannot be scored (class scores of no known layout, targets that are no tensor)
    reports the loss alone. Regression predictions are aligned with their targets by
    the rule the built-in losses follow (``stoker.train.losses``); any other mismatch
    is an error.

    Updates stay on the device (no ``.item()`` of a device tensor), so recording a step
    costs no CPU–GPU synchronization; ``compute`` reads everything at once.

    On the CPU, ``update`` only keeps references to the batch (no tensor op): the held
    batches are folded into the sums a few hundred at a time, with one concatenation
    and one argmax for all of them (``_fold``). Elsewhere — and for outputs too large to
    hold — each batch is folded as it comes (a device keeps running ahead of the host, so
    its ops are cheap to launch, and holding outputs could pin memory or CUDA-graph
    buffers that the next step overwrites). Either way the sums are the same; only the
    rounding of the float sums differs (a batched loss sum is exact in float64, then
    rounded once).
    """

    def __init__(
        self,
        task: Task | None,
        *,
        ignore_index: int | None = None,
        loss_fn: Callable[..., Any] | None = None,
    ) -> None:
        """``task`` None infers it from the first batch's targets.

        With ``ignore_index`` (token-level losses, ``loss.normalize: tokens``), ``count``
        passed to ``update`` is the number of real tokens. ``loss_fn`` tells which target
        value the loss skips (cross entropy's ``ignore_index`` wins over the argument)
        and whether perplexity means anything (the built-in cross entropy, unweighted).
        """
        self.task = task
        self.token_level = ignore_index is not None
        own = loss_ignore_index(loss_fn)
        self.ignore_index = own if own is not None else ignore_index
        # None until the first batch says whether the run is token-level.
        self._perplexity: bool | None = None if is_plain_cross_entropy(loss_fn) else False
        # Ordinary tensors even when made under inference_mode: held batches may be
        # folded into them in place after it (in ``compute``).
        with torch.inference_mode(False):
            self._sums = {
                name: torch.zeros((), dtype=torch.long if name in _COUNTS else torch.float32)
                for name in _SUMS
            }
        self.samples = 0
        # None until the first batch with targets says whether this run's predictions
        # can be scored; every later batch must agree.
        self._scoring: bool | None = None
        self._batches = 0
        self._held: list[_Held] = []
        # 0 until the first batch is folded, which picks how many later ones are held.
        self._hold = 0

    def update(
        self, outputs: torch.Tensor, targets: Any, loss: torch.Tensor | float, count: int
    ) -> None:
        """Add one batch: the mean loss over ``count`` samples and the predictions.

        Detached references only: the batch's tensors must not be changed in place
        afterwards (the loop's never are: each step has new ones). ``loss`` may be a host
        number the caller has read already (the plain step's check reads it): holding a
        float keeps no tensor alive until the fold, which on the CPU spares the allocator
        a block kept per step for up to ``_HOLD_STEPS`` steps.
        """
        self.samples += count
        # ``.data``: detached as by ``detach()``, without its dispatch (see train_step).
        # A loss the caller already detached is held as it is.
        if type(loss) is not float and loss.requires_grad:
            loss = loss.data
        held = self._held
        held.append((outputs.data, targets, loss, count))
        if len(held) >= self._hold:
            self._fold()

    def _fold(self) -> None:
        """Add the held batches to the sums (the first fold also infers the task)."""
        if not self._held:
            return
        held = self._held.copy()
        self._held.clear()  # in place: a restored state must not see these again
        outputs, targets, loss, _ = held[0]
        if self.task is None:
            # A custom loss: integer labels mean classes, float targets mean regression.
            floating = isinstance(targets, torch.Tensor) and targets.is_floating_point()
            self.task = "regression" if floating else "classification"
        if self._perplexity is None:
            # Token-level: targets per position ([N, T]), or real tokens counted.
            self._perplexity = (
                self.task == "classification"
                and isinstance(targets, torch.Tensor)
                and (targets.ndim >= 2 or self.token_level)
            )
        device = outputs.device if type(loss) is float else loss.device
        if self._sums["loss_sum"].device != device:
            self._move(device)
        if not self._hold:
            self._hold = _hold_steps(outputs, device)
        self._add_losses(held)
        if self._perplexity:
            self._add_token_losses(held)
        if self.task == "none":
            return
        joined = _joined(held)
        if joined is None:  # shapes differ from batch to batch: one at a time
            for outputs, targets, _, _ in held:
                self._add_predictions(outputs, targets, batches=1)
        else:
            self._add_predictions(*joined, batches=len(held))

    def _add_losses(self, held: list[_Held]) -> None:
        loss_sum = self._sums["loss_sum"]
        if len(held) == 1:
            _, _, loss, count = held[0]
            loss_sum.add_(loss, alpha=count)
            return
        # Several are held only on the CPU, where reading a scalar is no sync, and is
        # quicker than stacking them; fsum is exact, so the order does not matter.
        loss_sum.add_(math.fsum(float(loss) * count for _, _, loss, count in held))

    def _add_token_losses(self, held: list[_Held]) -> None:
        """Each batch's mean cross entropy times its real tokens: their summed NLL."""
        nll_sum, tokens = self._sums["nll_sum"], self._sums["tokens"]
        if len(held) == 1:
            _, targets, loss, _ = held[0]
            real = self._real_tokens(targets)
            # A batch of padding alone has a NaN mean loss (0/0) and adds nothing.
            value = loss.float() if isinstance(loss, torch.Tensor) else loss
            nll_sum.add_(torch.where(real > 0, value * real, 0.0))
            tokens.add_(real)
            return
        counts = [int(self._real_tokens(targets)) for _, targets, _, _ in held]  # CPU: no sync
        losses = (loss for _, _, loss, _ in held)
        nll_sum.add_(
            math.fsum(float(loss) * real for loss, real in zip(losses, counts, strict=True) if real)
        )
        tokens.add_(sum(counts))

    def _real_tokens(self, targets: torch.Tensor) -> torch.Tensor:
        """The positions the loss averaged over (a device tensor: no sync)."""
        if self.ignore_index is None:
            return torch.full((), targets.numel(), device=targets.device)
        return targets.ne(self.ignore_index).sum()

    def _add_predictions(self, outputs: torch.Tensor, targets: Any, *, batches: int) -> None:
        """Score ``batches`` batches' predictions (joined along the batch), or none of them."""
        hits: tuple[torch.Tensor, torch.Tensor | int] | None = None
        errors: tuple[torch.Tensor, torch.Tensor] | None = None
        if isinstance(targets, torch.Tensor):
            if self.task == "classification":
                hits = _class_hits(outputs, targets, self.ignore_index)
            else:
                errors = _errors(outputs, targets)
        scoring = hits is not None or errors is not None
        if self._scoring is None:
            self._scoring = scoring
        elif self._scoring != scoring:
            raise _inconsistent(outputs, targets, batch=self._batches, scoring=self._scoring)
        self._batches += batches
        sums = self._sums
        if hits is not None:
            sums["correct"].add_(hits[0])
            sums["scored"].add_(hits[1])
        elif errors is not None:
            error = errors[0].float() - errors[1].float()
            sums["abs_err"].add_(error.abs().sum())
            sums["sq_err"].add_(error.square().sum())
            sums["scored"].add_(error.numel())

    def _move(self, device: torch.device) -> None:
        with torch.inference_mode(False):  # as in __init__
            self._sums = {name: value.to(device) for name, value in self._sums.items()}

    def compute(self, prefix: str) -> dict[str, float]:
        """The epoch's metrics under ``prefix/`` (a CPU–GPU sync point).

        Classification: ``loss`` and ``accuracy``; with the built-in cross entropy over
        tokens also ``perplexity``; regression: ``loss``, and for ``val`` and ``test``
        ``mse`` and ``mae`` (means over every predicted value, as ``MSELoss`` and
        ``L1Loss`` take).

        In a distributed run the sums are reduced over the ranks first, so every rank
        reports the whole epoch's metrics (each rank must call this at the same point).
        """
        totals = self._totals()
        n = totals["samples"]
        if n == 0:
            return {}
        values = {f"{prefix}/loss": totals["loss_sum"] / n}
        scored = totals["scored"]
        if totals["scoring"] and scored:
            if self.task == "classification":
                values[f"{prefix}/accuracy"] = totals["correct"] / scored
            elif self.task == "regression" and prefix != "train":
                values[f"{prefix}/mse"] = totals["sq_err"] / scored
                values[f"{prefix}/mae"] = totals["abs_err"] / scored
        if totals["perplexity"] and totals["tokens"]:
            values[f"{prefix}/perplexity"] = _exp(totals["nll_sum"] / totals["tokens"])
        return values

    def _totals(self) -> dict[str, Any]:
        """The sums, over every rank in a distributed run (one all-reduce, every rank calls).

        In float64 (exact counts up to 2**53), on the CPU for MPS, which has no float64.
        """
        self._fold()
        device = self._sums["loss_sum"].device
        if device.type == "mps":
            device = torch.device("cpu")
        flags = (float(self.samples), float(bool(self._scoring)), float(bool(self._perplexity)))
        counts = torch.tensor(flags, dtype=torch.float64, device=device)
        # Each to float64 on its own: stacking first would round an int64 count to float32.
        parts = torch.stack([self._sums[name].to(device, torch.float64) for name in _SUMS])
        sums = torch.cat([parts, counts])
        if rank_and_world_size()[1] > 1:
            dist.all_reduce(sums)
        names = (*_SUMS, "samples", "scoring", "perplexity")
        totals: dict[str, Any] = dict(zip(names, sums.tolist(), strict=True))
        for name in (*_COUNTS, "samples"):
            totals[name] = round(totals[name])
        totals["scoring"], totals["perplexity"] = totals["scoring"] > 0, totals["perplexity"] > 0
        return totals

    @property
    def device(self) -> torch.device:
        """Where the sums are kept (a restored state's: the CPU until the next fold)."""
        return self._sums["loss_sum"].device

    def loss_sum(self) -> torch.Tensor:
        """The summed loss so far, on the device (reading it waits for the GPU)."""
        self._fold()
        return self._sums["loss_sum"]

    def state_dict(self) -> dict:
        """The running sums, so a run resumed mid-epoch reports the whole epoch.

        The batches held since the last fold are saved as they are, not folded: folding
        early would round the float sums differently (a run checkpointed every step
        would report an epoch loss a few ulps off the same run with no checkpoints), and
        a resumed run folds them where the uninterrupted run does. On the CPU they are
        at most ``_HOLD_ELEMENTS`` outputs (1 MiB in float32); elsewhere none is held.
        """
        return {
            "task": self.task,
            **{name: value.detach().cpu() for name, value in self._sums.items()},
            "samples": self.samples,
            "scoring": self._scoring,
            "perplexity": self._perplexity,
            "batches": self._batches,
            "held": [list(batch) for batch in self._held],
            "hold": self._hold,
        }

    def snapshot(self) -> tuple[Any, ...]:
        """The running state as it is now, to go back to with :meth:`restore`.

        For a step that may yet be taken back (``on_nonfinite=skip``): unlike
        ``state_dict`` it folds nothing and copies nothing to the host — a device clone
        of each sum, and the held batches by reference (they are never changed in place).
        """
        sums = {name: value.clone() for name, value in self._sums.items()}
        flags = (self.samples, self._scoring, self._perplexity, self._batches)
        return self.task, sums, flags, (list(self._held), self._hold)

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Go back to a :meth:`snapshot` (which stays valid for another restore)."""
        self.task, sums, flags, (held, self._hold) = snapshot
        self.samples, self._scoring, self._perplexity, self._batches = flags
        self._sums = {name: value.clone() for name, value in sums.items()}
        self._held[:] = held  # in place, as _fold relies on

    def load_state_dict(self, state: dict) -> None:
        """Replace the sums and the held batches with a saved state's.

        A state saved before accuracy, errors and tokens had their own counts (it has
        ``has_accuracy``) divided them by the samples: its samples are their count.
        """
        # Older checkpoints folded everything before saving: none held.
        self._held[:] = [tuple(batch) for batch in state.get("held", [])]
        self._hold = state.get("hold", 0)
        self.task = state["task"]
        self.samples = state["samples"]
        old = "has_accuracy" in state
        defaults = {"scored": torch.tensor(self.samples if old else 0)}
        self._sums = {
            name: state.get(name, defaults.get(name, torch.zeros(()))).to(
                torch.long if name in _COUNTS else torch.float32
            )
            for name in _SUMS
        }
        if old:
            self._scoring = bool(state["has_accuracy"]) or self.task == "regression"
            self._perplexity = False
        else:
            self._scoring, self._perplexity = state["scoring"], state["perplexity"]
        self._batches = state.get("batches", 0)


_COUNTS = frozenset({"correct", "scored", "tokens"})


def _exp(mean_nll: float) -> float:
    """Perplexity from a mean NLL: inf past float64's range, not an OverflowError."""
    return math.exp(mean_nll) if mean_nll < 709.0 else math.inf


def _hold_steps(outputs: torch.Tensor, device: torch.device) -> int:
    """How many batches to hold before folding them: 1 (none) off the CPU."""
    if device.type != "cpu" or outputs.device.type != "cpu":
        return 1
    return max(1, min(_HOLD_STEPS, _HOLD_ELEMENTS // max(outputs.numel(), 1)))


def _joined(held: list[_Held]) -> tuple[torch.Tensor, Any] | None:
    """The held outputs and targets, each concatenated along the batch; None when their
    shapes beyond the batch differ (or they cannot be joined)."""
    if len(held) == 1:
        return held[0][0], held[0][1]
    try:
        outputs = torch.cat([outputs for outputs, *_ in held])
        targets = torch.cat([targets for _, targets, *_ in held])
    except (RuntimeError, TypeError):
        return None
    return outputs, targets


def _class_hits(
    outputs: torch.Tensor, targets: torch.Tensor, ignore_index: int | None
) -> tuple[torch.Tensor, torch.Tensor | int] | None:
    """(correct predictions, predictions scored), or None when the outputs cannot be scored.

    Class logits are ``[N, C]`` with C > 1 or, per token, ``[N, C, T]`` (the layout
    ``CrossEntropyLoss`` takes) against integer targets ``[N]`` or ``[N, T]``: argmax,
    with targets equal to ``ignore_index`` left out. One binary logit per sample, ``[N]``
    or ``[N, 1]`` against 0/1 targets ``[N]`` or ``[N, 1]`` (``BCEWithLogitsLoss``):
    its sign. Anything else (several logits against as many float targets, as in
    multi-label or soft-label training) has no accuracy.
    """
    classes = outputs.ndim == targets.ndim + 1 and outputs.shape[1] > 1
    if classes and not targets.is_floating_point():
        if outputs.shape[:1] + outputs.shape[2:] != targets.shape:
            raise DataError(
                f"accuracy: the model's output {list(outputs.shape)} has class scores in "
                f"dimension 1, so the targets should be "
                f"{list(outputs.shape[:1] + outputs.shape[2:])}, but they are "
                f"{list(targets.shape)}",
                hint="make the targets one class index per output position",
            )
        hits = outputs.argmax(dim=1).eq(targets)
        if ignore_index is None:
            return hits.sum(), hits.numel()
        real = targets.ne(ignore_index)
        return hits.logical_and_(real).sum(), real.sum()
    aligned = aligned_shapes(outputs, targets)
    if aligned is None:
        return None
    outputs, targets = aligned
    if outputs.ndim > 1 and outputs.shape[-1] != 1:
        return None
    hits = outputs.gt(0).eq(targets.gt(0.5))
    return hits.sum(), hits.numel()


def _errors(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and targets of one shape, aligned as the built-in losses align them."""
    aligned = aligned_shapes(outputs, targets)
    if aligned is None:
        raise shape_mismatch(
            outputs,
            targets,
            what="regression metrics (val/mse, val/mae)",
            alternative="; if your loss compares other shapes on purpose, set "
            "train.task=none to report the loss alone",
        )
    return aligned


def _inconsistent(outputs: torch.Tensor, targets: Any, *, batch: int, scoring: bool) -> DataError:
    """The error for a batch that cannot be scored as the run's earlier ones were."""
    shapes = f"output {list(outputs.shape)}, targets " + (
        f"{list(targets.shape)}" if isinstance(targets, torch.Tensor) else type(targets).__name__
    )
    if scoring:
        what = "cannot be scored, unlike the batches before it"
    else:
        what = "can be scored, unlike the batches before it (which were not)"
    return DataError(
        f"metrics: batch {batch + 1} of the epoch ({shapes}) {what}; counting it in "
        "the metric's denominator but not in its sum would make the figure wrong",
        hint="make every batch's outputs and targets the same layout (same dimensions "
        "and dtypes; only the batch size and sequence length may change)",
    )


@dataclass
class StepWindow:
    """Sums since the last step-level record (no per-step tensor op or sync).

    The loss of every step that was not skipped is added as the host number the step's
    non-finite check read anyway (``FiniteCheck.loss_value``). The gradient norm, a
    device tensor, is measured on the window's first step that updates the parameters
    (and on every step when clipping by norm needs it anyway): measuring it is a pass
    over every gradient, too dear to pay on each step for a figure recorded every
    ``log_every_steps``.
    """

    grad_norm: torch.Tensor
    #: The sum of the step losses of the steps that were not skipped, and their number.
    loss_sum: float = 0.0
    losses: int = 0
    steps: int = 0
    norms: int = 0  # steps whose norm is in `grad_norm`
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> StepWindow:
        """A window with nothing recorded yet."""
        return cls(torch.zeros((), device=device))
