"""The rank grid and its process groups, built once and passed explicitly.

Nothing in zerotrain keeps a process group in a module global: every part that
communicates receives a :class:`Topology` (or the :class:`~zerotrain.comm.Comm`
built from one). The grid has a data-parallel axis (ZeRO shards across it) and a
tensor-parallel axis (blocks of consecutive ranks) and an expert axis: expert-parallel groups
of `ep_size` consecutive data-parallel ranks, and expert-data-parallel groups of the ranks
with the same position in theirs (`expert_parallel_group`, `expert_data_parallel_group`), and a
sequence-parallel axis (Ulysses, `sequence_parallel_size`): ranks are ordered data × sequence × tensor
(tensor innermost), each block of `sp_size` consecutive ZeRO ranks is a sequence-parallel group.
ZeRO partitions and reduces over the data × sequence ranks (`dp_group`, as DeepSpeed's Ulysses: the
sequence-parallel ranks share ZeRO partitions); the batch counts data-parallel ranks only
(`data_parallel_size`, `data_parallel_rank`). Pipeline parallelism (`pp_size` stages, `zerotrain.pipe`) is
the outermost axis: ranks are ordered pipeline × data × sequence × tensor, each stage a block of
world / pp consecutive ranks; `pp_group` holds the ranks at this rank's place in every stage.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .cluster import adopt_cluster_ranks


def default_device() -> torch.device:
    """The device this rank computes on: its CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_seconds: float = 1800.0) -> None:
    """Start torch.distributed if it is not running yet.

    Reads torchrun's environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or MPI's or Slurm's
    mapped onto them (`zerotrain.cluster`); without them this process is a world of one. NCCL on CUDA, gloo
    otherwise.
    """
    if dist.is_initialized():
        return
    adopt_cluster_ranks()  # mpirun / srun started this process: their ranks under torchrun's names
    timeout = datetime.timedelta(seconds=timeout_seconds)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(default_device())
        store = _restart_safe_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        return
    # A world of one: a private in-process store, no port to collide on.
    store = dist.HashStore()
    dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)


def _restart_safe_store(timeout: datetime.timedelta) -> Optional[dist.Store]:
    """The torchrun agent's store with this restart attempt's own key space, or None outside torchrun.

    torchrun's agent keeps one TCPStore for the whole job and hands it to every restart attempt,
    while torch's ``env://`` rendezvous uses its keys unprefixed. A restarted rank could then read the
    address a rank of an earlier attempt published and wait on that dead peer until the process-group
    timeout (seen as gloo "Connection refused" retries after a rank was killed). Prefixing the keys by
    TORCHELASTIC_RESTART_COUNT gives every attempt a fresh rendezvous. (Across nodes the count can disagree: an
    agent that restarts its ranks for another node's new round does not raise it. The zerotrain launcher avoids
    the shared store altogether, `command.run_torchrun`; this serves a plain `torchrun` on one node.)
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerotrain/attempt_{attempt}", agent_store)


def _ranks_per_node(world: int) -> int:
    for name in ("ZEROTRAIN_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name)
        if value:
            try:
                return max(1, min(int(value), world))
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
    return world


@dataclass
class Topology:
    """Where this rank sits in the grid, and the groups it talks through.

    `dp_group` spans the ranks that hold replicas (or shards) of the same model
    state; ZeRO partitions across it. With sequence parallelism it spans the data × sequence
    ranks of this tensor-parallel index (`dp_size` = world / tp), while `data_parallel_size`
    (world / (tp × sp)) is what the batch counts; `sp_group` is this rank's block of `sp_size`
    consecutive ZeRO ranks, which see the same samples, each its slice of every sequence.
    """

    rank: int
    world_size: int
    dp_group: Optional[dist.ProcessGroup]
    dp_rank: int
    dp_size: int
    device: torch.device
    timeout_seconds: float = 1800.0
    same_host_transport: bool = True  # see zerotrain.comm.same_host
    tp_size: int = 1
    tp_group: Optional[dist.ProcessGroup] = None
    tp_rank: int = 0
    ep_size: int = 1
    sp_size: int = 1
    sp_group: Optional[dist.ProcessGroup] = None
    sp_rank: int = 0
    extra: dict = field(default_factory=dict)
    # Ranks per node (machine): ZEROTRAIN_RANKS_PER_NODE, else torchrun's LOCAL_WORLD_SIZE, else all.
    # The two-hop quantized gradient reduce runs inside a node first, then across nodes.
    ranks_per_node: int = 0
    # pipeline parallelism (outermost axis): this rank's stage index and the ranks at its place in every stage
    pp_size: int = 1
    pp_group: Optional[dist.ProcessGroup] = None
    pp_rank: int = 0
    _subgroups: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, timeout_seconds: float = 1800.0, device: Optional[torch.device] = None,
              tp_size: int = 1, same_host_transport: bool = True, sp_size: int = 1,
              pp_size: int = 1) -> "Topology":
        """The topology of the running job (starting torch.distributed when needed).

        With `tp_size` > 1 the ranks form a (data, tensor) grid: each block of `tp_size`
        consecutive ranks (one node's GPUs first, where the all-reduces of tensor parallelism
        are cheapest) is a tensor-parallel group, and the ranks with the same index in every
        block form a data-parallel group, across which ZeRO shards. With `sp_size` > 1 each block of
        `sp_size` consecutive ranks of that group is a sequence-parallel group (global rank =
        (d × sp + s) × tp + t); ZeRO still shards across the whole group (data × sequence ranks). With
        `pp_size` > 1 the world is first cut into `pp_size` pipeline stages of world / pp consecutive ranks
        (global rank = ((p × dp + d) × sp + s) × tp + t): the groups above are made inside each stage, and
        the ranks at the same place in every stage form the pipeline group (`pp_group`)."""
        init_distributed(timeout_seconds)
        rank, world = dist.get_rank(), dist.get_world_size()
        if not isinstance(pp_size, int) or pp_size < 1 or world % pp_size:
            raise ValueError(f"pipeline_parallel_size: {pp_size} does not divide the world size {world}")
        stage_world = world // pp_size
        if tp_size < 1 or stage_world % tp_size:
            raise ValueError(f"tensor_parallel.autotp_size: {tp_size} does not divide the world size {world}"
                             + (f" / {pp_size} pipeline stages" if pp_size > 1 else ""))
        topology = cls(rank=rank, world_size=world, dp_group=dist.group.WORLD, dp_rank=rank, dp_size=world,
                       device=device or default_device(), timeout_seconds=timeout_seconds,
                       same_host_transport=same_host_transport,
                       ranks_per_node=_ranks_per_node(world))
        if not isinstance(sp_size, int) or sp_size < 1 or stage_world % (tp_size * sp_size):
            raise ValueError(f"sequence_parallel_size: {sp_size} x tensor_parallel.autotp_size: {tp_size} does not "
                             f"divide the world size {world}" + (f" / {pp_size} pipeline stages" if pp_size > 1 else ""))
        if pp_size > 1:
            topology._split_pipeline(pp_size)
        if tp_size > 1:
            topology._split_tensor_parallel(tp_size)
        if sp_size > 1:
            topology._split_sequence_parallel(sp_size)
        return topology

    def _split_pipeline(self, pp_size: int) -> None:
        """The pipeline groups, and the data-parallel group cut down to this rank's stage (collective)."""
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        stage_world = self.world_size // pp_size
        for place in range(stage_world):
            ranks = [stage * stage_world + place for stage in range(pp_size)]
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if self.rank in ranks:
                self.pp_group, self.pp_rank = group, ranks.index(self.rank)
        for stage in range(pp_size):
            ranks = list(range(stage * stage_world, (stage + 1) * stage_world))
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if self.rank in ranks:
                self.dp_group, self.dp_rank = group, ranks.index(self.rank)
        self.pp_size, self.dp_size = pp_size, stage_world
        self.ranks_per_node = max(1, min(self.ranks_per_node, stage_world))

    @property
    def stage_world_size(self) -> int:
        """Ranks per pipeline stage: world / pp."""
        return self.world_size // self.pp_size

    def own_group(self) -> Optional[dist.ProcessGroup]:
        """A process group of this rank alone (torch's `PipelineStage` of a one-stage pipeline on several
        data-parallel ranks needs a pipeline group of size 1); None in a one-rank world. Collective on first
        use: every rank creates every rank's group, in the same order."""
        if self.world_size == 1:
            return None
        if "own" not in self._subgroups:
            timeout = datetime.timedelta(seconds=self.timeout_seconds)
            groups = [dist.new_group(ranks=[rank], timeout=timeout) for rank in range(self.world_size)]
            self._subgroups["own"] = groups[self.rank]
        return self._subgroups["own"]

    def pipeline_subgroup(self, stages: list[int]) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The ranks at this rank's place in the pipeline stages `stages` (sorted stage indices; e.g. the stages
        holding one tied layer); (group or None when one stage, this rank's index in it or -1 outside it, size).
        Collective on first use: every rank creates every place's group, in the same order."""
        stages = sorted(stages)
        key = ("pipeline", tuple(stages))
        if key not in self._subgroups:
            stage_world = self.stage_world_size
            mine: tuple[Optional[dist.ProcessGroup], int, int] = (None, -1, len(stages))
            for place in range(stage_world):
                ranks = [stage * stage_world + place for stage in stages]
                group = dist.new_group(ranks=ranks, timeout=datetime.timedelta(seconds=self.timeout_seconds)) \
                    if len(ranks) > 1 else None
                if self.rank in ranks:
                    mine = (group, ranks.index(self.rank), len(ranks))
            self._subgroups[key] = mine
        return self._subgroups[key]

    def _split_sequence_parallel(self, sp_size: int) -> None:
        """This rank's sequence-parallel group: `sp_size` consecutive ranks of its ZeRO group (collective)."""
        self.sp_group, self.sp_rank, self.sp_size = self.partition_group(sp_size)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different samples: world / (tp × sp). The batch triple counts these."""
        return self.dp_size // self.sp_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the `data_parallel_size` ranks (shared by its sequence-parallel group)."""
        return self.dp_rank // self.sp_size

    def _split_tensor_parallel(self, tp_size: int) -> None:
        """Create the grid's groups (collective: every rank creates every group, in order)."""
        timeout = datetime.timedelta(seconds=self.timeout_seconds)
        for start in range(0, self.world_size, tp_size):
            ranks = list(range(start, start + tp_size))
            group = dist.new_group(ranks=ranks, timeout=timeout)
            if self.rank in ranks:
                self.tp_group, self.tp_rank = group, ranks.index(self.rank)
        stage_world = self.stage_world_size
        for stage in range(self.pp_size):
            for index in range(tp_size):
                ranks = list(range(stage * stage_world + index, (stage + 1) * stage_world, tp_size))
                group = dist.new_group(ranks=ranks, timeout=timeout)
                if self.rank in ranks:
                    self.dp_group, self.dp_rank = group, ranks.index(self.rank)
        self.tp_size, self.dp_size = tp_size, stage_world // tp_size
        self.ranks_per_node = max(1, self.ranks_per_node // tp_size)

    # --- data-parallel subgroups (ZeRO++) -------------------------------------------
    def _dp_ranks(self) -> list[int]:
        if self.dp_group is None or self.dp_group == dist.group.WORLD:
            return list(range(self.dp_size))
        return dist.get_process_group_ranks(self.dp_group)

    def _every_dp_ranks(self) -> list[list[int]]:
        """The global ranks of every data-parallel group of the grid (one per pipeline stage and tensor-parallel
        index)."""
        if self.tp_size == 1 and self.pp_size == 1:
            return [self._dp_ranks()]
        stage_world = self.stage_world_size
        return [list(range(stage * stage_world + index, (stage + 1) * stage_world, self.tp_size))
                for stage in range(self.pp_size) for index in range(self.tp_size)]

    def _subgroup(self, key: tuple, members: list[list[int]]) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """Create (once) one group per list of dp indices in `members`, in every data-parallel group of
        the grid; return this rank's (group, rank in it, size). Collective: every rank of the world
        creates every group (those of the other tensor-parallel indices too), in the same order, with
        the topology's timeout."""
        if key not in self._subgroups:
            mine = None
            for global_ranks in self._every_dp_ranks():
                own = (self.tp_size == 1 and self.pp_size == 1) or self.rank in global_ranks  # this rank's group
                for indices in members:
                    ranks = [global_ranks[i] for i in indices]
                    if len(ranks) == 1:
                        group = None
                    else:
                        group = dist.new_group(ranks=ranks,
                                               timeout=datetime.timedelta(seconds=self.timeout_seconds))
                    if own and self.dp_rank in indices:
                        mine = (group, indices.index(self.dp_rank), len(indices))
            self._subgroups[key] = mine
        return self._subgroups[key]

    def partition_group(self, size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The group of `size` consecutive data-parallel ranks holding this rank (hpZ, intra-node)."""
        if size < 1 or self.dp_size % size:
            raise ValueError(f"a group of {size} ranks does not divide the {self.dp_size} data-parallel ranks")
        return self._subgroup(("block", size), [list(range(start, start + size))
                                                for start in range(0, self.dp_size, size)])

    def strided_group(self, size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The ranks with this rank's index inside its block of `size` consecutive ranks, one per
        block (inter-node: the same local rank on every node)."""
        if size < 1 or self.dp_size % size:
            raise ValueError(f"a group of {size} ranks does not divide the {self.dp_size} data-parallel ranks")
        return self._subgroup(("stride", size), [list(range(local, self.dp_size, size)) for local in range(size)])

    # --- expert parallelism ------------------------------------------------------------
    def _check_ep_size(self, ep_size: int) -> None:
        if not isinstance(ep_size, int) or ep_size < 1 or self.dp_size % ep_size:
            raise ValueError(f"ep_size={ep_size!r} does not divide the {self.dp_size} data-parallel ranks: "
                             f"expert-parallel groups are blocks of ep_size consecutive data-parallel ranks")

    def expert_parallel_group(self, ep_size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The `ep_size` consecutive data-parallel ranks holding this rank, which between them hold every
        expert (the MoE layer's all-to-all runs over it); records `ep_size`. Collective on first use."""
        self._check_ep_size(ep_size)
        self.ep_size = ep_size
        if ep_size == self.dp_size:
            return self.dp_group, self.dp_rank, self.dp_size
        return self.partition_group(ep_size)

    def expert_data_parallel_group(self, ep_size: int) -> tuple[Optional[dist.ProcessGroup], int, int]:
        """The data-parallel ranks holding the same experts as this rank (the same position in their
        expert-parallel group): expert gradients are summed and expert states partitioned over it."""
        self._check_ep_size(ep_size)
        self.ep_size = ep_size
        return self.strided_group(ep_size)

    def node_layout(self) -> tuple[int, int]:
        """(ranks per node L, nodes M) over the data-parallel ranks; (dp_size, 1) when the
        ranks-per-node figure does not split them evenly."""
        per_node = self.ranks_per_node or self.dp_size
        if per_node <= 0 or per_node >= self.dp_size or self.dp_size % per_node:
            return self.dp_size, 1
        return per_node, self.dp_size // per_node

    def describe(self) -> dict:
        """The facts a checkpoint records about the layout that wrote it."""
        return {"world_size": self.world_size, "dp_size": self.dp_size, "tp_size": self.tp_size, "ep_size": self.ep_size,
                "sp_size": self.sp_size, "pp_size": self.pp_size}
