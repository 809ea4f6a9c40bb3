"""DeepSpeed's import paths and where each is in zerotrain: the one list `zerotrain port` and the guide use.

Collected from what real programs import (DeepSpeedExamples' `training/` and `applications/`,
Megatron-DeepSpeed, transformers' and accelerate's DeepSpeed integrations). A `ModulePath` says where a
DeepSpeed module's names are under zerotrain: the same names at `zerotrain.X` (a mirrored path: a thin
re-export of zerotrain's own code, with DeepSpeed's names and meaning) or at another module (`moved`).
`NOT_PROVIDED` lists the paths without a counterpart and what to write instead. docs/porting.md's table
is `porting_table()`'s output (tests/test_port.py checks that they agree, and that every name listed
imports).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["ModulePath", "MODULES", "NOT_PROVIDED", "TRANSFORMERS", "lookup", "advice_for", "porting_table",
           "mirrored_paths", "is_package", "not_provided"]


@dataclass(frozen=True)
class ModulePath:
    """DeepSpeed module `source` -> zerotrain module `target`: `names` exist there under the same name;
    `moved` names live elsewhere (name -> (module, name)); `note`: what differs, for the guide."""

    source: str
    target: str
    names: tuple[str, ...] = ()
    moved: dict[str, tuple[str, str]] = field(default_factory=dict)
    note: str = ""

    @property
    def mirrored(self) -> bool:
        """True when the zerotrain path is DeepSpeed's with `deepspeed` replaced by `zerotrain`."""
        return self.target == "zerotrain" + self.source[len("deepspeed"):]

    def where(self, name: str) -> Optional[tuple[str, str]]:
        """(module, name) of `name` in zerotrain, or None when this path does not provide it."""
        if name in self.names:
            return self.target, name
        return self.moved.get(name)


_ACCEL = ("get_accelerator",)
_ADVICE_ACCEL = "zerotrain.accelerator"

MODULES: tuple[ModulePath, ...] = (
    ModulePath("deepspeed", "zerotrain",
               ("initialize", "init_distributed", "add_config_arguments", "zero", "checkpointing", "__version__"),
               {"comm": ("zerotrain", "dist"), "get_accelerator": ("zerotrain.accelerator", "get_accelerator"),
                "DeepSpeedEngine": ("zerotrain.engine", "ZeroTrainEngine")},
               "`import deepspeed` becomes `import zerotrain as deepspeed`; `deepspeed.comm` is `zerotrain.dist`"),
    ModulePath("deepspeed.comm", "zerotrain.dist",
               ("init_distributed", "is_initialized", "destroy_process_group", "get_rank", "get_world_size",
                "get_local_rank", "barrier", "all_reduce", "broadcast", "all_gather", "ReduceOp"),
               note="`zerotrain.comm` is the library's internal collectives package: import `zerotrain.dist`"),
    ModulePath("deepspeed.accelerator", "zerotrain.accelerator", ("get_accelerator", "set_accelerator"),
               note="CUDA or the CPU; device, seed, synchronize and memory calls"),
    ModulePath("deepspeed.accelerator.real_accelerator", "zerotrain.accelerator.real_accelerator",
               ("get_accelerator", "set_accelerator")),
    ModulePath("deepspeed.ops", "zerotrain.ops", ("adam",)),
    ModulePath("deepspeed.ops.adam", "zerotrain.ops.adam", ("FusedAdam", "DeepSpeedCPUAdam"),
               note="torch's AdamW (Adam with `adam_w_mode=False`); where it steps is the config's `offload_optimizer`"),
    ModulePath("deepspeed.zero", "zerotrain.zero", ("Init", "GatheredParameters")),
    ModulePath("deepspeed.runtime.zero", "zerotrain.runtime.zero",
               ("GatheredParameters", "Init", "partition_parameters")),
    ModulePath("deepspeed.runtime.zero.partition_parameters", "zerotrain.runtime.zero.partition_parameters",
               ("ZeroParamStatus", "GatheredParameters", "Init"),
               note="partitioned parameters carry `ds_status`, `ds_id`, `ds_shape`, `ds_numel`"),
    ModulePath("deepspeed.runtime.engine", "zerotrain.engine", (),
               {"DeepSpeedEngine": ("zerotrain.engine", "ZeroTrainEngine")}, "the engine class is `ZeroTrainEngine`"),
    ModulePath("deepspeed.checkpointing", "zerotrain.checkpointing",
               ("checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
                "model_parallel_cuda_manual_seed", "set_num_layers", "partition_activations_in_checkpoint")),
    ModulePath("deepspeed.runtime.activation_checkpointing.checkpointing", "zerotrain.checkpointing",
               ("checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
                "model_parallel_cuda_manual_seed", "set_num_layers", "partition_activations_in_checkpoint"),
               note="`zerotrain.checkpointing` (docs/activation_checkpointing.md)"),
    ModulePath("deepspeed.moe.utils", "zerotrain.moe.utils",
               ("split_params_into_different_moe_groups_for_optimizer", "is_moe_param")),
    ModulePath("deepspeed.compression.helper", "zerotrain.compression.helper",
               ("recursive_getattr", "recursive_setattr"),
               note="deprecated in DeepSpeed 0.19.8 too: prefer `utils.module_utils`"),
    ModulePath("deepspeed.utils.module_utils", "zerotrain.utils.module_utils", ("recursive_getattr", "recursive_setattr")),
    ModulePath("deepspeed.utils", "zerotrain.utils", ("logger", "log_dist", "RepeatingLoader")),
    ModulePath("deepspeed.utils.logging", "zerotrain.utils.logging", ("logger", "log_dist")),
    ModulePath("deepspeed.runtime.dataloader", "zerotrain.runtime.dataloader", ("RepeatingLoader",)),
    ModulePath("deepspeed.runtime.utils", "zerotrain.runtime.utils",
               ("set_random_seed", "see_memory_usage", "RepeatingLoader", "partition_uniform", "partition_balanced",
                "move_to_device"),
               note="DeepSpeed's behaviour; its engine-internal helpers are listed below"),
    ModulePath("deepspeed.pipe", "zerotrain.pipe", ("PipelineModule", "LayerSpec", "TiedLayerSpec"),
               note="on torch.distributed.pipelining's schedules (`pipeline.schedule`); `engine.train_batch` / "
                    "`eval_batch` as DeepSpeed's (docs/pipeline.md)"),
)

# transformers' DeepSpeed integration names (their constructors need the deepspeed package, and with it
# installed `from_pretrained` builds under DeepSpeed's own zero.Init): module -> name -> (module, name).
_HF = {"HfDeepSpeedConfig": ("zerotrain.pretrained", "HfDeepSpeedConfig"),
       "is_deepspeed_zero3_enabled": ("zerotrain.pretrained", "is_deepspeed_zero3_enabled")}
TRANSFORMERS: dict[str, dict[str, tuple[str, str]]] = {
    "transformers.integrations.deepspeed": _HF,
    "transformers.integrations": _HF,
    "transformers.deepspeed": _HF,  # transformers 4.x
}

# DeepSpeed paths (a module, or "module:name") without a zerotrain counterpart -> what to write instead.
NOT_PROVIDED: dict[str, str] = {
    "deepspeed:DeepSpeedConfig": "the config is checked by `zerotrain.initialize` (`zerotrain.config.load_config` "
                                 "reads it alone)",
    "deepspeed:DeepSpeedTransformerLayer": "use the model's own layers (e.g. Hugging Face's)",
    "deepspeed:DeepSpeedTransformerConfig": "use the model's own layers (e.g. Hugging Face's)",
    "deepspeed:init_inference": "`zerotrain.inference.load_for_inference` / `zerotrain generate` (docs/inference.md)",
    "deepspeed:replace_transformer_layer": "no kernel injection: use the model as it is",
    "deepspeed.module_inject": "no kernel injection: use the model as it is",
    "deepspeed.ops.sparse_attention": "no sparse attention kernels: use the model's attention (torch SDPA)",
    "deepspeed.ops.lion": "pass `torch.optim` or another library's optimizer as `optimizer=`",
    "deepspeed.ops.adagrad": "pass `torch.optim.Adagrad(...)` as `optimizer=`",
    "deepspeed.ops.op_builder": "zerotrain builds no DeepSpeed ops",
    "deepspeed.ops.op_builder.builder": "zerotrain builds no DeepSpeed ops",
    "deepspeed.moe.layer": "zerotrain's expert-parallel layer is `zerotrain.parallel.moe.ExpertParallelMoE` "
                           "(docs/porting.md); DeepSpeed's MoE class is not provided",
    "deepspeed.runtime.pipe": "import `PipelineModule`, `LayerSpec`, `TiedLayerSpec` from `zerotrain.pipe`",
    "deepspeed.runtime.pipe.engine": "`zerotrain.initialize(model=PipelineModule(...))` returns the pipeline engine "
                                     "(`zerotrain.pipe.PipelineEngine`)",
    "deepspeed.runtime.pipe.topology": "the rank grid (pipeline x data x sequence x tensor) is "
                                       "`zerotrain.topology.Topology`, built from num_stages and the config",
    "deepspeed.runtime.pipe.schedule": "the schedules are torch's: the config's `pipeline.schedule`",
    "deepspeed.sequence.layer": "Ulysses sequence parallelism comes from `sequence_parallel_size` in the config "
                                "(docs/sequence_parallel.md)",
    "deepspeed.sequence.fpdt_layer": "no FPDT: Ulysses sequence parallelism via `sequence_parallel_size`",
    "deepspeed.runtime.sequence_parallel.ulysses_sp": "Ulysses via `sequence_parallel_size` (docs/sequence_parallel.md)",
    "deepspeed.runtime.data_pipeline.data_routing.helper": "no random-LTD data routing",
    "deepspeed.runtime.data_pipeline.data_sampling.data_analyzer": "no curriculum data sampling",
    "deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset": "no curriculum data sampling",
    "deepspeed.runtime.data_pipeline.curriculum_scheduler": "no curriculum learning",
    "deepspeed.runtime.domino.transformer": "no Domino tensor-parallel overlap",
    "deepspeed.runtime.zero.offload_config": "offload is set in the config's `offload_optimizer` / `offload_param`",
    "deepspeed.runtime.utils:*": "DeepSpeed's engine internals (gradient norms, overflow checks, "
                                 "`PartitionedTensor`, ...) have no counterpart: the engine does these itself "
                                 "(`engine.get_global_grad_norm()`, the config's `gradient_clipping`); "
                                 "`clip_grad_norm_`: `torch.nn.utils.clip_grad_norm_`",
    "deepspeed.pipe:*": "`zerotrain.pipe` has `PipelineModule`, `LayerSpec`, `TiedLayerSpec`; the grid comes from "
                        "num_stages and the config (no `ProcessTopology`)",
    "deepspeed.runtime.config": "the config is a dict / JSON file (`zerotrain.config`)",
    "deepspeed.compression.compress": "no compression library (removed from DeepSpeed too)",
    "deepspeed.checkpoint": "checkpoints are zerotrain's (`zerotrain ckpt export` writes Hugging Face weights)",
    "deepspeed.checkpoint.utils": "`clone_tensors_for_torch_save`: `{k: v.clone() for k, v in sd.items()}`",
    "deepspeed.utils.timer": "`engine.get_wall_clock_timers()`, `engine.tput_timer` (docs/metrics.md)",
    "deepspeed.utils.groups": "the process groups are the engine's (`engine.data_parallel_group`, `engine.topology`)",
    "deepspeed.utils:safe_get_full_fp32_param": "`engine.full_state_dict()` (collective; whole fp32 weights on rank 0)",
    "deepspeed.utils:set_z3_leaf_modules": "not needed: zerotrain gathers per module with prefetch",
    "deepspeed.env_report": "`python -c 'import torch, zerotrain; print(torch.__version__, zerotrain.__version__)'`",
    "deepspeed.launcher.runner": "launch with `zerotrain launch --nproc N script.py ...`",
}


def lookup(module: str) -> Optional[ModulePath]:
    """The ModulePath of DeepSpeed module `module`, or None."""
    return next((entry for entry in MODULES if entry.source == module), None)


def advice_for(module: str, name: Optional[str] = None) -> str:
    """What to write instead of DeepSpeed's `module` (or its `name`); a generic pointer when not listed."""
    if name is not None and f"{module}:{name}" in NOT_PROVIDED:
        return NOT_PROVIDED[f"{module}:{name}"]
    if name is not None and f"{module}:*" in NOT_PROVIDED:
        return NOT_PROVIDED[f"{module}:*"]
    for prefix in sorted((key for key in NOT_PROVIDED if ":" not in key), key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return NOT_PROVIDED[prefix]
    what = f"{module}.{name}" if name else module
    return f"{what} has no zerotrain counterpart; see docs/porting.md"


def is_package(module: str) -> bool:
    """True when DeepSpeed's `module` is a package above a listed path (`deepspeed.runtime`, `deepspeed.moe`)."""
    return any(path.startswith(module + ".") for path in [entry.source for entry in MODULES] +
               [key for key in NOT_PROVIDED if ":" not in key])


def not_provided(module: str, name: Optional[str] = None) -> bool:
    """True when DeepSpeed's `module` (or its `name`) is listed without a counterpart (`NOT_PROVIDED`)."""
    if name is None:
        return module in NOT_PROVIDED
    return f"{module}:{name}" in NOT_PROVIDED or f"{module}.{name}" in NOT_PROVIDED


def mirrored_paths() -> list[str]:
    """The `zerotrain.X` module paths that mirror `deepspeed.X`."""
    return [entry.target for entry in MODULES if entry.mirrored]


def porting_table() -> str:
    """docs/porting.md's table of DeepSpeed import paths (generated: `zerotrain port --table` prints it)."""
    rows = ["| DeepSpeed import | zerotrain | names |", "|---|---|---|"]
    for entry in MODULES:
        names = ", ".join(f"`{name}`" for name in entry.names)
        moved = ", ".join(f"`{name}` → `{module}.{target}`" for name, (module, target) in entry.moved.items())
        listed = "; ".join(part for part in (names, moved) if part)
        where = f"`{entry.target}`" + ("" if entry.mirrored else " (moved)")
        note = f" — {entry.note}" if entry.note else ""
        rows.append(f"| `{entry.source}` | {where} | {listed}{note} |")
    for module, names in TRANSFORMERS.items():
        listed = ", ".join(f"`{name}` → `{where}.{target}`" for name, (where, target) in names.items())
        rows.append(f"| `{module}` (transformers) | `zerotrain.pretrained` (moved) | {listed} |")
    rows += ["", "| DeepSpeed import (not provided) | write instead |", "|---|---|"]
    for key, advice in NOT_PROVIDED.items():
        rows.append(f"| `{key.replace(':', '.')}` | {advice} |")
    return "\n".join(rows) + "\n"
