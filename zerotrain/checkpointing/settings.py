"""What `zerotrain.checkpointing.configure` set, in one module-level object (as DeepSpeed keeps it: model code
calls `checkpoint` without an engine). Its own module so that `rng` reads the tensor-parallel rank without
importing the package that imports it."""
from __future__ import annotations

from typing import Optional

from ..comm import Comm
from .saved import ContiguousArena

__all__ = ["Settings", "fresh_stats", "settings"]


class Settings:
    """What `configure` set (module-level, as DeepSpeed's is: model code calls `checkpoint` without an engine)."""

    def __init__(self) -> None:
        self.configured = False
        self.tp: Optional[Comm] = None
        self.partition = False
        self.cpu = False
        self.contiguous = False
        self.number_checkpoints: Optional[int] = None
        self.synchronize = False
        self.profile = False
        self.arena: Optional[ContiguousArena] = None
        self.stats = fresh_stats()

    def tp_rank(self) -> int:
        return self.tp.rank if self.tp is not None else 0


def fresh_stats() -> dict:
    return {"forwards": 0, "recomputes": 0, "forward_seconds": 0.0, "recompute_seconds": 0.0,
            "input_bytes": 0, "kept_device_bytes": 0, "kept_host_bytes": 0}


settings = Settings()
