"""Where this process sits in a torchrun job, read from the environment torchrun sets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from stoker.errors import ConfigError


@dataclass(frozen=True)
class RankInfo:
    """This process's rank, local rank, the world size and how often torchrun restarted it.

    One process started without torchrun is rank 0 of a world of 1.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart_count: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, tracks and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when more than one process trains."""
        return self.world_size > 1

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankInfo:
        """Read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``TORCHELASTIC_RESTART_COUNT``."""
        values = {}
        for field, name, default in (
            ("rank", "RANK", 0),
            ("local_rank", "LOCAL_RANK", 0),
            ("world_size", "WORLD_SIZE", 1),
            ("restart_count", "TORCHELASTIC_RESTART_COUNT", 0),
        ):
            raw = environ.get(name)
            try:
                values[field] = default if raw in (None, "") else int(raw)
            except ValueError:
                raise ConfigError(
                    f"environment variable {name}={raw!r} is not an integer",
                    hint="launch with `stoker train --nproc N` or torchrun, which set it",
                ) from None
        info = cls(**values)
        if info.world_size < 1 or not 0 <= info.rank < info.world_size:
            raise ConfigError(
                f"RANK={info.rank} does not fit WORLD_SIZE={info.world_size}",
                hint="launch with `stoker train --nproc N` or torchrun, which set both",
            )
        return info
