"""``stoker config validate`` checks that each name in a config resolves, importing nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stoker import components
from stoker.cli.main import main
from stoker.config import load_config
from stoker.config_refs import BUILTINS, reference_problems

EXAMPLES = Path(__file__).parents[3] / "examples"


def test_the_builtin_names_are_the_ones_the_components_resolve() -> None:
    assert set(BUILTINS["model"]) == set(components.MODELS)
    assert set(BUILTINS["data"]) == set(components.DATASETS)
    assert set(BUILTINS["loss"]) == set(components.LOSSES)
    assert set(BUILTINS["collate"]) == set(components.COLLATES)


def test_validate_names_every_name_that_resolves_to_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a file.py path in an override resolves from here
    (tmp_path / "hooks.py").write_text(
        "import torch\n"
        "class Logger:\n    pass\n"
        "try:\n    from fast import Fast\nexcept ImportError:\n    Fast = None\n"
        "if True:\n    def make():\n        pass\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text((EXAMPLES / "digits.yaml").read_text())
    good = ["callbacks=[hooks.py:Logger, hooks.py:Fast, hooks.py:make, hooks.py:torch]"]
    assert main(["config", "validate", str(config), *good]) == 0
    assert "valid" in capsys.readouterr().out
    bad = [
        "model.name=mpl",
        "data.train.name=digitz",
        "loss.name=crossentropy",
        "optim.name=missing.py:Lion",
        "callbacks=[hooks.py:Loger, {name: no_such_package_x.cb:Hook}]",
        "train.step_fn=hooks",
    ]
    assert main(["config", "validate", str(config), *bad]) == 2
    err = capsys.readouterr().err
    assert "7 names that resolve to nothing" in err
    for line in (
        "model.name: 'mpl' is neither a built-in name (did you mean 'mlp'?)",
        "data.train.name: 'digitz' is neither a built-in name (did you mean 'digits'?)",
        "loss.name: 'crossentropy' is neither a built-in name (did you mean 'cross_entropy'?)",
        f"optim.name: file {tmp_path / 'missing.py'} not found",
        f"callbacks[0]: {tmp_path / 'hooks.py'} defines no 'Loger' (did you mean 'Logger'?)",
        "callbacks[1]: no module 'no_such_package_x' is installed",
        "train.step_fn: 'hooks' is no import path",
    ):
        assert line in err


def test_a_module_that_makes_names_at_import_is_left_to_the_run(tmp_path: Path) -> None:
    (tmp_path / "star.py").write_text("from os.path import *\n")
    (tmp_path / "lazy.py").write_text("def __getattr__(name):\n    return name\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    raw = yaml.safe_load((EXAMPLES / "digits.yaml").read_text())
    raw["callbacks"] = ["star.py:anything", "lazy.py:Anything", "broken.py:f"]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    problems = reference_problems(load_config(config))
    assert len(problems) == 1 and problems[0].startswith(f"callbacks[2]: {tmp_path / 'broken.py'}")


def test_every_example_config_is_valid(capsys: pytest.CaptureFixture[str]) -> None:
    configs = sorted(EXAMPLES.rglob("*.yaml"))
    assert len(configs) >= 5
    for config in configs:
        assert reference_problems(load_config(config)) == [], config
