"""What the engine hands the checkpoint: its `CheckpointState`, built from the parts.

The slots (trainable master shards with their layout records, then frozen ones), how loaded weights are
published, which offloaded states must be paged in (`resident_model_states`), the step counters and
LoCo's error buffers as `state_dict()` objects. `zerotrain.checkpoint` does the work; it reads nothing
of the engine but this.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..budget import load_copy_allowance
from ..checkpoint import CheckpointState
from ..offload.param_store import resident_model_states
from ..sharding import ShardedSlot
from .parts import EngineParts

__all__ = ["sharded_slots", "frozen_slots", "publish_weights", "checkpoint_state", "StepCounters", "ReducerLoCoState"]


def sharded_slots(parts: EngineParts) -> list[ShardedSlot]:
    """This rank's master shards with their layout records (what a checkpoint saves and loads)."""
    return [ShardedSlot(records=bucket.shard_records(), master=master,
                        model_shard=bucket.local_shard(), replicated=bucket.partitions == 1)
            for bucket, master in zip(parts.weights.buckets, parts.zero_optimizer.masters)]


def frozen_slots(parts: EngineParts) -> list[ShardedSlot]:
    """Frozen (untrained) parameters as slots without a master (`Weights.frozen_slots`)."""
    return parts.weights.frozen_slots()


def publish_weights(parts: EngineParts) -> None:
    """Make every rank's model weights current after masters or frozen shards were written (a load)."""
    parts.zero_optimizer.publish()
    parts.weights.refresh()


class StepCounters:
    """The engine's step counters as a checkpoint saves and restores them (`holder`: the engine)."""

    _KEYS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

    def __init__(self, holder: Any):
        self._holder = holder

    def state_dict(self) -> dict:
        return {key: getattr(self._holder, key) for key in self._KEYS}

    def load_state_dict(self, state: dict) -> None:
        for key in self._KEYS:
            setattr(self._holder, key, int(state[key]))


class ReducerLoCoState:
    """The gradient reducer's LoCo error buffers as a checkpoint saves and restores them
    (`checkpoint.LoCoState`); `steps`: the optimizer steps taken so far, read at load."""

    def __init__(self, parts: EngineParts, steps: Any):
        self._reducer = parts.reducer
        self._steps = steps

    @property
    def enabled(self) -> bool:
        return bool(self._reducer.loco_enabled)

    def state_dict(self) -> Optional[dict]:
        return self._reducer.loco_state() if self.enabled else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """The saved buffers, or zero when `state` is None; reset_T keeps counting from the restored step."""
        reducer = self._reducer
        reducer.optimizer_steps = self._steps()
        if not reducer.loco_enabled:
            return
        if state is None:
            reducer.reset_loco_state()
        else:
            reducer.load_loco_state(state)


def checkpoint_state(parts: EngineParts, holder: Any, files: dict) -> CheckpointState:
    """The declared set of state a checkpoint saves and loads (the checkpoint reads nothing else); `holder`
    keeps the step counters (the engine), `files` are copied into every checkpoint."""
    topology = parts.topology
    world = parts.comm if topology.tp_size == 1 else \
        parts.comm.subgroup(torch.distributed.group.WORLD, topology.rank, topology.world_size)
    return CheckpointState(
        module=parts.module, optimizer=parts.optimizer,
        slots=lambda: sharded_slots(parts) + frozen_slots(parts), publish=lambda: publish_weights(parts),
        resident=lambda write_back: resident_model_states(parts.zero_optimizer, parts.param_store, write_back),
        topology=topology, world=world, config=parts.config, stage=parts.stage, dtype=parts.dtype,
        ep_rank=int(parts.expert_groups.ep.rank) if parts.expert_groups is not None else int(topology.dp_rank),
        # Snapshot copies may run in the background only for CPU tensors that only step() changes: not with
        # an offloaded optimizer (NVMe states are resident only during the save; SuperOffload updates masters
        # during backward).
        defer_copies=topology.device.type == "cpu" and parts.zero_optimizer.snapshot_in_background,
        counters=StepCounters(holder), gradients_pending=lambda: holder.gradients_pending,
        loss_scaler=parts.loss_scaler, scheduler=parts.lr_scheduler,
        loco=ReducerLoCoState(parts, lambda: holder.global_steps), fences=parts.fences, files=files,
        load_copy_bytes=lambda: load_copy_allowance(topology))
