"""The tuner's search: loader candidates, their space, and successive halving over them."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stoker.observe.stages import loader_overrides, worker_counts

__all__ = [
    "Candidate",
    "Halving",
    "Measure",
    "Trial",
    "halving_cost",
    "likeliest_first",
    "search_space",
    "successive_halving",
]


@dataclass(frozen=True)
class Candidate:
    """One combination of settings: the loader's, and the doctor's other changes.

    Attributes:
        num_workers: Worker processes.
        prefetch_factor: Batches each worker loads ahead (None: PyTorch's 2).
        persistent_workers: Keep workers alive between epochs.
        pin_memory: Pin batches (only meaningful with CUDA).
        per_sample: Force per-sample fetch although the dataset fetches whole batches.
        batch_size: Samples per batch (None: as configured).
        cache: ``data.cache`` (None: as configured).
        fused: ``optim.fused`` (None: as configured).
        threads: ``train.threads``, intra-op threads (None: as configured).
    """

    num_workers: int
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory: bool = False
    per_sample: bool = False
    batch_size: int | None = None
    cache: str | None = None
    fused: bool | None = None
    threads: int | None = None

    def label(self) -> str:
        """The settings in one line, as tune's table and log show a candidate."""
        parts = [f"workers={self.num_workers}"]
        if self.num_workers:
            parts.append(f"prefetch={self.prefetch_factor or 2}")
            parts.append(f"persistent={'on' if self.persistent_workers else 'off'}")
        parts.append(f"pin={'on' if self.pin_memory else 'off'}")
        parts.append("fetch=per-sample" if self.per_sample else "fetch=as-is")
        if self.batch_size is not None:
            parts.append(f"batch={self.batch_size}")
        parts.extend(f"{key}={_word(value)}" for key, value in self.settings().items())
        return " ".join(parts)

    def cost(self) -> tuple[Any, ...]:
        """Ordering among equally fast candidates: fewer processes and defaults first."""
        return (
            len(self.settings()),
            self.num_workers,
            self.persistent_workers,
            self.prefetch_factor or 2,
            self.pin_memory,
            self.per_sample,
            self.batch_size or 0,
        )

    def settings(self) -> dict[str, Any]:
        """The changes besides the loader's, as dotted config keys (``data.cache``,
        ``optim.fused``, ``train.threads``); empty for a loader-only candidate."""
        found = {"data.cache": self.cache, "optim.fused": self.fused, "train.threads": self.threads}
        return {key: value for key, value in found.items() if value is not None}

    def loader(self) -> Candidate:
        """The same loader settings, without the other changes."""
        return dataclasses.replace(self, cache=None, fused=None, threads=None)

    def overrides(self) -> dict[str, Any]:
        """Keyword overrides for ``build_train_loader``."""
        options = loader_overrides(
            self.num_workers,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=self.persistent_workers,
        )
        options["pin_memory"] = self.pin_memory
        if self.batch_size is not None:
            options["batch_size"] = self.batch_size
        return options


@dataclass(frozen=True)
class Trial:
    """One measurement of one candidate."""

    candidate: Candidate
    round: int
    seconds: float
    samples_per_s: float


@dataclass(frozen=True)
class Halving:
    """What successive halving measured and kept.

    Attributes:
        winner: The fastest candidate of the last round (the cheapest within ``tie``).
        trials: Every measurement, in order.
        abandoned: The round after which each dropped candidate was abandoned.
        spent_s: Seconds of measurement asked for (not counting start-up).
    """

    winner: Candidate
    trials: tuple[Trial, ...]
    abandoned: dict[Candidate, int]
    spent_s: float

    def last_trial(self, candidate: Candidate) -> Trial | None:
        """The latest measurement of ``candidate`` (None if it was never measured)."""
        found = [t for t in self.trials if t.candidate == candidate]
        return found[-1] if found else None

    def status(self, candidate: Candidate) -> str:
        """``winner``, ``kept`` or the round it was dropped after, for tune's table."""
        if candidate == self.winner:
            return "winner"
        if candidate in self.abandoned:
            return f"abandoned after round {self.abandoned[candidate] + 1}"
        return "kept"


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


Measure = Callable[[Candidate, float], float]


def successive_halving(
    candidates: Sequence[Candidate],
    measure: Measure,
    *,
    final_s: float,
    eta: int = 4,
    rounds: int = 3,
    min_share: float = 0.5,
    tie: float = 0.03,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Halving:
    """Measure every candidate briefly, keep the best, measure the survivors longer.

    Round ``r`` measures each live candidate for ``final_s / eta ** (rounds - 1 - r)``
    seconds. After a round only the best ``1/eta`` survive, and never one below
    ``min_share`` of the round's best (clearly bad settings stop costing time at once).

    Args:
        candidates: The search space (at least one).
        measure: ``measure(candidate, seconds) -> samples/s``.
        final_s: Seconds per candidate in the last round.
        eta: The share kept per round is ``1/eta``.
        rounds: The most rounds.
        min_share: Drop candidates slower than this share of the round's best.
        tie: Among the last round's candidates within this share of the best, the
            cheapest (fewest workers, defaults) wins.
        deadline_s: Wall-clock budget. After each round the later rounds' measurements
            are shortened (to no less than a tenth) when, at the per-measurement
            overhead seen so far (start-up, warm-up), they would not fit; a measurement
            that would end past it (at the round's time per measurement so far) is not
            started, and its candidate is dropped (so list the likeliest first).
        clock: The wall clock (a fake one in tests).
    """
    if not candidates:
        raise ValueError("successive_halving needs at least one candidate")
    alive = list(dict.fromkeys(candidates))
    trials: list[Trial] = []
    abandoned: dict[Candidate, int] = {}
    spent = 0.0
    rates: dict[Candidate, float] = {}
    started, scale = clock(), 1.0
    for round_index in range(rounds):
        seconds = scale * final_s / eta ** (rounds - 1 - round_index)
        rates = {}
        round_started = clock()
        for candidate in alive:
            if rates and deadline_s is not None:
                # What one measurement of this round took so far (start-up, warm-up and
                # shutdown included): one that would end past the deadline is not started.
                each = (clock() - round_started) / len(rates)
                if clock() - started + each > deadline_s:
                    abandoned[candidate] = round_index  # out of time: not measured this round
                    continue
            rates[candidate] = measure(candidate, seconds)
            spent += seconds
            trials.append(Trial(candidate, round_index, seconds, rates[candidate]))
        alive = [c for c in alive if c in rates]
        if round_index == rounds - 1 or len(alive) == 1:
            break
        best = max(rates.values())
        ranked = sorted(alive, key=lambda c: (-rates[c], c.cost()))
        keep = _survivors(len(alive), eta)
        survivors = [c for c in ranked[:keep] if rates[c] >= min_share * best] or ranked[:1]
        for candidate in alive:
            if candidate not in survivors:
                abandoned[candidate] = round_index
        alive = survivors
        if len(alive) == 1:
            break
        if deadline_s is not None:
            scale = _fit(
                deadline_s,
                elapsed=clock() - started,
                spent=spent,
                measured=len(trials),
                later=_later_rounds(len(alive), round_index + 1, final_s, eta=eta, rounds=rounds),
            )
    best = max(rates[c] for c in alive)
    close = [c for c in alive if rates[c] >= (1 - tie) * best]
    winner = min(close, key=lambda c: c.cost())
    return Halving(winner=winner, trials=tuple(trials), abandoned=abandoned, spent_s=spent)


def _survivors(count: int, eta: int) -> int:
    """How many of ``count`` candidates survive a round: ``count / eta``, rounded, at least 1."""
    return max(1, math.floor(count / eta + 0.5))


def _later_rounds(
    alive: int, first: int, final_s: float, *, eta: int, rounds: int
) -> list[tuple[int, float]]:
    """``(candidates, seconds each)`` of the rounds from ``first`` on (at most)."""
    later = []
    for round_index in range(first, rounds):
        later.append((alive, final_s / eta ** (rounds - 1 - round_index)))
        alive = _survivors(alive, eta)
        if alive == 1:  # a lone survivor is the winner: nothing left to compare
            break
    return later


def _fit(
    deadline_s: float,
    *,
    elapsed: float,
    spent: float,
    measured: int,
    later: list[tuple[int, float]],
) -> float:
    """The factor (0.1 to 1) that fits the later rounds into what is left of the deadline."""
    overhead = max(0.0, elapsed - spent) / max(measured, 1)
    need = sum(count * seconds for count, seconds in later)
    room = deadline_s - elapsed - overhead * sum(count for count, _ in later)
    if need <= 0:
        return 1.0
    return min(1.0, max(0.1, room / need))


def likeliest_first(space: Sequence[Candidate], workers: int) -> list[Candidate]:
    """``space`` with the baseline first, then ``workers`` (default knobs, then
    persistent), then each group of equal knobs with its worker counts nearest
    ``workers`` first: a deadline drops the last, and a tight budget measures only a few.
    """
    if not space:
        return []
    baseline, rest = space[0], list(space[1:])
    pin = baseline.pin_memory
    front = [Candidate(workers, None, False, pin), Candidate(workers, None, True, pin)]
    groups: dict[tuple[Any, ...], list[Candidate]] = {}
    for candidate in rest:
        knobs = dataclasses.replace(candidate, num_workers=0)
        groups.setdefault(dataclasses.astuple(knobs), []).append(candidate)

    def distance(candidate: Candidate) -> float:
        return abs(math.log2((candidate.num_workers + 1) / (workers + 1)))

    ordered = [c for group in groups.values() for c in sorted(group, key=distance)]
    if not any(c.num_workers for c in ordered):
        front = []  # workers are not searched (in-memory arrays)
    return list(dict.fromkeys([baseline, *front, *ordered]))


def halving_cost(count: int, *, eta: int = 4, rounds: int = 3) -> float:
    """Seconds of measurement successive halving asks for at most, in units of ``final_s``."""
    return sum(n * seconds for n, seconds in _later_rounds(count, 0, 1.0, eta=eta, rounds=rounds))


# --- the search space and the real measurement -----------------------------------------


def search_space(
    *,
    cores: int,
    baseline: Candidate,
    cuda: bool,
    batched: bool,
    batch_sizes: Sequence[int] = (),
    max_workers: int = 16,
    cpu_share: float | None = None,
) -> list[Candidate]:
    """Every combination the tuner tries, the baseline (current settings) included.

    Args:
        cores: Usable CPU cores (worker counts go up to ``cores + 1``).
        baseline: The configured settings.
        cuda: Whether pinning matters (training on CUDA).
        batched: Whether the dataset fetches whole batches (per-sample is then tried too).
        batch_sizes: Batch sizes to try besides the configured one.
        max_workers: Cap of the worker counts (besides the configured one).
        cpu_share: The fetch's CPU share: below one half, worker counts go past the cores.
    """
    workers = worker_counts(cores, baseline.num_workers, cap=max_workers, cpu_share=cpu_share)
    prefetches = sorted({None, 4, baseline.prefetch_factor}, key=lambda p: p or 2)
    pins = (False, True) if cuda else (baseline.pin_memory,)
    fetches = (False, True) if batched else (False,)
    sizes: Sequence[int | None] = (None, *batch_sizes)
    space = [baseline]
    knobs = [(p, persist) for p in prefetches for persist in (False, True)]
    # Worker counts first, at the default knobs: under a tight budget they are the lever
    # that matters most, and the last candidates are the ones a deadline drops.
    for (prefetch, persist), pin, per_sample, size, count in (
        (k, pin, f, s, w)
        for k in knobs
        for pin in pins
        for f in fetches
        for s in sizes
        for w in workers
    ):
        if count == 0:
            prefetch, persist = None, False
        space.append(Candidate(count, prefetch, persist, pin, per_sample, size))
    return list(dict.fromkeys(space))
