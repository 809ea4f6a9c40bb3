"""`logger` and `log_dist`: DeepSpeed's logging helpers (`deepspeed.utils.logging`), on Python's logging."""
from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("zerotrain")


def log_dist(message: str, ranks: Optional[list[int]] = None, level: int = logging.INFO) -> None:
    """Log `message` prefixed with the global rank, where DeepSpeed's `log_dist` (`get_dist_msg`) would: always
    before the process group is up (as rank -1), afterwards only on the ranks listed (`[-1]` first: every rank;
    None or []: none)."""
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else -1
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")
