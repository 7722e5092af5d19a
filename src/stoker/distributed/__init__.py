"""Training on several processes under torchrun: the process group, DDP/FSDP wrapping,
rank-aware data views and the guardrails that turn hangs into errors."""

from stoker.distributed.env import RankInfo
from stoker.distributed.runtime import Distributed, distributed_run

__all__ = ["Distributed", "RankInfo", "distributed_run"]
