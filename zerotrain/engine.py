"""The training step a user calls: forward, backward(loss), step().

The engine composes the parts: it casts and places the model, packs its
trainable parameters into flat buckets (`zero.flat`), lets a gradient reducer
reduce gradients during backward and a `ShardedOptimizer` update this rank's
master shards, and keeps the step counters, loss scale and LR schedule. Its
API follows DeepSpeed's engine so existing loops port by changing the import.
"""
from __future__ import annotations

import contextlib
import logging
import os
import math
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch

from .checkpoint import Checkpointer, CheckpointState, SnapshotFences, load_checkpoint, save_checkpoint
from .comm import Comm, CommCounters
from .config import ZeroTrainConfig
from .optim import build_optimizer
from .parallel import tensor_parallel_comm
from .parallel.experts import build_expert_groups, check_expert_parallel
from .parallel.sequence import SequenceParallel, enable_sequence_parallel
from .offload.param_store import build_param_store, resident_model_states
from .precision import LossScaler, training_dtype
from .schedules import build_scheduler
from .lifecycle import StopRequest
from .monitor import TIMER_FIELDS, Monitors, ThroughputTimer, WallClockTimers, check_monitor_libraries
from .topology import Topology
from .consolidate import full_state_dict
from .sharding import ShardRecord, ShardedSlot
from .zero.flat import build_sharded_buckets
from .zero.gradnorm import GlobalGradients
from .zero.interfaces import GradientReducer
from .zero.grads import FullBufferReducer, PartitionedReducer
from .zero.reduce import GradQuantization, reduce_for
from .zero.forward_only import ForwardPasses, NoGradients, NoOptimizer, NoOptimizerError, no_optimizer_message, \
    generate_between_steps, synced_generate
from .zero.optimizer import ShardedOptimizer
from .zero.stage3.grads import Stage3GradReducer
from .zero.stage3.hooks import Stage3Hooks
from .zero.stage3.setup import Stage3Model, partition_module, place_module

logger = logging.getLogger("zerotrain")

OptimizerLike = Union[torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], None]


def _param_groups(module: torch.nn.Module, model_parameters: Optional[Iterable]) -> list[dict]:
    """Normalize DeepSpeed's `model_parameters` (params or group dicts) into group dicts."""
    if model_parameters is None:
        return [{"params": [p for p in module.parameters() if p.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(group, params=list(group["params"])) for group in items]
    return [{"params": items}]


class ZeroTrainEngine:
    """Data-parallel training with ZeRO stages 0-2 over the ranks of a Topology."""

    def __init__(self, model: torch.nn.Module, config: ZeroTrainConfig, topology: Topology,
                 model_parameters: Optional[Iterable] = None, optimizer: OptimizerLike = None,
                 lr_scheduler: Any = None):
        self.config = config
        self.topology = topology
        self.stage = config.zero_optimization.stage
        self.dtype = training_dtype(config.precision)
        check_expert_parallel(model, config, topology)  # experts split over ranks: what is refused with them
        self.counters = CommCounters()
        self.comm = Comm.data_parallel(topology, self.counters)
        self.tp_comm = tensor_parallel_comm(topology, self.counters) if topology.tp_size > 1 else None
        self.expert_groups = build_expert_groups(model, topology, self.comm)  # None without split experts
        # Ulysses (sequence_parallel_size > 1): batches go through self.sequence_parallel.shard(batch)
        self.sequence_parallel: Optional[SequenceParallel] = None
        if topology.sp_size > 1:
            self.sequence_parallel = enable_sequence_parallel(
                model, self.comm.subgroup(topology.sp_group, topology.sp_rank, topology.sp_size), topology.tp_size)
        # Pending async checkpoint snapshot copies: whatever writes this engine's slots waits on it first.
        self.snapshot_fences = SnapshotFences()
        if self.stage == 3:
            place_module(model, topology.device, self.dtype)
            self.module = model
        else:
            self.module = model.to(device=topology.device, dtype=self.dtype)

        # No optimizer passed and none in the config: a forward-only engine (DeepSpeed's ZeRO-Inference), every
        # parameter frozen, no gradient buffers, masters or optimizer states (zero.forward_only).
        self.inference = optimizer is None and config.optimizer is None
        if self.inference and (lr_scheduler is not None or config.scheduler is not None):
            from .config import ConfigError
            raise ConfigError("scheduler: a learning-rate scheduler needs an optimizer, and this engine has none "
                              "(no optimizer passed to initialize, no 'optimizer' block)", key="scheduler")
        torch_optimizer = None if self.inference else self._make_torch_optimizer(optimizer, model_parameters)
        group_of = {} if self.inference else \
            {id(p): index for index, group in enumerate(torch_optimizer.param_groups) for p in group["params"]}
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        orphans = [n for n, p in named if id(p) not in group_of]
        if orphans and not self.inference:
            warnings.warn(f"parameters {orphans[:5]} require grad but are in no optimizer group; they stay frozen")
        zero = config.zero_optimization
        self.stage3: Optional[Stage3Model] = None
        self.param_store = None  # offload_param (stage 3): where the non-persistent shards live
        if self.stage == 3:
            prefetch_numel, max_live_numel, max_reuse_distance = zero.stage3_fetch_limits()
            self.stage3 = partition_module(self.module, self.comm, group_of, int(zero.stage3_param_persistence_threshold),
                                           bool(zero.stage3_allgather_sequential), int(prefetch_numel),
                                           int(max_live_numel), int(max_reuse_distance),
                                           experts=self.expert_groups, fence=self.snapshot_fences)
            self.buckets = self.stage3.trainable
            self.stage3.use_param_store(build_param_store(self.stage3.all_parts(), zero.offload_param,
                                                          config.aio, self.comm.rank))
            self.param_store = self.stage3.param_store
        else:
            self.buckets = build_sharded_buckets([(n, p) for n, p in named if id(p) in group_of], group_of,
                                                 int(zero.reduce_bucket_size), self.comm, self.stage >= 1,
                                                 self.expert_groups)
            self._broadcast_initial_state()
        self.reducer = NoGradients() if self.inference else self._make_reducer()
        if self.stage3 is not None:  # its release hooks must run after the reducer's gradient hooks
            self.stage3.hooks = Stage3Hooks(self.module, self.stage3.fetcher)
            self._configure_weight_gathers()
        self.zero_optimizer = NoOptimizer() if self.inference else self._make_zero_optimizer(torch_optimizer)
        self.optimizer = torch_optimizer
        self.lr_scheduler = None if self.inference else self._make_scheduler(lr_scheduler)
        self.forward_passes: Optional[ForwardPasses] = None
        if self.inference:
            self._prepare_forward_only()
        else:
            self._prepare_generate_between_steps()
        self.loss_scaler = LossScaler.from_config(config.fp16)

        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self._checkpoint_files: dict[str, bytes] = {}  # add_checkpoint_files: copied into every checkpoint
        self._checkpoint_file_makers: list[Callable[[], dict]] = []  # ... and files made at each save
        self.skipped_steps = 0
        self._backward_done = False
        self.checkpointer = None  # created by the first save_checkpoint
        self.stop_request = StopRequest()  # signals turned into a stop at a step boundary (opt-in)
        self.timers = WallClockTimers(config.wall_clock_breakdown, topology.device)  # DeepSpeed's fwd/bwd/step
        self.tput_timer = ThroughputTimer(config.train_batch_size)  # DeepSpeed's engine.tput_timer (monitor.throughput)
        check_monitor_libraries(config)  # an enabled tensorboard/wandb block without its library: refused on every rank
        self.monitor: Optional[Monitors] = None  # DeepSpeed's engine events, rank 0, built at the first step
        self._configure_activation_checkpointing()

    def _configure_activation_checkpointing(self) -> None:
        """A config with an `activation_checkpointing` block configures `zerotrain.checkpointing` (inputs are
        partitioned over this engine's tensor-parallel group) and makes a built-in GPT checkpoint its blocks.
        Without the block a user's own `checkpointing.configure(...)` is left as it is."""
        if "activation_checkpointing" not in self.config.model_fields_set:
            return
        from . import checkpointing
        checkpointing.configure(self.tp_comm, deepspeed_config=self.config)
        if hasattr(self.module, "activation_checkpointing"):
            self.module.activation_checkpointing = True

    def _prepare_forward_only(self) -> None:
        """Each forward of the model is one fetcher micro-step (however it is called); at world > 1 the model's
        `generate` keeps every rank stepping until all have finished (transformers' `synced_gpus`)."""
        self.forward_passes = ForwardPasses(self.module, self.stage3.fetcher if self.stage3 is not None else None)
        generate = getattr(self.module, "generate", None)
        if self.topology.world_size > 1 and callable(generate) and not getattr(generate, "zerotrain_synced", False):
            self.module.generate = synced_generate(generate)  # an instance attribute: engine.module.generate too

    def _prepare_generate_between_steps(self) -> None:
        """A training engine's `engine.module.generate(...)` (evaluation between steps): no_grad, eval mode,
        stage-3 parameters gathered per forward and released after, outside the training record; synced across
        ranks where a forward holds collectives (`zero.forward_only.generate_between_steps`)."""
        generate = getattr(self.module, "generate", None)
        while hasattr(generate, "zerotrain_synced"):  # wrapped for an earlier engine of this model: its own
            generate = generate.__wrapped__
        if not callable(generate):
            return
        topology = self.topology
        synced = topology.world_size > 1 and (self.stage == 3 or topology.tp_size > 1 or topology.sp_size > 1
                                              or self.expert_groups is not None)
        self.module.generate = generate_between_steps(  # an instance attribute: engine.module.generate
            generate, self.module, self.stage3.fetcher if self.stage3 is not None else None,
            before_use=self._before_model_use, synced=synced)

    def generate(self, *args: Any, **kwargs: Any):
        """`engine.module.generate(...)` (a Hugging Face model's), synced across ranks at world > 1."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"engine.generate(): the model ({type(self.module).__name__}) has no generate method")
        if self.topology.world_size > 1 and not getattr(generate, "zerotrain_synced", False):
            generate = synced_generate(generate)
        with torch.no_grad():
            return generate(*args, **kwargs)

    # --- ZeRO++ ---------------------------------------------------------------
    def _subgroup_comm(self, group_info) -> Comm:
        group, rank, size = group_info
        return self.comm.subgroup(group, rank, size)

    def _make_reducer(self) -> GradientReducer:
        """The gradient reducer of this stage, summing with the exact reduce or qgZ's (+ LoCo)."""
        quantization = self._gradient_quantization()
        reduce = reduce_for(quantization, self.comm)
        if self.stage == 0:  # a full buffer, all-reduced at the boundary
            return FullBufferReducer(self.buckets, self.comm, reduce, sharded=False)
        if self.stage == 1:  # a full buffer, reduce-scattered at the boundary
            return FullBufferReducer(self.buckets, self.comm, reduce, sharded=True)
        if self.stage == 2 or quantization is not None:
            # staged and reduce-scattered every micro-step; stage 3 under qgZ too, each partitioned parameter
            # its own bucket (qgZ's blocks and LoCo buffers stay per parameter there)
            return PartitionedReducer(self.buckets, self.comm, reduce)
        # stage 3: the per-parameter shards packed into reduce buckets
        return Stage3GradReducer(self.buckets, self.comm, int(self.config.zero_optimization.reduce_bucket_size),
                                 reduce=reduce)

    def _gradient_quantization(self) -> Optional[GradQuantization]:
        """qgZ (int4 all-to-all reduce, two hops across nodes) with LoCo when zeropp_loco_param is set."""
        zero = self.config.zero_optimization
        if not zero.zero_quantized_gradients or self.stage == 0 or self.topology.dp_size == 1:
            return None
        loco = zero.zeropp_loco_param
        per_node, nodes = self.topology.node_layout()
        hierarchy = None
        if nodes > 1:
            hierarchy = (self._subgroup_comm(self.topology.partition_group(per_node)),
                         self._subgroup_comm(self.topology.strided_group(per_node)))
        return GradQuantization(bits=4, loco_beta=None if loco is None else float(loco.err_beta),
                                reset_T=1024 if loco is None else int(loco.reset_T), hierarchy=hierarchy)

    def _configure_weight_gathers(self) -> None:
        """qwZ (int8 forward/backward all-gathers) and hpZ (backward gathers inside a group)."""
        zero = self.config.zero_optimization
        hpz_size = int(zero.zero_hpz_partition_size or 1)
        dp = self.topology.dp_size
        hpz = None
        if hpz_size > 1 and dp > 1:
            if dp % hpz_size:
                raise ValueError(f"zero_optimization.zero_hpz_partition_size: {hpz_size} does not divide the "
                                 f"{dp} data-parallel ranks")
            if hpz_size < dp:
                hpz = self._subgroup_comm(self.topology.partition_group(hpz_size))
        self.stage3.fetcher.configure_zeropp(quantize_weights=bool(zero.zero_quantized_weights), hpz=hpz)

    def _make_torch_optimizer(self, optimizer: OptimizerLike, model_parameters) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        groups = _param_groups(self.module, model_parameters)
        if callable(optimizer):
            built = optimizer(groups)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
            return built
        return build_optimizer(self.config.optimizer, groups)

    def _make_zero_optimizer(self, torch_optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """The object that owns master shards and runs the update (on device, or offloaded)."""
        offload = self.config.zero_optimization.offload_optimizer
        gradients = GlobalGradients(self.buckets, self.comm, self.tp_comm)
        if offload is not None and offload.device in ("cpu", "nvme"):
            from .offload import build_offload_optimizer
            return build_offload_optimizer(self.buckets, self.comm, torch_optimizer, self.reducer, self.config,
                                           loss_scale=lambda: self.loss_scaler.scale, gradients=gradients,
                                           fence=self.snapshot_fences)
        return ShardedOptimizer(self.buckets, self.comm, torch_optimizer,
                                [g["params"] for g in torch_optimizer.param_groups], self.config.gradient_clipping,
                                gradients=gradients)

    def _make_scheduler(self, lr_scheduler: Any):
        if lr_scheduler is None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(self.optimizer)
        return lr_scheduler

    def _broadcast_initial_state(self) -> None:
        """Start every rank from rank 0's weights and buffers, as DDP does."""
        if self.comm.size == 1:
            return
        with torch.no_grad():
            for bucket in self.buckets:
                # split experts: from the first rank holding the same experts
                bucket.group.comm.broadcast(bucket.flat_param, src=0)
            in_buckets = {id(p) for b in self.buckets for p in b.params}
            for param in self.module.parameters():
                if id(param) not in in_buckets and getattr(param, "ep_slice", None) is None:
                    self.comm.broadcast(param.data, src=0)
            for buffer in self.module.buffers():
                self.comm.broadcast(buffer, src=0)

    # --- the training step --------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self.inference:  # forward-only: ForwardPasses brackets the module's forward (also under generate)
            with torch.no_grad():
                return self.module(*args, **kwargs)
        # wall_clock_breakdown times training forwards only (an evaluation would land in the next step's)
        with self.timers("fwd") if torch.is_grad_enabled() else contextlib.nullcontext():
            self._before_model_use()
            if self.stage3 is None:
                return self.module(*args, **kwargs)
            self.stage3.fetcher.begin_micro_step()
            with self.stage3.hooks.saved_tensors_hooks():
                output = self.module(*args, **kwargs)
            self.stage3.fetcher.end_forward(backward_follows=torch.is_grad_enabled())
            return output

    forward = __call__

    def _before_model_use(self) -> None:
        """super_offload may have written speculative weights during the last backward: undo them before the
        model is used again without a step in between (a no-op otherwise)."""
        self.zero_optimizer.before_model_use()

    def train(self, mode: bool = True) -> "ZeroTrainEngine":
        self.module.train(mode)
        return self

    @property
    def training(self) -> bool:
        """The module's training mode (DeepSpeed's engine is an nn.Module: `engine.training`)."""
        return self.module.training

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine lacks comes from the wrapped model, as DeepSpeed's engine forwards it
        (DeepSpeed-Chat calls `engine.gradient_checkpointing_enable()`). Only called after normal lookup
        failed; names starting with `_` are never forwarded."""
        module = self.__dict__.get("module")
        if not name.startswith("_") and module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (nor has its module)")

    def eval(self) -> "ZeroTrainEngine":
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next step() will update the weights: by the micro-step count, or as last set by
        `set_gradient_accumulation_boundary`."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary (accelerate's loop calls it before every backward and step()s only at
        the boundary): the following backward reduces, and step() updates, only when `is_boundary`. Each
        backward still scales the loss by 1/gradient_accumulation_steps, as in DeepSpeed."""
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backpropagate `loss` scaled by 1/accumulation (and the fp16 loss scale), reducing gradients."""
        if self.inference:
            raise NoOptimizerError(no_optimizer_message("engine.backward()"))
        scale = self.loss_scaler.scale / self.gradient_accumulation_steps()
        scaled = loss * scale if scale != 1.0 else loss
        with self.timers("bwd"):
            self._before_model_use()
            # inside no_sync() (stages 0-1) gradients stay local until the next backward outside it
            self.reducer.begin_backward(boundary=self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
            with self.timers("bwd_inner"):
                scaled.backward(retain_graph=retain_graph)
            with self.timers("bwd_allreduce"):  # the reductions still in flight after autograd
                self.reducer.end_backward()
            if self.stage3 is not None:
                self.stage3.fetcher.end_micro_step()
        self._backward_done = True
        return loss

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary, update the weights."""
        if self.inference:
            raise NoOptimizerError(no_optimizer_message("engine.step()"))
        if self.checkpointer is not None:
            self.checkpointer.raise_if_failed()
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync() is not allowed (as in DeepSpeed): "
                               "leave the context and run one more backward first")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        with self.timers("step"):
            if boundary:
                if not self._backward_done:
                    raise RuntimeError("engine.step() at an accumulation boundary without engine.backward() before it")
                self._take_model_step()
        self.micro_steps += 1
        if boundary:
            self.timers.close_step()
            self._write_monitor()

    def _take_model_step(self) -> None:
        grad_shards = self.reducer.grad_shards
        # fp16 (dynamic scale) and bf16 with DeepSpeed's `check_grad_overflow`: a non-finite gradient skips the step
        check = self.loss_scaler.dynamic or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow)
        overflow = check and self.zero_optimizer.has_overflow(grad_shards)
        scale_before = self.loss_scaler.scale
        if overflow:
            self.skipped_steps += 1
            logger.info("step %d: gradient overflow, skipped; loss scale %g -> lower", self.global_steps, self.loss_scaler.scale)
        else:
            self.zero_optimizer.step(grad_shards, self.loss_scaler.scale)
            if self.param_store is not None:
                self.param_store.flush()  # updated shards are in host memory / written (OffloadIOError else)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._step_applied = not overflow
        self.loss_scaler.update(overflow)
        # LoCo: count the step, drop the error on overflow, follow a loss-scale change.
        self.reducer.after_optimizer_step(overflow, scale_before, self.loss_scaler.scale)
        self.reducer.zero()
        self._backward_done = False
        if not overflow and not math.isfinite(self.zero_optimizer.last_grad_norm or 0.0):
            warnings.warn(f"step {self.global_steps}: the gradient norm is {self.zero_optimizer.last_grad_norm}; "
                          f"the weights are now non-finite (fp16, or bf16.check_grad_overflow: true, skip such "
                          f"steps)", RuntimeWarning, stacklevel=3)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._report_progress()

    def zero_grad(self) -> None:
        """Drop gradients, but never in the middle of an accumulation cycle (DeepSpeed loops call it freely)."""
        if self.micro_steps % self.gradient_accumulation_steps() == 0:
            self.reducer.zero()
            self._backward_done = False

    # --- queries ------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> Optional[float]:
        """The unscaled global gradient norm of the last step (before clipping)."""
        return self.zero_optimizer.last_grad_norm

    def last_save(self) -> tuple[bool, Optional[float]]:
        """(whether the last `save_checkpoint` is still being written in the background, seconds that save call
        blocked training); (False, None) before any save. What the Trainer reports, without reaching into
        the checkpointer."""
        if self.checkpointer is None:
            return False, None
        return bool(self.checkpointer.pending), self.checkpointer.last_stall_seconds

    def get_wall_clock_timers(self) -> dict[str, float]:
        """DeepSpeed's: the last optimizer step's timer totals in ms by name (`fwd`, `bwd`, `bwd_inner`,
        `bwd_allreduce`, `step`); {} unless `wall_clock_breakdown` is true."""
        return dict(self.timers.last)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights on CPU under the model's parameter names, on rank 0 only (collective).
        `trainable_only`: only the parameters that require grad (e.g. a LoRA adapter without its base).

        Data-parallel shards are gathered on data-parallel rank 0; with tensor parallelism the
        slices of its tensor-parallel group are then joined on tensor-parallel rank 0 (global
        rank 0), by the TensorSlice each split parameter carries.
        """
        optimizer = self.zero_optimizer
        return full_state_dict(self.module, self.buckets, optimizer.masters, self.comm, self.tp_comm,
                               frozen=self.stage3.frozen if self.stage3 is not None else (),
                               resident_masters=optimizer.resident_masters,  # NVMe: masters are in files
                               trainable_only=trainable_only)

    def sharded_slots(self) -> list[ShardedSlot]:
        """This rank's master shards with their layout records (what a checkpoint saves and loads)."""
        return [ShardedSlot(records=bucket.shard_records(), master=master,
                            model_shard=bucket.local_shard(), replicated=bucket.partitions == 1)
                for bucket, master in zip(self.buckets, self.zero_optimizer.masters)]

    def frozen_slots(self) -> list[ShardedSlot]:
        """Frozen (untrained) parameters as slots without a master: at stage 3 this rank's shards of each; at
        stages 0-2 the tensor-parallel slices (whole on each data-parallel rank), so a save joins every
        tensor-parallel rank's slice (a LoRA base split by tensor parallelism); other frozen parameters are
        whole on every rank and saved as they are."""
        if self.stage3 is None:
            in_buckets = {id(p) for b in self.buckets for p in b.params}
            slots, seen = [], set()
            for name, param in self.module.named_parameters():
                if id(param) in in_buckets or id(param) in seen or getattr(param, "tp_slice", None) is None:
                    continue
                seen.add(id(param))
                record = ShardRecord(name, tuple(param.shape), 0, param.numel(), 0)
                slots.append(ShardedSlot(records=[record], master=None, model_shard=param.data.view(-1),
                                         replicated=True))
            return slots
        return [ShardedSlot(records=part.shard_records(), master=None, model_shard=part.shard,
                            replicated=part.partitions == 1) for part in self.stage3.frozen]

    def publish_weights(self) -> None:
        """Make every rank's model weights current after masters or frozen shards were written (a load)."""
        self.zero_optimizer.publish()
        if self.stage3 is not None:
            self.stage3.refresh_frozen()

    # --- checkpoints (zerotrain.checkpoint does the work) ---------------------
    def checkpoint_state(self) -> CheckpointState:
        """The declared set of state a checkpoint saves and loads (the checkpoint reads nothing else)."""
        topology = self.topology
        world = self.comm if topology.tp_size == 1 else \
            self.comm.subgroup(torch.distributed.group.WORLD, topology.rank, topology.world_size)
        return CheckpointState(
            module=self.module, optimizer=self.optimizer,
            slots=lambda: self.sharded_slots() + self.frozen_slots(), publish=self.publish_weights,
            resident=lambda write_back: resident_model_states(self.zero_optimizer, self.param_store, write_back),
            topology=topology, world=world, config=self.config, stage=self.stage, dtype=self.dtype,
            ep_rank=int(self.expert_groups.ep.rank) if self.expert_groups is not None else int(topology.dp_rank),
            # Snapshot copies may run in the background only for CPU tensors that only step() changes: not with
            # an offloaded optimizer (NVMe states are resident only during the save; SuperOffload updates masters
            # during backward).
            defer_copies=topology.device.type == "cpu" and self.zero_optimizer.snapshot_in_background,
            counters=_StepCounters(self), loss_scaler=self.loss_scaler, scheduler=self.lr_scheduler,
            loco=_LoCoErrors(self), fences=self.snapshot_fences, files=self._checkpoint_files)

    def add_checkpoint_files(self, files: Union[dict, Callable[[], dict]]) -> None:
        """Copy these files ({name: bytes}) into every checkpoint directory saved from now on, listed in its
        manifest (e.g. the tokenizer's files, so `AutoTokenizer.from_pretrained(checkpoint_dir)` works).
        A callable is called on every rank at each save (it may be collective) and its files (those of
        global rank 0, which writes them) are taken as they are then: e.g. a LoRA adapter in PEFT's layout."""
        if callable(files):
            self._checkpoint_file_makers.append(files)
            return
        for name, data in files.items():
            if os.sep in name or name.startswith(".") or not isinstance(data, (bytes, bytearray)):
                raise ValueError(f"checkpoint file {name!r}: a plain file name with bytes is expected")
        self._checkpoint_files.update(files)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, async_save: Optional[bool] = None,
                        exclude_frozen_parameters: bool = False) -> str:
        """Write a unified checkpoint of model, optimizer and trainer state; see zerotrain.checkpoint.

        `exclude_frozen_parameters` (DeepSpeed's; the HF Trainer passes True for PEFT models) is accepted,
        but frozen weights are still written: the checkpoint stays a complete, HF-loadable model (warned)."""
        if self.inference:
            raise NoOptimizerError(no_optimizer_message("engine.save_checkpoint()") +
                                   " (engine.save_16bit_model() writes the weights)")
        if exclude_frozen_parameters:
            warnings.warn("save_checkpoint(exclude_frozen_parameters=True): zerotrain writes frozen weights too "
                          "(the checkpoint stays a complete model); only trainable ones get optimizer states",
                          stacklevel=2)
        for make in self._checkpoint_file_makers:
            self.add_checkpoint_files(make())
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.checkpoint_state())
        with self.timers.phase("save"):
            return save_checkpoint(self.checkpointer, save_dir, tag=tag, client_state=client_state or {},
                                   save_latest=save_latest, async_save=async_save)

    def watch_memory(self, timeline) -> None:
        """Tell `timeline` (a `zerotrain.monitor.MemoryTimeline`, or None to stop) where this engine's phases
        begin and end: forward, backward, gather (stage 3's blocking parameter gathers), reduce, optimizer
        step, save (the `wall_clock_breakdown` timers' boundaries), and when each optimizer step ends."""
        self.timers.listener = timeline
        if self.stage3 is not None:
            self.stage3.fetcher.phase = self.timers.phase
        if self.forward_passes is not None:  # forward-only: its forwards are not timed, but still a phase
            self.forward_passes.listener = timeline

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True, custom_load_fn: Optional[Callable] = None):
        """Load a unified checkpoint written at any world size or stage; returns (path, client_state).

        `load_module_strict` (DeepSpeed's; the HF Trainer passes it): zerotrain always loads strictly, a
        weight missing from the checkpoint is an error naming it, so False is accepted with a warning.
        `custom_load_fn` is not supported (an error)."""
        if custom_load_fn is not None:
            raise NotImplementedError("load_checkpoint(custom_load_fn=...) is not supported by zerotrain: its "
                                      "checkpoint loader reads each rank's shard ranges itself")
        if not load_module_strict:
            warnings.warn("load_checkpoint(load_module_strict=False): zerotrain loads strictly; a model weight "
                          "missing from the checkpoint is still an error", stacklevel=2)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        if self.inference:  # forward-only: the weights alone (no optimizer, scheduler or counters to restore)
            load_module_only, load_optimizer_states, load_lr_scheduler_states = True, False, False
        return load_checkpoint(self.checkpoint_state(), load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                               load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only)

    def claim_save_dir(self, save_dir: str) -> None:
        """Take `save_dir`'s one-writer lock for this job now (every rank), instead of at the first save:
        a second job writing there is refused before it trains (zerotrain.checkpoint.lock)."""
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.checkpoint_state())
        self.checkpointer.claim(save_dir)

    def wait_checkpoint(self) -> None:
        """Block until every pending asynchronous save is committed (raising its error, if any)."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def memory_report(self) -> dict:
        """Bytes of model state this rank holds, and communication counters since start."""
        if self.stage3 is not None:
            param_bytes = self.stage3.device_param_bytes()
        else:
            in_buckets = {id(p) for b in self.buckets for p in b.params}
            param_bytes = sum(b.flat_param.numel() * b.flat_param.element_size() for b in self.buckets)
            param_bytes += sum(p.numel() * p.element_size() for p in self.module.parameters()
                               if id(p) not in in_buckets)
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        report = {
            "parameters": param_bytes,
            # elements of the parameters that train (a LoRA adapter) and of the frozen ones (its base), whole
            # model: only the trainable ones have gradients, masters and optimizer states above
            "trainable_numel": trainable,
            "frozen_numel": sum(p.numel() for p in self.module.parameters()) - trainable,
            "gradients": self.reducer.held_bytes(),
            "loco_errors": self.reducer.loco_bytes(),  # qgZ's LoCo error buffers, already inside "gradients"
            "optimizer_states": self.zero_optimizer.state_bytes(),  # on the device; offloaded bytes below
            "comm": self.counters.snapshot(),
        }
        report.update(self._offload_memory())
        return report

    # --- stopping on signals (zerotrain.lifecycle) -----------------------------
    def install_signal_handlers(self, signals=None) -> StopRequest:
        """Turn SIGTERM/SIGINT/SIGHUP/SIGUSR1 (or `signals`) into a stop request (main thread only).

        A hand-written loop then asks `should_stop()` once per step, saves and exits; the Trainer
        and the CLI do this by default. A second signal (after 2 s) exits at once.
        """
        return self.stop_request.install(signals)

    def should_stop(self) -> bool:
        """Whether any rank received a stop signal: the same answer on every rank.

        One 8-byte all-reduce over all ranks (call it once per step, at the same point on every
        rank); the Trainer folds this flag into its per-step loss reduction instead.
        """
        flag = 1.0 if self.stop_request.requested else 0.0
        if self.topology.world_size == 1:
            return bool(flag)
        world = self.comm.subgroup(torch.distributed.group.WORLD, self.topology.rank, self.topology.world_size)
        return world.any_true(bool(flag), self.topology.device)

    # --- offload (zerotrain.offload does the work) ----------------------------
    def offload_stats(self) -> dict:
        """Counters of the offloaded optimizer (steps; with super_offload speculative steps, rollbacks,
        clip_redos = steps redone with clipped gradients; with nvme bytes read/written); {} without offload."""
        return dict(self.zero_optimizer.stats)

    def _offload_memory(self) -> dict:
        """`offload`: bytes of masters and optimizer states by place (device, host, nvme, host I/O buffers);
        `offload_param`: stage-3 parameter shards by place ("parameters" counts the device only)."""
        report = {"offload_param": self.param_store.memory_split()} if self.param_store is not None else {}
        split = self.zero_optimizer.memory_split()  # None without optimizer offload
        if split is not None:
            report["offload"] = dict(split, offloaded_bytes=self.zero_optimizer.offloaded_bytes())
        return report

    def close(self) -> None:
        """Finish pending checkpoint saves (releasing the save directory's lock), release the offload
        optimizer's threads and files (idempotent)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self.zero_optimizer.close()
        if self.param_store is not None:
            self.param_store.close()

    # --- DeepSpeed engine API ---------------------------------------------------------------
    # What DeepSpeed training scripts, DeepSpeedExamples and HF's DeepSpeed integration call on the
    # engine beyond the training step (the list, with notes, is docs/porting.md). Built only on the
    # engine's public surface (config, topology, comm, module, optimizer, ...).
    training_dataloader = None  # the loader initialize() built from `training_data` (DeepSpeed's name)
    _inside_no_sync = False
    _step_applied = False
    _boundary_override: Optional[bool] = None  # set_gradient_accumulation_boundary's value, once called
    _print_progress = True  # steps_per_print lines; the Trainer turns them off while it reports progress

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (the launcher's LOCAL_RANK; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Ranks that see different samples (the batch triple's): world / (tensor × sequence parallel)."""
        return self.topology.data_parallel_size

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel) ranks per model replica."""
        return self.topology.tp_size

    @property
    def data_parallel_group(self):
        """The torch process group ZeRO shards over (for `zerotrain.dist` calls, `group=`)."""
        return self.topology.dp_group

    @property
    def device(self) -> torch.device:
        """The device the model lives on: move each batch there (`x.to(engine.device)`)."""
        return self.topology.device

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_optimization(self) -> bool:
        return self.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.stage >= 3

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    bf16_enabled = bfloat16_enabled

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping or 0.0)

    def steps_per_print(self) -> int:
        return int(self.config.steps_per_print or 0)

    def get_mom(self) -> list:
        """Per parameter group: Adam's betas, else SGD's momentum (None when the optimizer has neither)."""
        if self.optimizer is None:
            return []
        return [group.get("betas", group.get("momentum")) for group in self.optimizer.param_groups]

    def was_step_applied(self) -> bool:
        """True when the last step() updated the weights (False between accumulation boundaries and on an
        fp16 overflow)."""
        return self._step_applied

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip the gradient reduction; the next backward outside reduces the sum.

        As in DeepSpeed: refused at ZeRO stages 2-3 (their gradients are partitioned during every
        backward), not re-entrant, and step() inside raises. The micro-step count does not advance,
        so the loss scale stays 1/gradient_accumulation_steps per backward: gradients add up.
        """
        if self.zero_optimization_partition_gradients():
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {self.stage}: stages 2 and 3 reduce "
                               "and partition gradients during every backward (DeepSpeed refuses it too)")
        if self._inside_no_sync:
            raise RuntimeError("no_sync() is not re-entrant")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, collate_fn: Optional[Callable] = None,
                     num_local_io_workers: Optional[int] = None, **unused: Any):
        """A DataLoader over this rank's share of `dataset` (a DistributedSampler over the data-parallel
        ranks, shuffled with the config's seed, incomplete last batch dropped), micro-batch size by default."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        if unused:
            warnings.warn(f"deepspeed_io: {sorted(unused)} have no effect in zerotrain")
        # the ranks of a sequence-parallel group draw the same samples (each then takes its slice)
        sampler = DistributedSampler(dataset, num_replicas=self.topology.data_parallel_size,
                                     rank=self.topology.data_parallel_rank,
                                     shuffle=True, seed=self.config.seed or 0)
        return DataLoader(dataset, batch_size=batch_size or self.train_micro_batch_size_per_gpu(), sampler=sampler,
                          collate_fn=collate_fn, drop_last=True, num_workers=num_local_io_workers or 0)

    def use_training_data(self, dataset, collate_fn: Optional[Callable] = None):
        """Build `training_dataloader` from `dataset` (what initialize(training_data=...) does); return it."""
        self.training_dataloader = self.deepspeed_io(dataset, collate_fn=collate_fn)
        return self.training_dataloader

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The wrapped model's own state_dict (training dtype). At ZeRO-3 the parameters are partitioned:
        use consolidated_16bit_state_dict() or save_16bit_model() for whole weights."""
        if self.stage3 is not None:
            raise RuntimeError("module_state_dict(): at ZeRO stage 3 the parameters are partitioned; "
                               "use engine.consolidated_16bit_state_dict() (collective) or engine.save_16bit_model()")
        state = self.module.state_dict()
        if exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return state

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """As DeepSpeed's engine (an nn.Module wrapping the model): the module's state under `module.`."""
        return {f"module.{k}": v for k, v in self.module_state_dict().items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load weights given as `module.`-prefixed keys (what state_dict() returns) or as the model's own
        names, into the weights and the fp32 masters (a plain module load would be undone by the next step)."""
        from .zero.stage3 import GatheredParameters

        own = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
        expected = dict(self.module.named_parameters())
        expected.update(dict(self.module.named_buffers()))
        missing = sorted(set(expected) - set(own))
        unexpected = sorted(set(own) - set(expected))
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing[:10]}, unexpected keys {unexpected[:10]}")
        names = [n for n in own if n in expected]
        with torch.no_grad():
            if self.stage3 is not None:  # the gathered values are written back to every shard and master
                params = [expected[n] for n in names if isinstance(expected[n], torch.nn.Parameter)]
                with GatheredParameters(params, modifier_rank=0):
                    for name in names:
                        expected[name].data.copy_(own[name].to(expected[name].dtype))
                return missing, unexpected
            for name in names:
                expected[name].data.copy_(own[name].to(expected[name].dtype))
            # Stages 0-2: the fp32 masters from the given values themselves (not their training-dtype cast).
            for bucket, master in zip(self.buckets, self.zero_optimizer.masters):
                flat = torch.zeros(bucket.padded_numel, dtype=torch.float32, device=bucket.device)
                for name, view in bucket.unflatten(flat).items():
                    view.copy_(own[name] if name in own else expected[name].detach())
                master.copy_(bucket.shard_of(flat))
        self.publish_weights()
        return missing, unexpected

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Whole weights in the training dtype (fp32 masters cast) plus persistent buffers, on global rank 0
        ({} elsewhere). Collective: every rank must call it."""
        full = self.full_state_dict()
        if self.topology.rank != 0:
            return {}
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state = {n: t.to(self.dtype) for n, t in full.items() if not (exclude_frozen_parameters and n in frozen)}
        for module_name, module in self.module.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    state.setdefault(f"{module_name}.{name}" if module_name else name, buffer.detach().cpu().clone())
        return state

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict  # the name HF transformers calls

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Write whole weights in the training dtype to save_dir/save_filename on global rank 0 (torch.save,
        or safetensors for a `.safetensors` name): loadable by `model.load_state_dict` / HF from_pretrained.
        Collective. As in DeepSpeed, at ZeRO-3 only with
        `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`, else nothing is written
        (with a warning) and False is returned."""
        path = os.path.join(save_dir, save_filename)
        if self.stage3 is not None and not self.zero_gather_16bit_weights_on_model_save():
            warnings.warn(f"save_16bit_model did not write {path}: at ZeRO stage 3 it needs "
                          "zero_optimization.stage3_gather_16bit_weights_on_model_save: true (as in DeepSpeed)")
            return False
        state = self.consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.topology.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            if save_filename.endswith(".safetensors"):
                from safetensors.torch import save_file
                seen: set = set()
                tensors = {}
                for name, tensor in state.items():  # safetensors refuses shared storage (tied weights)
                    tensors[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
                    seen.add(id(tensor))
                save_file(tensors, path, metadata={"format": "pt"})
            else:
                torch.save(state, path)
        self.comm.all_gather_object(None)  # no rank returns before the file is written
        return True

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    @contextlib.contextmanager
    def progress_printing(self, enabled: bool):
        """Turn the engine's own reports, the steps_per_print lines and the monitor events, on or off inside
        the block (the Trainer prints and writes its own, with the loss)."""
        before, self._print_progress = self._print_progress, enabled
        try:
            yield
        finally:
            self._print_progress = before

    def _write_monitor(self) -> None:
        """What DeepSpeed's engine writes to the `tensorboard`/`csv_monitor`/`wandb` blocks after each optimizer
        step, on global rank 0: `Train/Samples/lr` (the rate after the scheduler step), `loss_scale` (fp16),
        the `elapsed_time_ms_*` timers (wall_clock_breakdown), plus the gradient norm, at x = global samples."""
        if not (self._print_progress and self.topology.rank == 0):
            return
        if self.monitor is None:
            if not any(getattr(self.config, block).enabled for block in ("tensorboard", "csv_monitor", "wandb")):
                return
            self.monitor = Monitors.build(self.config)
        record = {"step": self.global_steps, "samples": self.global_samples, "next_lr": self.get_lr()[0]}
        if self.fp16_enabled():
            record["loss_scale"] = self.loss_scaler.scale
        if self.zero_optimizer.last_grad_norm is not None:
            record["grad_norm"] = self.zero_optimizer.last_grad_norm
        record.update({TIMER_FIELDS[name]: ms for name, ms in self.timers.last.items()})
        self.monitor.write(record)

    def _report_progress(self) -> None:
        """Every `steps_per_print` optimizer steps, one line on global rank 0's stdout, as DeepSpeed prints it."""
        every = self.steps_per_print()
        if not (self._print_progress and every and self.topology.rank == 0 and self.global_steps % every == 0):
            return
        extra = f", loss_scale={self.loss_scaler.scale:g}" if self.fp16_enabled() else ""
        norm = self.zero_optimizer.last_grad_norm
        extra += f", grad_norm={norm:.4g}" if norm is not None else ""
        extra += "".join(f", offload_{k}={v}" for k, v in self.offload_stats().items())
        print(f"[zerotrain] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
              f"mom={self.get_mom()}{extra}", flush=True)


class _StepCounters:
    """The engine's step counters as a checkpoint saves and restores them."""

    _KEYS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

    def __init__(self, engine: ZeroTrainEngine):
        self._engine = engine

    def state_dict(self) -> dict:
        return {key: getattr(self._engine, key) for key in self._KEYS}

    def load_state_dict(self, state: dict) -> None:
        for key in self._KEYS:
            setattr(self._engine, key, int(state[key]))


class _LoCoErrors:
    """The gradient reducer's LoCo error buffers as a checkpoint saves and restores them."""

    def __init__(self, engine: ZeroTrainEngine):
        self._engine = engine

    @property
    def enabled(self) -> bool:
        return bool(self._engine.reducer.loco_enabled)

    def state_dict(self) -> Optional[dict]:
        return self._engine.reducer.loco_state() if self.enabled else None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """The saved buffers, or zero when `state` is None; reset_T keeps counting from the restored step."""
        reducer = self._engine.reducer
        reducer.optimizer_steps = self._engine.global_steps
        if not reducer.loco_enabled:
            return
        if state is None:
            reducer.reset_loco_state()
        else:
            reducer.load_loco_state(state)
