"""The global gradient norm and overflow check over the whole (data, tensor) rank grid.

Each data-parallel rank holds a shard of each bucket's gradient (stage 0: all of it), and
with tensor parallelism each tensor-parallel rank holds its slice of every split parameter
and a whole copy of every replicated one (identical on every tensor-parallel rank). So
that every distinct gradient element counts exactly once, squares are summed over the
data-parallel ranks when buckets are partitioned, split slices over the tensor-parallel
ranks, and replicated parameters are taken from tensor-parallel rank 0 alone. Which pieces
of a shard are split comes from the shard records and the parameters' TensorSlice.
Expert buckets (whose ShardGroup is the expert-data-parallel group, zerotrain.sharding) are
summed over the data-parallel ranks too: partitioned ones over the expert-data-parallel group contribute their shards, replicated
ones only from that group's rank 0, so each expert element counts once whatever ep_size is.
With tensor parallelism experts are not split by it (no `tp_slice`): like replicated parameters
they count on tensor-parallel rank 0 only (`_split_ranges` leaves them out elsewhere).
With pipeline parallelism each stage holds different parameters: the squares (and the overflow flag) are
summed over the pipeline group too, and a tied parameter's copy on a later stage
(`sharding.is_pipeline_replica`) counts on its owning stage only.
"""
from __future__ import annotations

import math
from typing import Collection, Optional

import torch

from ..comm import Comm
from ..sharding import is_pipeline_replica, tensor_slice_of
from .flat import ShardLayout

__all__ = ["GlobalGradients", "squared_l2"]


# Elements cast to the norm's dtype at a time: a bounded fp64 copy (8 MiB), never one of the whole shard.
NORM_PIECE = 1 << 20


def norm_dtype(device: torch.device) -> torch.dtype:
    """The dtype the squares are summed in: fp64, as DeepSpeed 0.19's `get_norm_dtype()` (its ZeRO
    optimizers take each gradient's norm in fp64, sum the squares in fp64 and reduce that sum), except on a
    device without fp64 (MPS), where it is fp32 as there."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def squared_l2(grad: torch.Tensor) -> torch.Tensor:
    """Σ grad², summed in `norm_dtype` (fp64), cast `NORM_PIECE` elements at a time, without materializing
    a squared copy of the gradient (every optimizer, on the device or offloaded, sums it this way, so their
    clipping agrees bit for bit). In fp32 a large model's sum loses the small parameters' squares beside
    the large ones (1e-5 relative off DeepSpeed's norm on a 3M model)."""
    dtype = norm_dtype(grad.device)
    flat = grad.reshape(-1)
    if flat.numel() <= NORM_PIECE:
        return torch.linalg.vector_norm(flat, dtype=dtype).square()
    total = torch.zeros((), dtype=dtype, device=grad.device)
    for piece in flat.split(NORM_PIECE):
        total += torch.linalg.vector_norm(piece, dtype=dtype).square()
    return total


def _split_ranges(bucket: ShardLayout, split_only: bool = True) -> list[tuple[int, int]]:
    """[start, end) ranges of this rank's shard that count in the norm here: pieces of tensor-parallel-split
    parameters (`split_only`, tensor-parallel ranks other than 0) or of any parameter, never of a pipeline
    replica (counted on its owning stage)."""
    counted = {name for name, param in zip(bucket.names, bucket.params)
               if not is_pipeline_replica(param) and (not split_only or tensor_slice_of(param) is not None)}
    ranges: list[list[int]] = []
    for record in bucket.shard_records():
        if record.name not in counted:
            continue
        start, end = record.shard_start, record.shard_start + record.numel
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
    return [(start, end) for start, end in ranges]


class GlobalGradients:
    """Norm and overflow of the gradient shards of `buckets`, agreed on every rank of the grid."""

    def __init__(self, buckets: list[ShardLayout], comm: Comm, tp_comm: Optional[Comm] = None,
                 pp_comm: Optional[Comm] = None):
        self.comm = comm
        self.pp_comm = pp_comm if pp_comm is not None and pp_comm.size > 1 else None
        # Buckets whose squares are summed over the data-parallel ranks: partitioned or split experts.
        self._distinct = [bucket.group.distinct for bucket in buckets]
        # Expert replicas over the expert-data-parallel group count on one rank of it only.
        self._counted = [bucket.group.counts_in_norm for bucket in buckets]
        self.tp_comm = tp_comm if tp_comm is not None and tp_comm.size > 1 else None
        # Tensor-parallel ranks other than 0 count only their split slices; pipeline replicas count elsewhere.
        # Per bucket: the [start, end) ranges counted, or None for the whole shard.
        split_only = self.tp_comm is not None and self.tp_comm.rank != 0
        self._ranges: list[Optional[list[tuple[int, int]]]] = [
            _split_ranges(bucket, split_only)
            if split_only or any(is_pipeline_replica(param) for param in bucket.params) else None
            for bucket in buckets]

    def bucket_terms(self, index: int, grad: torch.Tensor) -> list[torch.Tensor]:
        """The squares bucket `index`'s gradient shard adds to the norm, in the order `squared_norm` adds
        them: computed ahead (super_offload does it in its background thread as each bucket's gradient
        becomes final) and handed to `squared_norm`, the sum is bit for bit the same."""
        if not self._counted[index]:
            return []
        ranges = self._ranges[index]
        if ranges is None:
            return [squared_l2(grad)]
        return [squared_l2(grad[start:end]) for start, end in ranges]

    def squared_norm(self, grad_shards: list[torch.Tensor],
                     terms: Optional[dict[int, list[torch.Tensor]]] = None) -> float:
        """Σ g² over every distinct gradient element of the model (still loss-scaled); `terms` holds
        `bucket_terms` already computed for some buckets."""
        device = grad_shards[0].device if grad_shards else torch.device("cpu")
        dtype = norm_dtype(device)  # fp64: the running sum too, and the all-reduce (DeepSpeed sums in fp64)
        distinct = torch.zeros(1, dtype=dtype, device=device)  # summed over data-parallel ranks
        replicated = torch.zeros(1, dtype=dtype, device=device)  # the same on every one
        for index, grad in enumerate(grad_shards):
            squared = distinct if self._distinct[index] else replicated
            known = terms.get(index) if terms else None
            for term in known if known is not None else self.bucket_terms(index, grad):
                squared += term
        if any(self._distinct):
            self.comm.sum_scalar(distinct)
        squared = distinct + replicated
        if self.tp_comm is not None:
            self.tp_comm.sum_scalar(squared)
        if self.pp_comm is not None:  # every stage holds different parameters
            self.pp_comm.sum_scalar(squared)
        return squared.item()

    def norm(self, grad_shards: list[torch.Tensor], terms: Optional[dict[int, list[torch.Tensor]]] = None) -> float:
        """The global L2 norm of the (still loss-scaled) gradients (`terms`: see `squared_norm`)."""
        return math.sqrt(self.squared_norm(grad_shards, terms))

    def terms_prove_finite(self, index: int, terms: list[torch.Tensor]) -> bool:
        """Whether bucket `index`'s `bucket_terms` show its whole gradient shard finite: a sum of squares
        is inf or nan when any element is, so a finite sum over the whole shard proves every element finite
        (an inf sum of finite squares proves nothing: that shard is then checked element by element)."""
        return bool(terms) and self._counted[index] and self._ranges[index] is None and \
            all(bool(torch.isfinite(term).all()) for term in terms)

    def overflow(self, grad_shards: list[torch.Tensor], known_finite: Collection[int] = ()) -> bool:
        """True on every rank of the grid when any rank's gradients hold inf or nan (`known_finite`: buckets
        already proven finite, see `terms_prove_finite`, not read again)."""
        device = grad_shards[0].device if grad_shards else torch.device("cpu")
        local = any(not torch.isfinite(grad).all() for index, grad in enumerate(grad_shards)
                    if index not in known_finite)
        overflow = self.comm.any_true(local, device)
        if self.tp_comm is not None:
            overflow = self.tp_comm.any_true(overflow, device)
        if self.pp_comm is not None:
            overflow = self.pp_comm.any_true(overflow, device)
        return overflow
