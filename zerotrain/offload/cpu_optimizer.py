"""ZeRO-Offload: the fp32 masters, the optimizer states and the step on the host.

`OffloadOptimizer` is a `ShardedOptimizer` whose masters of the offloaded buckets are
separate fp32 tensors in host memory (pinned when a GPU is present), even when the
"device" is the CPU itself, so the offload path really runs: the reduced fp32 gradient
shard is copied to the host (on a GPU the copy starts in the reducer's shard-ready
callback, during backward), unscaled and clipped there, the torch optimizer (fused
CPU Adam(W), see below) updates the host masters and states, and `publish()` casts them
back into the model's buffers in the training dtype. The math is ShardedOptimizer's,
element for element: same norm, same multiplier, same kernel.

`ratio` < 1 keeps the states of the remaining buckets on the device (their masters
are what ShardedOptimizer would use). Buckets are taken in index order, each one when at
least half of it fits under `ratio` of all shard elements (so the offloaded share is as near
`ratio` as whole buckets allow): `offloaded_bytes()` and `memory_split()` account for the split.

Fast CPU Adam: the offloaded fp32 masters of groups on torch's fused Adam(W) (which
`zerotrain.optim` builds, and to which a user's torch Adam/AdamW that did not choose is
switched here) are stepped by zerotrain's own kernel (`cpu_adam.py`): bit-identical to torch's
fused kernel, with the unscale/clip multiplier applied as the gradient is read instead of a
separate `mul_` pass, and the new weights written into the model's shard (cast to the training
dtype) in the same pass where that shard is a CPU tensor, so `publish()` copies nothing for those
buckets (`shards_written`); other groups keep torch's step. Measured (`benchmarks/offload.py`,
RESULTS_offload.md), 50M parameters: the whole update 1.00-1.07x DeepSpeedCPUAdam's bare step
at 1 and 2 threads (memory-bandwidth bound; torch foreach ~0.15x).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Collection, Optional

import torch

from ..comm import Comm
from ..zero.flat import ShardLayout
from ..zero.gradnorm import GlobalGradients
from ..zero.optimizer import ShardedOptimizer, device_master, is_own_master
from .bf16_host import Bf16HostStates
from .cpu_adam import COPY_BACK_DTYPES, CpuAdamStepper


def choose_offloaded(buckets: list[ShardLayout], ratio: float) -> list[bool]:
    """Which buckets go to the host: in index order, each when half of it still fits under `ratio` of the elements."""
    total = sum(b.shard_numel for b in buckets)
    chosen, done = [], 0
    for bucket in buckets:
        take = ratio >= 1.0 or done + bucket.shard_numel / 2 <= ratio * total
        chosen.append(take)
        if take:
            done += bucket.shard_numel
    return chosen


def host_empty(numel: int, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=torch.float32, pin_memory=pin and torch.cuda.is_available())


def prefer_fused(optimizer: torch.optim.Optimizer) -> None:
    """Switch a torch Adam/AdamW that left the implementation to torch onto the fused kernel."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable") \
                and not group.get("capturable"):
            group["fused"] = True
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.defaults["fused"] = True


def narrows_gradients(config, frees_final_shards: bool) -> bool:
    """Whether plain CPU offload keeps stage 3's reduced gradient shards in the training dtype (bf16: 2 bytes per
    element, not an fp32 copy) and casts each as its Adam kernel reads it: a reducer that can
    (`frees_final_shards`: stage 3's), bf16 training, no fp16, every bucket offloaded, no accumulation (the shards
    would be summed in bf16). With clipping the gradients wait for the norm in host memory: half the bytes."""
    offload = config.zero_optimization.offload_optimizer  # (None: `zerotrain estimate` trying the CPU option)
    return (frees_final_shards and config.bf16.enabled and not config.fp16.enabled
            and (offload is None or float(offload.ratio) >= 1.0) and config.gradient_accumulation_steps == 1)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


class HostGradients:
    """fp32 host copies of the offloaded gradient shards.

    On a GPU, `start` launches the device-to-host copy in the shard-ready callback and
    records an event; `get` waits for it. On the CPU, `get` copies at once (a plain copy).
    A buffer is allocated the first time its bucket needs one: a CPU run that updates with
    the reduced gradients themselves never holds these copies.
    """

    def __init__(self, sizes: dict[int, int], pin: bool):
        self.sizes, self.pin = sizes, pin
        self.buffers: dict[int, torch.Tensor] = {}
        self._events: dict[int, object] = {}

    def _buffer(self, index: int) -> torch.Tensor:
        buffer = self.buffers.get(index)
        if buffer is None:
            buffer = self.buffers[index] = host_empty(self.sizes[index], self.pin)
        return buffer

    def start(self, index: int, grad: torch.Tensor) -> None:
        if grad.is_cuda and index in self.sizes:
            self._buffer(index).copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events[index] = event

    def get(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer(index)
        event = self._events.pop(index, None)
        if event is not None:
            event.synchronize()
        else:
            buffer.copy_(grad)
        return buffer

    def reset(self) -> None:
        for event in self._events.values():
            event.synchronize()
        self._events.clear()

    def nbytes(self) -> int:
        return tensor_bytes(self.buffers.values())


class OffloadOptimizer(ShardedOptimizer):
    """Masters, states and update of the offloaded buckets in host memory; the rest as ShardedOptimizer."""

    kind = "cpu"
    snapshot_in_background = False  # MasterOptimizer: states paged in for the save (NVMe), updated in backward

    def __init__(self, buckets: list[ShardLayout], comm: Comm, optimizer: torch.optim.Optimizer,
                 group_params: list[list[torch.Tensor]], clip_norm: float, ratio: float = 1.0,
                 pin_memory: bool = False, reducer=None, host_grads: bool = True,
                 gradients: Optional[GlobalGradients] = None, master_dtype: torch.dtype = torch.float32,
                 state_dtype: Optional[torch.dtype] = None, narrow_gradients: bool = False):
        """`master_dtype` bf16 (`bf16.bf16_master_weights_and_grads`; `state_dtype` bf16 with
        `bf16.bf16_optimizer_states`): the offloaded masters (and Adam's moments) stored in bf16 (`bf16_host`).
        `narrow_gradients` (`narrows_gradients`): the reducer keeps the shards in the training dtype, each cast
        into one fp32 scratch of the largest shard as the kernel reads it (CPU runs, kernel-stepped groups only)."""
        # Which buckets go to the host, known before ShardedOptimizer builds the masters (initial_master).
        self.ratio = ratio
        self.master_dtype = master_dtype
        self.offloaded = choose_offloaded(buckets, ratio)
        self.device = buckets[0].device if buckets else torch.device("cpu")
        self._pin_memory = pin_memory
        super().__init__(buckets, comm, optimizer, group_params, clip_norm, gradients)
        prefer_fused(optimizer)
        self.cpu_adam = CpuAdamStepper(optimizer)  # our one-pass kernel for fp32 host masters
        self.bf16_host = Bf16HostStates(optimizer, self.cpu_adam, comm.rank if comm is not None else 0,
                                        state_dtype) if master_dtype == torch.bfloat16 else None
        self.shards_written: set[int] = set()  # buckets whose model shard this step's kernel already wrote
        sizes = {i: b.shard_numel for i, b in enumerate(buckets) if self.offloaded[i]}
        self.host_grads = HostGradients(sizes, pin_memory) if host_grads else None
        self.stats: dict[str, float] = {"offloaded_buckets": sum(self.offloaded), "steps": 0}
        self.reducer = reducer
        if reducer is not None:
            reducer.shard_ready_callbacks.append(self._on_shard_ready)
        self.narrow_gradients = bool(narrow_gradients) and reducer is not None and reducer.can_free_final_shards \
            and self.device.type == "cpu" and all(
                self.bf16_host is not None or self.cpu_adam.supports(self.masters[i], b.group_index)
                for i, b in enumerate(buckets) if self.offloaded[i])
        self._grad_scratch: Optional[torch.Tensor] = None  # the fp32 cast of one narrow gradient shard
        if self.narrow_gradients:
            reducer.keep_final_shards_in_training_dtype()

    def initial_master(self, index: int, bucket: ShardLayout) -> torch.Tensor:
        """Offloaded buckets: a host master (`initial_host_master`); the others on the device."""
        shard = bucket.local_shard()
        if self.offloaded[index]:
            return self.initial_host_master(shard, self._pin_memory)
        return device_master(bucket, shard)

    def initial_host_master(self, shard: torch.Tensor, pin_memory: bool) -> torch.Tensor:
        """An offloaded bucket's fp32 master, built from its model shard (NVMe overrides: into the files)."""
        if self.master_dtype == torch.bfloat16:
            return Bf16HostStates.initial_master(shard)
        master = host_empty(shard.numel(), pin_memory)
        master.copy_(shard)
        return master

    # --- gradients arrive during backward ----------------------------------
    def _on_shard_ready(self, index: int) -> None:
        grad = self.reducer.grad_shards[index]
        if self.host_grads is not None and self.offloaded[index] and grad is not None:
            self.host_grads.start(index, grad)

    # --- norm and overflow on the training device ---------------------------
    def has_overflow(self, grad_shards: list[torch.Tensor]) -> bool:
        overflow = self.gradients.overflow(grad_shards, self.known_finite())
        if overflow and self.host_grads is not None:
            self.host_grads.reset()
        return overflow

    def known_finite(self) -> Collection[int]:
        """Buckets already proven free of inf/nan this step, which the overflow check need not read (none here;
        super_offload's norm terms, summed during backward, prove some)."""
        return ()

    def multiplier(self, norm: float, loss_scale: float) -> float:
        """The one factor ShardedOptimizer applies to the gradients: unscale, then clip."""
        multiplier = 1.0 / loss_scale
        if self.clip_norm > 0:
            multiplier *= min(1.0, self.clip_norm / (norm + 1e-6))
        return multiplier

    # --- the step ----------------------------------------------------------
    def step(self, grad_shards: list[torch.Tensor], loss_scale: float) -> None:
        held = sum(g.numel() * g.element_size() for i, g in enumerate(grad_shards) if g is not None and self.offloaded[i])
        norm = self.grad_norm(grad_shards) / loss_scale
        self.last_grad_norm = norm
        self.shards_written = set()
        self.update(grad_shards, self.multiplier(norm, loss_scale), range(len(self.buckets)))
        # the host bytes of gradients the step held: the offloaded shards (and the narrow shards' fp32 scratch)
        held += self._grad_scratch.numel() * 4 if self._grad_scratch is not None else 0
        self.stats["grad_host_peak_bytes"] = max(self.stats.get("grad_host_peak_bytes", 0), held)
        self.stats["steps"] += 1
        self.publish_after_update()

    def publish_after_update(self) -> None:
        """`publish()`, skipping the copy into the model shards the update kernel already wrote (`shards_written`)."""
        written, self.shards_written = self.shards_written, set()
        if written:  # a subclass with its own publish() (NVMe) writes no shard in the kernel: plain call
            self.publish(current=written)
        else:
            self.publish()

    # SuperOffload steps speculatively and may redo a step from the same reduced gradients,
    # so it must multiply a copy; the plain step may scale the reduced gradients in place.
    keeps_reduced_gradients = False

    def host_gradient(self, index: int, grad: torch.Tensor, multiplier: float) -> torch.Tensor:
        """Bucket `index`'s gradient on the host, multiplied exactly as ShardedOptimizer would.

        A reduced gradient that already is an fp32 host tensor (a CPU run) is used as it is,
        as the device optimizer uses it: no copy and no buffer."""
        if grad.device.type == "cpu" and grad.dtype == torch.float32 and not self.keeps_reduced_gradients:
            host = grad
        else:
            host = self.host_grads.get(index, grad)
        if multiplier != 1.0:
            host.mul_(multiplier)
        return host

    def model_shard_target(self, index: int) -> Optional[torch.Tensor]:
        """Bucket `index`'s model shard when the CPU Adam kernel can write the new weights straight into it
        (a contiguous CPU tensor of fp32/bf16/fp16, not the master itself, not an offload_param shard); else None."""
        bucket, master = self.buckets[index], self.masters[index]
        if bucket.offloaded:
            return None
        shard = bucket.local_shard()
        if shard.device.type != "cpu" or shard.dtype not in COPY_BACK_DTYPES or not shard.is_contiguous() \
                or shard.numel() != master.numel() or shard.data_ptr() == master.data_ptr():
            return None
        return shard

    def native_step(self, index: int, grad: torch.Tensor, multiplier: float, copy_back: bool = True) -> bool:
        """Step bucket `index` with zerotrain's CPU Adam kernel (`cpu_adam`) in one pass: the multiplier is
        applied as the gradient is read (the reduced gradient is left as it was) and, with `copy_back`, the
        new weights are cast into the model shard. Returns whether the model shard was written."""
        target = self.model_shard_target(index) if copy_back else None
        if self.bf16_host is not None:
            self.bf16_host.step(index, self.masters[index], self.kernel_gradient(index, grad),
                                self.buckets[index].group_index, multiplier, copy_to=target)
            return target is not None
        self.cpu_adam.step(self.masters[index], self.kernel_gradient(index, grad), self.buckets[index].group_index,
                           multiplier, copy_to=target)
        return target is not None

    def kernel_gradient(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The reduced gradient as the CPU Adam kernel reads it: itself when it is a contiguous fp32 host
        tensor, else its host copy (not multiplied: the kernel applies the multiplier as it reads)."""
        on_host = grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()
        if on_host:
            return grad
        if self.narrow_gradients and grad.device.type == "cpu":  # one scratch, reused bucket after bucket
            if self._grad_scratch is None:
                self._grad_scratch = torch.empty(max(b.shard_numel for i, b in enumerate(self.buckets)
                                                     if self.offloaded[i]), dtype=torch.float32)
            return self._grad_scratch[:grad.numel()].copy_(grad)
        return self.host_grads.get(index, grad)

    def update(self, grad_shards: list[torch.Tensor], multiplier: float, indices) -> None:
        """One optimizer step over buckets `indices` (host and device ones together, one fused call).

        Buckets whose model shard the kernel wrote are added to `shards_written` (publish skips their copy)."""
        chosen, native = [], []
        for index in indices:
            grad, master = grad_shards[index], self.masters[index]
            if grad is None:
                continue
            if self.offloaded[index] and self.bf16_host is not None:
                native.append(index)
                continue
            if self.offloaded[index] and self.cpu_adam.supports(master, self.buckets[index].group_index):
                native.append(index)
                continue
            if self.offloaded[index]:
                master.grad = self.host_gradient(index, grad, multiplier)
            else:
                if multiplier != 1.0:
                    grad.mul_(multiplier)
                master.grad = grad
            chosen.append(master)
        try:
            for index in native:
                if self.native_step(index, grad_shards[index], multiplier):
                    self.shards_written.add(index)
            self.optimizer.step()
        finally:
            for master in chosen:
                master.grad = None
            if self.host_grads is not None:
                self.host_grads.reset()

    # --- accounting ----------------------------------------------------------
    def _bucket_state_bytes(self, index: int) -> int:
        return tensor_bytes(self.optimizer.state.get(self.masters[index], {}).values())

    def memory_split(self) -> dict[str, int]:
        """Bytes of masters and optimizer states by where they live: device, host, nvme (+ host buffers)."""
        split = {"device": 0, "host": 0, "nvme": 0, "host_buffers": 0}
        for index, (bucket, master) in enumerate(zip(self.buckets, self.masters)):
            state = self._bucket_state_bytes(index)
            if self.offloaded[index]:
                split["host"] += state + master.numel() * master.element_size()
            else:
                split["device"] += state + (0 if is_own_master(bucket) else master.numel() * master.element_size())
        if self.host_grads is not None:
            split["host_buffers"] += self.host_grads.nbytes()
        if self._grad_scratch is not None:
            split["host_buffers"] += self._grad_scratch.numel() * 4
        return split

    def offloaded_bytes(self) -> int:
        """Bytes of masters and optimizer states moved off the device (host memory and NVMe files)."""
        split = self.memory_split()
        return split["host"] + split["nvme"]

    def state_bytes(self) -> int:
        """Bytes of optimizer state and separate masters left on the device (what ZeRO memory reports count)."""
        return self.memory_split()["device"]

    @contextmanager
    def resident_states(self, write_back: bool = True):
        """Every optimizer state in `optimizer.state` while inside: host states always are (NVMe pages them in);
        bf16-stored masters and states are fp32 copies while inside (`Bf16HostStates.widen`)."""
        if self.bf16_host is None:
            yield self
            return
        with self.bf16_host.widen([m for m, off in zip(self.masters, self.offloaded) if off], write_back):
            yield self

    def close(self) -> None:
        """Release threads and files (nothing to release for plain CPU offload)."""


def resident_states(zero_optimizer, write_back: bool = True):
    """Context in which all of `zero_optimizer`'s states are in `optimizer.state` (checkpoint save and load).

    NVMe offload pages its per-element states into host memory while inside and, with
    `write_back`, writes what is there to its files on exit; others need nothing.
    """
    return zero_optimizer.resident_states(write_back=write_back)
