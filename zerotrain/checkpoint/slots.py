"""What the engine hands the checkpoint: a fixed, declared set of state (`CheckpointState`).

The checkpoint never reads or writes an engine attribute; the engine builds a
`CheckpointState` (`ZeroTrainEngine.checkpoint_state()`) and everything here works on it:

- `slots()`: the trainable slots (a master tensor that the optimizer updates, with its
  records), then at stage 3 the partitioned frozen parameters as slots with `master=None`
  (no master copy, no optimizer state). Everything else (frozen parameters at stages 0-2,
  persistent buffers) is whole in `module` on every rank.
- `optimizer`: the torch optimizer, read for its param groups and, per master tensor,
  `optimizer.state[master]` (the optimizer-state accessor).
- objects with `state_dict()` / `load_state_dict()`: the step counters, the loss scaler,
  the LR scheduler, LoCo's error buffers.
- the topology and the world-wide comm, and how to page offloaded state in (`resident`).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Protocol

import torch

from ..comm import Comm
from ..config import ZeroTrainConfig
from ..sharding import ShardedSlot
from ..topology import Topology
from .fence import SnapshotFences


class Stateful(Protocol):
    """Anything saved as a JSON-ready dict and restored from one (counters, loss scaler, scheduler)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class LoCoState(Protocol):
    """LoCo's per-rank error buffers (`enabled` False when gradients are not quantized with LoCo).

    `state_dict()` gives CPU copies, safe to write later; `load_state_dict(None)` restarts them from
    zero; either way the reducer's step count follows the restored `global_steps`."""

    enabled: bool

    def state_dict(self) -> Optional[dict]: ...

    def load_state_dict(self, state: Optional[dict]) -> None: ...


@dataclass(frozen=True)
class CheckpointState:
    """Everything a save reads and a load writes, as the engine declares it (see the module docstring)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    slots: Callable[[], list[ShardedSlot]]      # trainable (the optimizer's order), then frozen partitioned
    publish: Callable[[], None]                 # make model weights current after slots were written (a load)
    resident: Callable[[bool], AbstractContextManager[Any]]  # offloaded states paged in; arg: write_back
    topology: Topology
    world: Comm                                 # every rank, data- and tensor-parallel (training backend)
    config: ZeroTrainConfig
    stage: int
    dtype: torch.dtype
    ep_rank: int                                # rank in the expert-parallel group (dp_rank without experts)
    defer_copies: bool                          # snapshot copies may run in the background (see checkpointer)
    counters: Stateful                          # global_steps, global_samples, skipped_steps, micro_steps
    loss_scaler: Stateful
    scheduler: Optional[Stateful]
    loco: LoCoState
    fences: SnapshotFences                      # pending async snapshot copies of these slots
    # Files copied into every checkpoint directory by rank 0, listed in the manifest ({name: bytes}; e.g. the
    # tokenizer's, so AutoTokenizer.from_pretrained(checkpoint) works). The engine's dict: later additions count.
    files: dict = field(default_factory=dict)
    # True while gradients are held that no optimizer step applied (a save then warns: they are not saved)
    gradients_pending: Callable[[], bool] = field(default=lambda: False)
    # {name: owner's name}: this rank's tensors that are copies of a tensor saved under another name (a tied
    # layer's weights on a later pipeline stage, zerotrain.pipe): left out of a save (the owner's are saved,
    # once), loaded from the owner's entries (weights and optimizer states).
    aliases: dict = field(default_factory=dict)
    # Host bytes a verified load may spend now on a second copy of optimizer states the optimizer already has:
    # within it they are read into new tensors with their crc32 as the bytes land and swapped in after the
    # verdict (one pass over the bytes); beyond it (0: never) they are checksummed first and copied in after.
    load_copy_bytes: Callable[[], int] = field(default=lambda: 0)


def sharded_names(slots) -> set[str]:
    return {record.name for slot in slots for record in slot.records}


def aliased_slots(slots: list[ShardedSlot], aliases: dict) -> list[ShardedSlot]:
    """`slots` with each record of an aliased name renamed to its owner's (what a load reads them from)."""
    if not aliases:
        return slots
    return [replace(slot, records=[replace(record, name=aliases.get(record.name, record.name))
                                   for record in slot.records]) for slot in slots]
