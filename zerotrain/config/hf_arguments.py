"""Hugging Face `TrainingArguments` names -> zerotrain config keys; "auto" filled as transformers fills it.

One module for everyone who starts from HF's argument names: `zerotrain.hf.TrainingArguments` (its
`deepspeed=` config with "auto" values, or no config at all), and the `zerotrain train` flags
(`--learning-rate`, `--per-device-train-batch-size`, ...). It never imports transformers: the
arguments are a plain mapping of TrainingArguments field names to values (`arguments_of(args)` reads
them off a TrainingArguments object, or any object with those attributes).

    values = auto_values(arguments, world_size=8, num_training_steps=1000, hidden_size=4096)
    config = fill_auto(read_config_file("ds_config_zero3.json"), values)   # "auto" -> the HF value
    config = config_from_arguments(arguments, world_size=8)                # no file: ZeRO-3 from the arguments
    config = override(config, {"learning_rate": 1e-4}, world_size=8)       # flags over a file's keys

The rules are those of transformers 5.x (`HfTrainerDeepSpeedConfig.trainer_config_process` and
`trainer_config_finalize`): each mapped key that is "auto" takes the argument's value; a key the file
sets to a different value than the argument is a mismatch (one `ConfigError` listing them all, as
transformers raises one ValueError), except the keys transformers only fills (`warmup_min_lr`, the
hidden-size bucket sizes). Bucket sizes follow the model's hidden size h: reduce h*h, and at ZeRO-3
prefetch 0.9*h*h and persistence 10*h. `warmup_num_steps` is max(1, warmup steps) (DeepSpeed
0.19.6+ refuses 0), `total_num_steps` the Trainer's number of optimizer steps (for a file's DeepSpeed
scheduler). A scheduler made from `lr_scheduler_type` alone is an `HFSchedule` block (transformers' own
schedule, built by `zerotrain.schedules`): the HF Trainer's lr at every step, no 2-step minimum warmup. A file's
`HFSchedule` block takes "auto" the same way: `name` from `lr_scheduler_type`, `num_warmup_steps` the Trainer's
warmup steps (0 allowed), `num_training_steps` its steps (filled, never checked: transformers does not know it).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, Optional

from .auto import fill_auto as _fill_only
from .base import ConfigError, is_auto
from .params import HF_SCHEDULES

__all__ = ["ARGUMENT_DEFAULTS", "ARGUMENT_KEYS", "FILL_ONLY_KEYS", "arguments_of", "auto_values", "fill_auto",
           "config_from_arguments", "override", "warmup_steps", "hf_auto_values", "SCHEDULER_TYPES", "scheduler_block",
           "with_mixed_precision", "LATE_STEPS", "STEP_KEYS", "schedule_values"]

# TrainingArguments' defaults for the fields this module reads (transformers 5.x).
ARGUMENT_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "lr_scheduler_type": "linear",
    "fp16": False,
    "bf16": False,
    "fp16_full_eval": False,
    "bf16_full_eval": False,
    "save_total_limit": None,
    "logging_steps": 500,
    "seed": 42,
}

# TrainingArguments field -> the config keys (dotted) it sets. `adam_beta1`/`adam_beta2` set one key
# together (`optimizer.params.betas`); `train_batch_size` is computed (micro x accumulation x world).
ARGUMENT_KEYS: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("train_micro_batch_size_per_gpu", "train_batch_size"),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "train_batch_size"),
    "max_grad_norm": ("gradient_clipping",),
    "learning_rate": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "adam_beta1": ("optimizer.params.betas",),
    "adam_beta2": ("optimizer.params.betas",),
    "adam_epsilon": ("optimizer.params.eps",),
    "weight_decay": ("optimizer.params.weight_decay",),
    "fp16": ("fp16.enabled",),
    "fp16_full_eval": ("fp16.enabled",),
    "bf16": ("bf16.enabled",),
    "bf16_full_eval": ("bf16.enabled",),
    "warmup_steps": ("scheduler.params.warmup_num_steps",),
    "save_total_limit": ("checkpoint.keep_last",),
    "logging_steps": ("steps_per_print",),
}

# Keys transformers fills when "auto" but never checks against the arguments (`fill_only`).
# HFSchedule's keys (zerotrain's block, which transformers does not know) are filled, never checked: a file that fixes
# them chose its schedule.
FILL_ONLY_KEYS = frozenset({
    "scheduler.params.warmup_min_lr",
    "scheduler.params.name", "scheduler.params.num_warmup_steps", "scheduler.params.num_training_steps",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
})

# The argument name each checked key is reported under in a mismatch (transformers' wording).
_REPORTED_AS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "train_batch_size (calculated)",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1+adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "fp16.enabled": "fp16|fp16_full_eval",
    "bf16.enabled": "bf16|bf16_full_eval",
    "scheduler.params.total_num_steps": "num_training_steps (calculated)",
    "scheduler.params.warmup_num_steps": "warmup_steps",
}

# HF `lr_scheduler_type` -> the config scheduler type with its curve, for a config built from arguments alone
# where no Trainer is there to build its own scheduler (the CLI): zerotrain's HFSchedule, built by
# transformers' `get_scheduler` itself (DeepSpeed's WarmupDecayLR & co. would raise warmup to 2 steps, so the
# first steps would run at lr 0 where the HF Trainer runs step 1 at the full lr). "constant": no scheduler block.
SCHEDULER_TYPES: dict[str, Optional[str]] = {
    "linear": "HFSchedule",
    "cosine": "HFSchedule",
    "constant_with_warmup": "HFSchedule",
    "constant": None,
}


def arguments_of(args: Any) -> dict[str, Any]:
    """The fields this module reads, off a TrainingArguments (or any object with those attributes)."""
    out = {}
    for name, default in ARGUMENT_DEFAULTS.items():
        value = getattr(args, name, default)
        out[name] = value.value if hasattr(value, "value") and not isinstance(value, (int, float, str)) else value
    return out


def _with_defaults(arguments: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(arguments) - set(ARGUMENT_DEFAULTS) - {"warmup_ratio"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a training argument zerotrain maps to its config "
                          f"(known: {', '.join(sorted(ARGUMENT_DEFAULTS))})", key=unknown[0])
    merged = {**ARGUMENT_DEFAULTS, **{k: v for k, v in arguments.items() if v is not None or k == "save_total_limit"}}
    if arguments.get("warmup_ratio") is not None:  # TrainingArguments 4.x's name; 5.x reads warmup_steps < 1 as it
        merged["warmup_steps"] = float(arguments["warmup_ratio"])
    merged.pop("warmup_ratio", None)
    return merged


def warmup_steps(arguments: Mapping[str, Any], num_training_steps: int) -> int:
    """The Trainer's warmup steps: `warmup_steps` when >= 1, else that fraction of the steps, rounded up."""
    value = _with_defaults(arguments)["warmup_steps"]
    return int(value) if value >= 1 else math.ceil(num_training_steps * value)


# `num_training_steps` when the run's steps are not known yet (`zerotrain train --num-train-epochs` before the data is
# read): the keys counted in them (`STEP_KEYS`: the steps, and a warmup given as a share of them) stay "auto", to be
# filled once they are known (`schedule_values`), as transformers' `trainer_config_finalize` fills them.
LATE_STEPS = "auto"
STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps",
             "scheduler.params.num_training_steps", "scheduler.params.num_warmup_steps")


def _warmup_of(a: Mapping[str, Any], num_training_steps: Any) -> Any:
    """The warmup steps of `a` (defaults filled) for `num_training_steps`: None counts 0 steps, `LATE_STEPS` leaves a
    share of them "auto" (a whole number of steps needs no step count)."""
    value = a["warmup_steps"]
    if value >= 1:
        return int(value)
    if is_auto(num_training_steps):
        return LATE_STEPS if value > 0 else 0
    return math.ceil((num_training_steps or 0) * value)


def schedule_values(arguments: Mapping[str, Any], num_training_steps: int) -> dict[str, int]:
    """The `STEP_KEYS` values for `num_training_steps` optimizer steps: what fills the "auto" a config built with
    `LATE_STEPS` holds there once the run's steps are known."""
    values = auto_values(arguments, world_size=1, num_training_steps=num_training_steps)
    return {key: values[key] for key in STEP_KEYS}


def auto_values(arguments: Mapping[str, Any], *, world_size: int, num_training_steps: Optional[int] = None,
                hidden_size: Optional[int] = None, zero_stage: int = 3) -> dict[str, Any]:
    """Dotted config key -> the value transformers puts in place of "auto" for these arguments.

    `world_size` is the data-parallel size (train_batch_size = micro x accumulation x world_size);
    `num_training_steps` (the Trainer's optimizer steps) fills `total_num_steps` and the warmup (`LATE_STEPS`:
    "auto" where they count the steps);
    `hidden_size` (the model's) the bucket sizes, the ZeRO-3 ones only at `zero_stage` 3.
    """
    a = _with_defaults(arguments)
    values: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": a["per_device_train_batch_size"],
        "gradient_accumulation_steps": a["gradient_accumulation_steps"],
        "train_batch_size": world_size * a["per_device_train_batch_size"] * a["gradient_accumulation_steps"],
        "gradient_clipping": a["max_grad_norm"],
        "optimizer.params.lr": a["learning_rate"],
        "optimizer.params.betas": [a["adam_beta1"], a["adam_beta2"]],
        "optimizer.params.eps": a["adam_epsilon"],
        "optimizer.params.weight_decay": a["weight_decay"],
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": a["learning_rate"],
        "fp16.enabled": bool(a["fp16"] or a["fp16_full_eval"]),
        "bf16.enabled": bool(a["bf16"] or a["bf16_full_eval"]),
    }
    # zerotrain's HFSchedule block (transformers' schedule, its own key names): the Trainer's own values, warmup 0 allowed
    values["scheduler.params.name"] = str(a["lr_scheduler_type"])
    if num_training_steps is not None:
        warmup = _warmup_of(a, num_training_steps)
        values["scheduler.params.total_num_steps"] = num_training_steps
        values["scheduler.params.warmup_num_steps"] = warmup if is_auto(warmup) else max(1, warmup)
        values["scheduler.params.num_training_steps"] = num_training_steps
        values["scheduler.params.num_warmup_steps"] = warmup
    elif a["warmup_steps"] >= 1:
        values["scheduler.params.num_warmup_steps"] = int(a["warmup_steps"])
    if hidden_size is not None:
        values["zero_optimization.reduce_bucket_size"] = hidden_size * hidden_size
        if zero_stage == 3:
            values["zero_optimization.stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
            values["zero_optimization.stage3_param_persistence_threshold"] = 10 * hidden_size
    return values


def _lookup(config: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(file_value: Any, hf_value: Any) -> bool:
    if isinstance(file_value, (list, tuple)) and isinstance(hf_value, (list, tuple)):
        return len(file_value) == len(hf_value) and all(_same(f, h) for f, h in zip(file_value, hf_value))
    return file_value == hf_value


def fill_auto(config: Mapping[str, Any], values: Mapping[str, Any], *, check: bool = True,
              fill_only: frozenset[str] = FILL_ONLY_KEYS) -> dict[str, Any]:
    """A copy of `config` with every "auto" at a key of `values` replaced by its value (legacy key spellings too).

    With `check` (transformers' behaviour), a key the config sets to another value than `values` says is a
    mismatch, except the `fill_only` keys; all mismatches are raised together in one `ConfigError`, naming
    the config key and the argument. Keys of `values` the config does not have are left out.
    """
    filled = _fill_only(config, values)
    if not check:
        return filled
    mismatches = []
    for dotted, hf_value in values.items():
        if dotted in fill_only:
            continue
        present, file_value = _lookup(config, dotted)
        if present and file_value is not None and not is_auto(file_value) and not _same(file_value, hf_value):
            mismatches.append((dotted, file_value, hf_value))
    if mismatches:
        listed = "; ".join(f"{key}={file_value!r} vs {_REPORTED_AS.get(key, key)}={hf_value!r}"
                           for key, file_value, hf_value in mismatches)
        raise ConfigError(f"{mismatches[0][0]}: the config disagrees with the training arguments: {listed} "
                          "(set these keys to \"auto\" to take the arguments' values)", key=mismatches[0][0])
    return filled


def with_mixed_precision(config: Mapping[str, Any], arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` with the Trainer's mixed precision (`fp16` / `bf16`) put in, as accelerate puts it into a
    DeepSpeed config (`DeepSpeedPlugin.set_mixed_precision`): a `bf16` (`fp16`) block the config lacks is enabled
    when the argument is set, the other one disabled; one that says the opposite precision is refused.

    This is what TRL users meet first: `SFTConfig` defaults to `bf16=True`, so a DeepSpeed config without a `bf16`
    block trains in bf16 under the Trainer + DeepSpeed, and does here too.
    """
    a = _with_defaults(arguments)
    mixed = "fp16" if a["fp16"] else "bf16" if a["bf16"] else "no"
    out = copy.deepcopy(dict(config))
    if mixed != "no":
        other = "bf16" if mixed == "fp16" else "fp16"
        if str((out.get(other) or {}).get("enabled", False)).lower() == "true":
            raise ConfigError(f"{other}.enabled: the config enables {other} while the training arguments ask for "
                              f"{mixed} ({mixed}=True)", key=f"{other}.enabled")
        if mixed not in out:
            out[mixed] = {"enabled": True}
    for dtype in ("fp16", "bf16"):
        out.setdefault(dtype, {"enabled": False})
    return out


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def _scheduler_block(a: Mapping[str, Any], num_training_steps: Optional[int]) -> Optional[dict[str, Any]]:
    kind = str(a["lr_scheduler_type"])
    if kind not in SCHEDULER_TYPES:
        raise ConfigError(f"lr_scheduler_type: {kind!r} has no zerotrain scheduler with the same curve "
                          f"(supported: {', '.join(SCHEDULER_TYPES)})", key="lr_scheduler_type")
    name = SCHEDULER_TYPES[kind]
    if name is None:
        return None
    params: dict[str, Any] = {"name": kind, "num_warmup_steps": _warmup_of(a, num_training_steps)}
    if HF_SCHEDULES[kind]:
        if num_training_steps is None:
            raise ConfigError(f"lr_scheduler_type: {kind!r} decays over the run and needs its number of steps",
                              key="lr_scheduler_type")
        params["num_training_steps"] = num_training_steps
    return {"type": name, "params": params}


def scheduler_block(arguments: Mapping[str, Any], num_training_steps: Optional[int]) -> Optional[dict[str, Any]]:
    """The config's `scheduler` block for `lr_scheduler_type` (HF defaults for what is not given); None: constant."""
    return _scheduler_block(_with_defaults(arguments), num_training_steps)


def config_from_arguments(arguments: Mapping[str, Any], *, world_size: int, num_training_steps: Optional[int] = None,
                          zero_stage: int = 3, optimizer_and_scheduler: bool = True) -> dict[str, Any]:
    """A complete config from the training arguments alone: ZeRO-3 (`zero_stage`) by default.

    `optimizer_and_scheduler`: add the AdamW `optimizer` block and the `scheduler` block of
    `lr_scheduler_type` (the CLI); without them (the HF Trainer subclass) the Trainer builds its own,
    as it does under DeepSpeed when the config has neither. Checkpoint rotation (`save_total_limit`)
    is not in it: the HF Trainer rotates its checkpoint-N directories itself; the CLI adds
    `checkpoint.keep_last` with `override`.
    """
    a = _with_defaults(arguments)
    values = auto_values(a, world_size=world_size)
    config: dict[str, Any] = {"zero_optimization": {"stage": zero_stage}, "steps_per_print": a["logging_steps"]}
    keys = ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
            "fp16.enabled", "bf16.enabled"]
    if optimizer_and_scheduler:
        config["optimizer"] = {"type": "AdamW"}
        keys += ["optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                 "optimizer.params.weight_decay"]
    for key in keys:
        _set(config, key, values[key])
    if optimizer_and_scheduler:
        scheduler = _scheduler_block(a, num_training_steps)
        if scheduler is not None:
            config["scheduler"] = scheduler
    return config


# DeepSpeed's scheduler keys -> HFSchedule's (None: HFSchedule has no such key; it scales the optimizer's lr).
_HF_SCHEDULE_KEYS: dict[str, Optional[str]] = {"scheduler.params.warmup_num_steps": "scheduler.params.num_warmup_steps",
                                               "scheduler.params.total_num_steps": "scheduler.params.num_training_steps"}


def override(config: Mapping[str, Any], arguments: Mapping[str, Any], *, world_size: int,
             num_training_steps: Optional[int] = None) -> dict[str, Any]:
    """A copy of `config` in which the keys of the given arguments (only those given) are set to their values.

    For command-line flags over a file: a flag wins over the file's key, "auto" or not. An argument whose
    block the config lacks (e.g. `learning_rate` without an `optimizer` block) creates no block, except the
    top-level batch, clipping and precision keys.
    """
    out = copy.deepcopy(dict(config))
    a = _with_defaults(arguments)
    given = {k for k, v in arguments.items() if v is not None}
    if "warmup_ratio" in given:
        given.add("warmup_steps")
    values = auto_values(a, world_size=world_size, num_training_steps=num_training_steps)
    for name in sorted(given - {"warmup_ratio"}):
        for dotted in ARGUMENT_KEYS[name]:
            if dotted == "train_batch_size":
                _, micro = _lookup(out, "train_micro_batch_size_per_gpu")
                _, gas = _lookup(out, "gradient_accumulation_steps")
                if "train_batch_size" in out and not (isinstance(micro, int) and isinstance(gas, int)):
                    out.pop("train_batch_size")  # recomputed from the other two by the batch arithmetic
                elif "train_batch_size" in out:
                    out["train_batch_size"] = micro * gas * world_size
                continue
            if dotted == "checkpoint.keep_last":
                value = a["save_total_limit"]
            elif dotted == "steps_per_print":
                value = a["logging_steps"]
            elif dotted not in values:
                continue  # warmup without a step count: set where the scheduler block is built
            else:
                value = values[dotted]
            if dotted.startswith("scheduler.params.") and _lookup(out, "scheduler.type")[1] == "HFSchedule":
                # transformers' schedule (a config written by `--print-config`): its own names, the lr is the optimizer's
                dotted = _HF_SCHEDULE_KEYS.get(dotted)
                if dotted is None:
                    continue
                if dotted.endswith("num_warmup_steps"):
                    value = _warmup_of(a, num_training_steps)
            if dotted == "optimizer.params.betas" and not {"adam_beta1", "adam_beta2"} <= given:
                # one beta given: the other stays the file's (a flag sets only its own value)
                _, old = _lookup(out, dotted)
                if isinstance(old, (list, tuple)) and len(old) == 2 and not any(is_auto(b) for b in old):
                    value = [value[0], old[1]] if "adam_beta1" in given else [old[0], value[1]]
            block = dotted.split(".")[0]
            if "." in dotted and block not in out and block not in ("fp16", "bf16", "checkpoint"):
                continue
            _set(out, dotted, value)
    return out


def hf_auto_values(*, micro_batch_per_gpu: int, gradient_accumulation_steps: int, dp_world_size: int,
                   learning_rate: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 0,
                   total_steps: Optional[int] = None, hidden_size: Optional[int] = None, fp16: bool = False,
                   bf16: bool = False, save_16bit_model: bool = False) -> dict[str, Any]:
    """`auto_values` under keyword names of their own (the older entry point, kept for its callers).

    Without `total_steps` the warmup is still filled (max(1, warmup_steps)); `save_16bit_model` fills
    `stage3_gather_16bit_weights_on_model_save` as transformers 4.x did. Bucket sizes at any stage's
    "auto" follow `hidden_size` (a file that says "auto" asks for them).
    """
    arguments = {"per_device_train_batch_size": micro_batch_per_gpu,
                 "gradient_accumulation_steps": gradient_accumulation_steps, "learning_rate": learning_rate,
                 "adam_beta1": betas[0], "adam_beta2": betas[1], "adam_epsilon": eps, "weight_decay": weight_decay,
                 "max_grad_norm": max_grad_norm, "warmup_steps": warmup_steps, "fp16": fp16, "bf16": bf16}
    values = auto_values(arguments, world_size=dp_world_size, num_training_steps=total_steps,
                         hidden_size=hidden_size, zero_stage=3)
    values["scheduler.params.warmup_num_steps"] = max(1, int(warmup_steps))
    values["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = save_16bit_model
    return values
