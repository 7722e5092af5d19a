"""Fault injection: a full disk (ENOSPC) at every point of a save changes nothing on disk."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest_valid, load_checkpoint
from stoker.errors import CheckpointError, StokerError
from stoker.observe.report import write_report


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for folders)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def fail_on_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``n``-th call (from 1) raises ENOSPC."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise no_space()
        return real(*args, **kwargs)

    return wrapper


@pytest.fixture
def checkpointer(tmp_path: Path) -> Any:
    """keep_last=2 after four saves: steps 3 and 4, the best step 1, both pointers."""
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step, loss in [(1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)]:
        ckpt.save(
            {"step": step, "w": torch.full((256,), float(step))},
            epoch=step,
            step=step,
            metrics={"val/loss": loss},
        )
    yield ckpt
    ckpt.close()


def new_best(ckpt: Checkpointer) -> Path:
    # A new best: the save writes the folder, last.json and best.json, and then rotates.
    return ckpt.save(
        {"step": 5, "w": torch.full((256,), 5.0)}, epoch=5, step=5, metrics={"val/loss": 0.01}
    )


def assert_nothing_changed(
    directory: Path, before: dict[str, bytes | None], ckpt: Checkpointer
) -> None:
    assert snapshot(directory) == before
    assert ckpt.best_value == 0.1
    assert ckpt.state_dict()["best_checkpoint"] == "step-00000001"
    assert find_latest_valid(directory) == (directory / "step-00000004", [])


@pytest.mark.parametrize("target", ["fsync", "replace", "rename"])
def test_enospc_at_every_call_of_a_save_leaves_everything_as_it_was(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """Fails the n-th ``os.<target>`` call of a save, for n = 1, 2, ... until one succeeds."""
    before = snapshot(tmp_path)
    real = getattr(os, target)
    failures = 0
    for n in range(1, 50):
        monkeypatch.setattr(os, target, fail_on_call(n, real))
        try:
            saved = new_best(checkpointer)
        except CheckpointError as exc:
            monkeypatch.setattr(os, target, real)
            failures += 1
            assert "No space left on device (ENOSPC)" in exc.message, exc
            assert str(tmp_path / "step-00000005") in exc.message
            assert exc.hint is not None and "keep_last" in exc.hint
            assert_nothing_changed(tmp_path, before, checkpointer)
            continue
        monkeypatch.setattr(os, target, real)
        break
    else:
        pytest.fail("the save never succeeded")

    # Every fsync point (state, manifest, folder, marker, both pointers, the folder of the
    # checkpoints), every pointer replace and the folder rename were hit once.
    assert failures >= {"fsync": 8, "replace": 2, "rename": 1}[target]
    assert saved == tmp_path / "step-00000005"
    assert find_latest_valid(tmp_path) == (saved, [])
    assert checkpointer.last_path == checkpointer.best_path == saved
    assert load_checkpoint(tmp_path / "best.json")["step"] == 5
    kept = ["step-00000004", "step-00000005"]
    if target == "rename":
        # The call after the commit's rename is rotation's: it failed, with a warning only.
        kept.insert(0, "step-00000003")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == kept


def test_enospc_while_torch_writes_the_state(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(tmp_path)

    def write_half_then_fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"\0" * 4096)
        raise no_space()

    monkeypatch.setattr(torch, "save", write_half_then_fail)
    with pytest.raises(CheckpointError, match="No space left on device"):
        new_best(checkpointer)
    monkeypatch.undo()

    assert_nothing_changed(tmp_path, before, checkpointer)


@pytest.mark.skipif(not hasattr(errno, "EDQUOT"), reason="no EDQUOT on this platform")
def test_a_spent_quota_is_named_with_the_bytes_needed(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(tmp_path)

    def quota_spent(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"\0" * 4096)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(torch, "save", quota_spent)
    with pytest.raises(CheckpointError) as info:
        new_best(checkpointer)
    monkeypatch.undo()
    message = info.value.message
    assert "disk quota exceeded" in message and "(EDQUOT)" in message, message
    # The state's 1 KiB tensor and its few entries: about 1.1-1.5 KiB with the metadata.
    needed = re.search(r"the write needs about ([0-9.]+) KiB", message)
    assert needed is not None and 1.0 < float(needed[1]) < 2.0, message
    assert "free on the disk" in message
    assert info.value.hint is not None and "in your quota" in info.value.hint
    assert "keep_last" in info.value.hint
    assert_nothing_changed(tmp_path, before, checkpointer)


def test_enospc_creating_the_folder(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "mkdir", fail_on_call(1, os.mkdir))

    with pytest.raises(CheckpointError, match="No space left on device"):
        new_best(checkpointer)
    monkeypatch.undo()

    assert_nothing_changed(tmp_path, before, checkpointer)


def test_a_state_that_cannot_be_pickled_changes_nothing(
    tmp_path: Path, checkpointer: Checkpointer
) -> None:
    before = snapshot(tmp_path)

    with pytest.raises(CheckpointError, match="Could not write checkpoint") as info:
        checkpointer.save({"fn": lambda x: x}, epoch=5, step=5, metrics={"val/loss": 0.01})

    assert info.value.hint is not None and "plain data" in info.value.hint
    assert_nothing_changed(tmp_path, before, checkpointer)


def test_a_failed_rotation_is_a_warning_not_a_failed_save(
    tmp_path: Path,
    checkpointer: Checkpointer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    # The first os.rename is the commit of the new folder; the next ones are rotation's.
    monkeypatch.setattr(os, "rename", fail_on_call(2, os.rename))
    monkeypatch.setattr("shutil.rmtree", refuse)
    saved = new_best(checkpointer)
    monkeypatch.undo()

    assert find_latest_valid(tmp_path) == (saved, [])
    assert "could not delete old checkpoint" in caplog.text


# --- a real small disk: a tmpfs mounted for the test (root on Linux; skipped elsewhere) ---


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 512 KiB tmpfs at ``tmp_path/disk``, unmounted afterwards."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"this machine does not allow mounting a tmpfs: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_real_full_disk_is_named_with_the_bytes_needed(small_disk: Path) -> None:
    ckpt = Checkpointer(small_disk / "checkpoints", keep_last=3)
    first = ckpt.save({"w": torch.zeros(16 * 1024)}, epoch=1, step=1, metrics={"val/loss": 1.0})
    # 2 MiB of floats on a 512 KiB disk: torch.save fails mid-write ("unexpected pos").
    with pytest.raises(CheckpointError) as info:
        ckpt.save({"w": torch.zeros(512 * 1024)}, epoch=2, step=2, metrics={"val/loss": 0.5})
    error = info.value
    assert "disk full: No space left on device (ENOSPC)" in error.message, error
    assert "needs about 2.0 MiB" in error.message and "free on the disk" in error.message
    assert "unexpected pos" not in str(error) and "plain data" not in str(error)
    assert error.hint is not None and "keep_last" in error.hint
    assert find_latest_valid(small_disk / "checkpoints") == (first, [])
    assert not list((small_disk / "checkpoints").glob(".tmp-*"))
    ckpt.close()


def test_a_read_only_disk_is_named_with_the_fix(
    small_disk: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real read-only file system, met when the run starts...
    (small_disk / "checkpoints").mkdir()
    remount = ["mount", "-o", "remount,ro", str(small_disk)]
    assert subprocess.run(remount, capture_output=True).returncode == 0
    with pytest.raises(CheckpointError) as info:
        Checkpointer(small_disk / "checkpoints")
    assert "read-only file system" in info.value.message, info.value
    assert info.value.hint is not None and "remount it read-write" in info.value.hint
    # ... and one that turns read-only during a save (the kernel does so after disk errors;
    # a tmpfs cannot be remounted so while the run's lock file is open for writing).
    refuse = OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(os, "mkdir", lambda *a, **k: (_ for _ in ()).throw(refuse))
    with pytest.raises(CheckpointError) as info:
        new_best(checkpointer)
    assert "read-only file system: Read-only file system (EROFS)" in info.value.message
    assert info.value.hint is not None and "remount it read-write" in info.value.hint


def test_a_report_on_a_full_disk_names_only_options_that_exist(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: full\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n')
    with contextlib.suppress(OSError), open(small_disk / "filler", "wb") as filler:
        while True:
            filler.write(b"\0" * 65536)
    with pytest.raises(StokerError) as info:
        write_report(run_dir)
    text = str(info.value)
    assert "disk full" in text and "free space on the disk" in text
    # `stoker train` has no --out; the fix names the command that has one.
    assert f"stoker report {run_dir} --out FILE" in text
    assert not (run_dir / "report.html").exists()
