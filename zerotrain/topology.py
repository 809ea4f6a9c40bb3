"""The rank grid and its process groups, built once and passed explicitly.

Nothing in zerotrain keeps a process group in a module global: every part that
communicates receives a :class:`Topology` (or the :class:`~zerotrain.comm.Comm`
built from one). Today the grid has a single data-parallel axis; tensor and
expert axes plug in here later with their own groups.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """The device this rank computes on: its CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_seconds: float = 1800.0) -> None:
    """Start torch.distributed if it is not running yet.

    Reads torchrun's environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
    without them this process is a world of one. NCCL on CUDA, gloo otherwise.
    """
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(default_device())
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    # A world of one: a private in-process store, no port to collide on.
    store = dist.HashStore()
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


@dataclass
class Topology:
    """Where this rank sits in the grid, and the groups it talks through.

    `dp_group` spans the ranks that hold replicas (or shards) of the same model
    state; ZeRO partitions across it.
    """

    rank: int
    world_size: int
    dp_group: Optional[dist.ProcessGroup]
    dp_rank: int
    dp_size: int
    device: torch.device
    timeout_seconds: float = 1800.0
    tp_size: int = 1
    ep_size: int = 1
    extra: dict = field(default_factory=dict)

    @classmethod
    def build(cls, timeout_seconds: float = 1800.0, device: Optional[torch.device] = None) -> "Topology":
        """The topology of the running job (starting torch.distributed when needed)."""
        init_distributed(timeout_seconds)
        rank, world = dist.get_rank(), dist.get_world_size()
        return cls(
            rank=rank,
            world_size=world,
            dp_group=dist.group.WORLD,
            dp_rank=rank,
            dp_size=world,
            device=device or default_device(),
            timeout_seconds=timeout_seconds,
        )

    def describe(self) -> dict:
        """The facts a checkpoint records about the layout that wrote it."""
        return {"world_size": self.world_size, "dp_size": self.dp_size, "tp_size": self.tp_size, "ep_size": self.ep_size}
