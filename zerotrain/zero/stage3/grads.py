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

A staging buffer whose reduce-scatter has finished is kept as a spare for the next
bucket of the same backward that fits in it (and dropped at the end of backward): a
fresh 80 MB buffer costs ~20k page faults on first touch, about 4x the time of the
copy itself on a CPU run, so a backward of B buckets allocates about 2, not B.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...comm import Comm
from ..interfaces import GradientReducer
from .partition import PartitionedParam


@dataclass
class ReduceBucket:
    """Consecutive parameters reduced by one reduce-scatter, with their offsets in the shard layout."""

    index: int
    parts: list[PartitionedParam]
    comm: Comm  # the ranks it is reduced over: the data-parallel ones, or split experts' expert-data-parallel group
    offsets: list[int] = field(default_factory=list)  # each member's start in the reduced shard
    shard_numel: int = 0  # elements of the reduced shard (sum of the members' shard sizes)

    def __post_init__(self) -> None:
        for part in self.parts:
            self.offsets.append(self.shard_numel)
            self.shard_numel += part.shard_numel


def build_reduce_buckets(parts: list[PartitionedParam], bucket_numel: int, comm: Comm) -> list[ReduceBucket]:
    """Group `parts` (in order) into buckets of at most `bucket_numel` elements, one dtype and one group
    (the parts' ShardGroup Comm: split experts apart) per bucket. `comm` is the data-parallel Comm."""
    buckets: list[ReduceBucket] = []
    current: list[PartitionedParam] = []
    size = 0
    for part in parts:
        if current and (part.dtype != current[0].dtype or size + part.padded_numel > bucket_numel
                        or part.group.comm is not current[0].group.comm):
            buckets.append(ReduceBucket(len(buckets), current, current[0].group.comm))
            current, size = [], 0
        current.append(part)
        size += part.padded_numel
    if current:
        buckets.append(ReduceBucket(len(buckets), current, current[0].group.comm))
    return buckets


class Stage3GradReducer(GradientReducer):
    """Reduce-scatters stage-3 gradients in buckets during backward; owns the fp32 gradient shards.

    Offers the GradReducer interface the engine and the optimizers use: `grad_shards`
    (indexed by `part.index`), `begin_backward`, `end_backward`, `zero`, `held_bytes`,
    `shard_ready_callbacks` and the optimizer-step report.
    """

    quantization = None
    loco_enabled = False

    def __init__(self, parts: list[PartitionedParam], comm: Comm, bucket_numel: int, max_in_flight: int = 1):
        self.parts = parts
        self.comm = comm
        self.max_in_flight = max_in_flight
        self.buckets = build_reduce_buckets(parts, max(1, int(bucket_numel)), comm)
        self.grad_shards: list[Optional[torch.Tensor]] = [None] * len(parts)
        self.shard_ready_callbacks: list = []
        self.optimizer_steps = 0
        self.stats = {"reduce_scatters": 0, "staging_bytes": 0, "peak_staging_bytes": 0, "staging_reused": 0}
        self._stores: list[Optional[torch.Tensor]] = [None] * len(self.buckets)  # reduced fp32 shards
        self._staging: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._arrived: list[set[int]] = [set() for _ in self.buckets]
        self._pending: list[tuple[int, object, torch.Tensor, torch.Tensor]] = []
        self._spares: list[torch.Tensor] = []  # finished staging buffers of this backward, for the next buckets
        self._owned: set[int] = set()  # buckets whose staging buffer is ours (not an adopted gradient)
        self._next_launch = 0
        self._boundary = False
        self._where: dict[int, tuple[int, int]] = {}
        for bucket in self.buckets:
            for position, part in enumerate(bucket.parts):
                if part.index >= len(parts) or parts[part.index] is not part:
                    raise ValueError(f"parameter {part.names[0]}: index {part.index} does not match its position")
                self._where[id(part.param)] = (bucket.index, position)
                part.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # --- per micro-step ---------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Arm the hooks for one backward (every micro-step reduces; `boundary`: the shards become final)."""
        self._boundary = boundary
        self._next_launch = 0
        for arrived in self._arrived:
            arrived.clear()

    def end_backward(self) -> None:
        """Launch the buckets still waiting (parameters without a gradient count as zero), then wait for all."""
        while self._next_launch < len(self.buckets):
            self._launch(self._next_launch)
        self._drain(keep=0)
        self._spares.clear()

    def zero(self) -> None:
        """Forget and free all gradients (after a step, or when a step is skipped)."""
        self._stores = [None] * len(self.buckets)
        self.grad_shards = [None] * len(self.parts)

    # --- hooks ------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket_index, position = self._where[id(param)]
        if bucket_index < self._next_launch:
            raise RuntimeError(f"gradient of {self.buckets[bucket_index].parts[position].names[0]} arrived after its "
                               "bucket was reduced (a second backward through it in one micro-step?)")
        if not self._adopt(bucket_index, param.grad):
            self._pack(bucket_index, position, param.grad)
        param.grad = None  # the full gradient lives only in the staging buffer now
        while (self._next_launch < len(self.buckets)
               and len(self._arrived[self._next_launch]) == len(self.buckets[self._next_launch].parts)):
            self._launch(self._next_launch)

    def _adopt(self, bucket_index: int, grad: torch.Tensor) -> bool:
        """A bucket of one unpadded parameter reduces its gradient in place: divided by N, no copy."""
        bucket = self.buckets[bucket_index]
        part = bucket.parts[0]
        if (len(bucket.parts) > 1 or self._staging[bucket_index] is not None or part.numel != part.padded_numel
                or grad.dtype != part.dtype or not grad.is_contiguous() or self.comm.size == 1):
            return False
        staging = grad.view(-1)
        staging.div_(self.comm.size)
        self._staging[bucket_index] = staging
        self._count_staging(staging.numel() * staging.element_size())
        self._arrived[bucket_index].add(0)
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
        self._arrived[bucket_index].add(position)

    def _columns(self, bucket_index: int, position: int) -> torch.Tensor:
        """The (N, shard) view of the staging buffer that holds one member's chunks."""
        bucket = self.buckets[bucket_index]
        if self._staging[bucket_index] is None:
            self._staging[bucket_index] = self._take_staging(bucket)
            self._owned.add(bucket_index)
        start = bucket.offsets[position]
        rows = self._staging[bucket_index].view(bucket.comm.size, bucket.shard_numel)
        return rows[:, start:start + bucket.parts[position].shard_numel]

    def _take_staging(self, bucket: ReduceBucket) -> torch.Tensor:
        """A staging buffer for `bucket`: the head of a finished one of this backward if one fits, else new."""
        numel, part = bucket.comm.size * bucket.shard_numel, bucket.parts[0]
        for index, spare in enumerate(self._spares):
            if spare.numel() >= numel and spare.dtype == part.dtype and spare.device == part.device:
                buffer = self._spares.pop(index)
                self._count_staging(buffer.numel() * buffer.element_size())
                self.stats["staging_reused"] += 1
                return buffer[:numel]
        buffer = torch.empty(numel, dtype=part.dtype, device=part.device)
        self._count_staging(buffer.numel() * buffer.element_size())
        return buffer

    # --- reduction --------------------------------------------------------
    def _launch(self, bucket_index: int) -> None:
        bucket = self.buckets[bucket_index]
        for position in range(len(bucket.parts)):  # members that got no gradient this backward count as zero
            if position not in self._arrived[bucket_index]:
                self._columns(bucket_index, position).zero_()
        staging = self._staging[bucket_index]
        self._staging[bucket_index] = None
        output = torch.empty(bucket.shard_numel, dtype=staging.dtype, device=staging.device)
        handle = bucket.comm.reduce_scatter(output, staging, async_op=True)
        self.stats["reduce_scatters"] += 1
        self._pending.append((bucket_index, handle, output, staging))
        self._next_launch = bucket_index + 1
        self._drain(keep=self.max_in_flight)

    def _drain(self, keep: int) -> None:
        """Finish all but the newest `keep` reduce-scatters in flight, oldest first."""
        while len(self._pending) > keep:
            bucket_index, handle, output, staging = self._pending.pop(0)
            handle.wait()
            whole = staging if staging._base is None else staging._base  # a reused spare counts whole
            self._count_staging(-whole.numel() * whole.element_size())
            if bucket_index in self._owned:
                self._owned.discard(bucket_index)
                self._spares.append(whole)
            del staging, whole
            self._store(bucket_index, output)
            if self._boundary:
                for part in self.buckets[bucket_index].parts:
                    for callback in self.shard_ready_callbacks:
                        callback(part.index)

    def _store(self, bucket_index: int, output: torch.Tensor) -> None:
        bucket = self.buckets[bucket_index]
        store = self._stores[bucket_index]
        if store is not None:
            store.add_(output)
            return
        store = output if output.dtype == torch.float32 else output.float()
        self._stores[bucket_index] = store
        for part, offset in zip(bucket.parts, bucket.offsets):
            self.grad_shards[part.index] = store[offset:offset + part.shard_numel]

    def _count_staging(self, nbytes: int) -> None:
        self.stats["staging_bytes"] += nbytes
        self.stats["peak_staging_bytes"] = max(self.stats["peak_staging_bytes"], self.stats["staging_bytes"])

    # --- the engine's optimizer-step report (no error feedback here) ---------
    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        """Count the optimizer step (the GradReducer interface; nothing else to adjust without qgZ)."""
        self.optimizer_steps += 1

    def loco_bytes(self) -> int:
        return 0

    # --- accounting -------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of reduced gradient shards held now (zero between optimizer steps)."""
        return sum(store.numel() * store.element_size() for store in self._stores if store is not None)
