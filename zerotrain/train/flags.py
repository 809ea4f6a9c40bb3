"""The Hugging Face `TrainingArguments` flags of `zerotrain train` and `zerotrain train-embedding`, and the config they make.

Both commands take the same flags, with TrainingArguments' names and meaning (`--learning-rate`,
`--per-device-train-batch-size`, `--num-train-epochs`, ...); `add_training_flags` adds them, `effective_config`
turns them into the engine's config: the `--config`/`--deepspeed` file's keys with the given flags over them and its
"auto" values filled from the flags as transformers fills them, or, without a file, a complete ZeRO-3 config from
the flags alone. The name mapping and the "auto" rules are `zerotrain.config.hf_arguments`' (one module for the CLI
and `zerotrain.hf`); this module only reads the command line.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

__all__ = ["HF_FLAGS", "flag_defaults", "add_training_flags", "add_fp8_flag", "training_arguments", "effective_config", "schedule_values", "write_effective_config",
           "EFFECTIVE_CONFIG"]

EFFECTIVE_CONFIG = "effective_config.json"  # the file in the run directory

# HF flag (TrainingArguments field) -> (type, help). Each sets the config keys hf_arguments.ARGUMENT_KEYS names; its
# default (said in the help) is the command's own (`add_training_flags`' `defaults`), else TrainingArguments'
# (hf_arguments.ARGUMENT_DEFAULTS): the values the effective config is made from.
HF_FLAGS: dict[str, tuple[Any, str]] = {
    "learning_rate": (float, "peak learning rate (optimizer.params.lr; a file's DeepSpeed scheduler: warmup_max_lr)"),
    "per_device_train_batch_size": (int, "micro-batch per rank (train_micro_batch_size_per_gpu)"),
    "gradient_accumulation_steps": (int, "micro-batches per optimizer step (gradient_accumulation_steps)"),
    "warmup_steps": (float, "linear warmup steps from lr 0 (scheduler.params.num_warmup_steps; a file's DeepSpeed "
                            "scheduler: warmup_num_steps); a value < 1 is a share of the steps, as --warmup-ratio"),
    "warmup_ratio": (float, "warmup as a share of the run's steps, when --warmup-steps is not given"),
    "lr_scheduler_type": (str, "linear, cosine, constant_with_warmup (an HFSchedule block: transformers' schedule, "
                               "the HF Trainer's lr at every step; step 1 at the full lr without warmup) or constant "
                               "(no scheduler)"),
    "weight_decay": (float, "AdamW weight decay (optimizer.params.weight_decay)"),
    "adam_beta1": (float, "AdamW beta1 (optimizer.params.betas[0])"),
    "adam_beta2": (float, "AdamW beta2 (optimizer.params.betas[1])"),
    "adam_epsilon": (float, "AdamW epsilon (optimizer.params.eps)"),
    "max_grad_norm": (float, "gradient clipping norm (gradient_clipping)"),
    "save_total_limit": (int, "keep the newest N checkpoints (checkpoint.keep_last)"),
    "logging_steps": (int, "a progress line every N steps (steps_per_print)"),
}
# TrainingArguments' defaults the table's help says where hf_arguments.ARGUMENT_DEFAULTS has none
_MORE_DEFAULTS = {"warmup_ratio": 0.0}
_BOOL_FLAGS = {"bf16": "bf16 mixed precision (bf16.enabled)",
               "fp16": "fp16 mixed precision with loss scaling (fp16.enabled)",
               "gradient_checkpointing": "recompute each layer's activations in backward instead of keeping them "
                                         "(adds an activation_checkpointing block: the model's own gradient "
                                         "checkpointing, run by zerotrain.checkpointing)"}


def flag_defaults(defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The default of each `HF_FLAGS` flag, by TrainingArguments name: a command's own `defaults` (those of
    `effective_config`), else TrainingArguments' own (None: unset, e.g. save_total_limit keeps every checkpoint)."""
    from zerotrain.config.hf_arguments import ARGUMENT_DEFAULTS

    hf = {**ARGUMENT_DEFAULTS, **_MORE_DEFAULTS}
    return {name: (defaults or {}).get(name, hf.get(name)) for name in HF_FLAGS}


def add_training_flags(parser: argparse.ArgumentParser, *, aliases: Optional[dict[str, list[str]]] = None,
                       defaults: Optional[dict[str, Any]] = None) -> None:
    """Add the HF flags that map to config keys, plus `--config`/`--deepspeed`, `--zero-stage`/`--stage` and
    `--print-config`; `aliases` adds a command's older names for a flag (`{"learning_rate": ["--lr"]}`); `defaults`
    are the command's own defaults where TrainingArguments' differ (HF names, as `effective_config` takes them):
    each flag's help says the one in effect. Every option of the parser also takes its underscore spelling
    (`--learning_rate`, TrainingArguments' field names; `zerotrain.command.CommandParser`)."""
    from zerotrain.command import CommandParser

    aliases = aliases or {}
    if isinstance(parser, CommandParser):
        parser.underscore_spellings = True
        parser.epilog = ((parser.epilog + " ") if parser.epilog else "") + (
            "Every option also takes its underscore spelling, as TrainingArguments' fields are named "
            "(--learning_rate, --output_dir, --per_device_train_batch_size, ...).")
    stated = flag_defaults(defaults)
    parser.add_argument("--config", "--deepspeed", dest="config", default=None, metavar="PATH",
                        help="DeepSpeed-style JSON config file (examples/zero*.json); its \"auto\" values are filled "
                             "from the flags, the flags given override its keys. Without it the flags make the "
                             "whole config (ZeRO-3)")
    parser.add_argument("--zero-stage", "--stage", dest="zero_stage", type=int, default=None, choices=(0, 1, 2, 3),
                        help="ZeRO stage (zero_optimization.stage); default 3 without --config")
    for name, (kind, text) in HF_FLAGS.items():
        default = "all" if stated[name] is None else stated[name]
        parser.add_argument(f"--{name.replace('_', '-')}", *aliases.get(name, ()), dest=name, type=kind,
                            default=None, help=f"{text} (default: {default})")
    for name, text in _BOOL_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, action="store_true", default=None, help=text)
    parser.add_argument("--per-device-eval-batch-size", type=int, default=None, metavar="B",
                        help="samples per evaluation micro-batch per rank (HF's per_device_eval_batch_size); default: "
                             "the training micro-batch (train), 64 texts per forward (train-embedding)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective config (file, flags and filled \"auto\" values) and exit")


def add_max_steps_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """`--max-steps N` (also `--steps`; dest `steps`) as the HF Trainer's `max_steps`: N <= 0 (its default -1,
    which scripts pass explicitly) means not set, so the run goes by its epochs (or the command's default). (The
    help says "-1" without the word "default": each option's help names its default once.)"""
    def max_steps(text: str) -> Optional[int]:
        steps = int(text)
        return steps if steps > 0 else None

    max_steps.__name__ = "int"  # argparse's error names the type: "invalid int value: 'x'", as with type=int
    parser.add_argument("--max-steps", "--steps", dest="steps", type=max_steps, default=None, metavar="N",
                        help=help + "; N <= 0 (the HF Trainer's -1, which scripts pass) is the same as not giving it")


def add_fp8_flag(parser: argparse.ArgumentParser) -> None:
    """`--fp8 [tensorwise|rowwise]`: the config's `fp8` block (docs/fp8.md), accelerate's `mixed_precision="fp8"`
    with torchao's float8 (no TrainingArguments field exists for it)."""
    from zerotrain.config.schema import FP8_RECIPES

    parser.add_argument("--fp8", nargs="?", const=FP8_RECIPES[0], default=None, choices=FP8_RECIPES,
                        metavar="RECIPE",
                        help="float8 compute of the Linear layers through torchao (fp8.enabled; the recipe, "
                             "fp8.recipe: tensorwise (default) or rowwise); emulated where the device has no fp8 "
                             "matmul; weights, gradients and checkpoints stay in the training dtype")


def training_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The HF arguments given on the command line (only those given), by their TrainingArguments names."""
    out = {name: getattr(args, name) for name in (*HF_FLAGS, *_BOOL_FLAGS)
           if getattr(args, name, None) is not None and name != "gradient_checkpointing"}
    if out.get("warmup_steps") is not None and out.get("warmup_ratio") is not None:
        out.pop("warmup_ratio")  # TrainingArguments: warmup_steps wins
    return out


def effective_config(args: argparse.Namespace, *, world_size: int, num_training_steps: Optional[int],
                     hidden_size: Optional[int] = None, defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The engine's config for these arguments (a dict).

    With `--config`: the file, the given flags over its keys (`hf_arguments.override`), then its "auto" values
    filled from the flags (HF's defaults where a flag is not given) as transformers fills them. Without: a complete
    config from the flags (`hf_arguments.config_from_arguments`, ZeRO-3 unless `--zero-stage`), `defaults`
    (a command's own defaults, HF argument names) under the flags given.
    """
    from zerotrain.config.hf_arguments import (auto_values, config_from_arguments, fill_auto, override,
                                                scheduler_block)
    from zerotrain.config.loader import read_config_file

    given = training_arguments(args)
    if args.config is None:
        arguments = {**(defaults or {}), **given}
        config = config_from_arguments(arguments, world_size=world_size, num_training_steps=num_training_steps,
                                       zero_stage=3 if args.zero_stage is None else args.zero_stage)
        config = override(config, {k: v for k, v in arguments.items() if k == "save_total_limit"},
                          world_size=world_size)
        return _with_fp8(_with_checkpointing(config, args), args)
    arguments = {**(defaults or {}), **given}
    config = read_config_file(args.config)
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    check_batch_size(config, arguments, given, world_size=world_size, path=args.config)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    values = auto_values(arguments, world_size=world_size, num_training_steps=num_training_steps,
                         hidden_size=hidden_size, zero_stage=stage if isinstance(stage, int) else 3)
    config = fill_auto(config, values, check=False)  # "auto" -> the flags' (or HF's default) values
    config = override(config, {k: v for k, v in given.items() if k != "lr_scheduler_type"}, world_size=world_size,
                      num_training_steps=num_training_steps)  # the flags given win over the file's own values
    if "optimizer" not in config:
        # As the HF Trainer does when a DeepSpeed config has no optimizer (and no scheduler): AdamW from the
        # arguments (HF's defaults for the flags not given) and the schedule of --lr-scheduler-type (HF's linear)
        built = config_from_arguments(arguments, world_size=world_size, num_training_steps=num_training_steps)
        config["optimizer"] = built["optimizer"]
        if "scheduler" not in config and "scheduler" in built:
            config["scheduler"] = built["scheduler"]
    if "lr_scheduler_type" in given and "optimizer" in config:
        block = scheduler_block(arguments, num_training_steps)
        if block is None:
            config.pop("scheduler", None)
        else:
            config["scheduler"] = block
    return _with_fp8(_with_checkpointing(config, args), args)


def schedule_values(args: argparse.Namespace, steps: int, defaults: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The schedule's step counts (`hf_arguments.STEP_KEYS`, dotted) for `steps` optimizer steps of these
    arguments: what fills a config `effective_config` built with `LATE_STEPS` once the run's steps are known."""
    from zerotrain.config.hf_arguments import schedule_values as values_for

    return values_for({**(defaults or {}), **training_arguments(args)}, steps)


def optimizer_from_flags(args: argparse.Namespace) -> bool:
    """Whether `effective_config` builds the run's AdamW from the flags (no --config, or a file without an
    `optimizer` block), as the HF Trainer builds its own optimizer when DeepSpeed's config has none."""
    if args.config is None:
        return True
    from zerotrain.config.loader import read_config_file

    return "optimizer" not in read_config_file(args.config)


_BATCH_FLAGS = ("per_device_train_batch_size", "gradient_accumulation_steps")


def check_batch_size(config: dict[str, Any], arguments: dict[str, Any], given: dict[str, Any], *, world_size: int,
                     path: str) -> None:
    """A `train_batch_size` the file fixes that the batch flags given contradict is a `ConfigError` naming both
    values and keys, as transformers' mismatch check reports it; it is never silently replaced. The calculated
    size is micro-batch x accumulation x data-parallel ranks, each from the flag given, else the file's value,
    else HF's default."""
    from zerotrain.config import ConfigError
    from zerotrain.config.base import is_auto
    from zerotrain.config.hf_arguments import ARGUMENT_DEFAULTS

    fixed = config.get("train_batch_size")
    if fixed is None or is_auto(fixed) or not any(name in given for name in _BATCH_FLAGS):
        return
    factors = {}
    for name, key in zip(_BATCH_FLAGS, ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")):
        value = config.get(key)
        factors[name] = given[name] if name in given else \
            value if isinstance(value, int) and not isinstance(value, bool) else arguments.get(name, ARGUMENT_DEFAULTS[name])
    calculated = factors["per_device_train_batch_size"] * factors["gradient_accumulation_steps"] * world_size
    if fixed != calculated:
        raise ConfigError(f"train_batch_size: the config disagrees with the flags: train_batch_size={fixed!r} ({path}) "
                          f"vs train_batch_size (calculated)={calculated} = per_device_train_batch_size="
                          f"{factors['per_device_train_batch_size']} x gradient_accumulation_steps="
                          f"{factors['gradient_accumulation_steps']} x {world_size} data-parallel ranks (set it to "
                          f"\"auto\" or drop it to take the flags')", key="train_batch_size", file=path)


def _with_checkpointing(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`--gradient-checkpointing` (TrainingArguments' gradient_checkpointing): the config's activation_checkpointing
    block (DeepSpeed's; a file's own block is kept as it is), which turns on the model's gradient checkpointing with
    `zerotrain.checkpointing.checkpoint` as the function (`zerotrain.checkpointing.enable_hf_gradient_checkpointing`)."""
    if getattr(args, "gradient_checkpointing", None):
        config.setdefault("activation_checkpointing", {})
    return config


def _with_fp8(config: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """`--fp8 [RECIPE]`: the config's fp8 block enabled with that recipe (a file's other fp8 keys are kept)."""
    recipe = getattr(args, "fp8", None)
    if recipe is not None:
        block = config.get("fp8")
        config["fp8"] = {**(block if isinstance(block, dict) else {}), "enabled": True, "recipe": recipe}
    return config


def write_effective_config(config: dict[str, Any], directory: str) -> str:
    """Write `config` as `directory/effective_config.json` (the run's record of what it trained with)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, EFFECTIVE_CONFIG)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return path
