"""Gathering stage-3 parameters: bucketed or sequential, with prefetch and reuse by recorded order.

Bucketed (default): the parameters a module needs are gathered in one all-gather
of their concatenated shards (copy-in), then copied out of the rank-major result
into one full buffer each (a module with a single partitioned parameter gathers
straight into that parameter's buffer, no copy). Sequential
(`stage3_allgather_sequential`): one all-gather per parameter straight into its own
buffer and prefetch at most one parameter ahead: more, smaller collectives for a
lower memory peak. In both modes `stage3_prefetch_bucket_size = 0` turns prefetch
off. Gather buffers come from a small pool (`buffers.BufferPool`), so the same
memory serves every layer.

The first micro-step records the order of gather requests (`trace.FetchTrace`);
later micro-steps follow it:

- prefetch: while a module computes, the next requests are gathered with async
  collectives, up to `stage3_prefetch_bucket_size` elements not yet available
  (gathers in flight included) and never past `stage3_max_live_parameters` live
  gathered elements (gathers in flight included). Forward never prefetches for
  backward: between the two the user's code runs, and only activations are held;
- reuse (`stage3_max_reuse_distance`, DeepSpeed's semantics): a parameter whose next
  use comes within that many requested parameter elements is not released after
  use — e.g. the last layers of forward, which backward needs first. Neither is a
  parameter that prefetch passed over because it was still gathered (its next use
  lies inside the prefetch window).

A request that does not match the record turns both off until the next micro-step,
so a dynamic model is never handed a wrong parameter: gathers are keyed by
parameter, the record only changes when (`stats["order_mismatches"]` counts the
micro-steps that left the record). Everything not persistent is released at the
end of each micro-step.

Budget bookkeeping in `stats`: `inflight_numel` / `peak_inflight_numel` count every
gather in flight, `prefetch_inflight_numel` / `peak_prefetch_inflight_numel` and
`prefetch_inflight_params` / `peak_prefetch_inflight_params` only those prefetch
started, `peak_live_inflight_numel` the most gathered plus in-flight elements.

ZeRO++ (`configure_zeropp`):
- qwZ: every gather of a partitioned parameter sends its shard as int8 blocks plus scales
  (one collective per bucket) and dequantizes on arrival; persistent parameters and the
  fp32 master weights stay exact.
- hpZ: each global gather also keeps this rank's slice of the full parameter as a
  secondary shard, sharded over a group of `zero_hpz_partition_size` ranks; backward
  gathers then all-gather the secondary shards inside that group only. The secondary is
  taken afresh at every global (forward) gather, so it always equals what forward used,
  and is dropped at the end of the micro-step.

An activation-checkpoint recompute's module forwards are requests with reason "recompute": they
belong to backward for prefetch (forward's prefetch stops before them), and are gathered like
forward's (globally).

Split experts (zerotrain.parallel.experts) are gathered over their expert-data-parallel group,
never in one collective with other parameters; qwZ quantizes those gathers too; hpZ skips them.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...comm import Comm
from ...comm.compressed import Float8AllGather, QuantizedAllGather
from .buffers import BufferPool
from .partition import PartitionedParam
from .trace import FetchTrace


def _no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


# Requests made while backward runs: parameters unpacked, and module forwards of an activation-checkpoint
# recompute (a forward inside backward).
_BACKWARD = ("backward", "recompute")


class ParamFetcher:
    """Owns every gather and release of partitioned parameters for one engine."""

    def __init__(self, parts: list[PartitionedParam], comm: Comm, sequential: bool, prefetch_numel: int,
                 max_live_numel: int = 10**9, max_reuse_distance: int = 10**9):
        self.parts = parts
        self.comm = comm
        self.sequential = sequential
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel  # prefetch and reuse never take live + in-flight elements past this
        self.max_reuse_distance = max_reuse_distance
        self.trace = FetchTrace()
        self.weight_quantizer: Optional[QuantizedAllGather] = None  # qwZ
        self._expert_quantizers: dict[int, QuantizedAllGather] = {}  # qwZ over expert-data-parallel groups
        self.hpz: Optional[Comm] = None  # hpZ: the secondary-partition group
        self.secondaries: dict[int, torch.Tensor] = {}  # id(part) -> its hpZ secondary shard
        self._lossy: set[int] = set()  # gathered through qwZ or fp8: holds dequantized, not exact, values
        self.fp8_gather: Optional[Float8AllGather] = None  # fp8 weight gathers (configure_fp8_gathers)
        self._fp8_parts: set[int] = set()  # id(part) of the parameters gathered as float8
        self._fp8_scales: Optional[dict[int, torch.Tensor]] = None  # id(part) -> e4m3 scale, this micro-step's
        self._inflight: dict[int, tuple] = {}  # id(part) -> (handle, gather record, started by prefetch)
        self._by_id = {id(part): part for part in parts}
        self._skipped: set[int] = set()  # gathered parameters whose next use prefetch passed over: kept
        self.holds: dict[int, int] = {}  # id(part) -> module forwards currently using it
        self.param_store = None  # offload_param: where non-persistent shards live (set by the engine)
        # Forward-only engines (zero.forward_only): every forward repeats the recorded order, so reads ahead
        # of offloaded shards wrap from the end of the record to its start (the next forward's first modules).
        self.repeats = False
        # A context per blocking gather, named "gather" (the engine's memory timeline phase); none by default.
        self.phase = _no_phase
        largest = max((part.padded_numel * part.dtype.itemsize for part in parts), default=0)
        self.pool = BufferPool(4 * largest)
        self.stats = {"gathers": 0, "prefetched": 0, "prefetch_hits": 0, "peak_gather_bytes": 0,
                      "live_bytes": 0, "peak_live_bytes": 0, "live_numel": 0,
                      "inflight_numel": 0, "inflight_bytes": 0, "peak_held_bytes": 0,
                      "peak_inflight_numel": 0, "prefetch_inflight_numel": 0, "peak_prefetch_inflight_numel": 0,
                      "prefetch_inflight_params": 0, "peak_prefetch_inflight_params": 0,
                      "peak_live_inflight_numel": 0, "order_mismatches": 0,
                      "releases": 0, "reuse_kept": 0,
                      "quantized_gathers": 0, "hpz_gathers": 0, "secondary_bytes": 0, "peak_secondary_bytes": 0,
                      "fp8_gathers": 0, "fp8_scale_updates": 0}

    def configure_fp8_gathers(self, params: list[torch.nn.Parameter]) -> None:
        """Gather these parameters (float8 layers' weights, `fp8.float8_all_gather`) as float8 e4m3 with a
        tensorwise scale (`comm.compressed.Float8AllGather`), dequantized on arrival; dense (data-parallel)
        partitions only, and nothing at one rank."""
        wanted = {id(p) for p in params}
        self._fp8_parts = {id(part) for part in self.parts if id(part.param) in wanted and part.group.comm is self.comm
                           and not part.persistent}
        self.fp8_gather = Float8AllGather(self.comm) if self._fp8_parts and self.comm.size > 1 else None
        self._fp8_scales = None

    def weights_written(self) -> None:
        """The shards may hold new values (a step, a load, a modifying `GatheredParameters`): the float8 scales
        are computed again at the next float8 gather."""
        self._fp8_scales = None

    def _fp8_scales_of(self, group: list[PartitionedParam]) -> torch.Tensor:
        """The e4m3 scales of `group`'s weights: computed for every float8 weight at once (one all-reduce, as
        torchao's `precompute_float8_dynamic_scale_for_fsdp` does per step) at the first float8 gather after
        `weights_written`, then reused by every float8 gather until the next (forward, recompute, backward)."""
        if self._fp8_scales is None:
            parts = [part for part in self.parts if id(part) in self._fp8_parts]  # the same order on every rank
            scales = self.fp8_gather.scales([part.device_shard() for part in parts])
            self._fp8_scales = {id(part): scale for part, scale in zip(parts, scales)}
            self.stats["fp8_scale_updates"] += 1
        return torch.stack([self._fp8_scales[id(part)] for part in group])

    def configure_zeropp(self, quantize_weights: bool = False, hpz: Optional[Comm] = None,
                         block_size: int = 256) -> None:
        """Turn on qwZ (int8 weight gathers) and/or hpZ (`hpz`: the secondary-partition Comm)."""
        self.weight_quantizer = QuantizedAllGather(self.comm, 8, block_size) if quantize_weights and self.comm.size > 1 else None
        self.hpz = hpz if hpz is not None and 1 < hpz.size < self.comm.size else None
        self._drop_secondaries()

    @property
    def recording(self) -> bool:
        return self.trace.recording

    # --- requests -----------------------------------------------------------
    def begin_micro_step(self) -> None:
        """Called at each forward start: follow the recorded order from the top (the float8 scales are taken
        again: the weights may have changed since the last micro-step)."""
        self.trace.begin_micro_step()
        self.weights_written()

    def end_forward(self, backward_follows: bool = True) -> None:
        """Called when the model's forward returns: idle pooled buffers are not kept until backward,
        and without a backward to come (no grad: evaluation) nothing is kept for reuse either."""
        if not backward_follows:
            for key in list(self._inflight):
                self._complete(key)
            self._skipped.clear()
            for part in self.parts:
                if part.gathered and not part.persistent and self.holds.get(id(part), 0) == 0:
                    self._release(part)
        self.pool.clear()

    def end_micro_step(self) -> None:
        """Called after backward: close the record, finish stray prefetches, release all non-persistent."""
        self.trace.end_micro_step()
        for key in list(self._inflight):
            self._complete(key)
        self._skipped.clear()
        for part in self.parts:
            if part.gathered and not part.persistent:
                self._release(part)
        self.holds.clear()
        self._drop_secondaries()
        self.pool.clear()

    def begin_untraced(self) -> None:
        """A forward outside the training micro-steps (`generate` of a training engine between its steps):
        its requests neither extend the record (were it still recording) nor follow it, so it prefetches and
        keeps nothing; `end_untraced` releases what it gathered and puts the record back as it was."""
        self._untraced = (self.trace.recording, self.trace.cursor, self.trace.in_order)
        self.weights_written()
        self.trace.recording, self.trace.in_order = False, False

    def end_untraced(self) -> None:
        for key in list(self._inflight):
            self._complete(key)
        for part in self.parts:
            if part.gathered and not part.persistent and self.holds.get(id(part), 0) == 0:
                self._release(part)
        self._drop_secondaries()
        self.pool.clear()
        self.trace.recording, self.trace.cursor, self.trace.in_order = self._untraced

    def fetch(self, parts: list[PartitionedParam], reason: str = "forward") -> None:
        """Make `parts` gathered now (waiting for prefetched ones), then prefetch what comes next."""
        parts = [part for part in parts if not part.persistent]
        if not parts:
            return
        self.trace.follow(tuple(id(part) for part in parts), reason, sum(part.padded_numel for part in parts))
        self.stats["order_mismatches"] = self.trace.mismatches
        for part in parts:
            self._skipped.discard(id(part))
        missing = [part for part in parts if not part.gathered and id(part) not in self._inflight]
        waits = missing or (reason == "user" and self._lossy) or any(id(part) in self._inflight for part in parts)
        with self.phase("gather") if waits else contextlib.nullcontext():
            if missing:
                self._gather(missing, reason=reason)
            if reason == "user" and self._lossy:  # GatheredParameters may write back: give it exact values
                for part in parts:
                    self._complete(id(part))
                    if id(part) in self._lossy:
                        exact = torch.empty_like(part.flat_param)
                        part.group.comm.all_gather(exact, part.device_shard())
                        part.flat_param.copy_(exact)
                        self._lossy.discard(id(part))
            for part in parts:
                if id(part) in self._inflight:
                    self.stats["prefetch_hits"] += 1
                    self._complete(id(part))
        self._prefetch()
        if self.param_store is not None:  # offload_param nvme: start reading the next shards
            self.param_store.read_ahead(self.upcoming())

    def hold(self, parts: list[PartitionedParam]) -> None:
        for part in parts:
            self.holds[id(part)] = self.holds.get(id(part), 0) + 1

    def unhold_and_release(self, parts: list[PartitionedParam]) -> None:
        for part in parts:
            self.holds[id(part)] = max(self.holds.get(id(part), 0) - 1, 0)
            self.release(part)

    def release(self, part: PartitionedParam) -> None:
        """Release a parameter nobody holds, unless it is needed again soon (after its module's
        forward, or after its gradient is taken in backward)."""
        if self.holds.get(id(part), 0) == 0 and part.gathered and not part.persistent and not self._keep(part):
            self._release(part)

    def _keep(self, part: PartitionedParam) -> bool:
        """Whether the record says this parameter is used again soon enough to stay gathered."""
        if not self.trace.usable:
            return False
        if id(part) in self._skipped:
            return True
        distance = self.trace.reuse_distance(id(part))
        if distance is None or distance >= self.max_reuse_distance:
            return False
        if self.stats["live_numel"] + self.stats["inflight_numel"] > self.max_live_numel:
            return False
        self.stats["reuse_kept"] += 1
        return True

    # --- prefetch ---------------------------------------------------------------
    def upcoming(self):
        """Parameters of the recorded requests still to come, in order, not gathered (for reads ahead); with
        `repeats`, then those of the next forward from its start."""
        if not self.trace.usable:
            return
        count = len(self.trace.entries)
        cursor = self.trace.cursor
        positions = range(cursor, count + cursor) if self.repeats else range(cursor, count)
        for position in positions:
            for key in self.trace.entries[position % count]:
                part = self._by_id[key]
                if not part.gathered and key not in self._inflight:
                    yield part

    def _prefetch(self) -> None:
        """Gather the next recorded requests ahead, within the prefetch and live budgets."""
        if not self.trace.usable or self.prefetch_numel == 0:
            return
        ahead = 0  # elements (sequential: parameters) of upcoming requests not yet available
        seen: set[int] = set()
        in_backward = self.trace.cursor > 0 and self.trace.reasons[self.trace.cursor - 1] in _BACKWARD
        for position in range(self.trace.cursor, len(self.trace.entries)):
            if ahead >= (1 if self.sequential else self.prefetch_numel):
                break
            if not in_backward and self.trace.reasons[position] in _BACKWARD:
                break  # never past the end of forward: until backward starts, user code runs on activations alone
            upcoming = [self._by_id[key] for key in self.trace.entries[position] if key not in seen]
            seen.update(id(part) for part in upcoming)
            for part in upcoming:
                if part.gathered:  # would be released before this use otherwise
                    self._skipped.add(id(part))
            pending = [part for part in upcoming if not part.gathered]
            if self.sequential:
                pending = pending[:1]
                ahead += len(pending)
            else:
                ahead += sum(part.padded_numel for part in pending)
            wanted = [part for part in pending if id(part) not in self._inflight]
            size = sum(part.padded_numel for part in wanted)
            if wanted and self.stats["live_numel"] + self.stats["inflight_numel"] + size > self.max_live_numel:
                break
            if wanted:
                self.stats["prefetched"] += len(wanted)
                self._gather(wanted, async_op=True, reason=self.trace.reasons[position], prefetch=True)

    # --- collectives ----------------------------------------------------------
    def _gather(self, parts: list[PartitionedParam], async_op: bool = False, reason: str = "forward",
                prefetch: bool = False) -> None:
        self.stats["gathers"] += 1
        requested = parts
        if self.hpz is not None and reason == "backward":  # hpZ: inside the secondary group
            for part in parts:
                if id(part) in self.secondaries:
                    self._gather_secondary(part, prefetch)
            parts = [part for part in parts if id(part) not in self._inflight]
        groups: list[list[PartitionedParam]] = [[p] for p in parts] if self.sequential else _by_dtype(parts, self.comm)
        if self.fp8_gather is not None:  # float8 weights travel in collectives of their own
            groups = [g for group in groups for g in (
                [p for p in group if id(p) in self._fp8_parts], [p for p in group if id(p) not in self._fp8_parts]) if g]
        for group in groups:
            quantizer = self._weight_quantizer(group[0]) if reason != "user" else None
            if quantizer is not None:  # qwZ (int8 + scales) or fp8 (float8 + a tensorwise scale), dequantized on arrival
                scales = {"scales": self._fp8_scales_of(group)} if quantizer is self.fp8_gather else {}
                handle = quantizer([part.device_shard() for part in group], **scales)
                record = ("quantized", None, group)
                self.stats["fp8_gathers" if quantizer is self.fp8_gather else "quantized_gathers"] += 1
                full_bytes = sum(part.padded_numel * part.dtype.itemsize for part in group)
                self.stats["peak_gather_bytes"] = max(self.stats["peak_gather_bytes"], full_bytes)
            elif len(group) == 1:
                part = group[0]
                buffer = self.pool.take(part.padded_numel, part.dtype, part.device)
                handle = part.group.comm.all_gather(buffer, part.device_shard(), async_op=True)
                record = ("direct", buffer, group)
                self._track_buffer(buffer)
            else:
                staged = torch.cat([part.device_shard() for part in group])  # copy-in
                comm = group[0].group.comm  # split experts: their expert-data-parallel group
                output = self.pool.take(staged.numel() * comm.size, staged.dtype, staged.device)
                handle = comm.all_gather(output, staged, async_op=True)
                record = ("bucket", output, group)
                self._track_buffer(output, extra_bytes=staged.numel() * staged.element_size())
            self._count_inflight(group, +1, prefetch)
            for part in group:
                self._inflight[id(part)] = (handle, record, prefetch)
        if not async_op:
            for part in requested:
                self._complete(id(part))

    # --- hpZ: secondary partitions (keep at a global gather, gather in the hpZ group, drop) ------
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

    def _weight_quantizer(self, part: PartitionedParam):
        """The fp8 gather for a float8 layer's weight (`configure_fp8_gathers`); else qwZ's gather for `part`'s
        group: the data-parallel one, or a split expert's expert-data-parallel one."""
        if self.fp8_gather is not None and id(part) in self._fp8_parts:
            return self.fp8_gather
        comm = part.group.comm
        if comm is self.comm or self.weight_quantizer is None or comm.size == 1:
            return self.weight_quantizer if comm is self.comm else None
        if id(comm) not in self._expert_quantizers:
            self._expert_quantizers[id(comm)] = QuantizedAllGather(comm, 8, self.weight_quantizer.block_size)
        return self._expert_quantizers[id(comm)]

    def _complete(self, key: int) -> None:
        entry = self._inflight.pop(key, None)
        if entry is None:
            return
        handle, (kind, buffer, group), prefetch = entry
        handle.wait()
        for other in group:  # the whole collective is done: bind every member
            self._inflight.pop(id(other), None)
        self._count_inflight(group, -1, prefetch)
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
        ranks = group[0].group.comm.size
        rank_major = buffer.view(ranks, -1)
        offset = 0
        for part in group:  # copy-out: each parameter's chunks from every rank
            full = self.pool.take(part.padded_numel, part.dtype, part.device)
            full.view(ranks, -1).copy_(rank_major[:, offset:offset + part.shard_numel])
            self._bind(part, full)
            self._keep_secondary(part)
            offset += part.shard_numel
        # Peak of a bucketed gather: its output, the staged input (the collective may still hold it), and
        # the full buffers just copied out of it.
        self._track_buffer(buffer, extra_bytes=buffer.numel() * buffer.element_size() * (1 + 1 / ranks))
        del rank_major
        self.pool.give(buffer)

    def _count_inflight(self, group: list[PartitionedParam], sign: int, prefetch: bool) -> None:
        stats = self.stats
        numel = sum(part.padded_numel for part in group)
        stats["inflight_numel"] += sign * numel
        stats["inflight_bytes"] += sign * sum(part.padded_numel * part.dtype.itemsize for part in group)
        stats["peak_inflight_numel"] = max(stats["peak_inflight_numel"], stats["inflight_numel"])
        if prefetch:
            stats["prefetch_inflight_numel"] += sign * numel
            stats["prefetch_inflight_params"] += sign * len(group)
            stats["peak_prefetch_inflight_numel"] = max(stats["peak_prefetch_inflight_numel"],
                                                        stats["prefetch_inflight_numel"])
            stats["peak_prefetch_inflight_params"] = max(stats["peak_prefetch_inflight_params"],
                                                         stats["prefetch_inflight_params"])
        self._note_held()

    # --- bookkeeping --------------------------------------------------------------
    def _bind(self, part: PartitionedParam, flat: torch.Tensor) -> None:
        if part.gathered:
            return
        part.bind(flat)
        self.stats["live_numel"] += flat.numel()
        self.stats["live_bytes"] += flat.numel() * flat.element_size()
        self.stats["peak_live_bytes"] = max(self.stats["peak_live_bytes"], self.stats["live_bytes"])
        self._note_held()

    def _release(self, part: PartitionedParam) -> None:
        self._lossy.discard(id(part))
        self._skipped.discard(id(part))
        buffer = part.flat_param
        self.stats["live_numel"] -= buffer.numel()
        self.stats["live_bytes"] -= buffer.numel() * buffer.element_size()
        self.stats["releases"] += 1
        part.release()
        self.pool.give(buffer)  # kept for reuse only if nothing else references it

    def _note_held(self) -> None:
        stats = self.stats
        stats["peak_held_bytes"] = max(stats["peak_held_bytes"], stats["live_bytes"] + stats["inflight_bytes"])
        stats["peak_live_inflight_numel"] = max(stats["peak_live_inflight_numel"],
                                                stats["live_numel"] + stats["inflight_numel"])

    def _track_buffer(self, buffer: torch.Tensor, extra_bytes: float = 0) -> None:
        """`peak_gather_bytes`: the most transient memory one gather used (buffer plus copy-in/copy-out)."""
        size = int(buffer.numel() * buffer.element_size() + extra_bytes)
        self.stats["peak_gather_bytes"] = max(self.stats["peak_gather_bytes"], size)


def _by_dtype(parts: list[PartitionedParam], comm: Comm) -> list[list[PartitionedParam]]:
    """The parts gathered by one collective each: same dtype, same group (split experts: theirs)."""
    groups: dict[tuple[torch.dtype, int], list[PartitionedParam]] = {}
    for part in parts:
        groups.setdefault((part.dtype, id(part.group.comm)), []).append(part)
    return list(groups.values())


def gather_standalone(part: PartitionedParam, comm: Optional[Comm]) -> None:
    """Gather one parameter with no engine (e.g. a model built under zero.Init, before initialize)."""
    buffer = torch.empty(part.padded_numel, dtype=part.dtype, device=part.device)
    if comm is None:
        raise RuntimeError(f"parameter {part.names[0]} is partitioned but has no communicator")
    comm.all_gather(buffer, part.device_shard())
    part.bind(buffer)
