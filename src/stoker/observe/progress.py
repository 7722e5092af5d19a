"""What the user sees while a run trains: progress bars, epoch summary lines, messages."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol, TextIO, runtime_checkable

from stoker.errors import ConfigError
from stoker.observe.eta import Eta, format_duration

if TYPE_CHECKING:  # rich loads with the first bar: `stoker report` and logs do without it
    from rich.console import Console
    from rich.progress import Progress as RichBar
    from rich.progress import TaskID

__all__ = [
    "Eta",
    "PlainProgress",
    "Progress",
    "QuietProgress",
    "RichProgress",
    "build_progress",
    "format_epoch_summary",
]

ProgressMode = Literal["auto", "rich", "plain", "quiet"]
_MODES: tuple[str, ...] = ("auto", "rich", "plain", "quiet")

# Within train/* and val/*, these come first, in this order; the rest follow sorted.
_LEADING_NAMES = ("loss", "accuracy")
_PLACEHOLDER = "-"
#: Plain progress: a line at least this often within a run, by default (tracking.progress_every_s).
DEFAULT_EVERY_S = 30.0


@runtime_checkable
class Progress(Protocol):
    """Reports a run's progress to the user.

    ``epoch`` is the number shown to the user (``epoch 3/10``): the epoch record's own
    ``epoch``, which counts from 1 (``stoker.train.state.epoch_number``), so that this
    line, the messages, ``metrics.jsonl`` and the report name the same epoch.
    """

    def start_epoch(self, epoch: int, *, epochs: int, total_steps: int | None) -> None:
        """Begins showing an epoch of ``total_steps`` steps (``None`` when unknown)."""
        ...

    def advance(
        self,
        steps: int = 1,
        *,
        loss: float | None = None,
        samples_per_s: float | None = None,
    ) -> None:
        """Counts ``steps`` more steps done; updates the live values that are given.

        Callers pass ``loss`` only every few steps: reading it is a CPU–GPU sync.
        """
        ...

    def end_epoch(self, epoch: int, summary: Mapping[str, float]) -> None:
        """Ends the epoch and shows its summary line."""
        ...

    def message(self, text: str) -> None:
        """Shows one line to the user, e.g. where the run dir is."""
        ...

    def close(self) -> None:
        """Stops any live display."""
        ...


def format_epoch_summary(epoch: int, epochs: int | None, summary: Mapping[str, float]) -> str:
    """Formats the one-line summary of an epoch.

    Keys come in a stable order: ``train/*``, ``val/*`` (each with ``loss`` then
    ``accuracy`` first), ``lr``, ``time/*``, ``throughput/*``, then any other key
    sorted by name. The line is for a person at a terminal, so only the headline
    figures are shown: the ``train``/``val`` metrics, ``lr``, epoch time, data stall
    and throughput; everything else is in ``metrics.jsonl``, TensorBoard and the report.

    Example: ``epoch 3/10  train/loss 0.1234  val/loss 0.1500  time 0.84s  5123 samples/s``.

    Args:
        epoch: The epoch number as shown to the user.
        epochs: The number of epochs of the run, or ``None`` when open-ended.
        summary: The epoch's metrics, keyed ``group/name``.

    Returns:
        The line, without a trailing newline.
    """
    head = f"epoch {epoch}/{epochs}" if epochs is not None else f"epoch {epoch}"
    shown = [
        (key, value)
        for key, value in summary.items()
        if _is_headline(key) and not isinstance(value, str)
    ]
    shown.sort(key=lambda item: _order_key(item[0]))
    return "  ".join([head, *(_format_item(key, value) for key, value in shown)])


_HEADLINE_KEYS = frozenset(
    {
        "lr",
        "time/epoch_s",
        "time/data_stall_pct",
        "throughput/samples_per_s",
        "throughput/tokens_per_s",
    }
)


def _is_headline(key: str) -> bool:
    return key in _HEADLINE_KEYS or key.partition("/")[0] in ("train", "val")


def _order_key(key: str) -> tuple[int, int, str]:
    group, _, name = key.partition("/")
    if key == "lr":
        return (2, 0, "")
    if key == "time/epoch_s":
        return (3, 0, "")
    if key == "throughput/samples_per_s":
        return (4, 0, "")
    if group in ("train", "val"):
        lead = _LEADING_NAMES.index(name) if name in _LEADING_NAMES else len(_LEADING_NAMES)
        return (0 if group == "train" else 1, lead, name)
    if group == "time":
        return (3, 1, name)
    if group == "throughput":
        return (4, 1, name)
    return (5, 0, key)


def _format_item(key: str, value: float) -> str:
    group, _, name = key.partition("/")
    if key == "lr":
        return f"lr {_format_float(float(value), spec='.2e')}"
    if key == "time/epoch_s":
        return f"time {_format_float(float(value), spec='.2f')}s"
    if key == "time/data_stall_pct":
        return f"data stall {_format_float(float(value), spec='.1f')}%"
    if group == "time" and name.endswith("_s"):
        return f"{key} {_format_float(float(value), spec='.2f')}s"
    if group == "throughput" and name.endswith("_per_s"):
        unit = name.removesuffix("_per_s")
        return f"{_format_float(float(value), spec='.0f')} {unit}/s"
    return f"{key} {_format_number(value)}"


def _format_number(value: float) -> str:
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    # Four decimals read well for losses and accuracies; tiny or huge values would show
    # as 0.0000 or as a wall of digits, so they switch to scientific notation.
    if value == 0 or not math.isfinite(value) or 1e-3 <= abs(value) < 1e6:
        return _format_float(value, spec=".4f")
    return _format_float(value, spec=".3e")


def _format_float(value: float, *, spec: str) -> str:
    return format(value, spec) if math.isfinite(value) else str(value)


class RichProgress:
    """A rich progress bar per epoch, replaced by a summary line when the epoch ends.

    The bar shows ``epoch 3/10``, the steps done of the total, the time elapsed, the
    time left in the epoch and in the whole run (``ETA 0:42  run 6:10``) and the latest
    ``loss`` and ``samples/s`` the caller passed to ``advance``.
    """

    def __init__(self, console: Console | None = None, *, eta: Eta | None = None) -> None:
        """Keeps the console.

        Args:
            console: Where to draw; a default ``rich`` console (stdout) when ``None``.
            eta: Measures the time left; one that knows the run's steps when ``None``
                is not enough (``build_progress`` passes the session's).
        """
        if console is None:
            from rich.console import Console

            console = Console()
        self.console = console
        self.eta = eta if eta is not None else Eta()
        self._bar: RichBar | None = None
        self._task: TaskID | None = None
        self._epochs: int | None = None
        self._eta_at = -math.inf

    def start_epoch(self, epoch: int, *, epochs: int, total_steps: int | None) -> None:
        """Starts a new bar for ``epoch``, stopping any bar still running."""
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichBar

        self._stop_bar()
        self._epochs = epochs
        done = self.eta.start_epoch(epoch, epochs=epochs, total_steps=total_steps)
        self._eta_at = -math.inf
        self._bar = RichBar(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[epoch_eta]}  run {task.fields[run_eta]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[samples_per_s]} samples/s"),
            console=self.console,
            # The summary line replaces the finished bar.
            transient=True,
            refresh_per_second=5,
            # A bar cannot redraw in a file or a dumb terminal, and rich would leave a
            # blank line there instead; the summary line is all such output gets.
            disable=not (self.console.is_interactive or self.console.is_jupyter),
        )
        self._task = self._bar.add_task(
            f"epoch {epoch}/{epochs}",
            total=total_steps,
            completed=done,
            loss=_PLACEHOLDER,
            samples_per_s=_PLACEHOLDER,
            epoch_eta=_PLACEHOLDER,
            run_eta=_PLACEHOLDER,
        )
        self._bar.start()

    def advance(
        self,
        steps: int = 1,
        *,
        loss: float | None = None,
        samples_per_s: float | None = None,
    ) -> None:
        """Moves the bar on by ``steps``; does nothing outside an epoch."""
        if self._bar is None or self._task is None:
            return
        self.eta.advance(steps)
        fields: dict[str, str] = {}
        now = self.eta.clock()
        if now - self._eta_at >= 0.2:  # as often as the bar redraws (5 per second)
            self._eta_at = now
            fields["epoch_eta"] = format_duration(self.eta.epoch_eta_s())
            fields["run_eta"] = format_duration(self.eta.run_eta_s())
        if loss is not None:
            fields["loss"] = _format_number(loss)
        if samples_per_s is not None:
            fields["samples_per_s"] = _format_float(float(samples_per_s), spec=".0f")
        self._bar.update(self._task, advance=steps, **fields)

    def end_epoch(self, epoch: int, summary: Mapping[str, float]) -> None:
        """Removes the bar and prints the epoch's summary line."""
        self._stop_bar()
        line = format_epoch_summary(epoch, self._epochs, summary)
        from rich.text import Text

        text = Text(line)
        head_end = line.find("  ")
        text.stylize("bold", 0, head_end if head_end >= 0 else len(line))
        self.console.print(text)

    def message(self, text: str) -> None:
        """Prints ``text`` as is (no rich markup), above the bar if one is running."""
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        """Stops the bar if one is still running (e.g. after an error mid-epoch)."""
        self._stop_bar()

    def _stop_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        self._bar = None
        self._task = None


class PlainProgress:
    """Plain text for logs and non-TTY output (CI): no bar, but lines a log can show.

    Besides each epoch's summary line and the messages, a progress line comes every
    ``every_s`` seconds (and every ``every_steps`` steps, when set), mid-epoch too:
    ``step 120/469 (26%) in epoch 2/10  loss 0.4123  812 samples/s  ETA 0:42  run ETA 6:10``.
    The clock runs across epochs, so short epochs still get a line every ``every_s``.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        every_s: float | None = DEFAULT_EVERY_S,
        every_steps: int | None = None,
        eta: Eta | None = None,
    ) -> None:
        """Keeps the stream.

        Args:
            stream: Where lines go; ``sys.stdout`` when ``None``.
            every_s: Seconds between progress lines; None: no timed lines.
            every_steps: Steps between progress lines; None: none by count.
            eta: Measures the time left (``build_progress`` passes the session's).
        """
        self.stream = stream if stream is not None else sys.stdout
        self.eta = eta if eta is not None else Eta()
        self.every_s = every_s if every_s is not None else math.inf
        self.every_steps = every_steps
        self._epochs: int | None = None
        self._line_at: float | None = None
        self._since_line = 0
        self._loss: float | None = None
        self._samples_per_s: float | None = None

    def start_epoch(self, epoch: int, *, epochs: int, total_steps: int | None) -> None:
        """Remembers the epoch for the progress and summary lines; prints nothing."""
        self._epochs = epochs
        self.eta.start_epoch(epoch, epochs=epochs, total_steps=total_steps)
        if self._line_at is None:
            self._line_at = self.eta.clock()  # the first line comes every_s after the start
        self._since_line = 0
        self._loss = self._samples_per_s = None

    def advance(
        self,
        steps: int = 1,
        *,
        loss: float | None = None,
        samples_per_s: float | None = None,
    ) -> None:
        """Counts the steps; writes a progress line when one is due."""
        self.eta.advance(steps)
        self._since_line += steps
        if loss is not None:
            self._loss = loss
        if samples_per_s is not None:
            self._samples_per_s = samples_per_s
        now = self.eta.clock()
        due = self.every_steps is not None and self._since_line >= self.every_steps
        if due or (self._line_at is not None and now - self._line_at >= self.every_s):
            self._line_at, self._since_line = now, 0
            self._write(self.progress_line())

    def progress_line(self) -> str:
        """The line a log gets mid-epoch: where the run is, and the time left."""
        eta = self.eta
        # Not "epoch …" first: a line that starts so is an epoch's summary, for a reader
        # and for a grep of the log alike.
        step = f"step {eta.epoch_done}"
        if eta.epoch_total:
            share = 100 * eta.epoch_done / eta.epoch_total
            step = f"step {eta.epoch_done}/{eta.epoch_total} ({share:.0f}%)"
        epoch = f"epoch {eta.epoch}/{eta.epochs}" if self._epochs else f"epoch {eta.epoch}"
        parts = [f"{step} in {epoch}"]
        if self._loss is not None:
            parts.append(f"loss {_format_number(self._loss)}")
        if self._samples_per_s is not None:
            parts.append(f"{_format_float(float(self._samples_per_s), spec='.0f')} samples/s")
        parts.append(f"ETA {format_duration(eta.epoch_eta_s())}")
        parts.append(f"run ETA {format_duration(eta.run_eta_s())}")
        return "  ".join(parts)

    def end_epoch(self, epoch: int, summary: Mapping[str, float]) -> None:
        """Writes the epoch's summary line."""
        self._write(format_epoch_summary(epoch, self._epochs, summary))

    def message(self, text: str) -> None:
        """Writes ``text`` as one line."""
        self._write(text)

    def close(self) -> None:
        """Flushes the stream; it stays open (the caller owns it)."""
        self.stream.flush()

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        # Flushed per line so that `tail -f` on a redirected log keeps up.
        self.stream.flush()


class QuietProgress:
    """Shows nothing at all, messages included (``--quiet``, non-zero ranks)."""

    def start_epoch(self, epoch: int, *, epochs: int, total_steps: int | None) -> None:
        """Does nothing."""

    def advance(
        self,
        steps: int = 1,
        *,
        loss: float | None = None,
        samples_per_s: float | None = None,
    ) -> None:
        """Does nothing."""

    def end_epoch(self, epoch: int, summary: Mapping[str, float]) -> None:
        """Does nothing."""

    def message(self, text: str) -> None:
        """Does nothing."""

    def close(self) -> None:
        """Does nothing."""


def build_progress(
    mode: ProgressMode = "auto",
    *,
    stream: TextIO | None = None,
    every_s: float | None = DEFAULT_EVERY_S,
    every_steps: int | None = None,
    run_steps: int | None = None,
    steps_done: int = 0,
) -> Progress:
    """Builds the progress display.

    Args:
        mode: ``"rich"`` draws bars, ``"plain"`` writes summary and progress lines,
            ``"quiet"`` shows nothing, ``"auto"`` is rich on a terminal and plain otherwise.
        stream: Where to write; ``sys.stdout`` when ``None``.
        every_s: Plain mode: seconds between progress lines (``tracking.progress_every_s``).
        every_steps: Plain mode: steps between progress lines, too
            (``tracking.progress_every_steps``).
        run_steps: The run's optimizer steps, for the run's ETA (``train.max_steps`` may
            end it before its last epoch).
        steps_done: Steps already trained (a resume), so the ETA counts only those left.

    Returns:
        The progress display.

    Raises:
        ConfigError: ``mode`` is not one of the four above.
    """
    stream = stream if stream is not None else sys.stdout
    if mode == "auto":
        mode = "rich" if _isatty(stream) else "plain"
    eta = Eta(run_steps=run_steps, steps_done=steps_done)
    if mode == "rich":
        from rich.console import Console

        return RichProgress(Console(file=stream), eta=eta)
    if mode == "plain":
        return PlainProgress(stream, every_s=every_s, every_steps=every_steps, eta=eta)
    if mode == "quiet":
        return QuietProgress()
    raise ConfigError(
        f"progress mode {mode!r} is not known; expected one of {', '.join(_MODES)}",
        hint="pass mode='auto' (bars on a terminal, plain lines otherwise)",
    )


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        # No isatty (a custom writer) or a closed stream: not a terminal.
        return False
