"""Assemble full fp32 weights from master shards, one bucket at a time, on one rank.

It joins what three parts hold: ZeRO's bucket shards (`zero`), tensor-parallel slices and split
experts (`parallel`); so it sits above both, and `zero` does not import `parallel`.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Callable, Optional, Sequence

import torch

from .comm import Comm
from .parallel import assemble_full_tensors, tensor_slice_of
from .parallel.experts import gather_expert_weights
from .zero.flat import FlatBucket


def gather_full_weights(buckets: list[FlatBucket], masters: list[torch.Tensor], comm: Comm,
                        dst: int = 0) -> dict[str, torch.Tensor]:
    """Full fp32 CPU tensors by parameter name on rank `dst`; an empty dict elsewhere.

    Only one bucket is ever assembled at a time, and only on `dst`, so no other
    rank holds more than its own shards.
    """
    full: dict[str, torch.Tensor] = {}
    for bucket, master in zip(buckets, masters):
        if bucket.group.expert:  # different experts on every rank: parallel.experts joins them
            continue
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


def full_state_dict(module: torch.nn.Module, buckets: list[FlatBucket], masters: list[torch.Tensor], comm: Comm,
                    tp_comm: Optional[Comm] = None, frozen: Sequence = (),
                    resident_masters: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                    trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """`engine.full_state_dict()`: full fp32 CPU weights under the model's parameter names, on rank 0 only.

    `buckets` and their `masters` (read inside `resident_masters()`: NVMe-offloaded masters are in files
    otherwise), stage 3's partitioned `frozen` parameters, the data-parallel `comm` and the
    tensor-parallel `tp_comm` (None without tensor parallelism).

    Data-parallel shards are gathered on data-parallel rank 0; with tensor parallelism the
    slices of its tensor-parallel group are then joined on tensor-parallel rank 0 (global
    rank 0), by the TensorSlice each split parameter carries; split experts are joined over their
    expert-data-parallel group, then over the first expert-parallel group by their `ep_slice` into
    whole `(num_experts, ...)` tensors (each expert taken from one replica). Tied parameters
    appear under every name; parameters outside any bucket (never trained) are copied as they are.
    `trainable_only`: only the parameters that require grad (a LoRA adapter, not its frozen base).
    """
    with resident_masters():
        full = gather_full_weights(buckets, masters, comm)
        full.update(gather_expert_weights(buckets, masters))
    if frozen and not trainable_only:
        full.update(gather_full_weights(list(frozen), [part.shard for part in frozen], comm))
    if comm.rank != 0:
        return {}
    first_name: dict[int, str] = {}
    slices = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if trainable_only and not param.requires_grad:
            continue
        first_name.setdefault(id(param), name)
        if tensor_slice_of(param) is not None:
            slices[name] = tensor_slice_of(param)
        if name not in full:
            source = full.get(first_name[id(param)])
            full[name] = source if source is not None else param.detach().float().cpu().clone()
    if tp_comm is not None:  # every rank here is data-parallel rank 0: one tensor-parallel group
        full = assemble_full_tensors(full, slices, tp_comm)
    return full
