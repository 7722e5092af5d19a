"""The epoch's and the run's ETA, and the plain progress lines a log gets mid-epoch."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import stoker
from stoker.observe.eta import Eta, format_duration
from stoker.observe.progress import PlainProgress, RichProgress, build_progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 41.6, 725, 3723, None)] == [
        "0:00", "0:42", "12:05", "1:02:03", "-",
    ]  # fmt: skip


def test_run_eta_counts_the_epochs_left_at_the_pace_so_far() -> None:
    clock = Clock()
    eta = Eta(clock=clock)
    eta.start_epoch(1, epochs=3, total_steps=10)
    assert eta.epoch_eta_s() is None and eta.run_eta_s() is None  # no pace yet
    clock.now += 5
    eta.advance(5)
    assert eta.epoch_eta_s() == pytest.approx(5.0)  # 5 steps left at 1 s a step
    assert eta.run_eta_s() == pytest.approx(25.0)  # and 2 epochs of 10 steps
    # Validation between epochs slows the run's pace (2 s for 10 steps), not the epoch's.
    clock.now += 5
    eta.advance(5)
    clock.now += 10
    eta.start_epoch(2, epochs=3, total_steps=10)
    clock.now += 1
    eta.advance(1)
    assert eta.epoch_eta_s() == pytest.approx(9.0)
    assert eta.run_eta_s() == pytest.approx(19 * 21 / 11)


def test_the_run_ends_no_sooner_than_its_epoch() -> None:
    clock = Clock()
    eta = Eta(clock=clock)
    eta.start_epoch(1, epochs=2, total_steps=10)
    clock.now += 10
    eta.advance(10)  # 1 s a step
    eta.start_epoch(2, epochs=2, total_steps=10)
    clock.now += 4
    eta.advance(2)  # the last epoch starts slower: 2 s a step
    assert eta.epoch_eta_s() == pytest.approx(16.0)
    assert eta.run_eta_s() == pytest.approx(16.0)  # not 8 left x 14/12 s = 9.3
    # max_steps ending the run before the epoch does: the run's own count decides.
    short = Eta(run_steps=5, clock=clock)
    short.start_epoch(1, epochs=2, total_steps=10)
    clock.now += 4
    short.advance(2)
    assert short.epoch_eta_s() == pytest.approx(16.0)
    assert short.run_eta_s() == pytest.approx(6.0)  # 3 steps left at 2 s


def test_run_eta_ends_at_max_steps_and_leaves_out_a_resumes_steps() -> None:
    clock = Clock()
    # max_steps=12 ends the run two steps into its second epoch.
    eta = Eta(run_steps=12, clock=clock)
    eta.start_epoch(1, epochs=5, total_steps=10)
    clock.now += 4
    eta.advance(4)
    assert eta.run_eta_s() == pytest.approx(8.0)
    # A resume 3 steps into epoch 2 of 3: the epoch starts at 3, the run at 13 of 30.
    resumed = Eta(run_steps=30, steps_done=13, clock=clock)
    assert resumed.start_epoch(2, epochs=3, total_steps=10) == 3
    clock.now += 2
    resumed.advance(2)
    assert resumed.epoch_eta_s() == pytest.approx(5.0)
    assert resumed.run_eta_s() == pytest.approx(15.0)
    # A resume at an epoch's end starts the next one at 0.
    assert Eta(steps_done=20).start_epoch(3, epochs=3, total_steps=10) == 0


def test_plain_progress_writes_a_line_every_n_seconds_mid_epoch() -> None:
    clock, stream = Clock(), io.StringIO()
    progress = PlainProgress(stream, every_s=30.0, eta=Eta(clock=clock))
    progress.start_epoch(2, epochs=3, total_steps=10)
    for step in range(1, 7):
        clock.now += 10
        progress.advance(1, loss=0.5 if step == 2 else None, samples_per_s=640.0)
    # Lines at 30 s and 60 s: 3 and 6 steps done at 10 s a step.
    assert stream.getvalue().splitlines() == [
        "step 3/10 (30%) in epoch 2/3  loss 0.5000  640 samples/s  ETA 1:10  run ETA 2:50",
        "step 6/10 (60%) in epoch 2/3  loss 0.5000  640 samples/s  ETA 0:40  run ETA 2:20",
    ]
    assert not ANSI.search(stream.getvalue())


def test_plain_progress_lines_by_steps_and_across_short_epochs() -> None:
    clock, stream = Clock(), io.StringIO()
    progress = PlainProgress(stream, every_s=None, every_steps=4, eta=Eta(clock=clock))
    progress.start_epoch(1, epochs=1, total_steps=10)
    for _ in range(10):
        progress.advance(1)
    assert [line.split("  ")[0] for line in stream.getvalue().splitlines()] == [
        "step 4/10 (40%) in epoch 1/1", "step 8/10 (80%) in epoch 1/1",
    ]  # fmt: skip
    # Epochs of 5 s each and a line every 12 s: the clock runs on across epochs.
    clock, stream = Clock(), io.StringIO()
    progress = PlainProgress(stream, every_s=12.0, eta=Eta(clock=clock))
    for epoch in (1, 2, 3):
        progress.start_epoch(epoch, epochs=3, total_steps=5)
        for _ in range(5):
            clock.now += 1
            progress.advance(1)
        progress.end_epoch(epoch, {"train/loss": 1.0})
    lines = stream.getvalue().splitlines()
    assert [line for line in lines if "ETA" in line] == [
        "step 2/5 (40%) in epoch 3/3  ETA 0:03  run ETA 0:03",
    ]
    assert len(lines) == 4  # and the three summary lines


def test_rich_bar_shows_the_epochs_and_the_runs_eta() -> None:
    clock, out = Clock(), io.StringIO()
    progress = RichProgress(Console(file=out, force_terminal=True, width=140), eta=Eta(clock=clock))
    progress.start_epoch(1, epochs=2, total_steps=4)
    clock.now += 3
    progress.advance(3, loss=0.25)
    progress.close()
    text = ANSI.sub("", out.getvalue())
    assert "ETA 0:01  run 0:05" in text  # 1 step left in this epoch, 5 in the run


def test_build_progress_passes_the_plain_settings_on() -> None:
    view = build_progress("plain", stream=io.StringIO(), every_s=5.0, every_steps=7, run_steps=9)
    assert isinstance(view, PlainProgress)
    assert (view.every_s, view.every_steps, view.eta.run_steps) == (5.0, 7, 9)


def test_a_plain_run_logs_progress_lines_from_the_config_keys(
    toy_classification, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    stoker.fit(
        stoker_mlp(), toy_classification, epochs=2, batch_size=64, max_steps=6,
        run_dir=tmp_path / "run", progress="plain", tensorboard=False,
        progress_every_steps=2, log_every_steps=1,
    )  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if "run ETA" in line]
    # 4 steps an epoch; max_steps=6 ends the run in epoch 2, which the run's ETA counts.
    assert [line.split("  ")[0] for line in lines] == [
        "step 2/4 (50%) in epoch 1/2", "step 4/4 (100%) in epoch 1/2",
        "step 2/4 (50%) in epoch 2/2",
    ]  # fmt: skip
    assert lines[-1].endswith("run ETA 0:00")


def stoker_mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
