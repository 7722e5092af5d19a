"""``stoker.FitOptions``: generated from the run config, kept in step with it, all accepted."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic_core import PydanticUndefined
from torch import nn

import stoker
from stoker.config import FLAT_OPTIONS, RunConfig, config_from_options
from stoker.errors import ConfigError
from stoker.train import fit_options_gen
from stoker.train.fit_options import FitOptions

REGENERATE = "stale: regenerate with `python -m stoker.train.fit_options_gen`"


def test_committed_fit_options_are_current() -> None:
    assert not fit_options_gen.stale(), REGENERATE


def test_check_names_a_missing_or_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fit_options.py"
    assert fit_options_gen.main(["--path", str(path), "--check"]) == 1
    assert fit_options_gen.main(["--path", str(path)]) == 0
    assert fit_options_gen.main(["--path", str(path), "--check"]) == 0
    path.write_text(path.read_text().replace("    epochs: int\n", "    epochs: float\n"))
    capsys.readouterr()
    assert fit_options_gen.main(["--path", str(path), "--check"]) == 1
    assert f"stale: {path}" in capsys.readouterr().err


def test_a_new_config_option_makes_the_committed_file_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What adding a field to a flat section does: FLAT_OPTIONS gains it, FitOptions must too.
    grown = {**FLAT_OPTIONS, "warmup_epochs": ("train", "epochs")}
    monkeypatch.setattr(fit_options_gen, "FLAT_OPTIONS", grown)
    assert "    warmup_epochs: int\n" in fit_options_gen.fit_options_source()
    assert fit_options_gen.stale()


def test_every_fit_option_is_typed_in_order_and_resolves_at_run_time() -> None:
    hints = typing.get_type_hints(FitOptions)  # what pydantic or an IDE plugin would call
    assert list(hints) == list(FLAT_OPTIONS)
    assert FitOptions.__required_keys__ == frozenset()
    assert hints["epochs"] is int
    assert hints["precision"] == Literal["fp32", "bf16", "fp16"]
    assert hints["max_steps"] == int | None
    assert os.PathLike[str] in typing.get_args(hints["run_dir"])
    assert torch.optim.Optimizer in typing.get_args(hints["optimizer"])


def test_every_option_in_fit_options_is_accepted_by_name() -> None:
    values = {}
    for option, (section, name) in FLAT_OPTIONS.items():
        model = type(getattr(RunConfig(), section)) if section else RunConfig
        values[option] = model.model_fields[name].get_default(call_default_factory=True)
    assert PydanticUndefined not in values.values()
    assert set(values) == set(FitOptions.__annotations__)
    assert config_from_options(values) == RunConfig()


def test_an_unknown_option_is_still_a_clear_error() -> None:
    data = (torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"epoch: unknown option \(did you mean 'epochs'\?\)"):
        stoker.fit(nn.Linear(2, 2), data, epoch=1)  # type: ignore[call-arg]
