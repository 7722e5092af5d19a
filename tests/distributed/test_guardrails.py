"""What would hang a DDP job is an error instead, on every rank, naming the rank."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.distributed


def test_data_split_by_the_user_is_refused_as_double_sharding(write_config, run_stoker, tmp_path):
    config = write_config(dataset="rank_sliced")
    result = run_stoker("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    for rank in (0, 1):
        assert f"[rank {rank}] the ranks hold different training data" in result.stderr
    assert "rank 0: 160 samples" in result.stderr and "rank 1: 160 samples" in result.stderr
    assert "split twice" in result.stderr


def test_a_rank_that_runs_out_of_batches_is_named(write_config, run_stoker, tmp_path):
    config = write_config(dataset="uneven_stream", train={"epochs": 1})
    result = run_stoker("train", str(config), "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    message = "uneven data across ranks in epoch 1: rank(s) 0 ran out after 2 batches"
    assert f"[rank 0] {message}" in result.stderr
    assert f"[rank 1] {message}" in result.stderr


def test_a_hung_rank_is_named_on_every_rank_within_the_timeout(write_config, run_stoker, tmp_path):
    config = write_config(distributed={"timeout_s": 3})
    started = time.monotonic()
    result = run_stoker(
        "train",
        str(config),
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        env={"CASE_RANK": "1", "CASE_HANG_AT_SAMPLE": "70"},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    # The hung rank says so and shows where it is stuck.
    assert "rank 1 made no progress for 13 s (waiting for epoch 1, batch " in result.stderr
    assert "in _maybe_fail" in result.stderr and "case.py" in result.stderr
    # The rank left waiting names it.
    assert "[rank 0] rank 0: a collective at batch " in result.stderr
    assert "of epoch 1 failed: rank(s) 1 did not answer" in result.stderr
    assert "rank 1 exited with code 1" in result.stderr or "rank 1 (pid" in result.stderr
    assert "rank 0 made no progress" not in result.stderr
    # Ended, not waiting out torch's 30-minute collective timeout: the bound is loose
    # because two ranks starting on a busy 2-core machine took 65 s once.
    assert elapsed < 150


def test_a_killed_rank_is_named_with_its_signal(write_config, run_stoker, tmp_path):
    config = write_config()
    result = run_stoker(
        "train",
        str(config),
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        env={"CASE_RANK": "1", "CASE_KILL_AT_SAMPLE": "70", "CASE_KILL_ALWAYS": "1"},
    )
    assert result.returncode == 1
    assert "distributed run failed: rank 1 (pid" in result.stderr
    assert "was killed by SIGKILL first; then rank 0 exited with code 1" in result.stderr
    assert "[rank 0] rank 0: a collective at batch" in result.stderr
    assert "rank(s) 1 did not answer" in result.stderr
