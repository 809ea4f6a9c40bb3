"""`zerotrain.initialize`: config, process group, engine, data loader — in that order.

The config is read and checked before any process-group work starts, so a bad
file fails fast on every rank with a message naming the key.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from .config import ConfigError, load_config
from .config.batch import GAS, MICRO, TBS
from .parallel import apply_tensor_parallel, tensor_parallel_comm
from .parallel.plan import default_plan
from .engine import OptimizerLike, ZeroTrainEngine
from .lifecycle import die_with_parent, under_torchrun
from .topology import Topology


def _dp_size_hint() -> int:
    """The data-parallel size this job will have, known before any process group exists."""
    if dist.is_initialized():
        return dist.get_world_size()
    # The same rule as topology.init_distributed: a launcher world needs both RANK and WORLD_SIZE.
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return 1


def initialize(model: torch.nn.Module, config: Union[dict, str, os.PathLike, None] = None,
               model_parameters: Optional[Iterable] = None, optimizer: OptimizerLike = None,
               lr_scheduler: Any = None, training_data: Optional[Dataset] = None,
               collate_fn: Optional[Callable] = None, config_params: Optional[dict] = None,
               tensor_parallel_plan: Optional[dict] = None, **unused: Any) -> tuple[ZeroTrainEngine, torch.optim.Optimizer, Optional[DataLoader], Any]:
    """Build the engine; returns (engine, optimizer, dataloader or None, lr_scheduler or None).

    `config` is a dict or a path to a (DeepSpeed-style) JSON file; `config_params`
    is DeepSpeed's older name for it. `optimizer` may be a torch optimizer over the
    model's parameters or a callable building one from parameter groups.
    With `tensor_parallel.autotp_size` > 1 the model is split by `tensor_parallel_plan`
    (module-name pattern → `zerotrain.parallel.Column/Row/Vocab`; zerotrain's GPT has a
    built-in plan) and ZeRO shards across the data-parallel groups of the grid.
    """
    if config is None:
        config = config_params
    if config is None:
        args = unused.get("args")
        config = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is None:
        raise ValueError("zerotrain.initialize needs a config (a dict or a path to a JSON file)")
    world = _dp_size_hint()
    try:
        cfg = load_config(config)
    except ConfigError as err:
        if err.key not in (TBS, MICRO, GAS):
            raise
        # The data-parallel size also depends on tensor_parallel; name the world size this job has.
        raise ConfigError(f"{err}; this job has world size {world}", key=err.key, file=err.file) from None
    tp_size = int(cfg.tensor_parallel.autotp_size)
    if world % tp_size:
        raise ConfigError(f"tensor_parallel.autotp_size: {tp_size} does not divide the world size {world}",
                          key="tensor_parallel.autotp_size")
    cfg = load_config(cfg, dp_world_size=world // tp_size)  # the batch triple counts data-parallel ranks
    if tp_size > 1 and tensor_parallel_plan is None:
        tensor_parallel_plan = default_plan(model)  # before any process group: a missing plan fails fast
    if under_torchrun() and os.environ.get("ZEROTRAIN_DIE_WITH_PARENT", "1") != "0":
        die_with_parent()  # an orphaned rank must not train on into the directory a restart resumes from
    topology = Topology.build(timeout_seconds=cfg.comm_timeout_seconds, tp_size=tp_size,
                              same_host_transport=cfg.comm_same_host_transport)
    if tp_size > 1:
        apply_tensor_parallel(model, tensor_parallel_plan, tensor_parallel_comm(topology))
    engine = ZeroTrainEngine(model, cfg, topology, model_parameters=model_parameters,
                             optimizer=optimizer, lr_scheduler=lr_scheduler)
    dataloader = None
    if training_data is not None:
        sampler = DistributedSampler(training_data, num_replicas=topology.dp_size, rank=topology.dp_rank,
                                     shuffle=True, seed=cfg.seed or 0)
        dataloader = DataLoader(training_data, batch_size=engine.train_micro_batch_size_per_gpu(),
                                sampler=sampler, collate_fn=collate_fn, drop_last=True)
    return engine, engine.optimizer, dataloader, engine.lr_scheduler
