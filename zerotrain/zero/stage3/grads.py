"""Stage-3 gradient reduction: bucketed reduce-scatter as gradients become ready.

Each stage-3 parameter is its own one-parameter FlatBucket (`PartitionedParam`), so
reducing parameter by parameter would launch one reduce-scatter per parameter. Here
consecutive parameters (in `index` order, ≈ the order backward produces them) are
grouped into reduce buckets of at most `reduce_bucket_size` elements. A bucket's
staging buffer is laid out rank-major: chunk r holds, one after the other, chunk r of
every member's padded gradient, so one reduce-scatter leaves this rank with its shard
of every member, contiguous:

    staging = [p0 chunk 0 | p1 chunk 0 | ... ][p0 chunk 1 | p1 chunk 1 | ...] ...
    output  = [p0 shard  | p1 shard  | ...]          (this rank's chunk)

When a parameter's gradient is accumulated, it is divided by the data-parallel size
while being copied into its columns of the staging buffer (split experts too, whose buckets
are reduced over their expert-data-parallel group only, see zerotrain.parallel.experts), and the full gradient is
dropped at once (a bucket of a single unpadded parameter skips the copy: its gradient,
divided in place, is the staging buffer). A bucket is launched when all its members have arrived, strictly in
bucket order on every rank (a bucket waits for the ones before it), so collectives
always match; buckets whose members never got a gradient are launched with zeros at
the end of backward. Each parameter's fp32 gradient shard is a view of its bucket's
reduced output (first micro-step) or is added into (later micro-steps); all of it is
freed after the optimizer step, so no gradient memory is held between steps.

The hooks, the in-order launches, the queue of reductions in flight and the reuse of
finished staging buffers are `zero.grads.BucketReducer`'s, shared with the other reducers;
the sum itself is the `BucketReduce` it is given (exact by default). Under qgZ the engine
uses `zero.grads.PartitionedReducer` instead, each partitioned parameter its own bucket:
qgZ's quantization blocks and LoCo buffers are per parameter there (moving them onto these
reduce buckets is a later change of numerics).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...comm import Comm
from ...sharding import ShardGroup
from ..grads import BucketReducer
from ..interfaces import BucketReduce
from .partition import PartitionedParam


@dataclass
class ReduceBucket:
    """Consecutive parameters reduced by one reduce-scatter, with their offsets in the shard layout."""

    index: int
    parts: list[PartitionedParam]
    group: ShardGroup  # reduced over group.comm: the data-parallel ranks, or split experts' expert-data group
    offsets: list[int] = field(default_factory=list)  # each member's start in the reduced shard
    shard_numel: int = 0  # elements of the reduced shard (sum of the members' shard sizes)

    def __post_init__(self) -> None:
        for part in self.parts:
            self.offsets.append(self.shard_numel)
            self.shard_numel += part.shard_numel

    @property
    def comm(self) -> Comm:
        return self.group.comm


def build_reduce_buckets(parts: list[PartitionedParam], bucket_numel: int, comm: Comm) -> list[ReduceBucket]:
    """Group `parts` (in order) into buckets of at most `bucket_numel` elements, one dtype and one group
    (the parts' ShardGroup Comm: split experts apart) per bucket. `comm` is the data-parallel Comm."""
    buckets: list[ReduceBucket] = []
    current: list[PartitionedParam] = []
    size = 0
    for part in parts:
        if current and (part.dtype != current[0].dtype or size + part.padded_numel > bucket_numel
                        or part.group.comm is not current[0].group.comm):
            buckets.append(ReduceBucket(len(buckets), current, current[0].group))
            current, size = [], 0
        current.append(part)
        size += part.padded_numel
    if current:
        buckets.append(ReduceBucket(len(buckets), current, current[0].group))
    return buckets


class Stage3GradReducer(BucketReducer):
    """Reduce-scatters stage-3 gradients in buckets during backward; owns the fp32 gradient shards
    (`grad_shards`, indexed by `part.index`; `shard_ready_callbacks` are called with part indices)."""

    def __init__(self, parts: list[PartitionedParam], comm: Comm, bucket_numel: int, max_in_flight: int = 1,
                 reduce: Optional[BucketReduce] = None):
        self.parts = parts
        buckets = build_reduce_buckets(parts, max(1, int(bucket_numel)), comm)
        for bucket in buckets:
            for part in bucket.parts:
                if part.index >= len(parts) or parts[part.index] is not part:
                    raise ValueError(f"parameter {part.names[0]}: index {part.index} does not match its position")
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(parts)
        self._stores: list[Optional[torch.Tensor]] = [None] * len(buckets)  # reduced fp32 shards
        self._staging: list[Optional[torch.Tensor]] = [None] * len(buckets)
        self._owned: set[int] = set()  # buckets whose staging buffer is ours (not an adopted gradient)
        self._free_final = False  # free_final_shards(): a consumer takes each final shard in its callback
        self._narrow_final = False  # keep_final_shards_in_training_dtype(): no fp32 copy of a reduced shard
        super().__init__(buckets, [[part.param for part in bucket.parts] for bucket in buckets], comm, reduce,
                         max_in_flight)
        self.stats["reduce_scatters"] = 0

    can_free_final_shards = True

    def free_final_shards(self) -> None:
        self._free_final = True

    def keep_final_shards_in_training_dtype(self) -> None:
        self._narrow_final = True

    def zero(self) -> None:
        """Forget and free all gradients (after a step, or when a step is skipped)."""
        self._stores = [None] * len(self.buckets)
        self.grad_shards = [None] * len(self.parts)

    # --- staging ----------------------------------------------------------
    def _param_name(self, index: int, position: int) -> str:
        return self.buckets[index].parts[position].names[0]

    def _accept(self, index: int, position: int, param: torch.nn.Parameter) -> None:
        if not self._adopt(index, param.grad):
            self._pack(index, position, param.grad)
        param.grad = None  # the full gradient lives only in the staging buffer now

    def _adopt(self, bucket_index: int, grad: torch.Tensor) -> bool:
        """A bucket of one unpadded parameter reduces its gradient in place: divided by N, no copy."""
        part = self.buckets[bucket_index].parts[0]
        if (self._packed(bucket_index) or self._staging[bucket_index] is not None or grad.dtype != part.dtype
                or not grad.is_contiguous()):
            return False
        staging = grad.view(-1)
        staging.div_(self.comm.size)
        self._staging[bucket_index] = staging
        self._pool.count(staging.numel() * staging.element_size())
        return True

    def _pack(self, bucket_index: int, position: int, grad: torch.Tensor) -> None:
        """Copy grad / N into the member's columns of the rank-major staging buffer (padding zeroed)."""
        bucket = self.buckets[bucket_index]
        part = bucket.parts[position]
        columns = self._columns(bucket_index, position)
        flat = grad.reshape(-1)
        full_rows, rest = divmod(part.numel, part.shard_numel)
        accumulate = position in self._arrived[bucket_index]
        pieces = [(columns[:full_rows], flat[:full_rows * part.shard_numel].view(full_rows, part.shard_numel))]
        if rest:
            pieces.append((columns[full_rows, :rest], flat[full_rows * part.shard_numel:]))
        for target, source in pieces:
            if accumulate:
                target.add_(source / self.comm.size)
            elif self.comm.size > 1:
                torch.div(source, self.comm.size, out=target)
            else:
                target.copy_(source)
        if not accumulate:
            if rest:
                columns[full_rows, rest:].zero_()
            columns[full_rows + (1 if rest else 0):].zero_()

    def _columns(self, bucket_index: int, position: int) -> torch.Tensor:
        """The (N, shard) view of the staging buffer that holds one member's chunks."""
        bucket = self.buckets[bucket_index]
        if self._staging[bucket_index] is None:
            part = bucket.parts[0]
            self._staging[bucket_index] = self._pool.take(bucket.comm.size * bucket.shard_numel, part.dtype,
                                                          part.device)
            self._owned.add(bucket_index)
        start = bucket.offsets[position]
        rows = self._staging[bucket_index].view(bucket.comm.size, bucket.shard_numel)
        return rows[:, start:start + bucket.parts[position].shard_numel]

    def _spare_wanted(self, staging: torch.Tensor) -> bool:
        """Only while a bucket no gradient has reached yet will take a staging buffer this one can hold: a bucket
        of one unpadded parameter reduces its own gradient (`_adopt`), and one that has started has its buffer.
        (The last packed bucket's buffer would otherwise stay until the end of backward beside the adopted
        whole gradient of the largest parameter.)"""
        whole = self._pool.whole(staging)
        return any(not self._arrived[j] and self._staging[j] is None and self._packed(j)
                   and self.buckets[j].comm.size * self.buckets[j].shard_numel <= whole.numel()
                   for j in range(self._next_launch, len(self.buckets)))

    def _packed(self, bucket_index: int) -> bool:
        """Whether the bucket's gradients are copied into a staging buffer (not adopted in place: `_adopt`)."""
        bucket = self.buckets[bucket_index]
        part = bucket.parts[0]
        return len(bucket.parts) > 1 or part.numel != part.padded_numel or self.comm.size == 1

    # --- reduction --------------------------------------------------------
    def _launch(self, index: int):
        bucket = self.buckets[index]
        arrived = self._arrived[index]
        for position in range(len(bucket.parts)):  # members that got no gradient this backward count as zero
            if position not in arrived:
                self._columns(index, position).zero_()
        staging = self._staging[index]
        self._staging[index] = None
        output, handle = self.reduce.reduce_scatter(index, staging)
        self.stats["reduce_scatters"] += 1
        owned = index in self._owned
        self._owned.discard(index)
        return index, handle, output, staging, owned

    def _store(self, index: int, output: torch.Tensor) -> None:
        bucket = self.buckets[index]
        store = self._stores[index]
        if store is not None:
            store.add_(output)
            return
        # A consumer that steps each final shard at once (NVMe offload, `free_final_shards`) casts it
        # chunk by chunk into its own fp32 buffer: a whole-bucket fp32 copy here would only cost time
        # and memory (no accumulation then, so nothing is summed in the training dtype).
        keep = output.dtype == torch.float32 or self._free_final or self._narrow_final
        store = output if keep else output.float()
        self._stores[index] = store
        for part, offset in zip(bucket.parts, bucket.offsets):
            self.grad_shards[part.index] = store[offset:offset + part.shard_numel]

    def _shard_final(self, index: int) -> None:
        for part in self.buckets[index].parts:
            for callback in self.shard_ready_callbacks:
                callback(part.index)
        if self._free_final:  # a callback consumed them (NVMe offload steps them during backward)
            self._stores[index] = None
            for part in self.buckets[index].parts:
                self.grad_shards[part.index] = None

    # --- accounting -------------------------------------------------------
    def _gradient_bytes(self) -> int:
        """Bytes of reduced gradient shards held now (zero between optimizer steps)."""
        return sum(store.numel() * store.element_size() for store in self._stores if store is not None)

    def held_tensors(self) -> list[torch.Tensor]:
        return [t for t in self._stores + self._staging if t is not None] + list(self._pool.spares)
