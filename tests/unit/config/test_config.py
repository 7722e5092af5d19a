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
    with pytest.raises(ConfigError, match=r"train\.epoch=3: unknown key \(did you mean 'epochs'"):
        load_config(EXAMPLE, ["train.epoch=3"])


def test_invalid_override_value_names_the_override_not_the_file() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["train.epochs=abc"])
    text = str(info.value)
    assert text.startswith("train.epochs=abc: Input should be a valid integer")
    assert "digits.yaml" not in text and "\n" not in text  # one line, about the override


def test_problems_of_file_and_overrides_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("train: {epochs: 0}\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "run.yaml", ["loader.batch_size=-1", "optim={lr: x}"])
    lines = str(info.value).splitlines()
    assert lines[0] == f"{tmp_path / 'run.yaml'} and the overrides have 3 problems:"
    assert "  - train.epochs: Input should be greater than 0 (given: 0)" in lines
    assert "  - loader.batch_size=-1: Input should be greater than 0" in lines
    assert any(line.startswith("  - optim={lr: x}: ") and "(at optim.lr)" in line for line in lines)


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


RELATIVE_PATHS = """
model: {name: 'models.py:Net', args: {weights_path: w/init.pt, hidden: 8}}
data:
  train: {name: csv, args: {path: data/train.csv, target: label}}
  val: {name: npy, args: {path: {x: ../shared/x.npy, y: /abs/y.npy}, transform: 'aug.py:flip'}}
  cache: disk
  cache_path: cache
loader: {collate_fn: 'collate.py:pad_batch', collate_args: {vocab_file: vocab.txt}}
loss: {name: 'losses.py:focal'}
tracking: {runs_root: ../runs, mlflow_uri: 'http://host:5000'}
"""


def test_every_relative_path_resolves_from_the_config_folder(tmp_path: Path) -> None:
    folder = tmp_path / "project" / "configs"
    folder.mkdir(parents=True)
    (folder / "run.yaml").write_text(RELATIVE_PATHS)
    config = load_config(folder / "run.yaml")
    project = tmp_path / "project"
    assert config.model is not None and config.data.train and config.data.val
    assert config.model.name == f"{folder / 'models.py'}:Net"  # resolved though missing
    assert config.model.args == {"weights_path": str(folder / "w" / "init.pt"), "hidden": 8}
    assert config.data.train.args == {"path": str(folder / "data/train.csv"), "target": "label"}
    assert config.data.val.args["path"] == {"x": str(project / "shared/x.npy"), "y": "/abs/y.npy"}
    assert config.data.val.args["transform"] == f"{folder / 'aug.py'}:flip"
    assert config.data.cache_path == str(folder / "cache")
    assert config.loader.collate_fn == f"{folder / 'collate.py'}:pad_batch"
    assert config.loader.collate_args == {"vocab_file": str(folder / "vocab.txt")}
    assert config.loss.name == f"{folder / 'losses.py'}:focal"
    assert config.tracking.runs_root == str(project / "runs")
    assert config.tracking.mlflow_uri == "http://host:5000"  # a URL, not a path
    assert config.tracking.run_dir is None  # defaults are not written in the file: untouched


def test_built_in_names_and_module_paths_are_not_paths(tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text(
        "model: {name: mlp}\nloader: {collate_fn: pad}\nloss: {name: my_pkg.losses:focal}\n"
    )
    config = load_config(tmp_path / "run.yaml")
    assert (config.model and config.model.name, config.loader.collate_fn) == ("mlp", "pad")
    assert config.loss.name == "my_pkg.losses:focal"


def test_paths_in_overrides_resolve_from_the_folder_given(tmp_path: Path) -> None:
    raw = apply_overrides(
        {"data": {"train": {"name": "csv", "args": {"path": "a.csv"}}}},
        ["data.train.args.path=b.csv", "model.name=m.py:Net", "tracking.run_dir=runs/x"],
        base=tmp_path,
    )
    assert raw["data"]["train"]["args"]["path"] == str(tmp_path / "b.csv")
    assert raw["model"]["name"] == f"{tmp_path / 'm.py'}:Net"
    assert raw["tracking"]["run_dir"] == str(tmp_path / "runs" / "x")
    # Without a base (Python callers of apply_overrides) values are kept as written.
    assert apply_overrides({}, ["data.cache_path=c"]) == {"data": {"cache_path": "c"}}


def test_defaults_construct() -> None:
    assert RunConfig().train.precision == "fp32"
