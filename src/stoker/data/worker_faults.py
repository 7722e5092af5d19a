"""Loader faults, said for people: a dead or hung worker, a failing sample, full /dev/shm.

PyTorch's DataLoader reports trouble in its own terms: "DataLoader worker (pid(s) 123)
exited unexpectedly", "DataLoader timed out after 5 seconds", a reset connection, or a
dataset's exception re-raised with the worker's traceback pasted into its message. The
functions here turn each into a :class:`~stoker.errors.DataError` that names the worker,
the likely cause and the fix (how faults are detected is :mod:`stoker.data.worker_watch`):

* a worker that died: how (SIGKILL: the out-of-memory killer; SIGBUS: full /dev/shm; a
  crash: where), with its stack when faulthandler wrote one;
* a worker late past ``loader.timeout_s``: its Python stack, or that it is idle because
  its batch was lost on the way (an object that cannot be pickled);
* an exception in a dataset: the sample index (a batched fetch: the batch's indices), the
  dataset and what it reads, the line that raised;
* too little shared memory, or too few file descriptors: the sizes and how to make room.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import signal
import traceback
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset, Subset, get_worker_info

from stoker.errors import DataError, StokerError

__all__ = [
    "TIMED_OUT",
    "NamedFetch",
    "SampleError",
    "death_error",
    "describe_dataset",
    "hang_error",
    "is_transport_error",
    "sample_error",
    "shm_error",
    "worker_error",
]

#: How PyTorch's timeout error starts (the watch uses a short timeout as a poll).
TIMED_OUT = "DataLoader timed out after"
_SHOWN_INDICES = 8
_SHOWN_FRAMES = 20

_CAUGHT = re.compile(r"Caught (\w+) in DataLoader worker process (\d+)\.")
_SHM = re.compile(r"shared memory|\bshm\b|/dev/shm|</?torch_\d+|bus error", re.IGNORECASE)
_FDS = re.compile(r"received 0 items of ancdata|too many open files", re.IGNORECASE)
_FRAME = re.compile(r'File "(.+?)", line (\d+),? in (\S+)')
_OWN_FRAME = 'stoker/data/worker_faults.py"'


class SampleError(DataError):
    """A dataset raised while loading a sample (or a batch, for a batched ``__getitems__``)."""


# --- naming what failed ---------------------------------------------------------------

_SOURCE_ATTRIBUTES = ("path", "root", "paths", "files", "shards", "_path", "_paths", "_files")


def _source(dataset: Any) -> str | None:
    """The file or folder a dataset reads, when it keeps it under a usual name."""
    for name in _SOURCE_ATTRIBUTES:
        try:
            value = getattr(dataset, name, None)
        except Exception:  # a property may fail; naming the source is best effort
            continue
        if isinstance(value, str | os.PathLike):
            return os.fspath(value)
        paths = isinstance(value, list | tuple) and value
        if paths and all(isinstance(v, str | os.PathLike) for v in value):
            more = f" and {len(value) - 1} more" if len(value) > 1 else ""
            return f"{os.fspath(value[0])}{more}"
    return None


def describe_dataset(dataset: Any) -> str:
    """The dataset's class, with what it wraps and the file it reads when known."""
    name = type(dataset).__name__
    inner = dataset
    while isinstance(inner, Subset):
        inner = inner.dataset
        name = f"{name} of {type(inner).__name__}"
    source = _source(inner)
    return f"{name} ({source})" if source else name


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _raised_at(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    return f" (raised at {_short(frame.filename)}:{frame.lineno}, in {frame.name})"


def _process() -> str:
    info = get_worker_info()
    return "the training process" if info is None else f"loader worker {info.id}"


def _index_list(indices: Sequence[int] | Any) -> str:
    values = indices.tolist() if hasattr(indices, "tolist") else list(indices)
    shown = ", ".join(str(i) for i in values[:_SHOWN_INDICES])
    return f"[{shown}{', ...' if len(values) > _SHOWN_INDICES else ''}]"


def sample_error(
    error: Exception, dataset: Any, indices: Sequence[int] | Any, *, batched: bool
) -> SampleError:
    """The error for ``error``, raised by ``dataset`` while reading ``indices``.

    Args:
        error: What the dataset raised.
        dataset: The dataset as the user wrote it.
        indices: The sample read (one index), or the whole batch of a batched fetch.
        batched: Whether ``indices`` were fetched together, so any of them may be at fault.
    """
    if batched:
        what = f"the batch of {len(indices)} samples {_index_list(indices)}"
    else:
        what = f"sample {indices[0]}"
    where = _process()
    retry = (
        ""
        if where == "the training process"
        else "; with loader.num_workers=0 it is raised in the training process"
    )
    return SampleError(
        f"{what} of {describe_dataset(dataset)} failed in {where}: "
        f"{type(error).__name__}: {error}{_raised_at(error)}",
        hint=f"fix the dataset code or the record it reads{retry}; --debug shows the traceback",
    )


class NamedFetch(Dataset):
    """The dataset as the DataLoader fetches it: an exception names the sample and worker.

    PyTorch calls ``__getitems__`` with one batch's indices. A batched dataset (whose
    ``__getitems__`` returns one batch) is called once, any other is read sample by sample,
    as PyTorch itself would. An exception becomes a :class:`SampleError` naming the index
    being read (all of the batch's for a batched fetch), chained to the original; stoker's
    own errors (a bad record names its file and row) pass through. A ``try`` costs nothing
    until something raises.
    """

    def __init__(self, dataset: Dataset, *, batched: bool) -> None:
        self.dataset = dataset
        self.batched = batched

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except StokerError:
            raise
        except Exception as error:
            raise sample_error(error, self.dataset, [index], batched=False) from error

    def __getitems__(self, indices: list[int]) -> Any:
        dataset = self.dataset
        if self.batched:
            try:
                return dataset.__getitems__(indices)  # type: ignore[attr-defined]
            except StokerError:
                raise
            except Exception as error:
                raise sample_error(error, dataset, indices, batched=True) from error
        samples = []
        index = None
        try:
            for index in indices:
                samples.append(dataset[index])
        except StokerError:
            raise
        except Exception as error:
            raise sample_error(error, dataset, [index], batched=False) from error
        return samples

    def __getattr__(self, name: str) -> Any:
        # Only for names the wrapper lacks: a worker's get_worker_info().dataset shows the
        # dataset's own attributes. Dunder names and our own fields never recurse.
        if name.startswith("__") or name in ("dataset", "batched"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


# --- stacks that faulthandler wrote ---------------------------------------------------


def _worker_thread(dump: str) -> tuple[list[str], bool]:
    """The worker's main thread in a faulthandler dump: its frames, and whether it is idle.

    A worker's other threads (a queue's feeder) are noise; its main thread is the one
    running ``_worker_loop``. It is idle when no fetch is on its stack: it waits for work.
    """
    blocks = [b for b in dump.strip().split("\n\n") if b.strip()]
    block = next((b for b in blocks if "_worker_loop" in b), blocks[-1] if blocks else "")
    frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
    idle = any("_worker_loop" in f for f in frames) and not any(
        "/_utils/fetch.py" in f for f in frames
    )
    return frames, idle


def _show_frames(frames: list[str]) -> str:
    """The frames above PyTorch's worker machinery (most recent first), paths shortened."""
    internal = next(
        (i for i, f in enumerate(frames) if "/torch/utils/data/" in f.replace("\\", "/")),
        len(frames),
    )
    own = [f for f in frames[: max(internal, 1)] if _OWN_FRAME not in f.replace("\\", "/")]
    shown = (own or frames[:1])[:_SHOWN_FRAMES]
    lines = []
    for frame in shown:
        match = _FRAME.search(frame)
        if match:
            path, line, function = match.groups()
            frame = f'File "{_short(path)}", line {line}, in {function}'
        lines.append(f"    {frame}")
    return "\n".join(lines)


# --- diagnoses ---------------------------------------------------------------------------


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.0f} MiB"


def _shm_usage() -> str:
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return ""
    return f" (/dev/shm: {_size(usage.total)}, {_size(usage.free)} free)"


def shm_error(what: str, *, likely: bool = False, detail: str = "") -> DataError:
    """Too little shared memory, after ``what`` happened, with the ways to make room.

    Args:
        what: What happened, naming the worker.
        likely: Whether running out of shared memory is only the likely cause (a SIGBUS).
        detail: More lines for the message (the worker's stack).
    """
    return DataError(
        f"{what}: {'most likely ' if likely else ''}/dev/shm is too small. Loader workers "
        f"hand every batch to the training process through shared memory{_shm_usage()}."
        f"{detail}",
        hint="give the container more shared memory (`docker run --shm-size=8g ...` or "
        "`--ipc=host`; on Kubernetes mount an emptyDir with medium: Memory at /dev/shm), "
        "or keep fewer batches in flight: lower loader.num_workers, loader.prefetch_factor "
        "or loader.batch_size",
    )


def _fd_error(what: str) -> DataError:
    return DataError(
        f"{what}: the training process ran out of file descriptors. Each tensor a loader "
        "worker sends holds one open until the batch is received.",
        hint="raise the limit (`ulimit -n 65536` in the shell that starts training), or call "
        "torch.multiprocessing.set_sharing_strategy('file_system') before building the "
        "loader; fewer loader.num_workers or a lower loader.prefetch_factor also help",
    )


_RERUN = "run with loader.num_workers=0 to see the failure in the training process"
_CRASHES = {"SIGSEGV", "SIGABRT", "SIGFPE", "SIGILL"}
_STOPS = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


def _ending(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _death_cause(exitcode: int) -> tuple[str, str]:
    """Why a worker that ended with ``exitcode`` likely did, and what to do."""
    name = _ending(exitcode).rsplit(" ", 1)[-1]
    if name == "SIGKILL":
        return (
            "SIGKILL is what the kernel's out-of-memory killer sends: the training process "
            "and its workers together used more memory than the machine or container allows",
            "check with `dmesg -T | grep -i -E 'out of memory|killed process'` (or the "
            "container's memory limit), then lower loader.num_workers, "
            "loader.prefetch_factor or loader.batch_size, or make each worker hold less",
        )
    if name in _CRASHES:
        return (
            "native code (a C extension or library the dataset or collate function calls) crashed",
            f"the stack shows where; {_RERUN}",
        )
    if name in _STOPS:
        return (
            "another process stopped it",
            "check what signals the job's processes (a scheduler, a supervisor, a timeout)",
        )
    if exitcode >= 0:
        return (
            "the dataset or a library it calls ended the process (sys.exit, os._exit) "
            "before an exception could be reported",
            _RERUN,
        )
    return "", _RERUN


def _last_frame(text: str) -> str:
    frames = _FRAME.findall(text)
    if not frames:
        return ""
    path, line, function = frames[-1]
    return f" (raised at {_short(path)}:{line}, in {function})"


def _stoker_class(qualname: str) -> type[StokerError] | None:
    module, _, name = qualname.rpartition(".")
    if not module.startswith("stoker."):
        return None
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) and issubclass(found, StokerError) else None


def _rebuilt(cls: type[StokerError], message: str, hint: str | None) -> StokerError:
    """A stoker error of type ``cls`` from its text: only message and hint cross processes."""
    error = cls.__new__(cls)
    StokerError.__init__(error, message, hint=hint)
    return error


def _from_worker(error: Exception, caught: re.Match[str], dataset: str) -> StokerError:
    """A worker's exception, re-raised by PyTorch with the worker's traceback as its text."""
    type_name, worker = caught.group(1), int(caught.group(2))
    text = _text(error)
    header = re.compile(rf"^((?:[\w.]+\.)?{re.escape(type_name)})(?:: |$)", re.MULTILINE)
    # The last header is the exception PyTorch caught; earlier ones are its causes.
    last = next(reversed(list(header.finditer(text, caught.end()))), None)
    original = text[last.end() :].rstrip("\n") if last else ""
    cls = _stoker_class(last.group(1)) if last else None
    if cls is not None:
        message, _, hint = original.partition("\n  fix: ")
        if cls is not SampleError:  # a SampleError names its worker already
            message = f"{message} (in loader worker {worker})"
        return _rebuilt(cls, message, hint or None)
    location = _last_frame(text[: last.start()] if last else text)
    return DataError(
        f"loader worker {worker} raised {type_name}: {original}{location}, loading from {dataset}",
        hint=f"{_RERUN}; --debug shows the worker's traceback",
    )


def _text(error: BaseException) -> str:
    """An exception's message as given: a KeyError's ``str`` is the repr of its argument."""
    first = error.args[0] if len(error.args) == 1 else None
    return first if isinstance(first, str) else str(error)


def _chain_text(error: BaseException) -> str:
    """The messages of ``error`` and of every exception it was raised from or during."""
    texts, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts.append(str(current))
        current = current.__cause__ or current.__context__
    return "\n".join(texts)


def is_transport_error(error: BaseException) -> bool:
    """Errors that a worker dying mid-send leaves behind, before its death is seen.

    A dataset's own OSError re-raised from a worker is not one: its text starts "Caught".
    """
    if _CAUGHT.match(_text(error)):
        return False
    return isinstance(error, OSError | EOFError) or "exited unexpectedly" in str(error)


def death_error(dead: list[tuple[int, int | None, int]], dump: str = "") -> DataError:
    """The error for loader workers that ended while they had batches to load.

    Args:
        dead: ``(worker id, pid, exit code)`` of each; a negative code is the signal.
        dump: What faulthandler wrote in the first one when it crashed, if anything.
    """
    what = "; ".join(f"loader worker {i} (pid {pid}) {_ending(code)}" for i, pid, code in dead)
    exitcode = dead[0][2]
    frames, _ = _worker_thread(dump)
    stack = ""
    if frames:
        stack = f"\nIts stack when it crashed (most recent call first):\n{_show_frames(frames)}"
    if exitcode == -int(getattr(signal, "SIGBUS", 7)):
        return shm_error(what, likely=True, detail=stack)
    cause, hint = _death_cause(exitcode)
    return DataError(f"{what}{': ' + cause if cause else ''}.{stack}", hint=hint)


def hang_error(worker: str | None, *, timeout_s: float, dump: str) -> DataError:
    """The error for a worker (``worker`` names it; None: unknown) late past the timeout.

    Args:
        worker: ``loader worker 1 (pid 123)``, the worker the loader waits for.
        timeout_s: How long it waited.
        dump: The worker's stack as faulthandler wrote it on request ("" if none came).
    """
    waited = f"for {timeout_s:g} s (loader.timeout_s)"
    if worker is None:
        return DataError(
            f"no loader worker delivered a batch {waited}.",
            hint="raise loader.timeout_s if batches really take this long (0 waits forever)",
        )
    frames, idle = _worker_thread(dump)
    if idle:
        return DataError(
            f"{worker} did not deliver its batch {waited}, yet it is idle, waiting for work: "
            "it loaded the batch, but sending it to the training process failed. Usually "
            "the batch holds an object that cannot be pickled (the worker printed the error "
            f"on stderr), or /dev/shm is full{_shm_usage()}.",
            hint="return only tensors, numbers, strings and containers of them from the "
            "dataset and collate function; for a shared-memory error on stderr, give "
            "/dev/shm more room (`docker run --shm-size=8g`)",
        )
    shown = _show_frames(frames) if frames else "    (its stack could not be read)"
    return DataError(
        f"{worker} did not deliver a batch {waited}; it is stuck here (most recent call "
        f"first):\n{shown}",
        hint="fix the call that blocks (a lock, a network or disk read, a deadlock after "
        "fork); if batches really take this long, raise loader.timeout_s (0 waits forever)",
    )


def worker_error(error: Exception, dataset: Any) -> BaseException:
    """The error for what a multi-worker DataLoader raised, when no worker died or hung.

    Returns ``error`` itself when it is not a loader fault stoker can say more about.
    """
    caught = _CAUGHT.match(_text(error))
    who = f"loader worker {caught.group(2)}" if caught else "a loader worker"
    text = _chain_text(error)
    if _SHM.search(text):
        return shm_error(f"{who} could not put a batch in shared memory")
    if _FDS.search(text):
        return _fd_error(f"receiving a batch from {who} failed")
    if caught:
        return _from_worker(error, caught, describe_dataset(dataset))
    return error
