"""`ZeroTrainEngine`: DeepSpeed's engine API over the training step (`core`) and the parts (`parts`).

A thin layer: the DeepSpeed accessors (ranks, sizes, stage and precision questions, batch sizes, lr and
momentum), attribute forwarding to the wrapped model, checkpoints (`state`: what the checkpoint is
handed), whole weights (`export`), memory and offload reports, stop signals, the data loader, and the
engine's own reports after each step (steps_per_print lines, the tensorboard/csv/wandb monitors).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..checkpoint import Checkpointer, CheckpointState, load_checkpoint, save_checkpoint
from ..lifecycle import StopRequest
from ..monitor import TIMER_FIELDS, Monitors, ThroughputTimer, check_monitor_libraries
from ..sharding import ShardedSlot
from ..topology import Topology
from ..config import ZeroTrainConfig
from ..zero.forward_only import synced_generate
from . import export, state
from ..budget import first_pass_reserve, resolve_memory
from .core import EngineCore
from .parts import OptimizerLike, build_parts

__all__ = ["ZeroTrainEngine"]


class ZeroTrainEngine(EngineCore):
    """Data-parallel training with ZeRO stages 0-3 over the ranks of a Topology (DeepSpeed's engine API)."""

    def __init__(self, model: torch.nn.Module, config: ZeroTrainConfig, topology: Topology,
                 model_parameters: Optional[Iterable] = None, optimizer: OptimizerLike = None,
                 lr_scheduler: Any = None):
        # the size keys left unset, from the memory budget (every way of building an engine); a run that cannot
        # fit stops here, before any part is built
        config = resolve_memory(model, config, topology, trains=optimizer is not None or config.optimizer is not None)
        # an enabled tensorboard/wandb block without its library: refused on every rank, before any part holds files
        check_monitor_libraries(config)
        super().__init__(build_parts(model, config, topology, model_parameters, optimizer, lr_scheduler))
        self.first_pass_reserve = first_pass_reserve(config, self.parts.param_store,
                                                     self.parts.zero_optimizer.takes_norm_first_pass(), topology)
        self._checkpoint_files: dict[str, bytes] = {}  # add_checkpoint_files: copied into every checkpoint
        self._checkpoint_view: Optional[Callable[[CheckpointState], CheckpointState]] = None  # view_checkpoint_state
        self._checkpoint_file_makers: list[Callable[[], dict]] = []  # ... and files made at each save
        self.stop_request = StopRequest()  # signals turned into a stop at a step boundary (opt-in)
        # DeepSpeed's engine.tput_timer (monitor.throughput), driven as DeepSpeed's engine drives it: started by
        # each training forward, stopped by each step() (a global step at the boundary); it prints nothing (the
        # engine's own steps_per_print line carries the speed), a program reads avg_samples_per_sec()
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self.monitor: Optional[Monitors] = None  # DeepSpeed's engine events, rank 0, built at the first step
        self._configure_activation_checkpointing()

    def _configure_activation_checkpointing(self) -> None:
        """A config with an `activation_checkpointing` block configures `zerotrain.checkpointing` (inputs are
        partitioned over this engine's tensor-parallel group) and makes a built-in GPT checkpoint its blocks.
        Without the block a user's own `checkpointing.configure(...)` is left as it is."""
        if "activation_checkpointing" not in self.config.model_fields_set:
            return
        from .. import checkpointing
        checkpointing.configure(self.parts.tp_comm, deepspeed_config=self.config)
        if hasattr(self.module, "activation_checkpointing"):
            self.module.activation_checkpointing = True

    # --- the parts, by DeepSpeed's names (read-only: built once) -----------------------
    module = property(lambda self: self.parts.module, doc="The wrapped model.")
    optimizer = property(lambda self: self.parts.optimizer, doc="The torch optimizer (None: forward-only).")
    lr_scheduler = property(lambda self: self.parts.lr_scheduler, doc="The LR scheduler (None without one).")
    loss_scaler = property(lambda self: self.parts.loss_scaler, doc="The fp16 loss scaler (scale 1 otherwise).")
    stage = property(lambda self: self.parts.stage, doc="The ZeRO stage.")
    dtype = property(lambda self: self.parts.dtype, doc="The training dtype.")
    comm = property(lambda self: self.parts.comm, doc="The data-parallel Comm (for `zerotrain.dist`, `group=`).")
    tp_comm = property(lambda self: self.parts.tp_comm)
    counters = property(lambda self: self.parts.counters, doc="Collective calls and bytes since start.")
    expert_groups = property(lambda self: self.parts.expert_groups)
    sequence_parallel = property(lambda self: self.parts.sequence_parallel,
                                 doc="Ulysses: batches go through `engine.sequence_parallel.shard(batch)`.")
    snapshot_fences = property(lambda self: self.parts.fences)
    inference = property(lambda self: self.parts.forward_only, doc="Forward-only (built without an optimizer).")
    forward_passes = property(lambda self: self.parts.forward_passes)
    reducer = property(lambda self: self.parts.reducer)
    zero_optimizer = property(lambda self: self.parts.zero_optimizer)
    buckets = property(lambda self: self.parts.weights.buckets)
    stage3 = property(lambda self: self.parts.weights.stage3)
    param_store = property(lambda self: self.parts.param_store)

    def __getattr__(self, name: str) -> Any:
        """An attribute the engine lacks comes from the wrapped model, as DeepSpeed's engine forwards it
        (DeepSpeed-Chat calls `engine.gradient_checkpointing_enable()`). Only called after normal lookup
        failed; names starting with `_` are never forwarded."""
        parts = self.__dict__.get("parts")
        if not name.startswith("_") and parts is not None:
            try:
                return getattr(parts.module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (nor has its module)")

    def generate(self, *args: Any, **kwargs: Any):
        """`engine.module.generate(...)` (a Hugging Face model's), synced across ranks at world > 1."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"engine.generate(): the model ({type(self.module).__name__}) has no generate method")
        if self.topology.world_size > 1 and not getattr(generate, "zerotrain_synced", False):
            generate = synced_generate(generate)
        with torch.no_grad():
            return generate(*args, **kwargs)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    # --- queries ------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> Optional[float]:
        """The unscaled global gradient norm of the last step (before clipping)."""
        return self.parts.zero_optimizer.last_grad_norm

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
        return self.parts.loss_scaler.scale

    # --- whole weights (engine.export does the work) ---------------------------------
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full fp32 weights on CPU under the model's parameter names, on rank 0 only (collective).
        `trainable_only`: only the parameters that require grad (e.g. a LoRA adapter without its base).

        Data-parallel shards are gathered on data-parallel rank 0; with tensor parallelism the
        slices of its tensor-parallel group are then joined on tensor-parallel rank 0 (global
        rank 0), by the TensorSlice each split parameter carries.
        """
        return export.full_state_dict(self.parts, trainable_only)

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The wrapped model's own state_dict (training dtype). At ZeRO-3 the parameters are partitioned:
        use consolidated_16bit_state_dict() or save_16bit_model() for whole weights."""
        return export.module_state_dict(self.parts, exclude_frozen_parameters)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """As DeepSpeed's engine (an nn.Module wrapping the model): the module's state under `module.`."""
        return {f"module.{k}": v for k, v in self.module_state_dict().items()}

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """Load weights given as `module.`-prefixed keys (what state_dict() returns) or as the model's own
        names, into the weights and the fp32 masters (a plain module load would be undone by the next step)."""
        return export.load_state_dict(self.parts, state_dict, strict)

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """Whole weights in the training dtype (fp32 masters cast) plus persistent buffers, on global rank 0
        ({} elsewhere). Collective: every rank must call it."""
        return export.consolidated_16bit_state_dict(self.parts, exclude_frozen_parameters)

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
        return export.save_16bit_model(self.parts, save_dir, save_filename, exclude_frozen_parameters)

    save_fp16_model = save_16bit_model  # DeepSpeed's older name

    # --- checkpoints (zerotrain.checkpoint does the work; engine.state says what it is handed) ----------
    def sharded_slots(self) -> list[ShardedSlot]:
        """This rank's master shards with their layout records (what a checkpoint saves and loads)."""
        return state.sharded_slots(self.parts)

    def frozen_slots(self) -> list[ShardedSlot]:
        """Frozen (untrained) parameters as slots without a master: at stage 3 this rank's shards of each; at
        stages 0-2 the tensor-parallel slices (whole on each data-parallel rank), so a save joins every
        tensor-parallel rank's slice (a LoRA base split by tensor parallelism); other frozen parameters are
        whole on every rank and saved as they are."""
        return state.frozen_slots(self.parts)

    def publish_weights(self) -> None:
        """Make every rank's model weights current after masters or frozen shards were written (a load)."""
        state.publish_weights(self.parts)

    def checkpoint_state(self) -> CheckpointState:
        """The declared set of state a checkpoint saves and loads (the checkpoint reads nothing else)."""
        own = state.checkpoint_state(self.parts, self, self._checkpoint_files)
        return own if self._checkpoint_view is None else self._checkpoint_view(own)

    def view_checkpoint_state(self, view: Callable[[CheckpointState], CheckpointState]) -> None:
        """Save and load `view(state)` in place of this engine's own checkpoint state, through this engine's one
        checkpoint lifecycle (save, load, claim, background saves, close): a pipeline engine's unified format over
        every stage (`pipe.checkpoint`). Before the first save or claim."""
        if self.checkpointer is not None:
            raise RuntimeError("view_checkpoint_state() after a checkpoint was saved or claimed")
        self._checkpoint_view = view

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
        self.parts.zero_optimizer.refuse_training("engine.save_checkpoint()",
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

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        load_module_strict: bool = True, custom_load_fn: Optional[Callable] = None):
        """Load a unified checkpoint written at any world size or stage; returns (path, client_state).
        A forward-only engine loads the weights alone (no optimizer, scheduler or counters to restore).

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
        trains = not self.parts.forward_only
        return load_checkpoint(self.checkpoint_state(), load_dir, tag=tag,
                               load_optimizer_states=load_optimizer_states and trains,
                               load_lr_scheduler_states=load_lr_scheduler_states and trains,
                               load_module_only=load_module_only or not trains)

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

    # --- memory, offload -------------------------------------------------------
    def watch_memory(self, timeline) -> None:
        """Tell `timeline` (a `zerotrain.monitor.MemoryTimeline`, or None to stop) where this engine's phases
        begin and end: forward, backward, gather (stage 3's blocking parameter gathers), reduce, optimizer
        step, save (the `wall_clock_breakdown` timers' boundaries), and when each optimizer step ends."""
        self.timers.listener = timeline
        self.parts.weights.watch(self.timers.phase)
        if self.parts.forward_passes is not None:  # forward-only: its forwards are not timed, but still a phase
            self.parts.forward_passes.listener = timeline

    def memory_report(self) -> dict:
        """Bytes of model state this rank holds, and communication counters since start."""
        parts = self.parts
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        report = {
            "parameters": parts.weights.device_bytes(),
            # elements of the parameters that train (a LoRA adapter) and of the frozen ones (its base), whole
            # model: only the trainable ones have gradients, masters and optimizer states above
            "trainable_numel": trainable,
            "frozen_numel": sum(p.numel() for p in self.module.parameters()) - trainable,
            "gradients": parts.reducer.held_bytes(),
            "loco_errors": parts.reducer.loco_bytes(),  # qgZ's LoCo error buffers, already inside "gradients"
            "optimizer_states": parts.zero_optimizer.state_bytes(),  # on the device; offloaded bytes below
            "comm": parts.counters.snapshot(),
        }
        report.update(self._offload_memory())
        return report

    def work_stats(self) -> dict[str, dict]:
        """Counters of the parts' work since the engine was built, by part: `gather` (stage 3's parameter
        gathers, prefetches, qwZ/hpZ gathers and the bytes they held), `reduce` (the gradient reducer's staging
        buffers and reduce-scatters), `offload` (the offloaded optimizer's, as `offload_stats()`),
        `param_store` (offload_param's NVMe reads and writes); {} for a part that does none. For benchmarks
        and tests that check how the work is done, without reaching into the parts."""
        parts = self.parts
        return {"gather": parts.weights.gather_stats(), "reduce": dict(parts.reducer.stats),
                "offload": self.offload_stats(),
                "param_store": dict(parts.param_store.stats) if parts.param_store is not None else {}}

    def offload_stats(self) -> dict:
        """Counters of the offloaded optimizer (steps; with super_offload speculative steps, rollbacks,
        clip_redos = steps redone with clipped gradients; with nvme bytes read/written); {} without offload."""
        return dict(self.parts.zero_optimizer.stats)

    def _offload_memory(self) -> dict:
        """`offload`: bytes of masters and optimizer states by place (device, host, nvme, host I/O buffers);
        `offload_param`: stage-3 parameter shards by place ("parameters" counts the device only)."""
        parts = self.parts
        report = {"offload_param": parts.param_store.memory_split()} if parts.param_store is not None else {}
        split = parts.zero_optimizer.memory_split()  # None without optimizer offload
        if split is not None:
            report["offload"] = dict(split, offloaded_bytes=parts.zero_optimizer.offloaded_bytes())
        return report

    def close(self) -> None:
        """Finish pending checkpoint saves (releasing the save directory's lock), release the offload
        optimizer's threads and files (idempotent)."""
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        self.parts.close()

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

    # --- DeepSpeed engine API ---------------------------------------------------------------
    # What DeepSpeed training scripts, DeepSpeedExamples and HF's DeepSpeed integration call on the
    # engine beyond the training step (the list, with notes, is docs/porting.md). Built only on the
    # engine's public surface (config, topology, comm, module, optimizer, ...).
    training_dataloader = None  # the loader initialize() built from `training_data` (DeepSpeed's name)
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
        return self.parts.stage

    def zero_optimization(self) -> bool:
        return self.parts.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.parts.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.parts.stage >= 3

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

    # --- the engine's own reports after each step -----------------------------------------
    @contextlib.contextmanager
    def progress_printing(self, enabled: bool):
        """Turn the engine's own reports, the steps_per_print lines and the monitor events, on or off inside
        the block (the Trainer prints and writes its own, with the loss)."""
        before, self._print_progress = self._print_progress, enabled
        try:
            yield
        finally:
            self._print_progress = before

    def _training_forward(self, *args, **kwargs):
        self.tput_timer.start()
        return super()._training_forward(*args, **kwargs)

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary, update the weights (`EngineCore.step`); the
        throughput timer's span ends here, as in DeepSpeed's `engine.step()`."""
        boundary = self.is_gradient_accumulation_boundary()
        super().step()
        self.tput_timer.stop(global_step=boundary)

    def _after_step(self) -> None:
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
            record["loss_scale"] = self.loss_scale
        norm = self.get_global_grad_norm()
        if norm is not None:
            record["grad_norm"] = norm
        record.update({TIMER_FIELDS[name]: ms for name, ms in self.timers.last.items()})
        self.monitor.write(record)

    def _after_model_step(self) -> None:
        """Every `steps_per_print` optimizer steps, one line on global rank 0's stdout, as DeepSpeed prints it."""
        every = self.steps_per_print()
        if not (self._print_progress and every and self.topology.rank == 0 and self.global_steps % every == 0):
            return
        extra = f", loss_scale={self.loss_scale:g}" if self.fp16_enabled() else ""
        norm = self.get_global_grad_norm()
        extra += f", grad_norm={norm:.4g}" if norm is not None else ""
        extra += "".join(f", offload_{k}={v}" for k, v in self.offload_stats().items())
        print(f"[zerotrain] step={self.global_steps}, skipped={self.skipped_steps}, lr={self.get_lr()}, "
              f"mom={self.get_mom()}{extra}", flush=True)
