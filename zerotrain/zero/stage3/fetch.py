"""Gathering stage-3 parameters: bucketed or sequential, with prefetch by recorded order.

Bucketed (default): the parameters a module needs are gathered in one all-gather
of their concatenated shards (copy-in), then copied out of the rank-major result
into one full buffer each. Sequential (`stage3_allgather_sequential`): one
all-gather per parameter straight into that parameter's own buffer — no staging
bucket, no copy — and prefetch at most one parameter ahead: more, smaller
collectives for a lower memory peak.

The first micro-step records the order of gather requests (forward and backward);
later micro-steps prefetch the next requests with async collectives while the
current module computes. A request that does not match the record turns
prefetching off until the next micro-step, so a dynamic model is never handed a
wrong parameter: gathers are keyed by parameter, prefetch only changes when.

ZeRO++ (`configure_zeropp`):
- qwZ: every gather of a partitioned parameter sends its shard as int8 blocks plus scales
  (one collective per bucket) and dequantizes on arrival; persistent parameters and the
  fp32 master weights stay exact.
- hpZ: each global gather also keeps this rank's slice of the full parameter as a
  secondary shard, sharded over a group of `zero_hpz_partition_size` ranks; backward
  gathers then all-gather the secondary shards inside that group only. The secondary is
  taken afresh at every global (forward) gather, so it always equals what forward used,
  and is dropped at the end of the micro-step.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...comm import Comm
from ...comm.compressed import QuantizedAllGather
from .partition import PartitionedParam


class ParamFetcher:
    """Owns every gather and release of partitioned parameters for one engine."""

    def __init__(self, parts: list[PartitionedParam], comm: Comm, sequential: bool, prefetch_numel: int,
                 max_live_numel: int = 10**9):
        self.parts = parts
        self.max_live_numel = max_live_numel  # prefetch never takes live gathered elements past this
        self.comm = comm
        self.sequential = sequential
        self.prefetch_numel = prefetch_numel
        self.trace: list[tuple[int, ...]] = []
        self.trace_reasons: list[str] = []  # "forward" / "backward" / "access", per trace entry
        self.weight_quantizer: Optional[QuantizedAllGather] = None  # qwZ
        self.hpz: Optional[Comm] = None  # hpZ: the secondary-partition group
        self.secondaries: dict[int, torch.Tensor] = {}  # id(part) -> its hpZ secondary shard
        self._lossy: set[int] = set()  # gathered through qwZ: holds dequantized, not exact, values
        self.recording = True
        self.cursor = 0
        self.in_order = True
        self._inflight: dict[int, tuple] = {}  # id(part) -> (handle, gather record)
        self.holds: dict[int, int] = {}  # id(part) -> module forwards currently using it
        self.stats = {"gathers": 0, "prefetched": 0, "prefetch_hits": 0, "peak_gather_bytes": 0,
                      "live_bytes": 0, "peak_live_bytes": 0, "live_numel": 0,
                      "quantized_gathers": 0, "hpz_gathers": 0, "secondary_bytes": 0, "peak_secondary_bytes": 0}
        for part in parts:
            part.fetcher = self

    def configure_zeropp(self, quantize_weights: bool = False, hpz: Optional[Comm] = None,
                         block_size: int = 256) -> None:
        """Turn on qwZ (int8 weight gathers) and/or hpZ (`hpz`: the secondary-partition Comm)."""
        self.weight_quantizer = QuantizedAllGather(self.comm, 8, block_size) if quantize_weights and self.comm.size > 1 else None
        self.hpz = hpz if hpz is not None and 1 < hpz.size < self.comm.size else None
        self._drop_secondaries()

    # --- requests -----------------------------------------------------------
    def begin_micro_step(self) -> None:
        """Called at each forward start: follow the recorded order from the top."""
        self.cursor = 0
        self.in_order = True

    def end_micro_step(self) -> None:
        """Called after backward: stop recording, finish stray prefetches, release all non-persistent."""
        self.recording = False
        for key in list(self._inflight):
            self._complete(key)
        for part in self.parts:
            if part.gathered and not part.persistent:
                self._release(part)
        self.holds.clear()
        self._drop_secondaries()

    def fetch(self, parts: list[PartitionedParam], reason: str = "forward") -> None:
        """Make `parts` gathered now (waiting for prefetched ones), then prefetch what comes next."""
        parts = [part for part in parts if not part.persistent]
        if not parts:
            return
        self._follow_trace(parts, reason)
        missing = [part for part in parts if not part.gathered and id(part) not in self._inflight]
        if missing:
            self._gather(missing, reason=reason)
        if reason == "user" and self._lossy:  # GatheredParameters may write back: give it exact values
            for part in parts:
                self._complete(id(part))
                if id(part) in self._lossy:
                    exact = torch.empty_like(part.flat_param)
                    self.comm.all_gather(exact, part.shard)
                    part.flat_param.copy_(exact)
                    self._lossy.discard(id(part))
        for part in parts:
            if id(part) in self._inflight:
                self.stats["prefetch_hits"] += 1
                self._complete(id(part))
        self._prefetch()

    def hold(self, parts: list[PartitionedParam]) -> None:
        for part in parts:
            self.holds[id(part)] = self.holds.get(id(part), 0) + 1

    def unhold_and_release(self, parts: list[PartitionedParam]) -> None:
        for part in parts:
            count = self.holds.get(id(part), 0) - 1
            self.holds[id(part)] = max(count, 0)
            if count <= 0 and part.gathered and not part.persistent:
                self._release(part)

    def release(self, part: PartitionedParam) -> None:
        """Release a parameter nobody holds (after its gradient is taken in backward)."""
        if self.holds.get(id(part), 0) == 0 and part.gathered and not part.persistent:
            self._release(part)

    # --- order and prefetch --------------------------------------------------
    def _follow_trace(self, parts: list[PartitionedParam], reason: str = "forward") -> None:
        key = tuple(id(part) for part in parts)
        if self.recording:
            self.trace.append(key)
            self.trace_reasons.append(reason)
            return
        if self.in_order and self.cursor < len(self.trace) and self.trace[self.cursor] == key:
            self.cursor += 1
        else:
            self.in_order = False

    def _prefetch(self) -> None:
        if self.recording or not self.in_order:
            return
        budget = 1 if self.sequential else self.prefetch_numel
        ahead = 0
        by_id = {id(part): part for part in self.parts}
        position = self.cursor
        while position < len(self.trace):
            upcoming = [by_id[key] for key in self.trace[position]]
            wanted = [part for part in upcoming
                      if not part.persistent and not part.gathered and id(part) not in self._inflight]
            size = sum(part.padded_numel for part in wanted)
            if self.stats["live_numel"] + ahead + size > self.max_live_numel:
                break
            if self.sequential:
                if ahead >= budget:
                    break
                wanted = wanted[:1]
                if wanted:
                    ahead += 1
            else:
                if ahead and ahead + size > budget:
                    break
                ahead += size
            if wanted:
                self.stats["prefetched"] += len(wanted)
                self._gather(wanted, async_op=True, reason=self.trace_reasons[position])
            position += 1

    # --- collectives ----------------------------------------------------------
    def _gather(self, parts: list[PartitionedParam], async_op: bool = False, reason: str = "forward") -> None:
        self.stats["gathers"] += 1
        requested = parts
        if self.hpz is not None and reason == "backward":  # hpZ: inside the secondary group
            for part in parts:
                if id(part) in self.secondaries:
                    self._gather_secondary(part)
            parts = [part for part in parts if id(part) not in self._inflight]
        groups: list[list[PartitionedParam]] = [[p] for p in parts] if self.sequential else _by_dtype(parts)
        for group in groups:
            if self.weight_quantizer is not None and reason != "user":  # qwZ: int8 + scales, dequantized on arrival
                handle = self.weight_quantizer([part.shard for part in group])
                record = ("quantized", None, group)
                self.stats["quantized_gathers"] += 1
                full_bytes = sum(part.padded_numel * part.shard.element_size() for part in group)
                self.stats["peak_gather_bytes"] = max(self.stats["peak_gather_bytes"], full_bytes)
            elif len(group) == 1:
                part = group[0]
                buffer = torch.empty(part.padded_numel, dtype=part.dtype, device=part.device)
                handle = self.comm.all_gather(buffer, part.shard, async_op=True)
                record = ("direct", buffer, group)
                self._track_buffer(buffer)
            else:
                staged = torch.cat([part.shard for part in group])  # copy-in
                output = torch.empty(staged.numel() * self.comm.size, dtype=staged.dtype, device=staged.device)
                handle = self.comm.all_gather(output, staged, async_op=True)
                record = ("bucket", output, group)
                self._track_buffer(output)
            for part in group:
                self._inflight[id(part)] = (handle, record)
        if not async_op:
            for part in requested:
                self._complete(id(part))

    def _complete(self, key: int) -> None:
        entry = self._inflight.pop(key, None)
        if entry is None:
            return
        handle, (kind, buffer, group) = entry
        handle.wait()
        for other in group:  # the whole collective is done: bind every member
            self._inflight.pop(id(other), None)
        if kind == "secondary":
            self._bind(group[0], buffer)
            return
        if kind == "quantized":
            for part, full in zip(group, handle.result):
                if not part.gathered:
                    self._lossy.add(id(part))
                self._bind(part, full)
                self._keep_secondary(part)
            return
        if kind == "direct":
            self._bind(group[0], buffer)
            self._keep_secondary(group[0])
            return
        rank_major = buffer.view(self.comm.size, -1)
        offset = 0
        for part in group:  # copy-out: each parameter's chunks from every rank
            full = rank_major[:, offset:offset + part.shard_numel].reshape(-1)
            self._bind(part, full)
            self._keep_secondary(part)
            offset += part.shard_numel

    # --- hpZ secondary partition ------------------------------------------------
    def _keep_secondary(self, part: PartitionedParam) -> None:
        """After a global gather: keep this rank's 1/H slice of the full parameter."""
        if self.hpz is None:
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

    def _gather_secondary(self, part: PartitionedParam) -> None:
        if part.gathered or id(part) in self._inflight:
            return
        buffer = torch.empty(part.padded_numel, dtype=part.dtype, device=part.device)
        handle = self.hpz.all_gather(buffer, self.secondaries[id(part)], async_op=True, kind="all_gather_hpz")
        self._track_buffer(buffer)
        self._inflight[id(part)] = (handle, ("secondary", buffer, [part]))
        self.stats["hpz_gathers"] += 1

    def _drop_secondaries(self) -> None:
        self.secondaries.clear()
        self.stats["secondary_bytes"] = 0

    def _bind(self, part: PartitionedParam, flat: torch.Tensor) -> None:
        if part.gathered:
            return
        part.bind(flat)
        self.stats["live_numel"] += flat.numel()
        self.stats["live_bytes"] += flat.numel() * flat.element_size()
        self.stats["peak_live_bytes"] = max(self.stats["peak_live_bytes"], self.stats["live_bytes"])

    def _release(self, part: PartitionedParam) -> None:
        self._lossy.discard(id(part))
        self.stats["live_numel"] -= part.flat_param.numel()
        self.stats["live_bytes"] -= part.flat_param.numel() * part.flat_param.element_size()
        part.release()

    def _track_buffer(self, buffer: torch.Tensor) -> None:
        size = buffer.numel() * buffer.element_size()
        self.stats["peak_gather_bytes"] = max(self.stats["peak_gather_bytes"], size)


def _by_dtype(parts: list[PartitionedParam]) -> list[list[PartitionedParam]]:
    groups: dict[torch.dtype, list[PartitionedParam]] = {}
    for part in parts:
        groups.setdefault(part.dtype, []).append(part)
    return list(groups.values())


def gather_standalone(part: PartitionedParam, comm: Optional[Comm]) -> None:
    """Gather one parameter with no engine (e.g. a model built under zero.Init, before initialize)."""
    buffer = torch.empty(part.padded_numel, dtype=part.dtype, device=part.device)
    if comm is None:
        raise RuntimeError(f"parameter {part.names[0]} is partitioned but has no communicator")
    comm.all_gather(buffer, part.shard)
    part.bind(buffer)
