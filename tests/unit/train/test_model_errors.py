"""Errors inside the user's model: the module, its input, what it expects, and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stoker
from stoker.config import RunConfig
from stoker.errors import ModelError, StokerError
from stoker.train import model_errors
from stoker.train.batch import forward
from stoker.train.model_errors import config_hint, config_hints


def _failure(model: nn.Module, inputs: object) -> ModelError:
    with pytest.raises(ModelError) as caught:
        forward(model, inputs)
    return caught.value


def _floats(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


class Net(nn.Module):
    """A user's model: an encoder of two blocks, then a head."""

    def __init__(self, in_features: int = 20) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)  # reassigned: the message still shows what the layer got
        return self.head(x)


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.conv1(x)).flatten(1))


def test_linear_in_features_names_the_layer_its_input_and_the_size() -> None:
    error = _failure(Net(in_features=20), _floats(8, 64))
    assert error.module == "model.encoder.0"
    assert (error.field, error.expected, error.got) == ("in_features", 20, 64)
    assert str(error).startswith("model.encoder.0 (Linear) cannot take its input: got [8, 64]")
    assert "float32" in error.message and "in_features=20" in error.message
    assert "mat1 and mat2 shapes cannot be multiplied" in error.message  # the original text
    assert error.hint == (
        "build model.encoder.0 with in_features=64, "
        "or give it inputs with 20 features (the last dimension)"
    )
    assert isinstance(error.__cause__, RuntimeError)  # a debugger still sees the cause


def test_conv_channels_1_against_3_suggests_rgb_images() -> None:
    error = _failure(SmallCNN(in_channels=3), _floats(2, 1, 8, 8))
    assert error.module == "model.conv1"
    assert (error.field, error.expected, error.got) == ("in_channels", 3, 1)
    assert "model.conv1 (Conv2d)" in error.message
    assert "[2, 1, 8, 8] float32" in error.message
    assert "(N, C, H, W) with C = in_channels=3" in error.message
    assert "mode=RGB" in error.hint and "in_channels=1" in error.hint


def test_flat_features_into_a_conv_show_the_view_to_write() -> None:
    error = _failure(SmallCNN(in_channels=1), _floats(4, 64))
    assert (error.module, error.field, error.expected, error.got) == ("model.conv1", "dims", 4, 2)
    assert "x = x.view(x.shape[0], 1, 8, 8)" in error.hint


def test_integer_input_to_linear_names_the_dtypes() -> None:
    ids = torch.randint(0, 5, (3, 20), generator=torch.Generator().manual_seed(0))
    error = _failure(Net(in_features=20), ids)
    assert error.module == "model.encoder.0"
    assert (error.field, error.expected, error.got) == ("dtype", torch.float32, torch.int64)
    assert "got [3, 20] int64" in error.message and "dtype float32" in error.message
    assert "x = x.float()" in error.hint


def test_float_input_to_embedding_asks_for_integer_ids() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    error = _failure(model, _floats(5, 3))
    assert (error.module, error.field, error.got) == ("model.0", "dtype", torch.float32)
    assert "model.0 (Embedding)" in error.message and "[5, 3] float32" in error.message
    assert "integer ids (int64) in [0, num_embeddings=10)" in error.message
    assert "torch.long" in error.hint


def test_embedding_index_out_of_range_gives_the_size_needed() -> None:
    model = nn.Sequential(nn.Embedding(10, 4))
    error = _failure(model, torch.tensor([[1, 12, 3]]))
    assert (error.module, error.field, error.expected, error.got) == (
        "model.0",
        "num_embeddings",
        10,
        13,
    )
    assert "IndexError" in error.message
    assert "ids go up to 12: build model.0 with num_embeddings=13" in error.hint


def test_negative_ids_name_the_smallest() -> None:
    error = _failure(nn.Embedding(10, 4), torch.tensor([[1, -100]]))
    assert (error.module, error.field, error.got) == ("model", "min_id", -100)
    assert "one is -100" in error.hint


def test_a_deeply_nested_layer_is_named_by_its_path() -> None:
    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(x)

    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.blocks = nn.ModuleList([Block(6), Block(5)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.encoder.blocks:
                x = block(x)
            return x

    error = _failure(Deep(), _floats(2, 6))
    assert error.module == "model.encoder.blocks.1.norm"
    assert (error.field, error.expected, error.got) == ("normalized_shape", [5], [6])
    assert "model.encoder.blocks.1.norm (LayerNorm)" in error.message


def test_batch_norm_num_features() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(5))
    error = _failure(model, _floats(3, 4))
    assert (error.module, error.field, error.expected, error.got) == (
        "model.1",
        "num_features",
        5,
        6,
    )


def test_a_users_own_bug_is_one_line_naming_the_module() -> None:
    class Lookup(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return {"features": x}["feature"]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lookup = Lookup()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lookup(x)

    error = _failure(Model(), _floats(2, 3))
    assert (
        error.message == "model.lookup (Lookup) failed on input [2, 3] float32: KeyError: 'feature'"
    )
    assert "model.lookup's forward" in error.hint
    assert isinstance(error.__cause__, KeyError)


def test_dict_inputs_the_model_does_not_take_name_the_keys() -> None:
    error = _failure(Net(in_features=3), {"x": _floats(2, 3), "mask": torch.ones(2)})
    assert error.module == "model"
    assert "inputs (x=[2, 3] float32, mask=[2] float32)" in error.message
    assert "must take x, mask" in error.hint


def test_wrapped_models_are_named_without_the_wrappers_prefix() -> None:
    wrapped = nn.DataParallel(Net(in_features=20))  # on the CPU it calls the module directly
    error = _failure(wrapped, _floats(8, 64))
    assert error.module == "model.encoder.0"


class Compiled(nn.Module):
    """What torch.compile's wrapper looks like here: it fails with no frame of the model's own
    (dynamo traces with fake tensors), and keeps the model as ``_orig_mod``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Failed running call_function <built-in function linear>")


def test_a_compiled_model_is_run_once_eagerly_to_find_the_layer() -> None:
    error = _failure(Compiled(Net(in_features=20)), _floats(8, 64))
    assert (error.module, error.field, error.got) == ("model.encoder.0", "in_features", 64)
    assert "mat1 and mat2 shapes cannot be multiplied" in error.message  # the eager error


@pytest.mark.slow  # importing and running dynamo takes ~10 s on a 2-core machine
def test_torch_compile_errors_name_the_layer() -> None:
    compiled = torch.compile(Net(in_features=20), backend="eager")
    error = _failure(compiled, _floats(8, 64))
    assert (error.module, error.field, error.got) == ("model.encoder.0", "in_features", 64)


def test_a_working_model_is_called_once_and_its_errors_pass_through() -> None:
    calls = []
    model = Net(in_features=4)
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    assert forward(model, _floats(2, 4)).shape == (2, 3)
    assert calls == [(2, 4)]

    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise StokerError("already for people")

    with pytest.raises(StokerError) as caught:
        forward(Raises(), _floats(1))
    assert type(caught.value) is StokerError


def test_the_explanation_never_hides_the_error(monkeypatch) -> None:
    def broken(error, model):
        raise AttributeError("explaining failed")

    monkeypatch.setattr(model_errors, "find_failing_module", broken)
    error = _failure(Net(in_features=20), _floats(8, 64))
    assert "the model (Net) failed on [8, 64] float32" in error.message
    assert "mat1 and mat2 shapes cannot be multiplied" in error.message


def test_config_hint_names_the_model_arg_that_sizes_the_layer() -> None:
    error = _failure(Net(in_features=20), _floats(8, 64))
    args = {"in_features": 20, "hidden": 16}
    assert config_hint(error, model_args=args, train_source="digits") == (
        "set model.args.in_features=64"
    )
    assert config_hint(error, model_args={"width": 20}, train_source=None) == (
        "set model.args.width=64"
    )
    # Two args hold 20: which one sizes the layer cannot be told, so no key is named.
    assert config_hint(error, model_args={"a": 20, "b": 20}, train_source=None) is None


def test_config_hint_sizes_an_embedding_and_skips_what_no_key_fixes() -> None:
    ids = _failure(nn.Sequential(nn.Embedding(10, 4)), torch.tensor([[1, 12]]))
    args = {"vocab_size": 10, "dim": 4}
    assert config_hint(ids, model_args=args, train_source=None) == "set model.args.vocab_size=13"
    flat = _failure(SmallCNN(in_channels=1), _floats(4, 64))  # a reshape, not a config key
    assert config_hint(flat, model_args={"in_channels": 1}, train_source=None) is None


def test_config_hints_point_a_channel_mismatch_at_the_image_mode() -> None:
    config = RunConfig(
        model={"name": "models.py:SmallCNN", "args": {"in_channels": 3}},
        data={"train": {"name": "image_folder", "args": {"root": "images"}}},
    )
    with (
        pytest.raises(ModelError) as caught,
        config_hints(config, user_model=False, user_data=False),
    ):
        forward(SmallCNN(in_channels=3), _floats(2, 1, 8, 8))
    assert caught.value.hint == (
        "set data.train.args.mode=RGB (the images load with 1 channel), "
        "or set model.args.in_channels=1"
    )


def test_fit_raises_a_model_error_from_the_original(tmp_path) -> None:
    features = _floats(16, 64)
    labels = torch.zeros(16, dtype=torch.long)
    with pytest.raises(ModelError) as caught:
        stoker.fit(
            Net(in_features=20),
            (features, labels),
            epochs=1,
            batch_size=8,
            progress="quiet",
            tensorboard=False,
            run_dir=tmp_path / "run",
        )
    assert caught.value.module == "model.encoder.0"
    assert caught.value.hint.startswith("build model.encoder.0 with in_features=64")
    assert isinstance(caught.value.__cause__, RuntimeError)
