"""A pipeline engine's checkpoint: the unified format, every stage's layers under their layer-indexed names.

The stage's ZeRO engine declares its `CheckpointState` (its slots, optimizer, counters, scheduler, loss scaler,
RNG); `pipeline_checkpoint_state` widens it to the whole pipeline: the checkpoint's collectives run over every
rank (each stage contributes the tensors of its own layers, named by global layer index as DeepSpeed names them,
so the files do not depend on the stage count), and a tied layer's copies on later stages are aliases of the
owner's tensors (`CheckpointState.aliases`): saved once under the first position's name (`0.wte.weight`, not
`4.wte.weight`), and loaded from it, weights and optimizer states alike (the copies take the same gradients and
so hold the same Adam state). A checkpoint saved at one pipeline × data-parallel shape loads at any other,
through `zerotrain.checkpoint`'s own resharding.
"""
from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..checkpoint import CheckpointState
from ..comm import Comm
from ..sharding import is_pipeline_replica
from ..topology import Topology
from .module import PipelineModule

__all__ = ["pipeline_checkpoint_state"]


def pipeline_checkpoint_state(stage_state: CheckpointState, module: PipelineModule, topology: Topology,
                              stage_comm: Comm) -> CheckpointState:
    """`stage_state` (the stage's ZeRO engine's) over every rank of the pipeline, tied copies aliased to their
    owner's names."""
    world = stage_comm.subgroup(dist.group.WORLD if topology.world_size > 1 else None, topology.rank,
                                topology.world_size)
    aliases = {name: module.tied_owner_name(name) for name, param in module.named_parameters()
               if is_pipeline_replica(param)}
    return dataclasses.replace(stage_state, world=world, aliases=aliases)
