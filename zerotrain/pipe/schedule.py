"""Which of `torch.distributed.pipelining`'s schedules runs the pieces, and where each piece sits.

The schedules themselves are torch's (GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero-bubble, ZBV
zero-bubble); zerotrain only names them in the config (`pipeline.schedule`) and places the pieces as each
expects: one piece per rank (`1f1b`, `gpipe`), `stages_per_rank` pieces in a loop (piece p on pipeline rank
p mod pp: interleaved, looped, interleaved zero-bubble), or two in a V (`zbv_zero_bubble`: rank r holds pieces
r and 2·pp − 1 − r, so the first and the last piece share rank 0).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "schedule_class"]

# The config's names -> torch.distributed.pipelining's class names. The module is imported only when a
# pipeline is built: it pulls in torch._dynamo and sympy (seconds per process), and every `import zerotrain`
# (each CLI process, each spawned rank) imports zerotrain.pipe for DeepSpeed's `deepspeed.pipe` path.
_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}


def schedule_class(name: str) -> type:
    """torch's schedule class for `pipeline.schedule` `name` (validated by the config)."""
    from torch.distributed import pipelining  # imported here, not at module import (see _CLASSES)
    return getattr(pipelining, _CLASSES[name])


@dataclass(frozen=True)
class Placement:
    """`pp` pipeline ranks holding `per_rank` pieces each, placed in a loop or (`v_shape`) a V."""

    pp: int
    per_rank: int
    v_shape: bool = False

    @property
    def pieces(self) -> int:
        return self.pp * self.per_rank

    def rank_of(self, piece: int) -> int:
        """The pipeline rank holding `piece`."""
        if self.v_shape:
            return piece if piece < self.pp else 2 * self.pp - 1 - piece
        return piece % self.pp

    def pieces_of(self, rank: int) -> list[int]:
        """The pieces pipeline rank `rank` holds, in increasing order."""
        return [piece for piece in range(self.pieces) if self.rank_of(piece) == rank]

    @property
    def first_rank(self) -> int:
        """The pipeline rank holding the first piece: it reads the inputs."""
        return self.rank_of(0)

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last piece: it reads the labels and computes the loss."""
        return self.rank_of(self.pieces - 1)
