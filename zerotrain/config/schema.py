"""The whole configuration as one pydantic model, `ZeroTrainConfig`, with DeepSpeed's key names.

Build it with `zerotrain.config.load_config` (which turns every validation problem into a
`ConfigError` naming the dotted key). Blocks: `fp16`, `bf16` (legacy alias `bfloat16`), `fp8` (zerotrain's: float8 Linear compute, docs/fp8.md),
`zero_optimization` (`zero.py`), `optimizer` and `scheduler` (`params.py`), `checkpoint`,
`aio`, `tensor_parallel`, `activation_checkpointing`, and the monitors `tensorboard`, `csv_monitor`, `wandb`
(`monitor.py`). zerotrain's own top-level keys: `comm_timeout_seconds`,
`comm_same_host_transport`, `seed`, `strict_config`, and the `checkpoint` keys. An unknown top-level key that is no
near-miss of a known key is ignored with a warning, as DeepSpeed ignores it (an error with `"strict_config": true`).
"""
from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from .base import Block, Bool, ConfigError, Int, NonNegFloat, NonNegInt, PosFloat, PosInt, choice, warn
from .batch import GAS, MICRO, TBS, check_batch_partial, resolve_batch_triple
from .monitor import CSVMonitorConfig, TensorBoardConfig, WandbConfig
from .params import OptimizerConfig, SchedulerConfig
from .zero import ZeroConfig

__all__ = ["ZeroTrainConfig", "FP16Config", "BF16Config", "FP8Config", "FP8_RECIPES", "CheckpointConfig", "AioConfig", "TensorParallelConfig", "ActivationCheckpointingConfig",
           "PipelineConfig", "PIPELINE_SCHEDULES",
           "DEEPSPEED_ONLY_KEYS"]

# Top-level keys DeepSpeed accepts that zerotrain does not implement: accepted with a warning.
DEEPSPEED_ONLY_KEYS = frozenset({
    "amp", "flops_profiler", "comet",
    "comms_logger", "compression_training", "data_efficiency", "curriculum_learning", "elasticity", "autotuning",
    "sparse_attention", "dump_state", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type", "sparse_gradients",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown", "data_types",
    "eigenvalue", "progressive_layer_drop", "quantize_training", "hybrid_engine", "nebula", "weight_quantization",
    "compile", "timers", "graph_harvesting",
    "use_data_before_expert_parallelism", "dataloader_drop_last", "zero_allow_comm_data_type_fp32",
    "torch_autocast", "disable_allgather", "load_universal_checkpoint", "use_node_local_storage",
    "checkpoint_parallel_write_pipeline", "monitor_config", "elastic_checkpoint", "gradient_accumulation_dtype",
    # Read by DeepSpeed 0.19.8's DeepSpeedConfig (deepspeed/runtime/config.py, constants.py).
    "disable_python_gc", "expert_parallel", "gradient_allreduce_op", "managed_gradient_accumulation",
    "vocabulary_size", "log_level", "datastates_ckpt",
    # Not read by DeepSpeed either (it ignores unknown top-level keys), but LLaMA-Factory's shipped
    # examples/deepspeed/*.json carry it, so real configs have it.
    "comms_config",
})


class FP16Config(Block):
    """`fp16`: `loss_scale` 0 means dynamic scaling starting at 2**initial_scale_power."""

    PATH = "fp16"
    DEEPSPEED_ONLY = frozenset({"fp16_master_weights_and_grads"})

    INERT = frozenset({"auto_cast"})  # inputs are not cast for the model

    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: NonNegFloat = 0.0
    initial_scale_power: Annotated[Int, Field(ge=0, le=64)] = 16
    loss_scale_window: PosInt = 1000
    hysteresis: PosInt = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: PosFloat = 1.0


class BF16Config(Block):
    """`bf16` (legacy top-level spelling: `bfloat16`)."""

    PATH = "bf16"
    DEEPSPEED_ONLY = frozenset({"immediate_grad_update"})

    enabled: Bool = False
    # DeepSpeed's: check the gradients for inf/nan and skip such a step (state untouched), as fp16 does
    check_grad_overflow: Bool = False
    # DeepSpeed's: masters (and, with the second, Adam's moments) stored in bf16. zerotrain implements them on
    # the offloaded optimizer, NVMe records or CPU memory (stochastic rounding, offload/stochastic_round.py);
    # elsewhere fp32 (warned)
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False

    @model_validator(mode="after")
    def _states_need_masters(self):
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ConfigError(f"{self.key_path('bf16_optimizer_states')}: requires "
                              f"{self.key_path('bf16_master_weights_and_grads')} (as DeepSpeed)",
                              key=self.key_path("bf16_optimizer_states"))
        return self


FP8_RECIPES = ("tensorwise", "rowwise")


class FP8Config(Block):
    """`fp8` (zerotrain's block; docs/fp8.md): the model's Linear layers compute in float8 through torchao's
    `convert_to_float8_training` with `recipe`'s scaling (torchao's recipe names). The head, layers whose dims
    are not multiples of 16 and `exclude_modules` (name substrings) stay in high precision. `emulate`: null
    chooses (emulated where the device has no fp8 matmul: the CPU, CUDA capability below 8.9); true always
    emulates; false refuses a device without fp8 matmul."""

    PATH = "fp8"

    enabled: Bool = False
    recipe: choice(*FP8_RECIPES) = "tensorwise"
    emulate: Optional[Bool] = None
    exclude_modules: list[str] = Field(default_factory=list)
    # ZeRO-3: the converted layers' weights gathered as float8 + a tensorwise scale (FSDP2's
    # enable_fsdp_float8_all_gather); tensorwise only, as torchao's
    float8_all_gather: Bool = False

    @model_validator(mode="after")
    def _gather_needs_tensorwise(self):
        if self.float8_all_gather and self.recipe != "tensorwise":
            raise ConfigError(f"{self.key_path('float8_all_gather')}: float8 weight gathers use one scale per "
                              f"weight (recipe 'tensorwise'), not {self.recipe!r}", key=self.key_path("float8_all_gather"))
        return self


SaveErrorPolicy = choice("raise", "warn")


class CheckpointConfig(Block):
    """`checkpoint`: zerotrain's own keys (DeepSpeed's keys here are accepted with a warning)."""

    PATH = "checkpoint"
    DEEPSPEED_ONLY = frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                                "writer", "checkpoint_serialization"})

    async_save: Bool = False
    keep_last: Optional[PosInt] = None
    verify_on_load: Bool = True
    # a failed save (disk full, ...): "raise" stops training; "warn" logs it and training goes on
    on_save_error: SaveErrorPolicy = "raise"
    # save only the trainable parameters (a LoRA adapter) with their masters and optimizer states; the frozen
    # base is not written (a resume reads it from the model directory again)
    adapters_only: Bool = False


class AioConfig(Block):
    """`aio`: asynchronous NVMe I/O (used by NVMe offload). `thread_count` is the old name of
    `intra_op_parallelism`."""

    PATH = "aio"
    LEGACY = {"thread_count": "intra_op_parallelism"}
    WARN_LEGACY = frozenset({"thread_count"})

    block_size: PosInt = 1_048_576
    queue_depth: PosInt = 8
    intra_op_parallelism: PosInt = 1
    single_submit: Bool = False
    overlap_events: Bool = True
    use_gds: Bool = False


class TensorParallelConfig(Block):
    """`tensor_parallel` (DeepSpeed's AutoTP block): `autotp_size` ranks split each layer."""

    PATH = "tensor_parallel"
    DEEPSPEED_ONLY = frozenset({"tp_overlap_comm", "tensor_parallel", "tp", "injection_policy_tuple",
                                "keep_module_on_host", "tp_grain_size", "partition_config", "preset_model", "dtype",
                                "vocab_parallel_lm_head", "vocab_parallel_ce_backend", "replace_with_kernel_inject",
                                "kernel_inject"})

    autotp_size: PosInt = 1

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        # DeepSpeed's default is 0, meaning no AutoTP: the same as 1 here
        if data.get("autotp_size") == 0 and not isinstance(data["autotp_size"], bool):
            data = dict(data, autotp_size=1)
        return data


class ActivationCheckpointingConfig(Block):
    """`activation_checkpointing`: how `zerotrain.checkpointing.checkpoint` keeps a checkpoint's inputs
    (the engine passes it to `zerotrain.checkpointing.configure`; see docs/activation_checkpointing.md)."""

    PATH = "activation_checkpointing"

    partition_activations: Bool = False
    cpu_checkpointing: Bool = False
    contiguous_memory_optimization: Bool = False
    number_checkpoints: Optional[PosInt] = None
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble",
                      "zbv_zero_bubble")


class PipelineConfig(Block):
    """`pipeline` (docs/pipeline.md): which schedule of `torch.distributed.pipelining` runs the stages of a
    `zerotrain.pipe.PipelineModule`, how many model pieces each rank holds (`stages_per_rank`: 1 for
    `1f1b`/`gpipe`, default 2 for the interleaved, looped and zero-bubble ones; `zbv_zero_bubble` needs 2), the
    activation checkpoint interval in layers (0: none) and whether each layer is built under its own seed."""

    PATH = "pipeline"
    # DeepSpeed's: the stage count comes from PipelineModule(num_stages=...), its partition_method and the
    # activation exchange of torch's pipelining
    DEEPSPEED_ONLY = frozenset({"stages", "partition", "pipe_partitioned", "grad_partitioned", "use_reentrant"})

    schedule: choice(*PIPELINE_SCHEDULES) = "1f1b"
    stages_per_rank: Optional[PosInt] = None
    activation_checkpoint_interval: NonNegInt = 0
    seed_layers: Bool = False

    @property
    def multi_stage(self) -> bool:
        """Whether the schedule runs several model pieces per rank (torch's PipelineScheduleMulti)."""
        return self.schedule not in ("1f1b", "gpipe")

    @property
    def pieces_per_rank(self) -> int:
        """Model pieces (torch's stages) each rank holds."""
        if self.stages_per_rank is not None:
            return int(self.stages_per_rank)
        return 2 if self.multi_stage else 1


class ZeroTrainConfig(Block):
    """The whole config. Batch fields are None until `resolve_batch(dp_world_size)` fills them in."""

    PATH = ""
    LEGACY = {"bfloat16": "bf16"}
    DEEPSPEED_ONLY = DEEPSPEED_ONLY_KEYS
    AUTO_MEANS_UNSET = frozenset({TBS, MICRO, GAS})

    train_batch_size: Optional[PosInt] = None
    train_micro_batch_size_per_gpu: Optional[PosInt] = None
    gradient_accumulation_steps: Optional[PosInt] = None
    gradient_clipping: NonNegFloat = 1.0  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT (DeepSpeed 0.16 had 0)
    steps_per_print: Optional[NonNegInt] = None  # DeepSpeed 0.19.8's default: no progress line
    wall_clock_breakdown: Bool = False
    comm_timeout_seconds: PosFloat = 1800.0
    comm_same_host_transport: Bool = True  # ranks on one host read each other's memory (gloo only)
    strict_config: Bool = False  # an unknown top-level key is an error (by default a warning, as DeepSpeed ignores it)
    seed: Optional[NonNegInt] = None
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    fp8: FP8Config = Field(default_factory=FP8Config)  # float8 compute of Linear layers (torchao), docs/fp8.md
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    aio: AioConfig = Field(default_factory=AioConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    # Ulysses sequence parallelism (DeepSpeed's key): ranks per sequence-parallel group, docs/sequence_parallel.md
    sequence_parallel_size: PosInt = 1
    # pipeline stages (docs/pipeline.md): a zerotrain.pipe.PipelineModule's num_stages, which this must match
    pipeline_parallel_size: PosInt = 1
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _unimplemented: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        zero = data.get("zero_optimization")
        if isinstance(zero, bool):  # DeepSpeed's oldest form: true means stage 1
            data["zero_optimization"] = {"stage": 1 if zero else 0}
            warn(f"zero_optimization: {str(zero).lower()} is a legacy DeepSpeed form; read as "
                 f"{{\"stage\": {1 if zero else 0}}}", "zero_optimization")
        return data

    @model_validator(mode="after")
    def _check_cross_keys(self, info: ValidationInfo):
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one", key="fp16.enabled")
        if self.bf16.bf16_master_weights_and_grads and not self.bf16_records:
            warn("bf16.bf16_master_weights_and_grads: bf16 masters and optimizer states are implemented on the "
                 "offloaded optimizer (bf16.enabled, zero_optimization.stage >= 1, offload_optimizer.device 'nvme' "
                 "or 'cpu' without super_offload); this run keeps them in fp32", "bf16.bf16_master_weights_and_grads")
        dp = info.context.get("dp_world_size") if isinstance(info.context, dict) else None
        pipe = self.pipeline
        if pipe.stages_per_rank is not None and not pipe.multi_stage and pipe.stages_per_rank != 1:
            raise ConfigError(f"pipeline.stages_per_rank: {pipe.stages_per_rank} needs a multi-stage schedule "
                              f"(interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble); "
                              f"{pipe.schedule!r} runs one piece per rank", key="pipeline.stages_per_rank")
        if pipe.schedule == "zbv_zero_bubble" and pipe.pieces_per_rank != 2:
            raise ConfigError("pipeline.stages_per_rank: zbv_zero_bubble places exactly 2 pieces per rank (a V)",
                              key="pipeline.stages_per_rank")
        check_batch_partial(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                            self.gradient_accumulation_steps, dp_world_size=dp)
        return self

    @property
    def bf16_records(self) -> bool:
        """Whether the offloaded optimizer stores its masters in bf16 (`bf16.bf16_master_weights_and_grads` where it
        is implemented: bf16 training, stage >= 1, offload_optimizer on NVMe or the CPU without super_offload); its
        states too with `bf16.bf16_optimizer_states`."""
        offload = self.zero_optimization.offload_optimizer
        return bool(self.bf16.enabled and self.bf16.bf16_master_weights_and_grads and self.zero_optimization.stage >= 1
                    and offload is not None and (offload.device == "nvme"
                                                 or (offload.device == "cpu" and not offload.super_offload)))

    @property
    def precision(self) -> str:
        """"bf16", "fp16" or "fp32"."""
        if self.bf16.enabled:
            return "bf16"
        if self.fp16.enabled:
            return "fp16"
        return "fp32"

    @property
    def raw(self) -> dict[str, Any]:
        """The input dict, with `_`-prefixed keys removed; `load_config(cfg.raw)` rebuilds this config
        (before batch resolution, so it can be resolved again for another data-parallel size).
        A config built without `load_config` gives its `model_dump()`."""
        return self._raw if self._raw else self.model_dump()

    def fill_schedule(self, params: dict[str, Any]) -> None:
        """Set `scheduler.params` keys (in this config and its `raw`) the run's steps decide, once they are known
        (`zerotrain.run.config.RunConfig.schedule_over`, as transformers' `trainer_config_finalize`); nothing else
        depends on them, so nothing else changes."""
        if self.scheduler is None:
            raise ConfigError("scheduler: the config has no scheduler whose steps to set", key="scheduler")
        self.scheduler.params.update(params)
        raw = self._raw.get("scheduler")
        if isinstance(raw, dict):
            raw["params"] = {**(raw.get("params") or {}), **params}

    @property
    def unimplemented(self) -> dict[str, Any]:
        """DeepSpeed keys that were accepted but ignored: dotted key -> value."""
        return self._unimplemented

    @property
    def batch_resolved(self) -> bool:
        return None not in (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                            self.gradient_accumulation_steps)

    def resolve_batch(self, dp_world_size: int) -> "ZeroTrainConfig":
        """A copy whose three batch fields are ints for `dp_world_size` data-parallel ranks; this config itself when
        they already are (and agree with `dp_world_size`: a ConfigError otherwise), so a config resolved once is
        handed on as the same object."""
        tbs, micro, gas = resolve_batch_triple(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                               self.gradient_accumulation_steps, dp_world_size)
        if self.batch_resolved:
            return self
        return self.model_copy(deep=True, update={TBS: tbs, MICRO: micro, GAS: gas})
