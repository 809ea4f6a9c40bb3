"""Assemble full fp32 weights from master shards, one bucket at a time, on one rank."""
from __future__ import annotations

import torch

from ..comm import Comm
from .flat import FlatBucket


def gather_full_weights(buckets: list[FlatBucket], masters: list[torch.Tensor], comm: Comm,
                        dst: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 CPU tensors by parameter name on rank `dst`; an empty dict elsewhere.

    Only one bucket is ever assembled at a time, and only on `dst`, so no other
    rank holds more than its own shards.
    """
    full: dict[str, torch.Tensor] = {}
    for bucket, master in zip(buckets, masters):
        shard = master.detach().to(device=bucket.device, dtype=torch.float32)  # host (offloaded) masters too
        if bucket.partitions > 1:
            pieces = comm.gather_to(shard.contiguous(), dst)
            if comm.rank != dst:
                continue
            flat = torch.cat([piece.cpu() for piece in pieces])
        else:
            if comm.rank != dst:
                continue
            flat = shard.cpu()
        for name, tensor in bucket.unflatten(flat).items():
            full[name] = tensor.clone()
    return full
