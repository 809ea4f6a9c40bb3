"""Expert parallelism through the ZeRO engine (stages 0-2), experts split over all data-parallel ranks.

An expert weight (`ep_slice` set, local shape smaller than the full one) holds different experts
on every rank, so the engine must neither average nor shard it: after backward its gradient
already holds every rank's tokens routed to those experts. Such parameters go into buckets of
their own, flagged `expert_local` (one partition, never reduced across ranks; the reducer only
divides them by the data-parallel size, since the loss is the mean of the ranks' losses). The
gradient norm sums their squares over all ranks (distinct elements everywhere), and
`full_state_dict` assembles whole `(num_experts, ...)` tensors by each rank's `ep_slice`.

Supported: ZeRO stages 0, 1, 2 with the expert-parallel group equal to the data-parallel group
and no tensor parallelism. Everything else is refused up front with a NotImplementedError.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..comm import Comm
from .gather import assemble_full_tensors
from .slices import TensorSlice

__all__ = ["expert_slice_of", "is_split_expert", "check_expert_parallel", "build_buckets_with_experts",
           "gather_expert_weights"]


def expert_slice_of(param: torch.Tensor) -> Optional[TensorSlice]:
    """The TensorSlice an expert-parallel parameter carries, or None."""
    return getattr(param, "ep_slice", None)


def is_split_expert(param: torch.Tensor) -> bool:
    """True for an expert weight of which this rank holds only some experts."""
    expert_slice = expert_slice_of(param)
    return expert_slice is not None and expert_slice.local_shape != expert_slice.full_shape


def check_expert_parallel(model: torch.nn.Module, config, topology) -> bool:
    """Whether `model` has experts split over ranks; raises NotImplementedError, naming what is not
    supported, when they are combined with something the engine cannot train them with yet."""
    split = [(name, param) for name, param in model.named_parameters() if is_split_expert(param)]
    if not split:
        return False
    names = [name for name, _ in split[:4]]
    what = f"expert-parallel parameters {names} (experts split over ranks)"
    zero = config.zero_optimization
    if zero.stage == 3:
        raise NotImplementedError(f"{what} are not supported with ZeRO stage 3 yet (stages 0, 1, 2 are)")
    offload = zero.offload_optimizer
    if offload is not None and offload.device in ("cpu", "nvme"):
        raise NotImplementedError(f"{what} are not supported with zero_optimization.offload_optimizer "
                                  f"(device {offload.device!r}) yet")
    if zero.zero_quantized_gradients:
        raise NotImplementedError(f"{what} are not supported with zero_optimization.zero_quantized_gradients "
                                  f"(ZeRO++ qgZ) yet")
    if getattr(topology, "tp_size", 1) > 1:
        raise NotImplementedError(f"{what} are not supported together with tensor parallelism "
                                  f"(tp_size={topology.tp_size}) yet")
    for name, param in split:
        expert_slice = expert_slice_of(param)
        ep_size = expert_slice.full_shape[expert_slice.dim] // expert_slice.local_shape[expert_slice.dim]
        if ep_size != topology.dp_size:
            raise NotImplementedError(f"expert-parallel parameter {name!r} is split over {ep_size} ranks but there "
                                      f"are {topology.dp_size} data-parallel ranks: expert-parallel groups smaller "
                                      f"than the data-parallel group are not supported yet")
    return True


def build_buckets_with_experts(named_params: Iterable[tuple[str, torch.nn.Parameter]], group_of: dict[int, int],
                               bucket_numel: int, partitions: int, rank: int) -> list:
    """`zero.flat.build_buckets`, with split expert parameters in buckets of their own after the others:
    one partition each (every rank keeps its whole experts) and flagged `expert_local`."""
    from ..zero.flat import build_buckets

    named = list(named_params)
    shared = [(name, p) for name, p in named if not is_split_expert(p)]
    experts = [(name, p) for name, p in named if is_split_expert(p)]
    buckets = build_buckets(shared, group_of, bucket_numel, partitions, rank)
    for bucket in build_buckets(experts, group_of, bucket_numel, 1, 0):
        bucket.index = len(buckets)
        bucket.expert_local = True
        buckets.append(bucket)
    return buckets


def gather_expert_weights(buckets: list, masters: list[torch.Tensor], comm: Comm) -> dict[str, torch.Tensor]:
    """Whole fp32 CPU expert tensors `(num_experts, ...)` on rank 0 (an empty dict elsewhere), joined
    from every rank's experts by the `ep_slice` each rank's parameters carry. Call on every rank."""
    local: dict[str, torch.Tensor] = {}
    slices: dict[str, TensorSlice] = {}
    for bucket, master in zip(buckets, masters):
        if not getattr(bucket, "expert_local", False):
            continue
        flat = master.detach().to(device=bucket.device, dtype=torch.float32)  # gathered on the training device
        for position, (name, param) in enumerate(zip(bucket.names, bucket.params)):
            local[name] = bucket.param_view(position, flat).clone()
            slices[name] = expert_slice_of(param)
    if not local:
        return {}
    return assemble_full_tensors(local, slices, comm)
