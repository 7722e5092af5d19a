"""Tests for stoker.observe.progress."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from stoker.errors import ConfigError
from stoker.observe.progress import (
    PlainProgress,
    Progress,
    QuietProgress,
    RichProgress,
    build_progress,
    format_epoch_summary,
)

ANSI = re.compile(r"\x1b\[")

SUMMARY = {
    "val/accuracy": 0.955,
    "throughput/samples_per_s": 5123.4,
    "time/epoch_s": 0.8412,
    "train/accuracy": 0.96123,
    "val/loss": 0.15,
    "train/loss": 0.12341,
}
LINE = (
    "epoch 3/10  train/loss 0.1234  train/accuracy 0.9612  val/loss 0.1500  "
    "val/accuracy 0.9550  time 0.84s  5123 samples/s"
)


def test_format_epoch_summary_exact() -> None:
    assert format_epoch_summary(3, 10, SUMMARY) == LINE


def test_format_epoch_summary_shows_only_headline_figures() -> None:
    summary = {
        "zeta": 2,
        "grad/norm": 1.5,
        "lr": 0.0003,
        "time/data_wait_s": 0.1234,
        "time/data_stall_pct": 7.25,
        "val/f1": 0.5,
        "throughput/samples_per_s": 812345.6,
        "train/loss": 0.00001,
        "epoch": 3,
        "note": "text is not shown",
        "time/epoch_s": 12.0,
    }
    assert format_epoch_summary(3, None, summary) == (
        "epoch 3  train/loss 1.000e-05  val/f1 0.5000  lr 3.00e-04  time 12.00s  "
        "data stall 7.2%  812346 samples/s"
    )


def test_format_epoch_summary_nonfinite() -> None:
    assert format_epoch_summary(1, 2, {"train/loss": float("nan")}) == "epoch 1/2  train/loss nan"


def test_plain_progress_prints_summary_and_message_without_ansi() -> None:
    stream = io.StringIO()
    progress = PlainProgress(stream)
    progress.message("run dir: runs/demo")
    progress.start_epoch(3, epochs=10, total_steps=5)
    progress.advance(loss=0.5, samples_per_s=100.0)
    progress.advance(4)
    progress.end_epoch(3, SUMMARY)
    progress.close()
    assert stream.getvalue() == f"run dir: runs/demo\n{LINE}\n"
    assert not ANSI.search(stream.getvalue())


def test_quiet_progress_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    progress = build_progress("quiet")
    assert isinstance(progress, QuietProgress)
    progress.message("hello")
    progress.start_epoch(1, epochs=1, total_steps=2)
    progress.advance(2, loss=0.1)
    progress.end_epoch(1, SUMMARY)
    progress.close()
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")


def test_rich_progress_prints_summary_line() -> None:
    out = io.StringIO()
    progress = RichProgress(Console(file=out, force_terminal=False, width=120))
    progress.message("run dir: runs/[demo]")
    for epoch in (1, 2):
        progress.start_epoch(epoch, epochs=2, total_steps=4)
        progress.advance(loss=0.5, samples_per_s=1000.0)
        progress.advance(3)
        progress.end_epoch(epoch, {"train/loss": 0.25, "time/epoch_s": 0.5})
    progress.close()
    assert out.getvalue() == (
        "run dir: runs/[demo]\n"
        "epoch 1/2  train/loss 0.2500  time 0.50s\n"
        "epoch 2/2  train/loss 0.2500  time 0.50s\n"
    )


def test_rich_progress_bar_shows_live_fields_on_terminal() -> None:
    out = io.StringIO()
    progress = RichProgress(Console(file=out, force_terminal=True, width=120))
    progress.start_epoch(2, epochs=3, total_steps=4)
    progress.advance(3, loss=0.123456, samples_per_s=2048.4)
    progress.close()
    text = ANSI.sub("", out.getvalue())
    assert "epoch 2/3" in text
    assert "3/4" in text
    assert "loss 0.1235" in text
    assert "2048 samples/s" in text


def test_rich_progress_unknown_total_and_advance_outside_epoch() -> None:
    out = io.StringIO()
    progress = RichProgress(Console(file=out, force_terminal=False, width=120))
    progress.advance(loss=1.0)  # before any epoch: ignored
    progress.start_epoch(1, epochs=1, total_steps=None)
    progress.advance(5)
    progress.end_epoch(1, {"train/loss": 1.0})
    progress.close()
    assert out.getvalue() == "epoch 1/1  train/loss 1.0000\n"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_build_progress_auto_picks_by_tty() -> None:
    assert isinstance(build_progress("auto", stream=io.StringIO()), PlainProgress)
    rich_progress = build_progress(stream=_Tty())
    assert isinstance(rich_progress, RichProgress)
    assert isinstance(build_progress("plain", stream=_Tty()), PlainProgress)
    assert isinstance(build_progress("rich", stream=io.StringIO()), RichProgress)
    for progress in (rich_progress, PlainProgress(io.StringIO()), QuietProgress()):
        assert isinstance(progress, Progress)


def test_build_progress_unknown_mode_lists_choices() -> None:
    with pytest.raises(ConfigError, match="auto, rich, plain, quiet"):
        build_progress("fancy")  # type: ignore[arg-type]
