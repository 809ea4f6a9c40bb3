"""The optimizer step over this rank's shards of the fp32 master weights.

Each bucket contributes one master tensor: this rank's shard of the bucket's
flat buffer, in fp32. In fp32 training it is a view of the model's own flat
buffer (no copy); under bf16/fp16 it is a separate fp32 copy. A plain torch
optimizer updates those master tensors, so any element-wise torch optimizer
(AdamW, Adam, SGD, ...) works unchanged and its states take 1/N of the memory.

The step: agree on overflow (fp16), compute the global gradient norm with one
all-reduce of squared shard norms, unscale and clip in one multiply, update,
cast the shards back into the training dtype, and all-gather the parameters.
"""
from __future__ import annotations

from typing import Collection, Optional

import torch

from ..comm import Comm
from .flat import ShardLayout
from .gradnorm import GlobalGradients
from .interfaces import MasterOptimizer


# A kept-whole bucket whose full copy is at most this many bytes is all-gathered in one collective with the other
# small ones of its group and device (`Comm.all_gather_coalesced`): stage 3's small persistent parameters were one
# small all-gather each (98 per step at a 70M GPT). Larger buckets keep their own collective (no packing copy).
COALESCE_BYTES = 1 << 20


def is_own_master(bucket: ShardLayout) -> bool:
    """An fp32 shard in device memory is its own fp32 master (no copy); any other needs one."""
    return bucket.dtype == torch.float32 and bucket.shard_in_device_memory


def device_master(bucket: ShardLayout, shard: torch.Tensor) -> torch.Tensor:
    """The fp32 master of `shard` on the device: the shard itself when it can be, else an fp32 copy
    (another dtype, or a stage-3 shard offloaded to host or NVMe by offload_param)."""
    return shard if is_own_master(bucket) else shard.detach().to(device=bucket.device, dtype=torch.float32, copy=True)


class ShardedOptimizer(MasterOptimizer):
    """Wraps a torch optimizer whose parameters are this rank's fp32 master shards.

    Subclasses (zerotrain.offload) choose where a bucket's master lives by overriding `initial_master`."""

    def __init__(self, buckets: list[ShardLayout], comm: Comm, optimizer: torch.optim.Optimizer,
                 group_params: list[list[torch.Tensor]], clip_norm: float,
                 gradients: Optional[GlobalGradients] = None):
        """`gradients` agrees on norm and overflow across the grid (default: the data-parallel ranks)."""
        self.buckets = buckets
        self.comm = comm
        self.clip_norm = clip_norm
        self.gradients = gradients if gradients is not None else GlobalGradients(buckets, comm)
        self.masters: list[torch.Tensor] = []
        for index, bucket in enumerate(buckets):
            self.masters.append(self.initial_master(index, bucket))
        self.optimizer = optimizer
        self._rewire(group_params)
        self.last_grad_norm: Optional[float] = None
        self.stats: dict[str, float] = {}  # counters of offloaded optimizers (MasterOptimizer.stats)

    def initial_master(self, index: int, bucket: ShardLayout) -> torch.Tensor:
        """Bucket `index`'s fp32 master, built from its model shard: on the device (`device_master`)."""
        return device_master(bucket, bucket.local_shard())

    def _rewire(self, group_params: list[list[torch.Tensor]]) -> None:
        """Point every optimizer group at the master shards of its buckets, dropping old state."""
        by_group: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(self.optimizer.param_groups))}
        for bucket, master in zip(self.buckets, self.masters):
            by_group[bucket.group_index].append(master)
        for index, group in enumerate(self.optimizer.param_groups):
            group["params"] = by_group[index]
        self.optimizer.state.clear()
        del group_params  # only the shapes of the original groups mattered

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    # --- the step ---------------------------------------------------------
    def grad_norm(self, grad_shards: list[torch.Tensor]) -> float:
        """The global L2 norm of the (still loss-scaled) gradients over all shards."""
        return self.gradients.norm(grad_shards)

    def has_overflow(self, grad_shards: list[torch.Tensor]) -> bool:
        """True on every rank when any rank's gradients hold inf or nan."""
        return self.gradients.overflow(grad_shards)

    def step(self, grad_shards: list[torch.Tensor], loss_scale: float) -> None:
        """Unscale and clip the gradient shards, update the masters, refresh the model weights."""
        norm = self.grad_norm(grad_shards) / loss_scale
        self.last_grad_norm = norm
        multiplier = 1.0 / loss_scale
        if self.clip_norm > 0:
            multiplier *= min(1.0, self.clip_norm / (norm + 1e-6))
        for master, grad in zip(self.masters, grad_shards):
            if multiplier != 1.0:
                grad.mul_(multiplier)
            master.grad = grad
        self.optimizer.step()
        for master in self.masters:
            master.grad = None
        self.publish()

    def publish(self, current: Collection[int] = ()) -> None:
        """Cast master shards into the model's flat buffers and all-gather every bucket.

        `current`: indices of buckets whose model shard already holds the cast masters (the offload
        CPU Adam kernel wrote it in its update pass); only their all-gather is left to do."""
        handles = []
        small: dict[tuple[int, torch.device], tuple[Comm, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for index, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            if bucket.offloaded:  # offload_param: into host memory or the NVMe file
                bucket.write_shard(master)
                continue
            shard = bucket.local_shard()
            if index not in current and master.data_ptr() != shard.data_ptr():
                shard.copy_(master)
            if bucket.keeps_full_copy and (bucket.partitions > 1 or shard.data_ptr() != bucket.flat_param.data_ptr()):
                # Stages 1-2 (and stage-3 parameters kept whole): refresh the full copy now.
                comm = bucket.group.comm  # split experts: their expert-data-parallel group
                full = bucket.flat_param
                if full.numel() * full.element_size() <= COALESCE_BYTES:  # with the other small ones, below
                    small.setdefault((id(comm), shard.device), (comm, []))[1].append((full, shard))
                else:
                    handles.append(comm.all_gather(full, shard, async_op=True))
        for comm, pairs in small.values():  # in bucket order: the same on every rank of the group
            handles.append(comm.all_gather_coalesced(pairs, async_op=True))
        for handle in handles:
            handle.wait()

    # --- accounting -------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state plus separate fp32 master copies this rank holds."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        for bucket, master in zip(self.buckets, self.masters):
            if not is_own_master(bucket):
                total += master.numel() * master.element_size()
        return total
