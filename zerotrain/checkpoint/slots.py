"""What the engine holds, as the checkpoint sees it: sharded slots, trainable and frozen.

`engine.sharded_slots()` gives the trainable slots (a master tensor that the
optimizer updates, with its records). At stage 3 frozen parameters are partitioned
too, so they are not whole in `engine.module` on every rank; `engine.frozen_slots()`
gives them as slots with `master=None` (no master copy, no optimizer state).
Everything else (frozen parameters at stages 0-2, persistent buffers) is whole on
every rank. Only these public engine methods are read: the checkpoint never looks
inside the engine's partitions.
"""
from __future__ import annotations

import torch.distributed as dist

from ..comm import Comm
from ..sharding import ShardedSlot


def frozen_slots(engine) -> list[ShardedSlot]:
    """Partitioned frozen parameters (stage 3), as slots without a master."""
    provided = getattr(engine, "frozen_slots", None)
    return list(provided()) if callable(provided) else []


def all_slots(engine) -> list[ShardedSlot]:
    """Trainable slots first (in the optimizer's order), then frozen partitioned ones.

    Buckets of experts split over ranks (`expert_local`) are ordinary slots here: this rank's
    experts (whole, or its shard of them over the expert-data-parallel group), placed in the
    whole tensors by `ep_slice` (`split`)."""
    return list(engine.sharded_slots()) + frozen_slots(engine)


def sharded_names(slots) -> set[str]:
    return {record.name for slot in slots for record in slot.records}


def refresh_after_load(engine) -> None:
    """Make every rank's model weights current after masters and frozen shards were written."""
    engine.publish_weights()


def world_comm(engine) -> Comm:
    """Every rank, data- and tensor-parallel, on the training group's backend.

    `engine.comm` spans only the data-parallel group; with tensor parallelism each group holds
    other slices, so what a checkpoint plans, agrees on and commits must span the world."""
    topology = engine.topology
    if getattr(topology, "tp_size", 1) == 1:
        return engine.comm
    return engine.comm.subgroup(dist.group.WORLD, topology.rank, topology.world_size)
