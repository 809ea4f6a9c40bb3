"""The `zero_optimization` block: stage, buckets, stage-3 knobs, offload and ZeRO++.

Defaults follow DeepSpeed. Offload, stage-3 and quantization keys are validated here;
whether they are implemented is the engine's business.
"""
from __future__ import annotations

import os
from typing import Annotated, Any, Optional

from pydantic import BeforeValidator, Field, model_validator

from .base import Block, Bool, ConfigError, Float, Int, NonNegInt, PosInt, choice, warn

__all__ = ["ZeroConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "LocoConfig"]

OffloadDevice = choice("none", "cpu", "nvme")
SpeculationPolicy = choice("adaptive", "always")


def _path_string(value: Any) -> Any:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"expected a non-empty path string, got {value!r}")
    return value


NvmePath = Annotated[Optional[str], BeforeValidator(_path_string)]


def _file_in_the_way(path: str) -> Optional[str]:
    """The path itself or the nearest existing parent when it is not a directory (the swap directory could not be
    created there: checked with the config, so a typo is one line before any rank starts); None otherwise, a path
    that does not exist yet included (the engine creates it)."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current


class _Offload(Block):
    device: OffloadDevice = "none"
    nvme_path: NvmePath = None
    pin_memory: Bool = False
    buffer_count: PosInt = 4

    @model_validator(mode="after")
    def _nvme_needs_path(self):
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{self.key_path('nvme_path')}: required when device is 'nvme'",
                              key=self.key_path("nvme_path"))
        if self.device == "nvme":
            blocker = _file_in_the_way(self.nvme_path)
            if blocker is not None:
                raise ConfigError(f"{self.key_path('nvme_path')}: {blocker} is a file, not a directory for the "
                                  "swap files", key=self.key_path("nvme_path"))
        return self

    @property
    def enabled(self) -> bool:
        return self.device != "none"


class OffloadOptimizerConfig(_Offload):
    """`zero_optimization.offload_optimizer`: optimizer states and step on CPU or NVMe."""

    PATH = "zero_optimization.offload_optimizer"
    DEEPSPEED_ONLY = frozenset({"pipeline", "pipeline_read", "pipeline_write", "cpuadam_cores_perc"})

    fast_init: Bool = False
    ratio: Annotated[Float, Field(gt=0, le=1)] = 1.0
    super_offload: Bool = False
    # zerotrain's own: "adaptive" speculates only when the previous step was neither clipped nor
    # overflowed (a clipped step is predicted to be followed by another, whose speculation would be
    # rolled back); "always" speculates every step (and rolls back whenever it must).
    super_offload_speculation: SpeculationPolicy = "adaptive"
    # zerotrain's own: with clipping, take the global gradient norm from a first backward over the retained
    # graph, then stream the clipped step during a second one (`offload.nvme.takes_norm_first`). "auto" (None,
    # the default): where the parameters are on NVMe too; false: spill the gradients to disk instead.
    norm_first_pass: Optional[Bool] = None

    AUTO_MEANS_UNSET = frozenset({"norm_first_pass"})

    @model_validator(mode="after")
    def _super_offload_needs_cpu(self):
        if self.super_offload and self.device != "cpu":
            raise ConfigError(f"{self.key_path('super_offload')}: needs device 'cpu' (device is '{self.device}')",
                              key=self.key_path("super_offload"))
        if self.norm_first_pass and self.device != "nvme":
            raise ConfigError(f"{self.key_path('norm_first_pass')}: true needs device 'nvme' (device is "
                              f"'{self.device}')", key=self.key_path("norm_first_pass"))
        return self


class OffloadParamConfig(_Offload):
    """`zero_optimization.offload_param`: stage-3 parameters on CPU or NVMe."""

    PATH = "zero_optimization.offload_param"

    buffer_count: PosInt = 5
    buffer_size: PosInt = 100_000_000
    max_in_cpu: NonNegInt = 1_000_000_000


class LocoConfig(Block):
    """`zero_optimization.zeropp_loco_param`: error feedback of the 4-bit gradient reduce."""

    PATH = "zero_optimization.zeropp_loco_param"

    err_beta: Annotated[Float, Field(ge=0, lt=1)] = 0.8
    reset_T: PosInt = 1024


# The fetcher prefetches while fewer than this many elements are ahead: 1 means one recorded request.
PREFETCH_ONE_REQUEST = 1


class ZeroConfig(Block):
    """`zero_optimization`. `overlap_comm` None means the per-stage default (on at stage 3)."""

    PATH = "zero_optimization"
    LEGACY = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "prefetch_bucket_size": "stage3_prefetch_bucket_size",
        "param_persistence_threshold": "stage3_param_persistence_threshold",
        "max_live_parameters": "stage3_max_live_parameters",
        "max_reuse_distance": "stage3_max_reuse_distance",
        "allgather_sequential": "stage3_allgather_sequential",
    }
    DEEPSPEED_ONLY = frozenset({
        "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size", "stage3_model_persistence_threshold",
        "model_persistence_threshold", "stage3_module_granularity_threshold", "module_granularity_threshold",
        "use_multi_rank_bucket_allreduce", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
        "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather",
        "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
        "log_trace_cache_warnings", "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
        "save_muon_momentum_buffer_in_memory", "offload_optimizer_config", "offload_param_config",
        # fields of DeepSpeed 0.19.8's DeepSpeedZeroConfig (deepspeed/runtime/zero/config.py) not implemented here
        "compute_grad_norm", "enable_sanity_checks", "leaf_module", "parameter_alignment", "zenflow",
    })
    # Stages 1-2 all-gather updated weights per gradient bucket (reduce_bucket_size); stage 3 by
    # stage3_prefetch_bucket_size. Nothing reads allgather_bucket_size yet.
    INERT = frozenset({"allgather_bucket_size"})

    stage: Annotated[Int, Field(ge=0, le=3)] = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: PosInt = 500_000_000
    allgather_partitions: Bool = True
    allgather_bucket_size: PosInt = 500_000_000
    overlap_comm: Optional[Bool] = None
    stage3_prefetch_bucket_size: NonNegInt = 50_000_000
    stage3_param_persistence_threshold: NonNegInt = 100_000
    stage3_max_live_parameters: NonNegInt = 1_000_000_000
    stage3_max_reuse_distance: NonNegInt = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_allgather_sequential: Bool = False
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    offload_param: Optional[OffloadParamConfig] = None
    zero_quantized_weights: Bool = False
    zero_quantized_gradients: Bool = False
    zero_hpz_partition_size: PosInt = 1
    zeropp_loco_param: Optional[LocoConfig] = None
    # zerotrain's own: the host bytes per rank that the size keys left unset are chosen from
    # (zerotrain.budget; None: half of the host memory available to the job / ranks on the node)
    memory_budget_bytes: Optional[PosInt] = None

    @classmethod
    def _prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's legacy `cpu_offload*` switches become offload blocks."""
        legacy = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                  "cpu_offload_params": "offload_param"}  # DeepSpeed's spelling is cpu_offload_param
        pin = data.pop("cpu_offload_use_pin_memory", None)
        if pin is not None and not isinstance(pin, bool):
            raise ConfigError(f"{cls.key_path('cpu_offload_use_pin_memory')}: expected true or false, got {pin!r}",
                              key=cls.key_path("cpu_offload_use_pin_memory"))
        for old, new in legacy.items():
            if old not in data:
                continue
            value = data.pop(old)
            if not isinstance(value, bool):
                raise ConfigError(f"{cls.key_path(old)}: expected true or false, got {value!r}", key=cls.key_path(old))
            if not value:
                continue
            block = data.get(new)
            if isinstance(block, dict) and block.get("device", "cpu") not in ("cpu", "CPU"):
                raise ConfigError(f"{cls.key_path(old)} is true but {cls.key_path(new)}.device is "
                                  f"{block.get('device')!r}; keep one of them", key=cls.key_path(old))
            block = dict(block) if isinstance(block, dict) else {}
            block["device"] = "cpu"
            if pin is not None:
                block.setdefault("pin_memory", pin)
            data[new] = block
            warn(f"{cls.key_path(old)} is a legacy DeepSpeed key; read as {cls.key_path(new)}.device = 'cpu'",
                 cls.key_path(old))
        return data

    @model_validator(mode="after")
    def _offload_needs_stage(self):
        if self.offload_param is not None and self.offload_param.enabled and self.stage != 3:
            raise ConfigError(f"{self.key_path('offload_param')}: parameter offload needs stage 3 "
                              f"(stage is {self.stage})", key=self.key_path("offload_param"))
        if self.offload_optimizer is not None and self.offload_optimizer.enabled and self.stage == 0:
            raise ConfigError(f"{self.key_path('offload_optimizer')}: optimizer offload needs stage 1, 2 or 3 "
                              f"(stage is 0)", key=self.key_path("offload_optimizer"))
        return self

    @model_validator(mode="after")
    def _warn_without_effect(self):
        warn_settings_without_effect(self)  # while the file is read: the warnings point at its keys
        return self

    def stage3_fetch_limits(self) -> tuple[int, int, int]:
        """(prefetch elements, max live elements, max reuse distance) the stage-3 fetcher runs with.

        A key the user sets wins. Left unset, prefetch and reuse take zerotrain's memory-bounded
        defaults instead of DeepSpeed's (5e7 / 1e9): those keep nearly every gathered parameter of a
        sub-billion model live from forward to backward (90% of an 84M Llama measured), so ZeRO-3 held
        more than FSDP2. Unset prefetch runs one recorded request ahead (the fetcher stops once anything
        is ahead: FSDP2 prefetches one module), unset reuse distance 0 releases every parameter after
        use (FSDP2's reshard after forward). `stage3_max_live_parameters` keeps DeepSpeed's default.
        """
        chosen = self.model_fields_set
        prefetch = (self.stage3_prefetch_bucket_size if "stage3_prefetch_bucket_size" in chosen
                    else PREFETCH_ONE_REQUEST)
        reuse = self.stage3_max_reuse_distance if "stage3_max_reuse_distance" in chosen else 0
        return prefetch, self.stage3_max_live_parameters, reuse

    @property
    def resolved_overlap_comm(self) -> bool:
        """`overlap_comm`, with None read as DeepSpeed's default: on at stage 3, off below."""
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3


def warn_settings_without_effect(zero: "ZeroConfig") -> None:
    """Warn, naming the key, for settings accepted but with no effect at this stage (when the block is
    validated)."""
    stage = zero.stage
    # ZeRO++ keys that do nothing at this stage (DeepSpeed ignores them there too).
    no_effect = {
        "zero_optimization.zero_quantized_gradients": (bool(zero.zero_quantized_gradients) and stage == 0,
                                                       "needs stage 1, 2 or 3"),
        "zero_optimization.zero_quantized_weights": (bool(zero.zero_quantized_weights) and stage != 3,
                                                     "needs stage 3"),
        "zero_optimization.zero_hpz_partition_size": (zero.zero_hpz_partition_size not in (None, 1)
                                                      and stage != 3, "needs stage 3"),
        "zero_optimization.zeropp_loco_param": (zero.zeropp_loco_param is not None
                                                and not zero.zero_quantized_gradients,
                                                "needs zero_quantized_gradients"),
    }
    for key, (is_set, why) in no_effect.items():
        if is_set:
            warn(f"{key} has no effect: it {why}", key)
