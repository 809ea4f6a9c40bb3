"""Which offloaded optimizer a config asks for: plain CPU offload, super_offload or NVMe.

Its own module so that `cpu_optimizer` (the base) does not import its subclasses.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm import Comm
from ..zero.flat import FlatBucket
from ..zero.gradnorm import GlobalGradients
from ..zero.stage3.partition import Fence
from .cpu_optimizer import OffloadOptimizer
from .nvme import NvmeOffloadOptimizer
from .speculative import SuperOffloadOptimizer

__all__ = ["build_offload_optimizer"]


def streams_gradients(config, reducer) -> bool:
    """Whether NVMe offload steps each bucket as soon as its gradient shard is final, during backward, so
    that host memory never holds the whole model's gradients: only where nothing needs all of them before
    the update (no clipping, no fp16 loss scale, no bf16 overflow check, every bucket offloaded), the
    reducer frees a shard once consumed (stage 3), and no accumulation: with it the reducer holds the
    summed shards between micro-batches anyway, and a failed step could not be retried by running the one
    batch's forward/backward again (its gradients are gone once streamed)."""
    offload = config.zero_optimization.offload_optimizer
    return (not config.gradient_clipping and not config.fp16.enabled and float(offload.ratio) >= 1.0
            and config.gradient_accumulation_steps == 1
            and not (config.bf16.enabled and config.bf16.check_grad_overflow)
            and hasattr(reducer, "release_final_shards"))


def build_offload_optimizer(buckets: list[FlatBucket], comm: Comm, optimizer: torch.optim.Optimizer,
                            reducer, config, loss_scale: Callable[[], float],
                            gradients: Optional[GlobalGradients] = None,
                            fence: Optional[Fence] = None) -> OffloadOptimizer:
    """The offloaded optimizer the config's `zero_optimization.offload_optimizer` block asks for
    (`fence`: the engine's checkpoint fence, waited on by SuperOffload's in-place steps during backward)."""
    offload = config.zero_optimization.offload_optimizer
    groups = [g["params"] for g in optimizer.param_groups]
    common = dict(ratio=float(offload.ratio), pin_memory=bool(offload.pin_memory), reducer=reducer,
                  gradients=gradients)
    if offload.device == "nvme":
        built = NvmeOffloadOptimizer(buckets, comm, optimizer, groups, config.gradient_clipping,
                                     nvme_path=offload.nvme_path, buffer_count=int(offload.buffer_count),
                                     aio=config.aio, stream_gradients=streams_gradients(config, reducer), **common)
    elif offload.super_offload:
        built = SuperOffloadOptimizer(buckets, comm, optimizer, groups, config.gradient_clipping,
                                      loss_scale=loss_scale, speculation=offload.super_offload_speculation,
                                      fence=fence, **common)
    else:
        built = OffloadOptimizer(buckets, comm, optimizer, groups, config.gradient_clipping, **common)
    return built
