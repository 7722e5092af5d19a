"""Config validation, overrides, flat fit options and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stoker.config import (
    FLAT_OPTIONS,
    RunConfig,
    apply_overrides,
    config_from_options,
    load_config,
    validate_config,
    write_config,
)
from stoker.errors import ConfigError

EXAMPLE = Path(__file__).parents[3] / "examples" / "digits.yaml"


def test_reference_config_loads_with_defaults_filled() -> None:
    config = load_config(EXAMPLE)
    assert config.name == "digits"
    assert config.model is not None and config.model.name == "mlp"
    assert config.loader.batch_size == 64
    assert config.loader.num_workers == 0  # default filled in
    assert config.optim.name == "adamw"


def test_all_problems_are_reported_at_once_with_field_paths() -> None:
    raw = {"train": {"epochs": 0, "precision": "fp8"}, "loader": {"batch_size": "many"}}
    with pytest.raises(ConfigError) as info:
        validate_config(raw, source="bad.yaml")
    text = str(info.value)
    assert "bad.yaml has 3 problems" in text
    assert "train.epochs" in text and "train.precision" in text and "loader.batch_size" in text
    assert "'fp8'" in text


def test_unknown_key_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        validate_config({"loader": {"batch_sise": 32}})
    text = str(info.value)
    assert "loader.batch_sise: unknown key (did you mean 'batch_size'?)" in text
    assert "num_workers" in text  # lists the known keys


def test_unknown_section_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"optimizer: unknown key \(did you mean 'optim'\?\)"):
        validate_config({"optimizer": {"lr": 0.1}})


def test_overrides_are_typed_by_the_schema() -> None:
    raw = apply_overrides(
        {"train": {"epochs": 5}},
        ["train.epochs=2", "optim.betas=[0.8,0.9]", "loader.pin_memory=false", "optim.lr=1e-2"],
    )
    config = validate_config(raw)
    assert config.train.epochs == 2
    assert config.optim.betas == (0.8, 0.9)
    assert config.loader.pin_memory is False
    assert config.optim.lr == pytest.approx(0.01)


def test_override_without_equals_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        apply_overrides({}, ["train.epochs"])


def test_override_of_unknown_key_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"train\.epoch: unknown key"):
        load_config(EXAMPLE, ["train.epoch=3"])


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_both_clipping_modes_is_an_error() -> None:
    with pytest.raises(ConfigError, match="choose one"):
        validate_config({"train": {"clip_grad_norm": 1.0, "clip_grad_value": 0.5}})


def test_resolved_config_round_trips_through_yaml(tmp_path: Path) -> None:
    config = load_config(EXAMPLE, ["train.epochs=3"])
    write_config(config, tmp_path / "config.yaml")
    again = validate_config(yaml.safe_load((tmp_path / "config.yaml").read_text()))
    assert again == config


def test_flat_options_map_to_config_keys() -> None:
    config = config_from_options(
        {"epochs": 3, "batch_size": 16, "optimizer": "sgd", "lr": 0.1, "schedule": "cosine"}
    )
    assert (config.train.epochs, config.loader.batch_size) == (3, 16)
    assert (config.optim.name, config.optim.lr, config.schedule.name) == ("sgd", 0.1, "cosine")
    assert FLAT_OPTIONS["grad_accum_steps"] == ("train", "grad_accum_steps")
    assert FLAT_OPTIONS["run_dir"] == ("tracking", "run_dir")


def test_unknown_flat_option_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match=r"epoch: unknown option \(did you mean 'epochs'\?\)"):
        config_from_options({"epoch": 3})


def test_file_py_import_paths_resolve_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "net.py").write_text("def make():\n    return None\n")
    (tmp_path / "run.yaml").write_text("model: {name: 'net.py:make'}\n")
    config = load_config(tmp_path / "run.yaml")
    assert config.model is not None
    assert config.model.name == f"{tmp_path / 'net.py'}:make"


def test_defaults_construct() -> None:
    assert RunConfig().train.precision == "fp32"
