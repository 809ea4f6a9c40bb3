"""hpZ's secondary partitions for ParamFetcher (see fetch.py's docstring, "hpZ").

Each global gather keeps this rank's 1/H slice of the full parameter (H = `zero_hpz_partition_size`),
and backward gathers all-gather those slices inside the hpZ group only. The mixin uses the fetcher's
`hpz` Comm, `secondaries`, `stats`, buffer pool and in-flight bookkeeping.
"""
from __future__ import annotations

from .partition import PartitionedParam


class SecondaryPartitions:
    """The hpZ part of ParamFetcher: keep, gather and drop secondary shards."""

    def _keep_secondary(self, part: PartitionedParam) -> None:
        """After a global gather: keep this rank's 1/H slice of the full parameter (split experts keep none:
        the hpZ group holds other experts; they are gathered over their expert-data-parallel group)."""
        if self.hpz is None or part.group.expert:
            return
        size = part.padded_numel // self.hpz.size  # N is a multiple of H, so this is exact
        start = self.hpz.rank * size
        old = self.secondaries.get(id(part))
        if old is not None:
            self.stats["secondary_bytes"] -= old.numel() * old.element_size()
        secondary = part.flat_param[start:start + size].clone()
        self.secondaries[id(part)] = secondary
        self.stats["secondary_bytes"] += secondary.numel() * secondary.element_size()
        self.stats["peak_secondary_bytes"] = max(self.stats["peak_secondary_bytes"], self.stats["secondary_bytes"])

    def _gather_secondary(self, part: PartitionedParam, prefetch: bool = False) -> None:
        if part.gathered or id(part) in self._inflight:
            return
        buffer = self.pool.take(part.padded_numel, part.dtype, part.device)
        handle = self.hpz.all_gather(buffer, self.secondaries[id(part)], async_op=True, kind="all_gather_hpz")
        self._track_buffer(buffer)
        self._count_inflight([part], +1, prefetch)
        self._inflight[id(part)] = (handle, ("secondary", buffer, [part]), prefetch)
        self.stats["hpz_gathers"] += 1

    def _drop_secondaries(self) -> None:
        self.secondaries.clear()
        self.stats["secondary_bytes"] = 0
