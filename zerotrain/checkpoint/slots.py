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

from ..zero.flat import ShardedSlot
from .format import CheckpointError


def frozen_slots(engine) -> list[ShardedSlot]:
    """Partitioned frozen parameters (stage 3), as slots without a master."""
    provided = getattr(engine, "frozen_slots", None)
    return list(provided()) if callable(provided) else []


def all_slots(engine) -> list[ShardedSlot]:
    """Trainable slots first (in the optimizer's order), then frozen partitioned ones."""
    return list(engine.sharded_slots()) + frozen_slots(engine)


def sharded_names(slots) -> set[str]:
    return {record.name for slot in slots for record in slot.records}


def refresh_after_load(engine) -> None:
    """Make every rank's model weights current after masters and frozen shards were written."""
    engine.publish_weights()


def refuse_tensor_parallel(engine, what: str) -> None:
    """Tensor-parallel slices are not in the unified format yet: refuse before touching any file.

    Their records give flat ranges of the local slice, not of the whole tensor, so writing
    them would store slices under whole-tensor names; a clear error loses nothing."""
    tp_size = getattr(engine.topology, "tp_size", 1)
    if tp_size > 1:
        raise CheckpointError(f"cannot {what} a checkpoint with tensor_parallel.autotp_size {tp_size}: "
                              f"tensor-parallel checkpoints are not supported yet (use engine.full_state_dict() "
                              f"for the whole weights)")
