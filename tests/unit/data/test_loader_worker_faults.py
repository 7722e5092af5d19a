"""The messages of loader faults, from synthetic inputs (no worker processes; see tests/faults)."""

from __future__ import annotations

import pickle
import signal

import pytest
import torch
from torch.utils.data import Dataset, Subset

from stoker import build_loader
from stoker.data.records import BadRecordError
from stoker.data.sources import ArrayDataset
from stoker.data.worker_faults import (
    NamedFetch,
    SampleError,
    death_error,
    describe_dataset,
    hang_error,
    worker_error,
)
from stoker.errors import ConfigError, DataError

# What faulthandler writes for a worker blocked in a dataset, and for an idle one.
BUSY_DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 327 in wait
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 231 in _feed

Current thread 0x00007f0000000001 (most recent call first):
  File "/srv/project/my_data.py", line 42 in read_record
  File "/srv/project/my_data.py", line 30 in __getitem__
  File "/srv/venv/site-packages/stoker/data/worker_faults.py", line 190 in __getitems__
  File "/srv/venv/site-packages/torch/utils/data/_utils/fetch.py", line 52 in fetch
  File "/srv/venv/site-packages/torch/utils/data/_utils/worker.py", line 349 in _worker_loop
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""
IDLE_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 440 in _poll
  File "/usr/lib/python3.11/multiprocessing/queues.py", line 113 in get
  File "/srv/venv/site-packages/torch/utils/data/_utils/worker.py", line 334 in _worker_loop
  File "/usr/lib/python3.11/multiprocessing/process.py", line 108 in run
"""


class Rows(Dataset):
    def __init__(self, broken: int = -1) -> None:
        self.broken = broken
        self.paths = ["shard-0.bin", "shard-1.bin", "shard-2.bin"]
        self.tag = "rows"

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.broken:
            raise KeyError("label")
        return torch.tensor(index)


def test_dataset_is_named_with_what_it_reads() -> None:
    assert describe_dataset(Rows()) == "Rows (shard-0.bin and 2 more)"
    assert describe_dataset(Subset(Rows(), [1, 2])) == "Subset of Rows (shard-0.bin and 2 more)"
    assert describe_dataset(ArrayDataset(torch.zeros(3))) == "ArrayDataset"


def test_named_fetch_names_the_failing_sample_and_keeps_the_dataset_visible() -> None:
    fetch = NamedFetch(Rows(broken=3), batched=False)
    assert [int(t) for t in fetch.__getitems__([0, 1])] == [0, 1]
    with pytest.raises(SampleError) as caught:
        fetch.__getitems__([2, 3, 4])
    assert caught.value.message.startswith(
        "sample 3 of Rows (shard-0.bin and 2 more) failed in the training process: "
        "KeyError: 'label' (raised at "
    )
    assert isinstance(caught.value.__cause__, KeyError)
    # get_worker_info().dataset is the wrapper: the dataset's attributes show through,
    # and it survives the trip to a worker.
    assert fetch.tag == "rows"
    assert pickle.loads(pickle.dumps(fetch)).tag == "rows"


def test_stoker_errors_pass_through_unwrapped() -> None:
    class Bad(Rows):
        def __getitem__(self, index: int) -> torch.Tensor:
            raise DataError("already for people", hint="do this")

    with pytest.raises(DataError) as caught:
        NamedFetch(Bad(), batched=False).__getitems__([0])
    assert type(caught.value) is DataError and caught.value.message == "already for people"


def test_direct_path_names_the_batch() -> None:
    class Broken(ArrayDataset):
        def __getitems__(self, indices):
            raise RuntimeError("disk read failed")

    loader = build_loader(Broken(torch.arange(10)), batch_size=4)
    with pytest.raises(SampleError, match=r"^the batch of 4 samples \[0, 1, 2, 3\] of Broken"):
        list(loader)


def test_a_worker_exception_is_rebuilt_from_pytorchs_text() -> None:
    text = (
        "Caught KeyError in DataLoader worker process 1.\n"
        "Original Traceback (most recent call last):\n"
        '  File "/srv/venv/torch/utils/data/_utils/worker.py", line 349, in _worker_loop\n'
        '  File "/srv/project/stream.py", line 17, in __iter__\n'
        "    raise KeyError('label')\n"
        "KeyError: 'label'\n"
    )
    error = worker_error(KeyError(text), Rows())
    assert type(error) is DataError
    assert error.message.startswith(
        "loader worker 1 raised KeyError: 'label' (raised at /srv/project/stream.py:17, "
        "in __iter__), loading from Rows"
    )


def test_a_stoker_error_from_a_worker_keeps_its_type() -> None:
    text = (
        "Caught BadRecordError in DataLoader worker process 0.\n"
        "Original Traceback (most recent call last):\n"
        '  File "/srv/project/x.py", line 1, in f\n'
        "stoker.data.records.BadRecordError: bad record in a.jsonl, line 3: not JSON\n"
        "  fix: set data.bad_records=skip\n"
    )
    error = worker_error(RuntimeError(text), Rows())
    assert isinstance(error, BadRecordError)
    assert error.message == "bad record in a.jsonl, line 3: not JSON (in loader worker 0)"
    assert error.hint == "set data.bad_records=skip"


def test_an_error_that_is_no_worker_fault_is_left_alone() -> None:
    error = ValueError("nothing to do with workers")
    assert worker_error(error, Rows()) is error


@pytest.mark.parametrize(
    ("exitcode", "expected", "hint"),
    [
        (-signal.SIGKILL, "was killed by signal SIGKILL: SIGKILL is what the kernel's", "dmesg"),
        (-signal.SIGSEGV, "was killed by signal SIGSEGV: native code", "loader.num_workers=0"),
        (-signal.SIGTERM, "was killed by signal SIGTERM: another process stopped it", "signals"),
        (-signal.SIGBUS, "was killed by signal SIGBUS: most likely /dev/shm is too small", "shm"),
        (0, "exited with code 0: the dataset or a library", "loader.num_workers=0"),
        (2, "exited with code 2: the dataset or a library", "loader.num_workers=0"),
    ],
)
def test_death_names_worker_cause_and_fix(exitcode: int, expected: str, hint: str) -> None:
    error = death_error([(1, 4242, exitcode)], BUSY_DUMP)
    assert error.message.startswith(f"loader worker 1 (pid 4242) {expected}")
    assert hint in error.hint
    # The stack shows the user's frames, not PyTorch's or stoker's machinery.
    assert 'File "/srv/project/my_data.py", line 42, in read_record' in error.message
    assert "fetch.py" not in error.message and "worker_faults.py" not in error.message


def test_hang_shows_the_blocked_frames_or_says_the_worker_is_idle() -> None:
    busy = hang_error("loader worker 0 (pid 7)", timeout_s=300, dump=BUSY_DUMP)
    assert busy.message.startswith(
        "loader worker 0 (pid 7) did not deliver a batch for 300 s (loader.timeout_s); "
        "it is stuck here (most recent call first):\n"
        '    File "/srv/project/my_data.py", line 42, in read_record\n'
        '    File "/srv/project/my_data.py", line 30, in __getitem__'
    )
    assert "_feed" not in busy.message  # another thread's stack is noise
    idle = hang_error("loader worker 0 (pid 7)", timeout_s=300, dump=IDLE_DUMP)
    assert "yet it is idle" in idle.message and "cannot be pickled" in idle.message
    blind = hang_error("loader worker 0 (pid 7)", timeout_s=300, dump="")
    assert "(its stack could not be read)" in blind.message


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "soon", True])
def test_timeout_must_be_seconds(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"loader\.timeout_s must be a number of seconds"):
        build_loader(Rows(), batch_size=2, timeout_s=bad)  # type: ignore[arg-type]


def test_timeout_zero_turns_the_limit_off() -> None:
    loader = build_loader(Rows(), batch_size=2, num_workers=1, timeout_s=0)
    assert loader.timeout_s == 0 and loader.dataloader.timeout > 0  # still polls
    assert [int(t) for batch in loader for t in batch] == list(range(10))
