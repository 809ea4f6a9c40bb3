"""What a partitioned parameter reaches beyond itself, in one object: its owner.

A `PartitionedParam` keeps its layout and (unless offloaded) its shard; everything else it needs comes
from the one `ParamOwner` its builder hands it: who gathers it (`fetcher`: the engine's `ParamFetcher`,
None before an engine adopted it), what a writer of its shard or master waits on first (`fence`: the
engine's pending asynchronous checkpoint copies), where its shard lives while offloaded (`store`: the
`offload_param` store), and its fp32 master (`masters`: the engine's master optimizer, once built).

Who builds it: `zero.Init` (one owner with its NVMe store, for the parameters it partitions),
`partition_parameter` alone (an empty owner), and the engine (`zero.stage3.setup.partition_module`, then
`Stage3Model.use_param_store` and `use_masters`): the builder fills its owner and hands it to the parts,
so no part sets a pointer on another (a store, an optimizer) and the parameter carries exactly one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

import torch

if TYPE_CHECKING:  # types only: fetch and partition import this module
    from ..interfaces import MasterOptimizer, ParamStore
    from .fetch import ParamFetcher

__all__ = ["Fence", "ParamOwner"]


class Fence(Protocol):
    """What a writer of shards or masters waits on first: the engine's fence for its pending asynchronous
    checkpoint snapshot copies (`zerotrain.checkpoint.fence.SnapshotFences`, handed in by the engine)."""

    def wait(self) -> None: ...


class ParamOwner:
    """The fetcher, fence, parameter store and masters of a set of partitioned parameters (module docstring)."""

    def __init__(self, fetcher: Optional["ParamFetcher"] = None, fence: Optional[Fence] = None,
                 store: Optional["ParamStore"] = None) -> None:
        self.fetcher = fetcher
        self.fence = fence
        self.store = store  # holds the shard of every part of this owner whose shard is offloaded
        self._masters: Optional["MasterOptimizer"] = None
        self._index: dict[int, int] = {}  # id(part) -> its bucket index in the master optimizer

    def use_masters(self, optimizer: "MasterOptimizer") -> None:
        """From now on the parts' fp32 masters are `optimizer`'s (its buckets are the trainable parts)."""
        self._masters = optimizer
        self._index = {id(bucket): index for index, bucket in enumerate(optimizer.buckets)}

    def master_of(self, part) -> Optional[torch.Tensor]:
        """`part`'s fp32 master (NVMe: a placeholder; `write_master` reaches the files); None without one."""
        index = self._index.get(id(part))
        return None if index is None else self._masters.masters[index]

    def write_master(self, part, values: torch.Tensor) -> None:
        """New values for `part`'s fp32 master, wherever the master optimizer keeps it."""
        self._masters.write_master(self._index[id(part)], values)
