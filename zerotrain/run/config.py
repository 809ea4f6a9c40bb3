"""The run's config, built once: file + flags + filled "auto" values as one object, parsed once, handed down.

`RunConfig.build` makes the effective config (a dict: what `effective_config.json` records and `zero.Init` reads)
with the command's own builder, parses it once (`config.load_config`) and resolves the batch triple for the
data-parallel ranks the job has (world size over the tensor-, sequence- and pipeline-parallel sizes the config
gives). The model, the data wiring and `zerotrain.initialize` all take this one object: `initialize` is handed the
parsed config itself (no second parse; its batch triple already agrees with the ranks).

With `--num-train-epochs` alone the steps (a decaying schedule's `total_num_steps`) are known once the data is read,
after the model (which the data's packing asks) is built: `schedule_over(steps)` then lays the schedule over them
in the same object (the one rebuild of that case; the dtype, stage and batch the model was built for cannot change).

`train_config` is `zerotrain train`'s builder (HF flags over the `--config` file, ZeRO-3 by default, stage 1 with a
pipeline).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable, Optional

from zerotrain.command import CLIError

if TYPE_CHECKING:
    from zerotrain.config import ZeroTrainConfig

__all__ = ["RunConfig", "train_config", "TRAIN_DEFAULTS"]

# where `zerotrain train`'s defaults differ from TrainingArguments' (HF names): a progress line every 10 steps
TRAIN_DEFAULTS = {"logging_steps": 10}


class RunConfig:
    """One run's config: `values` (the effective config dict), `parsed` (a `ZeroTrainConfig`, the batch triple
    resolved for `dp_world_size` data-parallel ranks), `steps` (the optimizer steps its schedule is laid out over)."""

    def __init__(self, make: Callable[[int], dict], *, world_size: int, steps: int) -> None:
        """Build and parse the config for `world_size` ranks with its schedule over `steps` (`make(steps)`: the
        command's builder, called here once)."""
        self._make = make
        self.world_size = world_size
        self.steps = steps
        self.values: dict = make(steps)
        self.parsed: "ZeroTrainConfig" = self._parse(self.values)

    def _parse(self, values: dict) -> "ZeroTrainConfig":
        from zerotrain.config import ConfigError, load_config

        parsed = load_config(values)
        split = (int(parsed.tensor_parallel.autotp_size) * int(parsed.sequence_parallel_size)
                 * int(parsed.pipeline_parallel_size))
        if self.world_size % split:
            raise ConfigError(f"tensor_parallel.autotp_size x sequence_parallel_size x pipeline_parallel_size = "
                              f"{split} does not divide the world size {self.world_size}", key="pipeline_parallel_size")
        self.dp_world_size = self.world_size // split  # ranks that see different samples
        try:
            return parsed.resolve_batch(self.dp_world_size)
        except ConfigError as err:  # as zerotrain.initialize says it: the world size this job has
            raise ConfigError(f"{err}; this job has world size {self.world_size}", key=err.key,
                              file=err.file) from None

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over every data-parallel rank (micro x accumulation x ranks)."""
        return int(self.parsed.train_batch_size)

    def schedule_over(self, steps: int) -> None:
        """Lay the schedule out over `steps` optimizer steps (known once the data is read); nothing when it already
        is. The batch, dtype and stage cannot change with the steps: the model built before stays right."""
        if steps == self.steps:
            return
        values = self._make(steps)
        parsed = self._parse(values)
        self.values, self.parsed, self.steps = values, parsed, steps


def train_config(args: argparse.Namespace, *, world_size: int, hidden_size: Optional[int] = None,
                 steps: Optional[int] = None) -> dict:
    """`zerotrain train`'s effective config (a dict): the --config file with the HF flags over it and its "auto"
    values filled, or the flags alone (ZeRO-3); `zerotrain.train.flags.effective_config` for `steps` optimizer steps
    (default --max-steps). With --num-train-epochs alone the steps are known only once the data is read; before that
    a schedule that decays over the run is laid out over `steps` (the check before launching, the model's build), or
    refused when it is None too (`--print-config`: one clear error)."""
    from zerotrain.config import ConfigError
    from zerotrain.train.flags import effective_config

    if hidden_size is None and args.config is not None:  # the model's hidden size fills "auto" bucket sizes
        from zerotrain.models.hf import ModelError, resolve_model
        try:
            hidden = getattr(resolve_model(args.model, args.model_config, args.tokenizer).config, "hidden_size", None)
        except ModelError as exc:
            raise CLIError(str(exc)) from None
        hidden_size = hidden if isinstance(hidden, int) else None
    pipeline = getattr(args, "pipeline_parallel_size", None) or 1
    try:
        config = effective_config(args, world_size=world_size // pipeline,
                                  num_training_steps=args.steps if steps is None else steps,
                                  hidden_size=hidden_size, defaults=TRAIN_DEFAULTS)
        if pipeline > 1:  # the stages split the world; ZeRO-2/3 are refused with a pipeline: stage 1 by default
            config["pipeline_parallel_size"] = pipeline
            if args.config is None and args.zero_stage is None:
                config["zero_optimization"]["stage"] = 1
        return config
    except ConfigError as exc:
        if args.steps is None and steps is None and "needs its number of steps" in str(exc):
            raise CLIError("--print-config with --num-train-epochs and no --max-steps: the run's steps (and the "
                           "learning-rate decay's total_num_steps) are known only once the data is read; give "
                           "--max-steps to see them") from None
        raise
