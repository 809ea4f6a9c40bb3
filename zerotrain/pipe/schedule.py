"""Which of `torch.distributed.pipelining`'s schedules runs the pieces, and where each piece sits.

The schedules themselves are torch's (GPipe, 1F1B, interleaved 1F1B, looped BFS, interleaved zero-bubble, ZBV
zero-bubble); zerotrain only names them in the config (`pipeline.schedule`) and places the pieces as each
expects: one piece per rank (`1f1b`, `gpipe`), `stages_per_rank` pieces in a loop (piece p on pipeline rank
p mod pp: interleaved, looped, interleaved zero-bubble), or two in a V (`zbv_zero_bubble`: rank r holds pieces
r and 2·pp − 1 − r, so the first and the last piece share rank 0).

`in_flight` says how many micro-batches' activations each rank holds at the peak of one batch under each schedule
(what `zerotrain estimate` multiplies a stage's activations by): GPipe all m on every rank, 1F1B min(m, pp − r),
the others read off torch's own order of actions.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "schedule_class", "in_flight"]

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


def in_flight(name: str, pp: int, micro_batches: int, per_rank: int = 1) -> list[float]:
    """Per pipeline rank, the most micro-batches whose activations it holds at once in one batch of
    `micro_batches` under schedule `name`, in units of the rank's whole share of the layers (a piece of a
    multi-piece schedule counts 1 / `per_rank`). GPipe runs every forward first: m on every rank. 1F1B: rank r
    runs pp − 1 − r forwards before its first backward, then one forward and one backward in turn: min(m, pp − r),
    the first rank the most. The multi-piece schedules walk torch's own list of actions for each rank (forward:
    one piece's micro-batch more; full backward or weight backward: one less); a zero-bubble schedule's input
    backward keeps what its deferred weight backward needs, counted whole until then (an upper bound)."""
    m = int(micro_batches)
    if name == "gpipe":
        return [float(m)] * pp
    if name == "1f1b":
        return [float(min(m, pp - rank)) for rank in range(pp)]
    from torch.distributed.pipelining.schedules import _ComputationType
    # torch computes a multi-piece schedule's order of actions (`_calculate_single_rank_operations`) inside a
    # schedule built over live PipelineStages and a process group; the same method on a bare instance given the
    # few sizes it reads (set as the schedule's __init__ sets them) yields that order without either
    cls = schedule_class(name)
    bare = cls.__new__(cls)
    bare.pp_group_size, bare.n_local_stages, bare._n_microbatches = pp, per_rank, m
    bare.number_of_rounds = max(1, m // pp)
    bare.microbatches_per_round = m // bare.number_of_rounds
    bare._stages, bare.num_stages, bare._num_stages = [None] * per_rank, pp * per_rank, pp * per_rank
    freeing = {_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT}
    peaks = []
    for rank in range(pp):
        bare.rank = rank
        held = peak = 0
        for action in bare._calculate_single_rank_operations(rank):
            if action is None:
                continue
            if action.computation_type == _ComputationType.FORWARD:
                held += 1
                peak = max(peak, held)
            elif action.computation_type in freeing:
                held -= 1
        peaks.append(peak / per_rank)
    return peaks
