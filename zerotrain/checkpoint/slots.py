"""What the engine holds, as the checkpoint sees it: sharded slots, trainable and frozen.

`engine.sharded_slots()` gives the trainable slots (a master tensor that the
optimizer updates, with its records). At stage 3 frozen parameters are partitioned
too, so they are not whole in `engine.module` on every rank; they become slots with
`master=None` (no master copy, no optimizer state), read from the engine's
`frozen_slots()` when it has one, else from its stage-3 partitions. Everything else
(frozen parameters at stages 0-2, persistent buffers) is whole on every rank.
"""
from __future__ import annotations

import torch

from ..zero.flat import ShardedSlot


def frozen_slots(engine) -> list[ShardedSlot]:
    """Partitioned frozen parameters (stage 3), as slots without a master."""
    provided = getattr(engine, "frozen_slots", None)
    if callable(provided):
        return list(provided())
    stage3 = getattr(engine, "stage3", None)
    if stage3 is None:
        return []
    return [ShardedSlot(records=part.shard_records(), master=None, model_shard=part.shard,
                        replicated=part.partitions == 1) for part in stage3.frozen]


def all_slots(engine) -> list[ShardedSlot]:
    """Trainable slots first (in the optimizer's order), then frozen partitioned ones."""
    return list(engine.sharded_slots()) + frozen_slots(engine)


def sharded_names(slots) -> set[str]:
    return {record.name for slot in slots for record in slot.records}


def refresh_after_load(engine) -> None:
    """Make every rank's model weights current after masters and frozen shards were written."""
    engine.zero_optimizer.publish()
    if callable(getattr(engine, "frozen_slots", None)):
        return  # an engine that lists its frozen slots refreshes them in publish()
    stage3 = getattr(engine, "stage3", None)
    if stage3 is None:
        return
    with torch.no_grad():
        for part in stage3.frozen:  # same order on every rank
            if part.gathered:
                engine.comm.all_gather(part.flat_param, part.shard)
