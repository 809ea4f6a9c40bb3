"""Expert parallelism through the ZeRO engine (stages 0-3), as DeepSpeed-MoE lays it out.

The data-parallel ranks form expert-parallel (ep) groups of `ep_size` consecutive ranks; each ep
group holds every expert, split over its ranks (an expert weight carries `ep_slice`, its local
shape smaller than the full one), and the MoE layer's all-to-all runs inside it. The ranks with
the same position in their ep group hold the same experts: an expert-data-parallel group of
`dp_size / ep_size` ranks (`ExpertGroups`, built once from the Topology and passed explicitly).

Expert weights go into buckets of their own whose ShardGroup (`bucket.group`, zerotrain.sharding)
is the expert-data-parallel group, carrying the ExpertGroups (`zero.flat.build_sharded_buckets`). After backward an expert gradient holds every token of its ep group
routed to this rank's experts; the reducer divides it by the data-parallel size (the loss is the
mean of every dp rank's loss) and sums it over the expert-data-parallel group: an all-reduce at
stage 0, a reduce-scatter at stages 1-2, where expert buckets are partitioned over that group
(each rank updates its shard; the updated shards are all-gathered there). With ep_size == dp_size
that group is one rank: nothing is reduced. The gradient norm counts every expert element once
(shards when partitioned, else only the expert-data-parallel rank 0's replica), and
`full_state_dict` / checkpoints assemble whole `(num_experts, ...)` tensors by `ep_slice`, taking
each slice from one expert-data-parallel replica.

Optimizer offload (`offload_optimizer`: cpu, `super_offload`, nvme, any ratio) works unchanged at
stages 1-2: its masters are this rank's shards whatever group they are partitioned over, the
norm comes from the same GlobalGradients, and every publish all-gathers a bucket over
`bucket.group.comm` (the NVMe optimizer's failure agreement stays over all ranks).

qgZ (`zero_quantized_gradients`, stages 1-2, LoCo included) quantizes expert buckets too: their
reduce-scatter is the int4 all-to-all reduce over the expert-data-parallel group, in one hop
(the dense buckets keep the two-hop reduce across nodes); a group of one rank reduces nothing.

Stage 3 partitions each split expert over its expert-data-parallel group (`zero.stage3.setup`:
its ShardGroup is that group, like a bucket's); the module hooks gather it there (never in one
collective with dense parameters), the stage-3 reducer reduce-scatters its gradient there (divided
by the data-parallel size), and persistent ones are all-gathered there after each step.
GatheredParameters reads experts; a `modifier_rank` write to them is refused.

Optimizer offload, offload_param and ZeRO++ work at stage 3 too: qgZ as above, qwZ quantizes the
experts' gathers over their group, hpZ keeps no secondary shard of experts (its group of ranks
holds other experts), so they are gathered over their expert-data-parallel group.

Tensor parallelism (TP+EP): experts are not split by it. The data-parallel ranks of each
tensor-parallel index form their own expert-parallel and expert-data-parallel groups (Topology
builds them per index), so each tensor-parallel rank holds the same experts as its TP peers; the
MoE input is the same on every TP rank (after a row-parallel all-reduce), so are its output and
expert gradients. Expert gradients are reduced over the expert-data-parallel group only, never
over TP; the norm counts expert elements on TP rank 0 only (they carry no `tp_slice`, like
replicated parameters: zero.gradnorm); `full_state_dict` and checkpoints take TP rank 0's copy.
A layer built over other ranks (the TP group, say) is refused by name on every rank.

Supported: ZeRO stages 0-3 with offload_optimizer (stages 1-3), offload_param and ZeRO++, any
ep_size dividing the data-parallel size, with or without tensor parallelism. Refused
(NotImplementedError): at stage 3 frozen or zero.Init-built experts (when partitioning); an ep_size
not dividing the dp size, or experts not matching the consecutive-rank layout: ValueError.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..comm import Comm
from .gather import assemble_full_tensors
from ..sharding import ExpertGroups, TensorSlice, expert_slice_of, is_split_expert

__all__ = ["ExpertGroups", "expert_slice_of", "is_split_expert", "expert_parallel_size", "check_expert_parallel",
           "build_expert_groups", "gather_expert_weights"]


def _split_ways(expert_slice: TensorSlice) -> int:
    return expert_slice.full_shape[expert_slice.dim] // expert_slice.local_shape[expert_slice.dim]


def expert_parallel_size(model: torch.nn.Module) -> int:
    """Over how many ranks the model's experts are split (1 without split experts); every split expert
    must agree (ValueError naming two that do not)."""
    sizes = {name: _split_ways(expert_slice_of(p)) for name, p in model.named_parameters() if is_split_expert(p)}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"expert-parallel parameters are split over different numbers of ranks: {sizes}")
    return next(iter(sizes.values()), 1)


def check_expert_parallel(model: torch.nn.Module, config, topology) -> bool:
    """Whether `model` has experts split over ranks; raises ValueError when their ep_size does not divide
    the data-parallel size (every `config` works with them, tensor parallelism included; the stage-3
    refusals come when partitioning)."""
    split = [(name, param) for name, param in model.named_parameters() if is_split_expert(param)]
    if not split:
        return False
    names = [name for name, _ in split[:4]]
    what = f"expert-parallel parameters {names} (experts split over ranks)"
    ep_size = expert_parallel_size(model)
    if topology.dp_size % ep_size:
        raise ValueError(f"{what} are split over ep_size={ep_size} ranks, which does not divide the "
                         f"{topology.dp_size} data-parallel ranks")
    return True


def build_expert_groups(model: torch.nn.Module, topology, comm: Comm) -> Optional[ExpertGroups]:
    """The expert-parallel and expert-data-parallel Comms of the model's split experts (None without
    any), sharing `comm`'s counters. Checks that this rank holds the experts of its position in its
    group of consecutive ranks (the layer must be built over `topology.expert_parallel_group`).
    Collective: every rank calls it (with tensor parallelism, every rank of the grid)."""
    ep_size = expert_parallel_size(model)
    if ep_size == 1:
        return None
    ep_group, ep_rank, size = topology.expert_parallel_group(ep_size)
    ep = comm if size == comm.size else comm.subgroup(ep_group, ep_rank, size)
    data = comm.subgroup(*topology.expert_data_parallel_group(ep_size))
    problem = None
    for name, param in model.named_parameters():
        if is_split_expert(param) and problem is None:
            expert_slice = expert_slice_of(param)
            first, count = expert_slice.pieces[0][0], expert_slice.local_shape[expert_slice.dim]
            if len(expert_slice.pieces) != 1 or first != ep_rank * count:
                where = f" (rank {topology.rank}, tensor-parallel rank {topology.tp_rank})" \
                    if topology.tp_size > 1 else ""
                problem = (f"expert-parallel parameter {name!r} on data-parallel rank {topology.dp_rank}{where} "
                           f"holds experts {expert_slice.pieces}, but its expert-parallel group (ranks of "
                           f"{ep_size} consecutive data-parallel ranks) puts it at position {ep_rank}: "
                           f"build the layer over topology.expert_parallel_group({ep_size})")
    if topology.tp_size > 1:  # agreed over the grid, so that no rank goes on into collectives alone
        grid = comm.subgroup(dist.group.WORLD, topology.rank, topology.world_size)
        problem = next((p for p in grid.all_gather_object(problem) if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
    return ExpertGroups(ep_size, ep, data)


def gather_expert_weights(buckets: list, masters: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole fp32 CPU expert tensors `(num_experts, ...)` on data-parallel rank 0 (an empty dict
    elsewhere): each expert-data-parallel group joins its shards on its rank 0, then the first
    expert-parallel group (those rank-0s, data-parallel rank 0 among them) joins its ranks' experts
    by `ep_slice`. Call on every rank."""
    local: dict[str, torch.Tensor] = {}
    slices: dict[str, TensorSlice] = {}
    groups: Optional[ExpertGroups] = None
    for bucket, master in zip(buckets, masters):
        if not bucket.group.expert:
            continue
        groups = bucket.group.experts
        shard = master.detach().to(device=bucket.device, dtype=torch.float32)  # gathered on the training device
        if bucket.partitions > 1:
            pieces = groups.data.gather_to(shard.contiguous(), 0)
            if groups.data.rank != 0:
                continue
            shard = torch.cat(pieces)
        for position, (name, param) in enumerate(zip(bucket.names, bucket.params)):
            local[name] = bucket.param_view(position, shard).clone()
            slices[name] = expert_slice_of(param)
    if groups is None or groups.data.rank != 0:
        return {}
    return assemble_full_tensors(local, slices, groups.ep)
