"""The declared interfaces between the engine and its parts: gradient reducer, master-weight optimizer,
parameter store.

The engine holds one of each and calls only what is declared here. Optional capabilities (what only
some implementations do: super_offload's `before_model_use`, offload's `memory_split`, NVMe's `close`)
are real methods with no-op defaults, so the engine calls them unconditionally instead of probing for
them by name. Implementations subclass the Protocol explicitly to inherit those defaults.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, NamedTuple, Optional, Protocol, runtime_checkable

import torch

__all__ = ["BucketReduce", "GradientReducer", "MasterOptimizer", "ParamStore", "ShardExtent"]


class ShardExtent(NamedTuple):
    """Where an NVMe parameter store keeps one shard: the store's I/O engine (`offload.aio.AsyncFileIO`), its
    file descriptor, the byte offset of the shard's aligned extent and the extent's bytes (the shard's, rounded
    up to the alignment)."""

    io: Any
    fd: int
    offset: int
    nbytes: int


@runtime_checkable
class BucketReduce(Protocol):
    """How a reducer sums one bucket's gradient over the bucket's ShardGroup (`zero.reduce`: exact, or
    qgZ with LoCo). Bound once to the reducer's buckets (anything with `group` and `shard_numel`);
    `index` is a bucket's position among them. The error-feedback methods are no-ops by default."""

    exact: bool  # False: a quantized sum; reducers divide by the world size before it (the mean is quantized)

    def bind(self, buckets) -> None:
        ...

    def all_reduce(self, index: int, source: torch.Tensor):
        """Start summing `source` in place over bucket `index`'s group; returns the handle."""
        ...

    def reduce_scatter(self, index: int, source: torch.Tensor, out: Optional[torch.Tensor] = None):
        """Start reducing rank-major `source` into this rank's shard (into `out` when the reduce can);
        returns (shard, handle)."""
        ...

    # --- error feedback (LoCo): no-op defaults ------------------------------
    loco_enabled: bool = False

    def loco_after_step(self, overflow: bool, scale_before: float, scale_after: float, steps: int) -> None:
        """After an optimizer step (taken or skipped); `steps` counted so far, this one included."""

    def loco_state(self) -> dict:
        """The error buffers and their layout, for a checkpoint."""
        return {}

    def load_loco_state(self, state: dict) -> bool:
        """Restore what loco_state() returned; whether the buffers were loaded."""
        return False

    def reset_loco_state(self) -> None:
        """Zero every error buffer."""

    def loco_bytes(self) -> int:
        return 0


@runtime_checkable
class GradientReducer(Protocol):
    """Turns the backward pass's gradients into this rank's reduced fp32 gradient shards (`grad_shards`,
    one per bucket, in the buckets' order), launching collectives as buckets fill."""

    grad_shards: list
    shard_ready_callbacks: list[Callable[[int], None]]  # called with a bucket index when its shard is final
    optimizer_steps: int
    stats: dict  # counters of its work (staging buffers, reduce-scatters); empty where it does none

    def begin_backward(self, boundary: bool) -> None:
        """Before a backward pass; `boundary`: its gradients end the accumulation (reduce them)."""
        ...

    def end_backward(self) -> None:
        """After a backward pass: wait for every reduction launched by it."""
        ...

    def zero(self) -> None:
        """Drop the accumulated gradients (after the step)."""
        ...

    def after_optimizer_step(self, overflow: bool, scale_before: float, scale_after: float) -> None:
        """After the optimizer step (or a skipped one): error-feedback bookkeeping."""
        ...

    def held_bytes(self) -> int:
        """Bytes of gradient buffers this rank holds."""
        ...

    # --- LoCo's error buffers (qgZ): none by default ---------------------------
    loco_enabled: bool = False

    def loco_bytes(self) -> int:
        """Bytes of LoCo error buffers (0 without qgZ's LoCo)."""
        return 0

    def loco_state(self) -> dict:
        """The error buffers and the optimizer-step count, for a checkpoint (per rank)."""
        return {"optimizer_steps": self.optimizer_steps}

    def load_loco_state(self, state: dict) -> bool:
        """Restore what loco_state() returned; whether error buffers were loaded."""
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        return False

    def reset_loco_state(self) -> None:
        """Zero every LoCo error buffer (the step count is kept)."""

    # --- final shards consumed by the callbacks (NVMe offload's streamed step): only where declared ----------
    can_free_final_shards: bool = False  # whether `free_final_shards()` is supported (stage 3's reducer)

    def free_final_shards(self) -> None:
        """From now on drop each final shard right after the `shard_ready_callbacks` ran: a consumer that steps
        every shard in its callback (NVMe offload, streaming) asks for it, so host memory never holds all
        gradients. Only where `can_free_final_shards`."""
        raise NotImplementedError(f"{type(self).__name__} keeps its final shards until zero()")

    def keep_final_shards_in_training_dtype(self) -> None:
        """From now on keep each reduced shard in the dtype it was reduced in (bf16 training: 2 bytes per element)
        instead of an fp32 copy: a consumer that casts each shard as it reads it (plain CPU offload's Adam kernel)
        asks for it, without gradient accumulation (the shards are not summed). Only where `can_free_final_shards`."""
        raise NotImplementedError(f"{type(self).__name__} keeps fp32 shards")


@runtime_checkable
class MasterOptimizer(Protocol):
    """Steps this rank's fp32 master shards from the reduced gradient shards and publishes them into the
    model's weights. `masters[i]` is bucket i's master (what the checkpoint saves); `optimizer` the torch
    optimizer keyed by them."""

    buckets: list
    masters: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    last_grad_norm: Optional[float]
    stats: dict  # counters of an offloaded optimizer (steps, rollbacks, bytes read...); empty when not offloaded
    # Whether a checkpoint may copy masters and states in the background: they are ordinary tensors that only
    # step() changes (not with offload: NVMe pages states in only for the save, super_offload updates in backward).
    snapshot_in_background: bool = True

    def has_overflow(self, grad_shards: list[torch.Tensor]) -> bool:
        """True on every rank when any rank's gradients hold inf or nan (collective). Optional and repeatable:
        step() does not rely on it having been called (fp32 runs never call it), nor does a later step."""
        ...

    def step(self, grad_shards: list[torch.Tensor], loss_scale: float) -> None:
        """Unscale by `loss_scale`, clip, update the masters and refresh the model weights (collective)."""
        ...

    def publish(self, current: Iterable[int] = ()) -> None:
        ...

    def state_bytes(self) -> int:
        """Bytes of optimizer state and separate masters left on the training device."""
        ...

    def write_master(self, index: int, values: torch.Tensor) -> None:
        """New values for bucket `index`'s master from outside a step (a user's write to a stage-3 parameter:
        GatheredParameters, an in-place initializer); NVMe writes its files. Into the tensor by default."""
        self.masters[index].copy_(values)

    # --- optional capabilities: no-op defaults ------------------------------
    def refuse_training(self, call: str, hint: str = "") -> None:
        """Raise when this optimizer cannot train (a forward-only engine's, `call` naming what was asked);
        nothing by default."""

    def before_model_use(self) -> None:
        """Called before the model is used again (super_offload undoes speculative weights); nothing by default."""

    def takes_norm_first_pass(self) -> bool:
        """Whether each accumulation-boundary backward runs twice over the retained graph: a first pass whose
        reduced shards only give the global gradient norm (`begin_norm_pass` / `end_norm_pass`), then the one that
        steps with the clip fixed (NVMe offload with clipping, `offload.nvme.takes_norm_first`); False by default."""
        return False

    def begin_norm_pass(self) -> None:
        """The first pass's shards, reported final from now on, only add their squares to the norm; nothing by
        default."""

    def end_norm_pass(self, loss_scale: float) -> None:
        """After the first pass: the global norm (collective) and with it the clip of the step; nothing by
        default."""

    def memory_split(self) -> Optional[dict[str, int]]:
        """Bytes of masters and states by place (device, host, nvme, host buffers); None when not offloaded."""
        return None

    def offloaded_bytes(self) -> int:
        """Bytes of masters and states moved off the device."""
        return 0

    def resident_states(self, write_back: bool = True):
        """Context in which every optimizer state is in `optimizer.state` (checkpoint save and load; NVMe pages
        them in and, with `write_back`, writes them out on exit); nothing by default."""
        return contextlib.nullcontext()

    def resident_masters(self):
        """Context in which every master holds its values (NVMe pages them in, read only); nothing by default."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release threads and files; nothing by default."""


@runtime_checkable
class ParamStore(Protocol):
    """Where stage 3's non-persistent parameter shards live under offload_param (host memory or NVMe)."""

    kind: str  # "cpu" or "nvme"
    stats: dict  # counters of its reads and writes; empty where it does none (host memory)

    def add(self, part) -> None:
        """Take `part`'s shard from now on (zero.Init hands each shard in as it partitions a module)."""
        raise NotImplementedError(f"{type(self).__name__} takes its shards when it is built")

    def remove(self, part, keep_values: bool = True) -> None:
        """Give `part`'s shard back to it as a tensor (or, without `keep_values`, drop it)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its shards until closed")

    def shares_device_memory(self, part) -> bool:
        ...

    def host_shard(self, part) -> torch.Tensor:
        ...

    def device_shard(self, part) -> torch.Tensor:
        ...

    def write(self, part, values: torch.Tensor) -> None:
        ...

    def shard_extent(self, part) -> Optional[ShardExtent]:
        """The file extent holding `part`'s shard, or None where the store keeps no file (host memory)."""
        return None

    def lend(self, part) -> None:
        """Lend `part`'s extent (`shard_extent`) to the optimizer until `part`'s next `write`: the gradient
        spilled there for clipping replaces the values on disk, so the store drops its reads in flight and
        reading the shard from the file raises until the write (the step's new values) comes."""
        raise NotImplementedError(f"{type(self).__name__} has no file extents to lend")

    def read_ahead(self, parts: Iterable) -> None:
        ...

    def flush(self) -> None:
        ...

    def resident(self, write_back: bool = True):
        """Context in which every shard is in host memory (checkpoint save and load)."""
        ...

    def memory_split(self) -> dict[str, int]:
        ...

    def hold_back_cache(self, nbytes: int) -> int:
        """Keep the host cache `nbytes` under its bound (`max_in_cpu`) from now on, evicting what no longer fits:
        memory a step holds elsewhere for a while (the norm's first pass keeps the micro-batch's activations,
        `budget.FirstPassReserve`). The latest call's `nbytes` counts, not their sum. Returns the cache's bound
        now, in bytes; 0 where the store keeps no cache (host memory: every shard is there anyway)."""
        return 0

    def close(self) -> None:
        ...
