"""Composable sample transforms whose randomness is fixed by (seed, epoch, sample index)."""

from __future__ import annotations

import inspect
import numbers
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from stoker.data.records import BadSample
from stoker.data.samplers import _MASK64, _splitmix64, epoch_seed
from stoker.data.sources import dataset_targets
from stoker.errors import ConfigError, DataError

__all__ = [
    "Compose",
    "Normalize",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomNoise",
    "ReproducibleTransformDataset",
    "Resize",
    "SampleSeeds",
    "SharedEpoch",
    "ToTensor",
    "Transform",
    "as_transform",
    "sample_generator",
]

# An epoch_seed stream of its own: 0-5 and 2**32 + rank are taken by samplers, workers,
# bucketing and streaming.
_AUGMENT_STREAM = 1 << 33


class Transform(Protocol):
    """What stoker calls a transform: ``transform(x, *, generator) -> x``.

    Random transforms draw every random number from ``generator``; deterministic ones
    ignore it. Plain one-argument callables (torchvision transforms, lambdas) work too:
    see :func:`as_transform`.
    """

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> Any:
        """The transformed sample; a random transform draws from ``generator`` alone."""


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator for one sample's augmentation, determined by ``(seed, epoch, index)`` alone.

    The three are mixed with SplitMix64, so the same sample in the same epoch gets the
    same augmentation whichever worker loads it and however many workers there are,
    while nearby epochs and indices get unrelated streams.

    Args:
        seed: The run's seed.
        epoch: The current epoch.
        index: The sample's index in the dataset.

    Returns:
        A freshly seeded CPU ``torch.Generator``.
    """
    mixed = epoch_seed(epoch_seed(seed, epoch, stream=_AUGMENT_STREAM), index)
    return torch.Generator().manual_seed(mixed)


class SampleSeeds:
    """:func:`sample_generator` for one dataset, at a fraction of its cost per sample.

    The same generator states: the seed and epoch are mixed once per epoch rather than
    per sample (two of SplitMix64's four rounds), and one ``torch.Generator`` per thread
    is re-seeded rather than a new one built for every sample (building one costs more
    than the crop and flip it drives). A transform must use the generator it is given
    within its call, as every stoker transform does.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._epoch: int | None = None
        self._mixed = 0
        self._local = threading.local()

    def epoch_base(self, epoch: int) -> int:
        """The part of every sample's seed that the epoch fixes (cached)."""
        if epoch != self._epoch:
            base = epoch_seed(self.seed, epoch, stream=_AUGMENT_STREAM)
            self._mixed = _splitmix64(base & _MASK64)
            self._epoch = epoch
        return self._mixed

    def seed_of(self, epoch: int, index: int) -> int:
        """The seed :func:`sample_generator` gives ``(seed, epoch, index)``."""
        x = _splitmix64(self.epoch_base(epoch) ^ (index & _MASK64))
        return _splitmix64(x) & ((1 << 63) - 1)  # epoch_seed's stream 0: x ^ 0 is x

    def generator(self, epoch: int, index: int) -> torch.Generator:
        """The sample's generator, in the state ``sample_generator`` would give it."""
        generator = getattr(self._local, "generator", None)
        if generator is None:
            generator = self._local.generator = torch.Generator()
        return generator.manual_seed(self.seed_of(epoch, index))

    def __getstate__(self) -> dict[str, Any]:
        return {"seed": self.seed}  # generators and thread slots stay in their process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["seed"])  # type: ignore[misc]


def _takes_generator(transform: Callable[..., Any]) -> bool:
    """Whether ``transform`` accepts a ``generator`` keyword argument."""
    try:
        parameters = inspect.signature(transform).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        (p.name == "generator" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in parameters
    )


class _GlobalRngTransform:
    """A one-argument callable run with torch's global CPU RNG seeded from the generator."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> Any:
        if generator is None:
            return self.transform(x)
        state = torch.get_rng_state()
        torch.default_generator.manual_seed(int(torch.randint(2**62, (), generator=generator)))
        try:
            return self.transform(x)
        finally:
            # Leave the global stream as it was: the transform must not shift other draws.
            torch.set_rng_state(state)

    def __repr__(self) -> str:
        return repr(self.transform)


def as_transform(transform: Callable[..., Any]) -> Transform:
    """``transform`` as a stoker :class:`Transform`, called ``transform(x, generator=g)``.

    A callable that takes ``generator`` is returned as is. Any other one-argument
    callable (e.g. a torchvision transform, which draws from torch's global RNG) is
    wrapped to run with the global CPU RNG seeded from ``g`` and restored afterwards,
    so it is reproducible per sample too. Check once, when a dataset is built.

    Raises:
        ConfigError: ``transform`` is not callable.
    """
    if not callable(transform):
        raise ConfigError(
            f"transform={transform!r} is not callable; expected a function of one sample.",
            hint="e.g. transform=Compose([ToTensor(), RandomHorizontalFlip()])",
        )
    if _takes_generator(transform):
        return transform
    return _GlobalRngTransform(transform)


def _size_pair(size: int | Sequence[int], owner: str) -> tuple[int, int]:
    pair: tuple[Any, ...]  # what the caller gave, checked below
    try:
        pair = (size, size) if isinstance(size, int | numbers.Integral) else tuple(size)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) > 0 for v in pair
    ):
        raise ConfigError(
            f"{owner} size={size!r}; expected a positive int or a (height, width) pair.",
            hint=f"e.g. {owner}(32) or {owner}((32, 48))",
        )
    return int(pair[0]), int(pair[1])


def _need_tensor(x: Any, owner: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        got = f"a {x.dim()}-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise DataError(
            f"{owner} works on image tensors (..., H, W); got {got}.",
            hint=f"put ToTensor() before {owner} in Compose([...])",
        )
    return x


def _need_generator(generator: torch.Generator | None, owner: str) -> torch.Generator:
    if generator is None:
        raise ConfigError(
            f"{owner} is random and needs an explicit generator; got none.",
            hint="call it as transform(x, generator=sample_generator(seed, epoch, index)), "
            "or wrap the dataset in ReproducibleTransformDataset(dataset, transform, seed=...)",
        )
    return generator


class Compose:
    """Apply transforms in order, passing each the same generator."""

    def __init__(self, transforms: Iterable[Callable[..., Any]]) -> None:
        """Chain ``transforms``: stoker transforms or any one-argument callables."""
        self.transforms = list(transforms)
        self._steps = [as_transform(t) for t in self.transforms]

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> Any:
        """Apply each transform in order, all drawing from the one ``generator``."""
        for step in self._steps:
            x = step(x, generator=generator)
        return x

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


_SCALES = {"u1": 255.0, "u2": 65535.0}  # numpy dtype codes (no byte order) -> full scale


class ToTensor:
    """A Pillow image or an H×W(×C) array → a float32 C×H×W tensor in [0, 1]."""

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """The image as a float32 C×H×W tensor, scaled to [0, 1] from its integer range."""
        # A Pillow image hands numpy a read-only copy of its pixels: no second copy here.
        array = np.asarray(x)
        if array.ndim == 2:
            array = array[:, :, None]
        if array.ndim != 3:
            raise DataError(
                f"ToTensor got an array of shape {array.shape}; expected H×W or H×W×C.",
                hint="pass a Pillow image or a numpy array with channels last",
            )
        scale = _SCALES.get(array.dtype.str[1:])
        if scale is None and array.dtype.kind not in "fb":
            raise DataError(
                f"ToTensor got pixels of dtype {array.dtype}; expected uint8, uint16 or float.",
                hint="convert the image first, e.g. image.convert('RGB')",
            )
        # One pass turns channels-last into C×H×W and converts to float32 (a new,
        # writable array); the division then works in place.
        tensor = torch.from_numpy(array.transpose(2, 0, 1).astype(np.float32, order="C"))
        return tensor.div_(scale) if scale is not None else tensor

    def __repr__(self) -> str:
        return "ToTensor()"


class Normalize:
    """Per-channel ``(x - mean) / std`` on a C×H×W (or N×C×H×W) float tensor."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        if self.mean.numel() != self.std.numel() or not bool((self.std > 0).all()):
            raise ConfigError(
                f"Normalize(mean={list(mean)}, std={list(std)}); expected one mean and one "
                "positive std per channel.",
                hint="e.g. Normalize(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25])",
            )

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``x`` normalized; a DataError when its channels do not match the statistics."""
        image = _need_tensor(x, "Normalize")
        channels = image.shape[-3] if image.dim() >= 3 else 1
        if self.mean.shape[0] not in (1, channels):
            raise DataError(
                f"Normalize has {self.mean.shape[0]} channel statistics but the image has "
                f"{channels} channels (shape {tuple(image.shape)}).",
                hint="give one mean and std per channel",
            )
        return (image - self.mean) / self.std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


class Resize:
    """Resize a Pillow image or an image tensor (bilinear, antialiased).

    An int ``size`` sets the shorter side and keeps the aspect ratio; a
    ``(height, width)`` pair sets both.
    """

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = size
        self._pair = _size_pair(size, "Resize")
        self._shorter = isinstance(size, numbers.Integral)

    def _target(self, height: int, width: int) -> tuple[int, int]:
        if not self._shorter:
            return self._pair
        side = self._pair[0]
        if height <= width:
            return side, max(1, round(width * side / height))
        return max(1, round(height * side / width)), side

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> Any:
        """``x`` resized; a tensor already of the target size comes back as is."""
        if isinstance(x, torch.Tensor):
            x = _need_tensor(x, "Resize")
            height, width = self._target(x.shape[-2], x.shape[-1])
            if (height, width) == tuple(x.shape[-2:]):
                return x  # already that size: resampling would only blur and cost time
            if not x.is_floating_point():
                raise DataError(
                    f"Resize got a tensor of dtype {x.dtype}; expected a float tensor.",
                    hint="put ToTensor() before Resize, or resize the Pillow image",
                )
            batch = x.reshape(-1, *x.shape[-3:]) if x.dim() >= 3 else x[None, None]
            out = F.interpolate(
                batch, size=(height, width), mode="bilinear", align_corners=False, antialias=True
            )
            return out.reshape(*x.shape[:-2], height, width)
        if not hasattr(x, "resize") or not hasattr(x, "height"):
            raise DataError(
                f"Resize works on Pillow images and image tensors; got {type(x).__name__}.",
                hint="pass a Pillow image, or put ToTensor() before Resize",
            )
        from PIL import Image  # loaded already: x is a Pillow image

        height, width = self._target(x.height, x.width)
        if (height, width) == (x.height, x.width):
            return x
        return x.resize((width, height), resample=Image.Resampling.BILINEAR)

    def __repr__(self) -> str:
        return f"Resize({self.size!r})"


class RandomCrop:
    """Crop a random ``size`` window from an image tensor, after optional zero padding."""

    def __init__(self, size: int | Sequence[int], *, padding: int = 0) -> None:
        self.size = _size_pair(size, "RandomCrop")
        if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
            raise ConfigError(
                f"RandomCrop padding={padding!r}; expected an int >= 0.",
                hint="e.g. RandomCrop(32, padding=4)",
            )
        self.padding = padding

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """A crop of ``x`` (padded first by ``padding``) at a place drawn from ``generator``."""
        image = _need_tensor(x, "RandomCrop")
        generator = _need_generator(generator, "RandomCrop")
        if self.padding:
            image = F.pad(image, (self.padding,) * 4)
        height, width = self.size
        free_h, free_w = image.shape[-2] - height, image.shape[-1] - width
        if free_h < 0 or free_w < 0:
            raise DataError(
                f"RandomCrop size {self.size} is larger than the (padded) image "
                f"{tuple(image.shape[-2:])}.",
                hint="Resize the image first, or crop a smaller size",
            )
        # One draw picks the window among all (free_h + 1) * (free_w + 1) positions.
        top, left = divmod(
            int(torch.randint((free_h + 1) * (free_w + 1), (), generator=generator)), free_w + 1
        )
        # narrow() is a view, like slicing, without parsing an index expression.
        return image.narrow(-2, top, height).narrow(-1, left, width)

    def __repr__(self) -> str:
        return f"RandomCrop({self.size}, padding={self.padding})"


class RandomHorizontalFlip:
    """Mirror an image tensor left to right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ConfigError(
                f"RandomHorizontalFlip p={p!r}; expected a probability in [0, 1].",
                hint="e.g. RandomHorizontalFlip(p=0.5)",
            )
        self.p = p

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``x`` mirrored or not; it draws either way, so later draws do not depend on it."""
        image = _need_tensor(x, "RandomHorizontalFlip")
        # Always draw, so the generator advances the same way whatever the outcome.
        flip = float(torch.rand((), generator=_need_generator(generator, "RandomHorizontalFlip")))
        return image.flip(-1) if flip < self.p else image

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class RandomNoise:
    """Add Gaussian noise of standard deviation ``std`` to a float tensor."""

    def __init__(self, std: float) -> None:
        if not std >= 0:
            raise ConfigError(
                f"RandomNoise std={std!r}; expected a number >= 0.", hint="e.g. RandomNoise(0.05)"
            )
        self.std = float(std)

    def __call__(self, x: Any, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``x`` plus noise drawn from ``generator``."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise DataError(
                f"RandomNoise works on float tensors; got {type(x).__name__}"
                + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else "")
                + ".",
                hint="put ToTensor() (or .float()) before RandomNoise",
            )
        generator = _need_generator(generator, "RandomNoise")
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        return x + noise.mul_(self.std)

    def __repr__(self) -> str:
        return f"RandomNoise({self.std})"


class SharedEpoch:
    """An epoch number that worker processes see change, persistent workers included.

    A dataset is copied into each worker; a plain ``self.epoch = e`` set in the main
    process never reaches workers that persist across epochs. This value lives in shared
    memory instead, so ``set_epoch`` reaches every worker before its next sample.
    """

    def __init__(self, epoch: int = 0) -> None:
        zero = torch.zeros((), dtype=torch.int64)
        self._value = zero.share_memory_()  # type: ignore[no-untyped-call]  # torch: unannotated
        self._value.fill_(int(epoch))

    @property
    def value(self) -> int:
        """The epoch every worker process reads."""
        return int(self._value)

    @value.setter
    def value(self, epoch: int) -> None:
        self._value.fill_(int(epoch))

    def __repr__(self) -> str:
        return f"SharedEpoch({self.value})"


class ReproducibleTransformDataset(Dataset[Any]):
    """Apply a transform to the first field of each sample of any map-style dataset.

    Sample ``i`` of epoch ``e`` is transformed with ``sample_generator(seed, e, i)``, so
    its augmentation is the same with any number of workers and on resume. ``EpochLoader``
    calls :meth:`set_epoch` each epoch.

    Example:
        >>> ds = ReproducibleTransformDataset(images, Compose([RandomCrop(28, padding=2)]),
        ...                                   seed=0)
    """

    def __init__(
        self, dataset: Dataset[Any], transform: Callable[..., Any], *, seed: int = 0
    ) -> None:
        """Wrap ``dataset``.

        Args:
            dataset: A map-style dataset; samples are tuples/lists (the first field is
                transformed) or single values (transformed whole).
            transform: A stoker transform, a ``Compose``, or any one-argument callable.
            seed: The run's seed, mixed with the epoch and the sample index.
        """
        self.dataset = dataset
        self.transform = transform
        self.seed = int(seed)
        self._transform = as_transform(transform)
        self._epoch = SharedEpoch()
        self._seeds = SampleSeeds(self.seed)

    @property
    def epoch(self) -> int:
        """The epoch whose augmentations are applied (shared with the loader's workers)."""
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentations of ``epoch`` (forwarded to the wrapped dataset too)."""
        self._epoch.value = epoch
        inner = getattr(self.dataset, "set_epoch", None)
        if callable(inner):
            inner(epoch)

    @property
    def targets(self) -> torch.Tensor | None:
        """The wrapped dataset's labels, when known without reading samples."""
        return dataset_targets(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        if index < 0:
            index += len(self)  # ds[-1] is ds[n - 1], augmentation included
        sample = self.dataset[index]
        if isinstance(sample, BadSample):
            return sample
        generator = self._seeds.generator(self._epoch.value, index)
        if not isinstance(sample, tuple | list):
            return self._transform(sample, generator=generator)
        first = self._transform(sample[0], generator=generator)
        if isinstance(sample, list):
            return [first, *sample[1:]]
        if hasattr(sample, "_fields"):  # a namedtuple takes its fields as arguments
            return type(sample)(first, *sample[1:])
        return (first, *sample[1:])

    def __repr__(self) -> str:
        return (
            f"ReproducibleTransformDataset({type(self.dataset).__name__}, {self.transform!r}, "
            f"seed={self.seed})"
        )
