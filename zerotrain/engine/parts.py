"""The engine's parts, built once: `build_parts(...)` -> a frozen `EngineParts`.

Every choice the config makes is taken here and nowhere else: where the model is placed and cast, flat
buckets or stage-3 partitions (`weights`), which gradient reducer and which reduce (exact, or ZeRO++'s
qgZ with LoCo), qwZ/hpZ gathers, which master optimizer (on the device, or offloaded to CPU / NVMe /
super_offload), the parameter store of `offload_param`, the LR scheduler and the loss scaler. A
forward-only engine (no optimizer: DeepSpeed's ZeRO-Inference) gets null parts (`zero.forward_only`), so
the step code over the parts is the same for both.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..checkpoint import SnapshotFences
from ..comm import Comm, CommCounters
from ..config import ConfigError, ZeroTrainConfig
from ..fp8 import convert_for_fp8, float8_gathered_weights
from ..offload.cpu_optimizer import OffloadOptimizer, narrows_gradients
from ..offload import nvme as nvme_offload
from ..offload.param_store import build_param_store
from ..offload.speculative import SuperOffloadOptimizer
from ..optim import build_optimizer
from ..parallel import tensor_parallel_comm
from ..parallel.experts import build_expert_groups, check_expert_parallel
from ..parallel.sequence import SequenceParallel, enable_sequence_parallel
from ..precision import LossScaler, training_dtype
from ..schedules import build_scheduler
from ..sharding import ExpertGroups
from ..topology import Topology
from ..zero.flat import build_sharded_buckets
from ..zero.forward_only import ForwardPasses, NoGradients, NoOptimizer, generate_between_steps, synced_generate
from ..zero.gradnorm import GlobalGradients
from ..zero.grads import FullBufferReducer, PartitionedReducer
from ..zero.interfaces import GradientReducer, MasterOptimizer, ParamStore
from ..zero.optimizer import ShardedOptimizer
from ..zero.reduce import GradQuantization, reduce_for
from ..zero.stage3.grads import Stage3GradReducer
from ..zero.stage3.hooks import Stage3Hooks
from ..zero.stage3.setup import Stage3Model, partition_module, place_module
from .weights import FlatWeights, PartitionedWeights, Weights

__all__ = ["EngineParts", "build_parts", "OptimizerLike"]

OptimizerLike = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None]


@dataclass(frozen=True)
class EngineParts:
    """What one engine is made of; built by `build_parts`, never rebuilt or replaced."""

    config: ZeroTrainConfig
    topology: Topology
    stage: int
    dtype: torch.dtype
    counters: CommCounters
    comm: Comm                                  # the data-parallel (ZeRO) group
    tp_comm: Optional[Comm]                     # the tensor-parallel group (None without tensor parallelism)
    expert_groups: Optional[ExpertGroups]       # None without split experts
    sequence_parallel: Optional[SequenceParallel]  # Ulysses (sequence_parallel_size > 1)
    fences: SnapshotFences                      # pending async checkpoint copies: writers of the slots wait
    module: torch.nn.Module
    weights: Weights                            # flat buckets (stages 0-2) or stage-3 partitions
    reducer: GradientReducer
    zero_optimizer: MasterOptimizer
    optimizer: Optional[torch.optim.Optimizer]  # the torch optimizer (None: forward-only)
    lr_scheduler: Any
    loss_scaler: LossScaler
    param_store: Optional[ParamStore]           # offload_param (stage 3): where the non-persistent shards live
    forward_passes: Optional[ForwardPasses]     # forward-only: each forward of the module one fetcher micro-step
    forward_only: bool

    @property
    def buckets(self) -> list:
        return self.weights.buckets

    @property
    def stage3(self) -> Optional[Stage3Model]:
        return self.weights.stage3

    def close(self) -> None:
        """Release the offload optimizer's and the parameter store's threads and files (idempotent)."""
        self.zero_optimizer.close()
        if self.param_store is not None:
            self.param_store.close()


def build_parts(model: torch.nn.Module, config: ZeroTrainConfig, topology: Topology,
                model_parameters: Optional[Iterable] = None, optimizer: OptimizerLike = None,
                lr_scheduler: Any = None) -> EngineParts:
    """Place the model and build every part the config asks for (collective: every rank, same order)."""
    stage = config.zero_optimization.stage
    dtype = training_dtype(config.precision)
    check_expert_parallel(model, config, topology)  # experts split over ranks: what is refused with them
    # fp8 (torchao Float8Linear, same Parameter objects): before anything is flattened or partitioned
    fp8_plan = convert_for_fp8(model, config.fp8, topology.device, topology.rank)
    counters = CommCounters()
    comm = Comm.data_parallel(topology, counters)
    tp_comm = tensor_parallel_comm(topology, counters) if topology.tp_size > 1 else None
    expert_groups = build_expert_groups(model, topology, comm)  # None without split experts
    # Ulysses (sequence_parallel_size > 1): batches go through engine.sequence_parallel.shard(batch)
    sequence_parallel = None
    if topology.sp_size > 1:
        sequence_parallel = enable_sequence_parallel(
            model, comm.subgroup(topology.sp_group, topology.sp_rank, topology.sp_size), topology.tp_size)
    fences = SnapshotFences()
    # the parameters in the training dtype, the buffers in their own (as DeepSpeed 0.19), at every stage
    place_module(model, topology.device, dtype)
    module = model

    # No optimizer passed and none in the config: a forward-only engine (DeepSpeed's ZeRO-Inference), every
    # parameter frozen, no gradient buffers, masters or optimizer states (zero.forward_only).
    forward_only = optimizer is None and config.optimizer is None
    if forward_only and (lr_scheduler is not None or config.scheduler is not None):
        raise ConfigError("scheduler: a learning-rate scheduler needs an optimizer, and this engine has none "
                          "(no optimizer passed to initialize, no 'optimizer' block)", key="scheduler")
    torch_optimizer = None if forward_only else _torch_optimizer(module, config, optimizer, model_parameters)
    group_of = {} if forward_only else \
        {id(p): index for index, group in enumerate(torch_optimizer.param_groups) for p in group["params"]}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    orphans = [n for n, p in named if id(p) not in group_of]
    if orphans and not forward_only:
        warnings.warn(f"parameters {orphans[:5]} require grad but are in no optimizer group; they stay frozen")
    zero = config.zero_optimization
    param_store = None
    zero_optimizer = None
    try:  # a part that fails closes the threads and files of those built before it
        if stage == 3:
            prefetch_numel, max_live_numel, max_reuse_distance = zero.stage3_fetch_limits()
            stage3 = partition_module(module, comm, group_of, int(zero.stage3_param_persistence_threshold),
                                      bool(zero.stage3_allgather_sequential), int(prefetch_numel),
                                      int(max_live_numel), int(max_reuse_distance), experts=expert_groups, fence=fences)
            stage3.use_param_store(build_param_store(stage3.all_parts(), zero.offload_param, config.aio, comm.rank,
                                                     stage3.early_stores))
            param_store = stage3.param_store
            weights: Weights = PartitionedWeights(module, stage3)
        else:
            buckets = build_sharded_buckets([(n, p) for n, p in named if id(p) in group_of], group_of,
                                            int(zero.reduce_bucket_size), comm, stage >= 1, expert_groups)
            _broadcast_initial_state(module, buckets, comm)
            weights = FlatWeights(module, buckets)
        reducer = NoGradients() if forward_only else _reducer(weights.buckets, config, topology, comm, stage)
        if weights.stage3 is not None:  # its release hooks must run after the reducer's gradient hooks
            weights.stage3.hooks = Stage3Hooks(module, weights.fetcher)
            _configure_weight_gathers(weights.fetcher, config, topology, comm)
            weights.fetcher.configure_fp8_gathers(float8_gathered_weights(module, fp8_plan, config.fp8))
        loss_scaler = LossScaler.from_config(config.fp16)
        zero_optimizer = NoOptimizer() if forward_only else \
            _master_optimizer(weights.buckets, config, topology, comm, tp_comm, torch_optimizer, reducer, loss_scaler,
                              fences)
        if weights.stage3 is not None:  # GatheredParameters and initializers write the masters through the owner
            weights.stage3.use_masters(zero_optimizer)
        scheduler = None if forward_only else _scheduler(config, torch_optimizer, lr_scheduler)
        forward_passes = None
        if forward_only:
            forward_passes = _prepare_forward_only(module, weights, topology)
        else:
            _prepare_generate_between_steps(module, weights, topology, expert_groups, zero_optimizer.before_model_use)
        return EngineParts(config=config, topology=topology, stage=stage, dtype=dtype, counters=counters, comm=comm,
                           tp_comm=tp_comm, expert_groups=expert_groups, sequence_parallel=sequence_parallel,
                           fences=fences, module=module, weights=weights, reducer=reducer,
                           zero_optimizer=zero_optimizer,
                           optimizer=torch_optimizer, lr_scheduler=scheduler, loss_scaler=loss_scaler,
                           param_store=param_store, forward_passes=forward_passes, forward_only=forward_only)
    except BaseException:
        _close_built(zero_optimizer, param_store)
        raise


def _close_built(zero_optimizer: Optional[MasterOptimizer], param_store: Optional[ParamStore]) -> None:
    """Release what a failed `build_parts` had built (the offload optimizer's and the parameter store's I/O threads
    and swap files), leaving the original error to propagate."""
    for part in (zero_optimizer, param_store):
        if part is not None:
            try:
                part.close()
            except Exception:  # noqa: BLE001 - the build's own error is the one to report
                pass


def _param_groups(module: torch.nn.Module, model_parameters: Optional[Iterable]) -> list[dict]:
    """Normalize DeepSpeed's `model_parameters` (params or group dicts) into group dicts."""
    if model_parameters is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


def _torch_optimizer(module: torch.nn.Module, config: ZeroTrainConfig, optimizer: OptimizerLike,
                     model_parameters: Optional[Iterable]) -> torch.optim.Optimizer:
    """The torch optimizer: the one passed, the callable's, or the config's `optimizer` block's."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    groups = _param_groups(module, model_parameters)
    if callable(optimizer):
        built = optimizer(groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
        return built
    return build_optimizer(config.optimizer, groups)


def _broadcast_initial_state(module: torch.nn.Module, buckets: list, comm: Comm) -> None:
    """Start every rank from rank 0's weights and buffers, as DDP does."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for bucket in buckets:
            # split experts: from the first rank holding the same experts
            bucket.group.comm.broadcast(bucket.flat_param, src=0)
        in_buckets = {id(p) for b in buckets for p in b.params}
        for param in module.parameters():
            if id(param) not in in_buckets and getattr(param, "ep_slice", None) is None:
                comm.broadcast(param.data, src=0)
        for buffer in module.buffers():
            comm.broadcast(buffer, src=0)


# --- the gradient reducer and ZeRO++ ------------------------------------------------
def _subgroup_comm(comm: Comm, group_info) -> Comm:
    group, rank, size = group_info
    return comm.subgroup(group, rank, size)


def _reducer(buckets: list, config: ZeroTrainConfig, topology: Topology, comm: Comm, stage: int) -> GradientReducer:
    """The gradient reducer of this stage, summing with the exact reduce or qgZ's (+ LoCo)."""
    quantization = _gradient_quantization(config, topology, comm, stage)
    reduce = reduce_for(quantization, comm)
    if stage == 0:  # a full buffer, all-reduced at the boundary
        return FullBufferReducer(buckets, comm, reduce, sharded=False)
    if stage == 1:  # a full buffer, reduce-scattered at the boundary
        return FullBufferReducer(buckets, comm, reduce, sharded=True)
    if stage == 2 or quantization is not None:
        # staged and reduce-scattered every micro-step; stage 3 under qgZ too, each partitioned parameter
        # its own bucket (qgZ's blocks and LoCo buffers stay per parameter there)
        return PartitionedReducer(buckets, comm, reduce)
    # stage 3: the per-parameter shards packed into reduce buckets
    return Stage3GradReducer(buckets, comm, int(config.zero_optimization.reduce_bucket_size), reduce=reduce)


def _gradient_quantization(config: ZeroTrainConfig, topology: Topology, comm: Comm,
                           stage: int) -> Optional[GradQuantization]:
    """qgZ (int4 all-to-all reduce, two hops across nodes) with LoCo when zeropp_loco_param is set."""
    zero = config.zero_optimization
    if not zero.zero_quantized_gradients or stage == 0 or topology.dp_size == 1:
        return None
    loco = zero.zeropp_loco_param
    per_node, nodes = topology.node_layout()
    hierarchy = None
    if nodes > 1:
        hierarchy = (_subgroup_comm(comm, topology.partition_group(per_node)),
                     _subgroup_comm(comm, topology.strided_group(per_node)))
    return GradQuantization(bits=4, loco_beta=None if loco is None else float(loco.err_beta),
                            reset_T=1024 if loco is None else int(loco.reset_T), hierarchy=hierarchy)


def _configure_weight_gathers(fetcher, config: ZeroTrainConfig, topology: Topology, comm: Comm) -> None:
    """qwZ (int8 forward/backward all-gathers) and hpZ (backward gathers inside a group)."""
    zero = config.zero_optimization
    hpz_size = int(zero.zero_hpz_partition_size or 1)
    dp = topology.dp_size
    hpz = None
    if hpz_size > 1 and dp > 1:
        if dp % hpz_size:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size: {hpz_size} does not divide the "
                             f"{dp} data-parallel ranks")
        if hpz_size < dp:
            hpz = _subgroup_comm(comm, topology.partition_group(hpz_size))
    fetcher.configure_zeropp(quantize_weights=bool(zero.zero_quantized_weights), hpz=hpz)


# --- the master optimizer -------------------------------------------------------------
def _master_optimizer(buckets: list, config: ZeroTrainConfig, topology: Topology, comm: Comm,
                      tp_comm: Optional[Comm], torch_optimizer: torch.optim.Optimizer, reducer: GradientReducer,
                      loss_scaler: LossScaler, fences: SnapshotFences) -> MasterOptimizer:
    """The object that owns master shards and runs the update: on the device, or the offloaded optimizer
    `zero_optimization.offload_optimizer` asks for (plain CPU offload, super_offload or NVMe)."""
    offload = config.zero_optimization.offload_optimizer
    # pipeline parallelism: the norm and the overflow flag over every stage (zerotrain.pipe)
    pp_comm = Comm.pipeline(topology, comm.counters) if topology.pp_size > 1 else None
    gradients = GlobalGradients(buckets, comm, tp_comm, pp_comm)
    groups = [g["params"] for g in torch_optimizer.param_groups]
    if offload is None or offload.device not in ("cpu", "nvme"):
        return ShardedOptimizer(buckets, comm, torch_optimizer, groups, config.gradient_clipping, gradients=gradients)
    common = dict(ratio=float(offload.ratio), pin_memory=bool(offload.pin_memory), reducer=reducer,
                  gradients=gradients)
    if offload.device == "nvme":
        frees = reducer.can_free_final_shards
        return nvme_offload.NvmeOffloadOptimizer(buckets, comm, torch_optimizer, groups, config.gradient_clipping,
                                    nvme_path=offload.nvme_path, buffer_count=int(offload.buffer_count),
                                    aio=config.aio, stream_gradients=nvme_offload.streams_gradients(config, frees),
                                    spill_gradients=nvme_offload.spills_gradients(config, frees),
                                    norm_first_pass=_norm_first_pass(config, frees),
                                    **nvme_offload.record_dtypes(config), **common)
    if offload.super_offload:
        # `fences`: waited on by SuperOffload's in-place steps during backward
        return SuperOffloadOptimizer(buckets, comm, torch_optimizer, groups, config.gradient_clipping,
                                     loss_scale=lambda: loss_scaler.scale,
                                     speculation=offload.super_offload_speculation, fence=fences, **common)
    return OffloadOptimizer(buckets, comm, torch_optimizer, groups, config.gradient_clipping,
                            narrow_gradients=narrows_gradients(config, reducer.can_free_final_shards),
                            **nvme_offload.record_dtypes(config), **common)


def _norm_first_pass(config: ZeroTrainConfig, frees_final_shards: bool) -> bool:
    """`offload.nvme.takes_norm_first` for this run; `offload_optimizer.norm_first_pass: true` where it cannot
    apply is refused, naming the key and what it needs."""
    zero = config.zero_optimization
    on_nvme = zero.offload_param is not None and zero.offload_param.device == "nvme"
    if zero.offload_optimizer.norm_first_pass and not nvme_offload.spills_gradients(config, frees_final_shards):
        key = "zero_optimization.offload_optimizer.norm_first_pass"
        raise ConfigError(f"{key}: true needs ZeRO stage 3 with the exact gradient reduce, gradient_clipping > 0, "
                          f"gradient_accumulation_steps 1, no fp16 or bf16.check_grad_overflow and offload_optimizer "
                          f"ratio 1 (here: stage {zero.stage}, gradient_clipping {config.gradient_clipping}, "
                          f"gradient_accumulation_steps {config.gradient_accumulation_steps})", key=key)
    return nvme_offload.takes_norm_first(config, frees_final_shards, on_nvme)


def _scheduler(config: ZeroTrainConfig, optimizer: torch.optim.Optimizer, lr_scheduler: Any):
    if lr_scheduler is None:
        return build_scheduler(config.scheduler, optimizer)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return lr_scheduler(optimizer)
    return lr_scheduler


# --- forward-only, and generate between training steps ----------------------------
def _prepare_forward_only(module: torch.nn.Module, weights: Weights, topology: Topology) -> ForwardPasses:
    """Each forward of the model is one fetcher micro-step (however it is called); at world > 1 the model's
    `generate` keeps every rank stepping until all have finished (transformers' `synced_gpus`)."""
    passes = ForwardPasses(module, weights.fetcher)
    generate = getattr(module, "generate", None)
    if topology.world_size > 1 and callable(generate) and not getattr(generate, "zerotrain_synced", False):
        module.generate = synced_generate(generate)  # an instance attribute: engine.module.generate too
    return passes


def _prepare_generate_between_steps(module: torch.nn.Module, weights: Weights, topology: Topology,
                                    expert_groups: Optional[ExpertGroups], before_use: Callable[[], None]) -> None:
    """A training engine's `engine.module.generate(...)` (evaluation between steps): no_grad, eval mode,
    stage-3 parameters gathered per forward and released after, outside the training record; synced across
    ranks where a forward holds collectives (`zero.forward_only.generate_between_steps`)."""
    generate = getattr(module, "generate", None)
    while hasattr(generate, "zerotrain_synced"):  # wrapped for an earlier engine of this model: its own
        generate = generate.__wrapped__
    if not callable(generate):
        return
    synced = topology.world_size > 1 and (weights.partitioned or topology.tp_size > 1 or topology.sp_size > 1
                                          or expert_groups is not None)
    module.generate = generate_between_steps(  # an instance attribute: engine.module.generate
        generate, module, weights.fetcher, before_use=before_use, synced=synced)
