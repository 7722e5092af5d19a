"""The test split: evaluated once, at the end of a run, with the best or the last weights.

``data.test`` (a dataset, as ``data.val``) or ``data.test_fraction`` (a share of
``data.train``) gives the data; ``data.test_checkpoint`` the weights: ``best`` loads the
best checkpoint by ``train.monitor``, ``last`` takes the weights the run ended with, and
``auto`` is best when the run keeps a best checkpoint. The figures are ``test/*`` — the
same metrics as validation — logged as one record to the run's sinks
(``metrics.jsonl``), added to ``summary.json`` under ``test`` (the report shows them),
printed at the end, and returned in ``FitResult.test_metrics``.

The model the run returns and exports keeps the last weights: the best ones are loaded
for the test and the last ones put back afterwards (a copy of the weights is held in
host memory meanwhile — under FSDP, of this rank's shard on the device).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from stoker.checkpoint import load_checkpoint
from stoker.config import RunConfig
from stoker.data.sources import length_or_none
from stoker.errors import ConfigError
from stoker.safe_files import write_text
from stoker.train.objective import validate
from stoker.train.pipeline import Pipeline, build_eval_loader

if TYPE_CHECKING:
    from stoker.distributed.runtime import Distributed
    from stoker.train.loop import Loop

logger = logging.getLogger("stoker")


@dataclass
class TestSplit:
    """The run's test data and which weights to test; with no data it does nothing."""

    __test__ = False  # not a pytest test class

    data: Dataset | None = None
    weights: Literal["best", "last"] = "last"
    config: RunConfig | None = None
    collate_fn: Any = None
    #: The figures and the weights used, once evaluated: ``summary.json``'s ``test``.
    result: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pipeline(cls, config: RunConfig, pipeline: Pipeline) -> TestSplit:
        """The test of a run; checks the weights setting before anything trains.

        Raises:
            ConfigError: ``data.test_checkpoint=best`` in a run that keeps no best checkpoint.
        """
        if pipeline.test_data is None:
            return cls()
        keeps_best = config.checkpoint.enabled and config.checkpoint.keep_best
        setting = config.data.test_checkpoint
        if setting == "best" and not keeps_best:
            raise ConfigError(
                "data.test_checkpoint=best, but this run keeps no best checkpoint "
                f"(checkpoint.enabled={config.checkpoint.enabled}, "
                f"checkpoint.keep_best={config.checkpoint.keep_best})",
                hint="set checkpoint.enabled=true and checkpoint.keep_best=true, or "
                "data.test_checkpoint=last",
            )
        weights: Literal["best", "last"] = (
            "best" if setting == "best" or (setting == "auto" and keeps_best) else "last"
        )
        return cls(
            data=pipeline.test_data,
            weights=weights,
            config=config,
            collate_fn=pipeline.collate_fn,
        )

    def __bool__(self) -> bool:
        return self.data is not None

    def evaluate(
        self, loop: Loop, *, model: nn.Module, dist: Distributed, run_dir: Path
    ) -> dict[str, float]:
        """Evaluate the test data (every rank calls this); returns the ``test/*`` figures.

        ``model`` is the plain module the loop's model wraps: the best weights are loaded
        into it, and the last ones put back after.
        """
        if self.data is None:
            return {}
        assert self.config is not None
        state = loop.state
        pointer = None
        if self.weights == "best":
            # Rank 0 wrote the checkpoints; broadcasting waits for its last save too.
            pointer = dist.broadcast(_best_pointer(run_dir) if dist.is_main else None)
        used, epoch = "last", _epoch_of_last_step(loop)
        if pointer is not None:
            used, epoch = "best", int(pointer.get("epoch") or epoch)
        elif self.weights == "best":
            # A best checkpoint is chosen at an epoch's end: a run a callback stopped in
            # its first epoch has none yet.
            why = f"no finite {loop.monitor.metric}" if loop.history else "no epoch ended"
            loop.progress.message(
                f"warning: no best checkpoint was saved ({why}); testing the last weights"
            )
        size = length_or_none(self.data)
        loop.progress.message(
            f"testing {f'{size} samples ' if size is not None else ''}with the {used} "
            f"weights (epoch {epoch})"
        )
        loader = build_eval_loader(
            self.config, self.data, device=loop.device, collate_fn=self.collate_fn
        )
        bad_records = getattr(loop.train_loader, "bad_records", None)
        if bad_records is not None:
            loader.bad_records = bad_records.for_split("test")
        # The best checkpoint of the run's last step holds the weights in memory: no load.
        load = pointer is not None and pointer.get("step") != state.step
        sharded = dist.enabled and self.config.distributed.strategy == "fsdp"
        kept = _copy_weights(model) if load else None
        try:
            if load:
                assert pointer is not None
                bundle = load_checkpoint(run_dir / "checkpoints" / pointer["checkpoint"])
                _load_weights(model, bundle["model"], sharded=sharded)
                del bundle
            # As validation measures: the built-in loss and metrics, or the run's eval_fn.
            values = validate(loop, loader, prefix="test")
        finally:
            loader.close()  # its workers, persistent or not, end with the evaluation
            if kept is not None:
                model.load_state_dict(kept)
        loop.sink.log({"epoch": epoch, "step": state.step, **values})
        self.result = {"weights": used, "epoch": epoch, **values}
        return values

    def report(self, view: Any, run_dir: Path) -> None:
        """Add the figures to ``summary.json`` (``test``) and print them (rank 0, at the end)."""
        if not self.result:
            return
        path = run_dir / "summary.json"
        summary = json.loads(path.read_text()) if path.is_file() else {}
        summary["test"] = self.result
        write_text(path, json.dumps(summary, indent=2))  # never through a planted link
        figures = "  ".join(
            f"{key} {value:.4f}" for key, value in self.result.items() if key.startswith("test/")
        )
        view.message(
            f"test ({self.result['weights']} weights, epoch {self.result['epoch']}): {figures}"
        )


def _epoch_of_last_step(loop: Loop) -> int:
    """The epoch (from 1) the run's last weights were trained in.

    ``state.epoch`` counts finished epochs, which is that number when the run ended with
    an epoch; a run a callback stopped mid-epoch (``loop.request_stop``) has not counted
    the epoch its last step was in, so it is the next number, as its checkpoint says.
    """
    state, history = loop.state, loop.history
    ended_with_an_epoch = bool(history) and history[-1].get("step") == state.step
    if loop.stop_reason is not None and state.step > 0 and not ended_with_an_epoch:
        return state.epoch_number
    return state.epoch


def _best_pointer(run_dir: Path) -> dict[str, Any] | None:
    """``best.json``'s content (checkpoint, epoch, step) when it names a checkpoint."""
    path = run_dir / "checkpoints" / "best.json"
    try:
        pointer = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(pointer, dict) or not isinstance(pointer.get("checkpoint"), str):
        return None
    if not (run_dir / "checkpoints" / pointer["checkpoint"]).is_dir():
        return None
    return pointer


def _copy_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights as they are, to put back: on the host, or (sharded) the local shards."""
    copies = {}
    for name, value in model.state_dict().items():
        if type(value) is torch.Tensor:
            copies[name] = value.detach().to("cpu", copy=True)
        else:  # a DTensor shard (FSDP): cloned where it is
            copies[name] = value.detach().clone()
    return copies


def _load_weights(model: nn.Module, state: dict[str, Any], *, sharded: bool) -> None:
    if sharded:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        # Every rank holds the whole dict (read from the checkpoint) and keeps its shard.
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(state)
