"""`PipelineEngine`: DeepSpeed's `train_batch` / `eval_batch` over torch's pipelining schedules and a ZeRO engine.

`prepare_pipeline` (called by `initialize` before the engine is built) builds this rank's pieces of a
`PipelineModule`, marks the copies of tied parameters on later stages (`sharding.mark_pipeline_replica`: they
count once in the gradient norm) and makes those copies equal to the owning stage's. The ZeRO engine
(`engine.ZeroTrainEngine`, stage 0 or 1 over this stage's data-parallel ranks) is then built over the
PipelineModule; `PipelineEngine` wraps it:

`train_batch(data_iter)`: the first stage reads the inputs and the last the labels of exactly
`gradient_accumulation_steps` micro-batches (the others never touch the iterator); torch's schedule runs every
forward and backward (each micro-batch's loss unscaled, so gradients add up); inside the ZeRO engine's
`external_backward()` block the summed gradients are divided by the micro-batch count and the tied copies summed
over their stages (DeepSpeed's tied-weight all-reduce); the block's exit reduces them over the data-parallel
ranks once (after the schedule: zero-bubble schedules add into `.grad` directly, without hooks); the engine's
`step()` clips by the norm over every stage and updates. The batch's mean loss is broadcast from the last stage.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, Union

import torch

from ..checkpoint import CheckpointState
from ..comm import Comm
from ..config import ConfigError, ZeroTrainConfig
from ..sharding import mark_pipeline_replica
from ..topology import Topology
from ..training_engine import TrainingEngine
from .checkpoint import pipeline_checkpoint_state
from .module import PipelineModule
from .schedule import Placement, schedule_class


class StageEngine(TrainingEngine, Protocol):
    """What the pipeline engine calls on the ZeRO engine of its stage (`engine.ZeroTrainEngine` has it all): the one
    `TrainingEngine` interface, and what a pipeline schedule needs beyond it (the stage's data-parallel ranks, the
    optimizer and schedule, gradients made outside `backward`, the checkpoint's declared state)."""

    @property
    def comm(self) -> Comm: ...  # the stage's data-parallel ranks

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]: ...

    @property
    def lr_scheduler(self) -> Any: ...

    def external_backward(self, micro_steps: int = 1) -> ContextManager[None]: ...

    def add_checkpoint_files(self, files: Union[dict, Callable[[], dict]]) -> None: ...

    def view_checkpoint_state(self, view: Callable[[CheckpointState], CheckpointState]) -> None: ...


__all__ = ["PipelineEngine", "StageEngine", "PipelinePlan", "prepare_pipeline", "check_pipeline_config", "pipeline_size"]


def pipeline_size(model: torch.nn.Module, config: ZeroTrainConfig) -> int:
    """The pipeline size of this job: a PipelineModule's `num_stages` (the config's `pipeline_parallel_size`, when
    set, must agree), else `pipeline_parallel_size`."""
    configured = int(config.pipeline_parallel_size)
    if isinstance(model, PipelineModule):
        if configured not in (1, model.num_stages):
            raise ConfigError(f"pipeline_parallel_size: {configured} disagrees with the PipelineModule's "
                              f"num_stages={model.num_stages}", key="pipeline_parallel_size")
        return model.num_stages
    if configured > 1:
        raise ConfigError(f"pipeline_parallel_size: {configured} needs a zerotrain.pipe.PipelineModule model "
                          f"(got {type(model).__name__}); splitting other models is not available yet",
                          key="pipeline_parallel_size")
    return 1


def check_pipeline_config(model: PipelineModule, config: ZeroTrainConfig, world: int) -> None:
    """Refuse, by the key at fault, what the pipeline engine cannot run (before any process group exists)."""
    pp = model.num_stages
    stage = int(config.zero_optimization.stage)
    if stage >= 2:
        raise ConfigError(
            f"zero_optimization.stage: {stage} with pipeline parallelism is refused: stages 2 and 3 reduce (and "
            "stage 3 gathers) per backward through gradient hooks, while torch's pipeline schedules run many "
            "backwards per step and the zero-bubble ones add weight gradients into .grad without hooks; use "
            "stage 0 or 1 (ZeRO-1 over each stage's data-parallel ranks, as DeepSpeed allows)",
            key="zero_optimization.stage")
    if int(config.tensor_parallel.autotp_size) > 1 or int(config.sequence_parallel_size) > 1:
        raise ConfigError("pipeline parallelism with tensor_parallel.autotp_size > 1 or sequence_parallel_size > 1 "
                          "is not available yet (the grid supports it; the pieces do not split their layers)",
                          key="tensor_parallel.autotp_size" if int(config.tensor_parallel.autotp_size) > 1
                          else "sequence_parallel_size")
    if model.loss_fn is None:
        raise ValueError("PipelineModule: loss_fn is required for training (it runs on the last stage)")
    model.partition(pp * config.pipeline.pieces_per_rank)  # layers < pieces: refused here, naming the counts
    if world % pp:
        raise ConfigError(f"pipeline_parallel_size: the PipelineModule's num_stages={pp} does not divide the "
                          f"world size {world}", key="pipeline_parallel_size")


class PipelinePlan:
    """This rank's share of the pipeline: its pieces, where every piece sits, the tied-weight groups."""

    def __init__(self, module: PipelineModule, placement: Placement, topology: Topology,
                 tied: dict[str, Comm], pp_comm: Comm) -> None:
        self.module, self.placement, self.topology = module, placement, topology
        self.tied = tied        # tied key -> Comm over the stages holding it (only keys this rank holds, > 1 stage)
        self.pp_comm = pp_comm  # this rank's pipeline group (the loss broadcast)


def prepare_pipeline(module: PipelineModule, config: ZeroTrainConfig, topology: Topology) -> PipelinePlan:
    """Build this rank's pieces, mark tied copies on later stages as replicas and copy the owner's values into
    them (collective over the world: every rank makes every tie group, in key order)."""
    pipe = config.pipeline
    placement = Placement(topology.pp_size, pipe.pieces_per_rank, v_shape=pipe.schedule == "zbv_zero_bubble")
    module.build(placement.pieces_of(topology.pp_rank), placement.rank_of, placement.pieces,
                 interval=pipe.activation_checkpoint_interval, seed_layers=pipe.seed_layers)
    pp_comm = Comm.pipeline(topology)
    tied: dict[str, Comm] = {}
    for key in sorted(module.tied_owners):
        owners = module.tied_owners[key]
        group, rank, size = topology.pipeline_subgroup(owners)
        params = module.tied_parameters(key)
        if rank < 0 or size == 1:
            continue
        comm = pp_comm.subgroup(group, rank, size)
        with torch.no_grad():
            for param in params:
                comm.broadcast(param.data, src=0)  # the first stage holding the key owns it
                if rank > 0:
                    mark_pipeline_replica(param)
        tied[key] = comm
    return PipelinePlan(module, placement, topology, tied, pp_comm)


class PipelineEngine(TrainingEngine):
    """DeepSpeed's pipeline engine API (`train_batch`, `eval_batch`, stage questions) over a ZeRO engine; a
    `TrainingEngine` for the loops (its neutral reports; `zerotrain train` drives it through `train_batch`)."""

    def __init__(self, engine: StageEngine, plan: PipelinePlan, training_data: Any = None,
                 collate_fn: Optional[Callable] = None) -> None:
        self.engine = engine
        self.plan = plan
        self.module: PipelineModule = plan.module
        self.config: ZeroTrainConfig = engine.config
        self.topology: Topology = plan.topology
        self.micro_batches = int(self.config.gradient_accumulation_steps)
        placement = plan.placement
        device = self.topology.device
        pp = self.topology.pp_size
        group = self.topology.pp_group if pp > 1 else self.topology.own_group()  # not the default group
        from torch.distributed.pipelining import PipelineStage  # on use: it imports torch._dynamo (schedule.py)
        self.stages = [PipelineStage(piece, piece.index, placement.pieces, device, group=group)
                       for piece in self.module.pieces]
        name = self.config.pipeline.schedule
        if name == "1f1b" and self.micro_batches < placement.pieces:
            # torch's 1F1B needs a micro-batch per stage; GPipe runs fewer with the same math (every forward,
            # then every backward: no overlap, as DeepSpeed's pipeline engine runs one micro-batch per step)
            name = "gpipe"
        self._schedule_name = name
        cls = schedule_class(name)
        # scale_grads=False: each micro-batch's loss is unscaled and gradients add up; divided once after the
        # schedule, per parameter (a tied module held twice on one rank would otherwise be divided twice)
        target = self.stages[0] if len(self.stages) == 1 and not self.config.pipeline.multi_stage else self.stages
        self.schedule = cls(target, self.micro_batches, loss_fn=self._loss, scale_grads=False)
        self._first = placement.first_rank == self.topology.pp_rank
        self._last = placement.last_rank == self.topology.pp_rank
        self._params = list(dict.fromkeys(self.module.parameters()))
        # checkpoints: the stage engine's own lifecycle (save, load, claim, background saves, close), over the
        # unified format of every stage (pipe.checkpoint)
        engine.view_checkpoint_state(
            lambda state: pipeline_checkpoint_state(state, self.module, self.topology, engine.comm))
        # DeepSpeed's pipeline engine reads `training_data` itself when train_batch/eval_batch get no iterator:
        # a repeating loader over a DistributedSampler of the stage's data-parallel ranks, not shuffled
        self.training_dataloader: Any = None
        self.data_iterator: Optional[Iterator] = None
        if training_data is not None and (self._first or self._last):
            self.set_dataloader(self._pipe_loader(training_data, collate_fn))

    def _pipe_loader(self, dataset: Any, collate_fn: Optional[Callable]) -> Any:
        """DeepSpeed's `_build_data_iter`: micro-batches of this stage's data-parallel share, in order, forever."""
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler

        from ..utils import RepeatingLoader

        sampler = DistributedSampler(dataset, num_replicas=self.topology.data_parallel_size,
                                     rank=self.topology.data_parallel_rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=int(self.config.train_micro_batch_size_per_gpu), sampler=sampler,
                            collate_fn=collate_fn)  # DeepSpeed's dataloader_drop_last default
        return RepeatingLoader(loader)

    def set_dataloader(self, loader: Any) -> None:
        """Read batches from `loader` when train_batch/eval_batch get no iterator (first and last stage)."""
        if self._first or self._last:
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Read batches from `iterator` when train_batch/eval_batch get none (first and last stage)."""
        if self._first or self._last:
            self.training_dataloader = None
            self.data_iterator = iterator

    # --- DeepSpeed's questions ------------------------------------------------------
    @property
    def stage_id(self) -> int:
        return self.topology.pp_rank

    @property
    def num_stages(self) -> int:
        return self.topology.pp_size

    @property
    def schedule_name(self) -> str:
        """The schedule that runs: the config's, or `gpipe` where `1f1b` has fewer micro-batches than stages."""
        return self._schedule_name

    def is_first_stage(self) -> bool:
        return self._first

    def is_last_stage(self) -> bool:
        return self._last

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def global_samples(self) -> int:
        return self.engine.global_samples

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self.config.train_micro_batch_size_per_gpu)

    def train_batch_size(self) -> int:
        return int(self.config.train_batch_size)

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    @property
    def loss_scale(self) -> float:  # type: ignore[override]
        return self.engine.loss_scale

    @property
    def training(self) -> bool:
        return self.module.training

    @property
    def global_rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def dp_world_size(self) -> int:
        """Ranks of one stage that see different samples."""
        return self.topology.data_parallel_size

    def add_checkpoint_files(self, files: Union[dict, Callable[[], dict]]) -> None:
        """Copy these files ({name: bytes}) into every checkpoint directory saved from now on (the tokenizer's).
        A callable is called on every rank at each save (it may be collective, e.g. `full_state_dict`) and the
        files global rank 0 gets are written: a LoRA adapter in PEFT's layout."""
        self.engine.add_checkpoint_files(files)

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights on CPU under the model's parameter names, every stage's, on global rank 0 only
        ({} elsewhere; collective). `trainable_only`: only the parameters that require grad (a LoRA adapter)."""
        own = self.engine.full_state_dict(trainable_only)  # this stage's, on its data-parallel rank 0
        stages = self.plan.pp_comm.all_gather_object(own)   # rank 0's pipeline group: every stage's dp rank 0
        if self.topology.rank != 0:
            return {}
        return {name: tensor for stage in stages for name, tensor in stage.items()}

    def claim_save_dir(self, save_dir: str) -> None:
        """Take `save_dir`'s one-writer lock for this job now (every rank), instead of at the first save."""
        self.engine.claim_save_dir(save_dir)

    def get_global_grad_norm(self) -> Optional[float]:
        """The unscaled gradient norm of the last step, over every stage (before clipping)."""
        return self.engine.get_global_grad_norm()

    # --- DeepSpeed's accessors: the stage engine's own -----------------------------------
    def was_step_applied(self) -> bool:
        return self.engine.was_step_applied()

    def zero_optimization_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def bfloat16_enabled(self) -> bool:
        return self.engine.bfloat16_enabled()

    def fp16_enabled(self) -> bool:
        return self.engine.fp16_enabled()

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's: whole weights in the training dtype (the fp32 masters cast) plus persistent buffers, every
        stage's, on global rank 0 ({} elsewhere; collective). `exclude_frozen_parameters`: without the parameters
        that do not train (a LoRA base)."""
        engine = self.engine
        dtype = (torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled()
                 else torch.float32)
        own = engine.full_state_dict()  # this stage's fp32 masters, on its data-parallel rank 0 ({} elsewhere)
        if own:
            frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
            own = {n: t.to(dtype) for n, t in own.items() if not (exclude_frozen_parameters and n in frozen)}
            for module_name, sub in self.module.named_modules():
                for name, buffer in sub.named_buffers(recurse=False):
                    if buffer is not None and name not in sub._non_persistent_buffers_set:
                        own.setdefault(f"{module_name}.{name}" if module_name else name, buffer.detach().cpu().clone())
        stages = self.plan.pp_comm.all_gather_object(own)  # rank 0's pipeline group: every stage's dp rank 0
        if self.topology.rank != 0:
            return {}
        return {name: tensor for stage in stages for name, tensor in stage.items()}

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict  # the name HF transformers calls

    def train(self, mode: bool = True) -> "PipelineEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineEngine":
        return self.train(False)

    # --- refused: the schedule runs forward and backward ------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs whole batches: engine.train_batch(data_iter) or "
                           "engine.eval_batch(data_iter), not engine(...) / backward / step (as DeepSpeed's)")

    __call__ = forward
    backward = forward
    step = forward
    set_gradient_accumulation_boundary = forward

    # --- checkpoints: the stage engine's lifecycle over the unified format of every stage (pipe.checkpoint) ----
    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, async_save: Optional[bool] = None, **kwargs: Any) -> str:
        """Write a unified checkpoint of every stage (call on every rank). `async_save` (or
        `checkpoint.async_save`): written in the background as without a pipeline; the next `train_batch`
        fences the snapshot copy before its optimizer step and raises a failed save's error on every rank."""
        return self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
                                           async_save=async_save)

    def wait_checkpoint(self) -> None:
        """Block until a pending asynchronous save has committed (raise its error if it failed)."""
        self.engine.wait_checkpoint()

    def last_save(self) -> tuple[bool, Optional[float]]:
        """(whether a save is still being written, the training stall of the last save in seconds)."""
        return self.engine.last_save()

    def close(self) -> None:
        """Release the checkpoint save directory's lock, then the stage engine's resources (idempotent)."""
        self.engine.close()

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False, **kwargs: Any):
        """Load a unified checkpoint saved at any pipeline, data-parallel or ZeRO shape; returns
        (path, client_state). Tied copies on later stages read their owner's entries."""
        return self.engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=load_lr_scheduler_states,
                                           load_module_only=load_module_only)

    # --- the batch ------------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.module.loss_fn(output, target)
        scale = self.engine.loss_scale
        return loss * scale if scale != 1.0 else loss

    def _read(self, data_iter: Optional[Iterator]) -> tuple[tuple, Any]:
        """(inputs for the first stage or (), labels for the last or None), each the micro-batches of one batch
        joined on dim 0 (torch's schedule splits them back: every micro-batch must have the same shape)."""
        if not (self._first or self._last):
            return (), None
        if data_iter is None:
            data_iter = self.data_iterator
        if data_iter is None:
            raise ValueError(f"train_batch/eval_batch: pipeline rank {self.stage_id} holds the "
                             f"{'first' if self._first else 'last'} stage and needs data_iter (or "
                             "initialize(training_data=...), or engine.set_dataiterator(...))")
        inputs, labels = [], []
        for index in range(self.micro_batches):
            try:
                batch = next(data_iter)
            except StopIteration:
                raise ValueError(f"data_iter ran out after {index} of the {self.micro_batches} micro-batches of a "
                                 "batch (gradient_accumulation_steps)") from None
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise ValueError("each micro-batch must be an (inputs, labels) pair, as in DeepSpeed's pipeline")
            inputs.append(batch[0] if isinstance(batch[0], (tuple, list)) else (batch[0],))
            labels.append(batch[1])
        device = self.device
        joined_inputs: tuple = ()
        if self._first:
            joined_inputs = tuple(_join([mb[i] for mb in inputs], device, f"inputs[{i}]")
                                  for i in range(len(inputs[0])))
        joined_labels = _join(labels, device, "labels") if self._last else None
        return joined_inputs, joined_labels

    def _run(self, data_iter: Optional[Iterator], train: bool, aggregate: bool = True) -> torch.Tensor:
        inputs, labels = self._read(data_iter)
        losses: Optional[list] = [] if self._last else None
        kwargs = {"target": labels, "losses": losses} if self._last else {}
        if train:
            self.schedule.step(*inputs, **kwargs)
        elif len(self.stages) > 1 and self.topology.pp_size == 1:
            # every piece on this one rank: torch's multi-piece runtime hands a piece's output to the next piece on
            # the same rank by stealing it for a backward, which a forward-only run has not (AssertionError); with
            # nothing to send, the pieces run in order, micro-batch by micro-batch, as the schedule would
            with torch.no_grad():
                self._forward_locally(inputs, labels, losses)
        else:
            with torch.no_grad():
                self.schedule.eval(*inputs, **kwargs)
        return self._batch_loss(losses, aggregate)

    def _forward_locally(self, inputs: tuple, labels: Any, losses: list) -> None:
        """Forward every micro-batch through this rank's pieces in order (all of them: a pipeline of one rank; the
        module's own forward), appending each micro-batch's loss (scaled, as the schedule's) to `losses`."""
        chunks = [t.tensor_split(self.micro_batches) for t in inputs]
        targets = labels.tensor_split(self.micro_batches)
        for index in range(self.micro_batches):
            losses.append(self._loss(self.module(*(chunk[index] for chunk in chunks)), targets[index]))

    def train_batch(self, data_iter: Optional[Iterator] = None, *, aggregate: bool = True) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches of `data_iter` (read on the first
        and last stage only; kept for later calls without one, as DeepSpeed's), or, without one, of the iterator
        kept (`initialize(training_data=...)`'s loader, `set_dataiterator`); returns the batch's mean loss on
        every rank. `aggregate=False`: no collective for the loss, this rank's own (the mean of its micro-batches'
        on a last-stage rank, 0 elsewhere), for a loop that reduces it with the rest of what it reports
        (`zerotrain.trainer`'s one reduction per step)."""
        engine = self.engine
        if data_iter is not None:  # DeepSpeed's: kept, so a later train_batch() goes on reading it
            self.set_dataiterator(data_iter)
            data_iter = self.data_iterator
        self.train()  # an async save's failure: raised on every rank by the stage engine's step, before it updates
        # each micro-batch is a micro-step (DeepSpeed's count): the block counts all but the last, which step() below
        # counts, so a save sees a whole cycle
        with engine.external_backward(micro_steps=self.micro_batches):
            loss = self._run(data_iter, train=True, aggregate=aggregate)
            self._finish_gradients()
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        return loss

    def eval_batch(self, data_iter: Optional[Iterator] = None, *, aggregate: bool = True) -> torch.Tensor:
        """The mean loss over `gradient_accumulation_steps` micro-batches of `data_iter` (without one: of the
        iterator train_batch reads, which goes on from there), forward only, on every rank; `data_iter` is not
        kept (DeepSpeed's eval_batch restores the training iterator). `aggregate=False`: no collective for the
        loss, this rank's own (as `train_batch`'s: the mean of its micro-batches' on a last-stage rank, 0
        elsewhere), for a loop that reduces it with `zerotrain.trainer.reduce_step`."""
        if self.config.pipeline.schedule == "zbv_zero_bubble" and self.topology.pp_size > 1:
            # torch 2.13's ZBV runtime still steals backward inputs in a forward-only run (AssertionError); a
            # pipeline of one rank runs its pieces itself (`_run`)
            raise NotImplementedError("eval_batch with pipeline.schedule 'zbv_zero_bubble' is not available (torch's "
                                      "ZBV schedule has no forward-only run); evaluate with another schedule")
        was_training = self.module.training
        self.eval()
        try:
            return self._run(data_iter, train=False, aggregate=aggregate)
        finally:
            self.train(was_training)

    def _finish_gradients(self) -> None:
        """Mean over the micro-batches, then the tied copies summed over their stages (before the ZeRO reduce)."""
        with torch.no_grad():
            for param in self._params:
                if param.grad is not None:
                    param.grad.div_(self.micro_batches)
            for key, comm in self.plan.tied.items():
                for param in self.module.tied_parameters(key):
                    if not param.requires_grad:  # a frozen tied embedding (LoRA): equal and never updated
                        continue
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
                    comm.all_reduce(param.grad)

    def _batch_loss(self, losses: Optional[list], aggregate: bool = True) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses (loss scale removed), broadcast over the pipeline
        (`aggregate=False`: this rank's, 0 on the other stages)."""
        value = torch.zeros((), dtype=torch.float32, device=self.device)
        if losses is not None:
            value = torch.stack([loss.detach().float() for loss in losses]).mean() / self.engine.loss_scale
            if not aggregate:
                return value
            dp = self.engine.comm  # the mean over the stage's data-parallel ranks too, as DeepSpeed's
            if dp.size > 1:
                dp.all_reduce(value)
                value /= dp.size
        if aggregate:
            self.plan.pp_comm.broadcast(value, src=self.plan.placement.last_rank)
        return value


def _join(tensors: list, device: torch.device, what: str) -> torch.Tensor:
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"pipeline micro-batches must all have one shape (torch's PipelineStage exchanges fixed "
                         f"shapes; pad to the sequence length): {what} has {sorted(shapes)}")
    return torch.cat([t.to(device) for t in tensors], dim=0)
