"""Turning a module into a stage-3 module: place, partition, and hook it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...comm import Comm
from ...sharding import ExpertGroups, ShardGroup, is_split_expert
from .fetch import ParamFetcher
from .hooks import Stage3Hooks
from .owner import Fence, ParamOwner
from .partition import PartitionedParam, ZeroParameter, partition_parameter, state_dict_placeholders


@dataclass
class Stage3Model:
    """The partitioned parameters of one module and the machinery that gathers them."""

    trainable: list[PartitionedParam]  # in reverse registration order (≈ backward order)
    frozen: list[PartitionedParam]
    fetcher: ParamFetcher
    owner: ParamOwner  # every part's: the fetcher, the engine's fence, the parameter store, the masters
    early_stores: list  # the parameter stores zero.Init wrote shards to (`build_param_store` adopts or empties them)
    hooks: Stage3Hooks = None
    param_store: object = None  # offload_param: where the non-persistent shards live (None: on the device)

    def all_parts(self) -> list[PartitionedParam]:
        return self.trainable + self.frozen

    def use_param_store(self, store) -> None:
        """Keep the offloaded shards in `store` (offload_param: every part whose shard is detached is in it);
        the parts reach it through their owner, gathers read ahead through the fetcher. Then gather the
        persistent parameters (their shards may have been in zero.Init's store until now)."""
        self.param_store = self.fetcher.param_store = self.owner.store = store
        for part in self.all_parts():  # persistent parameters are gathered once, in the same order everywhere
            if part.persistent:
                buffer = torch.empty(part.padded_numel, dtype=part.dtype, device=part.device)
                part.group.comm.all_gather(buffer, part.shard)
                part.bind(buffer)

    def use_masters(self, optimizer) -> None:
        """The trainable parts' fp32 masters are `optimizer`'s from now on (written back by GatheredParameters
        and in-place initializers)."""
        self.owner.use_masters(optimizer)

    def refresh_frozen(self) -> None:
        """Re-gather the gathered frozen parameters after their shards were written (a checkpoint load)."""
        with torch.no_grad():
            for part in self.frozen:  # same order on every rank
                if part.gathered:
                    self.fetcher.comm.all_gather(part.flat_param, part.device_shard())

    def device_param_bytes(self) -> int:
        """Parameter bytes on the device: shards not offloaded, plus every gathered full buffer."""
        parts = self.all_parts()
        held = sum(part.shard_numel * part.dtype.itemsize for part in parts if not part.offloaded)
        return held + sum(part.flat_param.numel() * part.flat_param.element_size() for part in parts if part.gathered)


def place_module(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move a module to `device` and cast its floating parameters to `dtype` (partitioned ones without gathering
    them). Buffers are moved, never cast: as DeepSpeed 0.19 (`_cast_module_mixed_precision` without a
    `buffer_dtype`), an fp32 buffer such as a rotary embedding's `inv_freq` stays fp32 under bf16/fp16."""
    for param in module.parameters():
        cast = dtype if param.is_floating_point() else param.dtype
        if isinstance(param, ZeroParameter):
            param._zero.to_(device, cast)
        else:
            param.data = param.data.to(device=device, dtype=cast)
    for buffer in module.buffers():
        buffer.data = buffer.data.to(device=device)


def partition_module(module: torch.nn.Module, comm: Comm, group_of: dict[int, int],
                     persistence_threshold: int, sequential: bool, prefetch_numel: int,
                     max_live_numel: int = 10**9, max_reuse_distance: int = 10**9,
                     experts: Optional[ExpertGroups] = None, fence: Optional[Fence] = None) -> Stage3Model:
    """Partition every parameter of `module` (those built under zero.Init already are) and build its fetcher.

    Every rank starts from rank 0's values. Parameters with at most
    `persistence_threshold` elements stay whole on every rank (still with a shard
    for the optimizer), as DeepSpeed's `stage3_param_persistence_threshold` does.
    Split experts (`experts`, zerotrain.parallel.experts) are partitioned over their
    expert-data-parallel group instead, starting from that group's rank 0's values.
    `fence` (the engine's checkpoint fence) is handed to every partitioned parameter, in its new owner;
    the engine then calls `use_param_store` (which gathers the persistent parameters) and `use_masters`.
    """
    trainable, frozen, early = [], [], {}
    for name, param in module.named_parameters():
        if is_split_expert(param):
            part = _partition_expert(name, param, experts, trainable=param.requires_grad and id(param) in group_of)
        elif isinstance(param, ZeroParameter):
            part = param._zero
            if part.store is not None:  # zero.Init's NVMe store holds its shard
                early[id(part.store)] = part.store
            part.names = [name]
            if part.partitions != comm.size:
                raise ValueError(f"parameter {name} was partitioned for {part.partitions} ranks, not {comm.size}")
            part.group = ShardGroup.over(comm, True)  # the engine's Comm from now on (zero.Init had its own)
        else:
            with torch.no_grad():
                comm.broadcast(param.data, src=0)
            part = partition_parameter(name, param, ShardGroup.over(comm, True))
        part.group_index = group_of.get(id(param), 0)
        part.persistent = part.numel <= persistence_threshold
        (trainable if param.requires_grad and id(param) in group_of else frozen).append(part)
    trainable.reverse()
    state_dict_placeholders(module)  # module.state_dict() never gathers (a rank-0-only save must not hang)
    for index, part in enumerate(trainable):
        part.index = index
    # one owner for every part from now on: the fetcher gathers them, writes to a shard wait on the engine's
    # fence (its pending snapshot copies); the store and masters follow (use_param_store, use_masters)
    fetcher = ParamFetcher(trainable + frozen, comm, sequential, prefetch_numel, max_live_numel, max_reuse_distance)
    owner = ParamOwner(fetcher, fence)
    for part in trainable + frozen:
        part.owner = owner
    return Stage3Model(trainable, frozen, fetcher, owner, list(early.values()))


def _partition_expert(name: str, param: torch.nn.Parameter, experts: Optional[ExpertGroups],
                      trainable: bool) -> PartitionedParam:
    """A split expert's PartitionedParam over its expert-data-parallel group (its ShardGroup, carrying the groups)."""
    if experts is None:
        raise ValueError(f"expert-parallel parameter {name!r} needs its ExpertGroups")
    if isinstance(param, ZeroParameter):
        raise NotImplementedError(f"expert-parallel parameter {name!r} was built under zero.Init; build the expert "
                                  f"layer outside it (initialize partitions it over its expert-data-parallel group)")
    if not trainable:
        raise NotImplementedError(f"frozen expert-parallel parameter {name!r} is not supported at ZeRO stage 3; "
                                  f"train it, or use stages 0-2")
    with torch.no_grad():
        experts.data.broadcast(param.data, src=0)
    return partition_parameter(name, param, ShardGroup.over(experts.data, True, experts))
