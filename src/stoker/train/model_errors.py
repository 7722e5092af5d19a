"""Errors inside the user's model: which module failed, what it got, what it expects, the fix.

Nothing here runs while training goes well: ``stoker.train.batch.forward`` calls
``explain_model_failure`` only from its ``except``. The failing module is read from the
exception's traceback (the innermost frame whose ``self`` is one of the model's modules),
so no hook is ever installed; a compiled model, whose traceback holds only the compiler's
frames, is run once more, eagerly, to get one.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stoker.checkpoint.export import model_wrappers, unwrap_model
from stoker.errors import ModelError

if TYPE_CHECKING:
    from stoker.config import RunConfig

__all__ = ["config_hints", "explain_model_failure", "find_failing_module"]

_CONVS = (
    *(nn.Conv1d, nn.Conv2d, nn.Conv3d),
    *(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
)
#: Wrappers that call the user's module as it is (any other wrapper is torch.compile's).
_PARALLEL = (nn.parallel.DistributedDataParallel, nn.DataParallel)
_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}
#: The dimensions a batch norm takes, by class (the channels are always dimension 1).
_BATCH_NORM_DIMS = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}
#: How inputs that fit a layer are described in a hint, by the layer's field.
_GIVE = {
    "in_features": "{expected} features (the last dimension)",
    "input_size": "{expected} features (the last dimension)",
    "in_channels": "{expected} channels",
    "num_features": "{expected} channels (dimension 1)",
    "num_channels": "{expected} channels (dimension 1)",
    "normalized_shape": "last dimensions {expected}",
}
#: Fields that size a layer to its input: a config arg holding one is the likely fix.
_SIZES = ("in_features", "in_channels", "num_features", "num_channels", "normalized_shape",
          "input_size", "num_embeddings")  # fmt: skip


@dataclass(frozen=True)
class Site:
    """Where a forward failed: the module, its qualified name and the arguments it got."""

    name: str
    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    in_wrapper: bool = False  # the frame was torch.compile's or DDP's, not the model's own

    @property
    def input(self) -> Any:
        """The first tensor argument (the layer's input), else the first argument."""
        values = [*self.args, *self.kwargs.values()]
        tensors = (value for value in values if isinstance(value, torch.Tensor))
        return next(tensors, values[0] if values else None)

    def described(self) -> str:
        """``input [64, 20] float32``, or every argument when there are several."""
        if len(self.args) == 1 and not self.kwargs:
            return f"input {describe(self.args[0])}"
        shown = [describe(value) for value in self.args]
        shown += [f"{key}={describe(value)}" for key, value in self.kwargs.items()]
        return f"inputs ({', '.join(shown)})"


@dataclass(frozen=True)
class Mismatch:
    """One setting of a module its input does not fit: ``in_features`` 20 against 64."""

    field: str
    expected: Any
    got: Any


def explain_model_failure(error: Exception, model: nn.Module, inputs: Any) -> ModelError:
    """Turn an exception raised by ``model(inputs)`` into one message a person can act on.

    Never raises itself: whatever cannot be found out is left out of the message, and the
    original error's text is always in it.
    """
    try:
        return _explain(error, model, inputs)
    except Exception:  # a broken explanation must not hide the user's error
        return ModelError(
            f"the model ({type(model).__name__}) failed on {describe(inputs)}: {_text(error)}",
            hint="run with --debug for the traceback",
        )


def _explain(error: Exception, model: nn.Module, inputs: Any) -> ModelError:
    site = find_failing_module(error, model)
    compiled = any(not isinstance(wrapper, _PARALLEL) for wrapper in model_wrappers(model))
    if site is None or site.in_wrapper or compiled:
        # A compiled model's traceback holds the compiler's frames: run it eagerly once.
        eager = _eager_error(model, inputs)
        found = find_failing_module(eager, model) if eager is not None else None
        if eager is not None and found is not None and not found.in_wrapper:
            site, error = found, eager
    if site is None or site.in_wrapper:
        kind = type(unwrap_model(model)).__name__
        return ModelError(
            f"the model ({kind}) failed on its inputs {describe(inputs)}: {_text(error)}",
            hint=_unknown_hint("the model", error, inputs, root=True),
            module="model",
        )
    layer, kind, value = site.name, type(site.module).__name__, site.input
    expects, mismatches = expectations(site.module, value)
    if mismatches:
        message = f"{layer} ({kind}) cannot take its input: got {describe(value)}, "
        message += f"expects {expects} ({_text(error)})"
        first = mismatches[0]
        return ModelError(
            message,
            hint="; ".join(_hint(m, layer, site.module, value) for m in mismatches),
            module=layer,
            field=first.field,
            expected=first.expected,
            got=first.got,
        )
    known = f" (it expects {expects})" if expects else ""
    return ModelError(
        f"{layer} ({kind}) failed on {site.described()}{known}: {_text(error)}",
        hint=_unknown_hint(layer, error, inputs, root=site.name == "model"),
        module=layer,
    )


def find_failing_module(error: BaseException, model: nn.Module) -> Site | None:
    """The innermost of ``model``'s modules whose code the traceback of ``error`` passes.

    Names are those of the plain model, prefixed ``model.``: wrappers (DDP's ``module.``,
    torch.compile's ``_orig_mod.``) are stripped. None when no frame belongs to the model.
    """
    plain = unwrap_model(model)
    names: dict[int, str] = {}
    for name, module in plain.named_modules(remove_duplicate=False):
        names.setdefault(id(module), f"model.{name}" if name else "model")
    wrappers = {id(wrapper) for wrapper in model_wrappers(model)}  # DDP or compile around it
    for wrapper_id in wrappers:
        names.setdefault(wrapper_id, "model")
    frames: list[FrameType] = []
    trace = error.__traceback__
    while trace is not None:
        frames.append(trace.tb_frame)
        trace = trace.tb_next
    owners = [_owner(frame, names) for frame in frames]
    inner_index = next((i for i in reversed(range(len(frames))) if owners[i] is not None), None)
    if inner_index is None:
        return None
    module = owners[inner_index]
    assert module is not None
    # Its outermost frame in this call (`__call__`) holds the arguments as the caller gave them;
    # a module's own forward may have reassigned its locals before failing.
    call = inner_index
    for index in range(inner_index - 1, -1, -1):
        owner = owners[index]
        if owner is module:
            call = index
        elif owner is not None:
            break
    args, kwargs = _arguments(frames[call])
    in_wrapper = id(module) in wrappers
    return Site(names[id(module)], module, args, kwargs, in_wrapper=in_wrapper)


def _owner(frame: FrameType, names: Mapping[int, str]) -> nn.Module | None:
    owner = frame.f_locals.get("self")
    return owner if isinstance(owner, nn.Module) and id(owner) in names else None


def _arguments(frame: FrameType) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments a frame's function was called with (after ``self``), as it holds them."""
    code, local = frame.f_code, frame.f_locals
    names = code.co_varnames
    count = code.co_argcount + code.co_kwonlyargcount
    args = [local[name] for name in names[1 : code.co_argcount] if name in local]
    kwargs = {name: local[name] for name in names[code.co_argcount : count] if name in local}
    if code.co_flags & inspect.CO_VARARGS:
        args += list(local.get(names[count], ()))
        count += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs.update(local.get(names[count], {}))
    return tuple(args), kwargs


def _eager_error(model: nn.Module, inputs: Any) -> Exception | None:
    """The error of one eager forward of a wrapped model's plain module, or None.

    For a compiled model, whose traceback names no module of its own (torch.compile traces
    with fake tensors). It runs in the model's mode, so a batch norm's running statistics
    move once more, as in the forward that failed. Skipped in a distributed run, where a
    lone forward could wait on other ranks.
    """
    plain = unwrap_model(model)
    if plain is model or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    try:
        with torch.no_grad():
            plain(**inputs) if isinstance(inputs, Mapping) else plain(inputs)
    except Exception as error:
        return error
    return None


def expectations(module: nn.Module, value: Any) -> tuple[str | None, list[Mismatch]]:
    """What a built-in layer expects of its input, and each way ``value`` does not fit it."""
    if not isinstance(value, torch.Tensor):
        return None, []
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return _embedding(module, value)
    found: list[Mismatch] = []
    expects: str | None = None
    shape = tuple(value.shape)
    if isinstance(module, nn.Linear) and module.in_features:
        expects = f"a last dimension of in_features={module.in_features}"
        if not shape or shape[-1] != module.in_features:
            found.append(Mismatch("in_features", module.in_features, shape[-1] if shape else 0))
    elif isinstance(module, _CONVS) and module.in_channels:
        dims = len(module.kernel_size)
        expects = (
            f"(N, C, {_SPATIAL[dims]}) with C = in_channels={module.in_channels} "
            f"({dims + 2} dimensions, or {dims + 1} unbatched)"
        )
        if len(shape) not in (dims + 1, dims + 2):
            found.append(Mismatch("dims", dims + 2, len(shape)))
        elif shape[-(dims + 1)] != module.in_channels:
            found.append(Mismatch("in_channels", module.in_channels, shape[-(dims + 1)]))
    elif isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm):
        allowed = next((d for k, d in _BATCH_NORM_DIMS.items() if isinstance(module, k)), None)
        ndim = " or ".join(map(str, allowed)) if allowed else "2 or more"
        expects = f"{ndim} dimensions with num_features={module.num_features} at dimension 1"
        if allowed is not None and len(shape) not in allowed:
            found.append(Mismatch("dims", allowed[-1], len(shape)))
        elif len(shape) >= 2 and shape[1] != module.num_features:
            found.append(Mismatch("num_features", module.num_features, shape[1]))
    elif isinstance(module, nn.GroupNorm):
        expects = f"num_channels={module.num_channels} at dimension 1"
        if len(shape) >= 2 and shape[1] != module.num_channels:
            found.append(Mismatch("num_channels", module.num_channels, shape[1]))
    elif isinstance(module, nn.LayerNorm):
        wanted = tuple(module.normalized_shape)
        expects = f"last dimensions of normalized_shape={list(wanted)}"
        if shape[len(shape) - len(wanted) :] != wanted:
            got = list(shape[len(shape) - len(wanted) :])
            found.append(Mismatch("normalized_shape", list(wanted), got))
    elif isinstance(module, nn.RNNBase):
        expects = f"(N, L, input_size={module.input_size}) or (L, N, input_size) or (L, input_size)"
        if len(shape) not in (2, 3):
            found.append(Mismatch("dims", 3, len(shape)))
        elif shape[-1] != module.input_size:
            found.append(Mismatch("input_size", module.input_size, shape[-1]))
    if expects is not None and (wrong_dtype := _dtype_mismatch(module, value)) is not None:
        expects += f", dtype {_dtype(wrong_dtype.expected)}"
        found.insert(0, wrong_dtype)
    return expects, found


def _embedding(module: nn.Embedding | nn.EmbeddingBag, ids: torch.Tensor) -> tuple[str, list]:
    count = module.num_embeddings
    expects = f"integer ids (int64) in [0, num_embeddings={count})"
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return expects, [Mismatch("dtype", torch.int64, ids.dtype)]
    if not ids.numel():
        return expects, []
    low, high = int(ids.min()), int(ids.max())  # a sync on the GPU: only on this error path
    found = []
    if high >= count:
        found.append(Mismatch("num_embeddings", count, high + 1))
    if low < 0:
        found.append(Mismatch("min_id", 0, low))
    return expects, found


def _dtype_mismatch(module: nn.Module, value: torch.Tensor) -> Mismatch | None:
    """The layer's parameter dtype against an input it cannot compute with."""
    weight = next((p for p in module.parameters(recurse=False) if p.is_floating_point()), None)
    if weight is None or value.dtype == weight.dtype:
        return None
    if not value.is_floating_point() and not value.is_complex():
        return Mismatch("dtype", weight.dtype, value.dtype)  # ints never mix with weights
    if not torch.is_autocast_enabled(value.device.type):  # under autocast, dtypes may differ
        return Mismatch("dtype", weight.dtype, value.dtype)
    return None


def _hint(mismatch: Mismatch, layer: str, module: nn.Module, value: torch.Tensor) -> str:
    """The fix in code terms; ``config_hints`` turns it into a config key where one fits."""
    field, expected, got = mismatch.field, mismatch.expected, mismatch.got
    if field == "dtype" and isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return (
            f"{layer} takes token ids: have the dataset return integer (torch.long) ids, "
            "or use nn.Linear if these are real-valued features"
        )
    if field == "dtype" and not got.is_floating_point:
        cast = "x.float()" if expected == torch.float32 else f"x.to(torch.{_dtype(expected)})"
        return (
            f"convert the inputs to {_dtype(expected)}: `x = {cast}` at the top of forward, "
            f"or float features from the dataset (token ids need an nn.Embedding first)"
        )
    if field == "dtype":
        return (
            f"give the model {_dtype(expected)} inputs (a NumPy float64 array: "
            f".astype('{_dtype(expected)}')), or convert the model with .to(torch.{_dtype(got)})"
        )
    if field == "dims":
        return _dims_hint(layer, module, value, expected=expected)
    if field == "min_id":
        return (
            f"ids must be >= 0 but one is {got}: map padding to a real id "
            f"(and pass padding_idx=that id to {layer}) before the embedding"
        )
    if field == "num_embeddings":
        return (
            f"ids go up to {got - 1}: build {layer} with num_embeddings={got} "
            "(the vocabulary size), or check the tokenizer's vocab_size"
        )
    if field == "in_channels" and isinstance(module, nn.Conv2d) and {expected, got} == {1, 3}:
        mode = "RGB" if expected == 3 else "L"
        return (
            f"the images have {_channels(got)}: load them as {mode} "
            f"(image_folder's mode={mode}), or build {layer} with in_channels={got}"
        )
    given = _GIVE.get(field, "{expected} for " + field).format(expected=expected)
    return f"build {layer} with {field}={got}, or give it inputs with {given}"


def _dims_hint(layer: str, module: nn.Module, value: torch.Tensor, *, expected: int) -> str:
    hint = (
        f"{layer} takes {expected}-dimensional batches and got {value.ndim}: "
        "reshape the input in forward"
    )
    if isinstance(module, nn.Conv2d) and value.ndim == 2:
        # Flat features of square images (digits: 64 = 1 x 8 x 8): the exact view to write.
        channels = module.in_channels
        features = value.shape[1]
        side = _isqrt(features // channels) if features % channels == 0 else None
        size = f"{side}, {side}" if side else "H, W"
        hint += f", e.g. x = x.view(x.shape[0], {channels}, {size})"
    return hint


def _unknown_hint(layer: str, error: BaseException, inputs: Any, *, root: bool) -> str:
    if root and isinstance(error, TypeError) and isinstance(inputs, Mapping):
        keys = ", ".join(map(str, inputs))
        return (
            f"the batch's inputs are a dict passed as keyword arguments: the model's forward "
            f"must take {keys}"
        )
    return f"the failing line is in {layer}'s forward (--debug shows the traceback)"


@contextlib.contextmanager
def config_hints(config: RunConfig, *, user_model: bool, user_data: bool) -> Iterator[None]:
    """Point a ``ModelError``'s hint at the config key that sizes the failing layer.

    ``user_model``/``user_data``: the model or the training data came as Python objects
    (``stoker.fit``), so ``model.args`` / ``data.train`` do not describe them.
    """
    try:
        yield
    except ModelError as error:
        model_args = config.model.args if config.model is not None and not user_model else None
        train = config.data.train
        source = train.name if train is not None and not user_data else None
        error.hint = config_hint(error, model_args=model_args, train_source=source) or error.hint
        raise


def config_hint(
    error: ModelError, *, model_args: Mapping[str, Any] | None, train_source: str | None
) -> str | None:
    """The config override that likely fixes ``error``, or None when none applies."""
    if error.field not in _SIZES:
        return None
    args = model_args or {}
    key = _arg_holding(args, error.expected, field=error.field)
    model_fix = f"model.args.{key}={_value(error.got, like=args[key])}" if key else None
    gray_or_rgb = error.field == "in_channels" and {error.expected, error.got} == {1, 3}
    if gray_or_rgb and train_source == "image_folder":
        mode = "RGB" if error.expected == 3 else "L"
        other = (
            f"set {model_fix}"
            if model_fix
            else f"build {error.module} with in_channels={error.got}"
        )
        return (
            f"set data.train.args.mode={mode} (the images load with "
            f"{_channels(error.got)}), or {other}"
        )
    return f"set {model_fix}" if model_fix else None


def _arg_holding(args: Mapping[str, Any], expected: Any, *, field: str | None) -> str | None:
    """The key of ``model.args`` whose value is the layer's size: the one to change."""

    def holds(value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if isinstance(expected, list):
            return value == expected or (len(expected) == 1 and value == expected[0])
        return isinstance(value, int) and value == expected

    keys = [key for key, value in args.items() if holds(value)]
    if field in keys:
        return field
    return keys[0] if len(keys) == 1 else None


def describe(value: Any, *, depth: int = 0) -> str:
    """A tensor as ``[64, 1, 8, 8] float32``; tuples, lists and dicts of them alike."""
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {_dtype(value.dtype)}"
    if depth < 2 and isinstance(value, (tuple, list)) and value:
        inner = ", ".join(describe(item, depth=depth + 1) for item in list(value)[:4])
        return f"({inner}{', ...' if len(value) > 4 else ''})"
    if depth < 2 and isinstance(value, Mapping) and value:
        items = list(value.items())[:6]
        return "{" + ", ".join(f"{k}: {describe(v, depth=depth + 1)}" for k, v in items) + "}"
    return type(value).__name__


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _value(value: Any, *, like: Any) -> str:
    """``value`` written as an override of an arg that now holds ``like`` (a list or not)."""
    if isinstance(value, list) and len(value) == 1 and not isinstance(like, list):
        return str(value[0])
    return str(value).replace(" ", "")


def _text(error: BaseException) -> str:
    """``Type: first line`` of the original error, cut short if very long."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _channels(count: int) -> str:
    return "1 channel" if count == 1 else f"{count} channels"


def _isqrt(value: int) -> int | None:
    root = math.isqrt(value)
    return root if root * root == value else None
