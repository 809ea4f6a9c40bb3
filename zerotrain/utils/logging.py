"""`logger` and `log_dist`: DeepSpeed's logging helpers (`deepspeed.utils.logging`), on Python's logging."""
from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

__all__ = ["logger", "log_dist"]

logger = logging.getLogger("zerotrain")


def log_dist(message: str, ranks: Optional[list[int]] = None, level: int = logging.INFO) -> None:
    """Log `message` on the global ranks listed (every rank for None or [-1]), prefixed with the rank."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")
