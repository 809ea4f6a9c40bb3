"""The run's config, built once: file + flags + filled "auto" values as one object, parsed once, handed down.

`RunConfig.build` makes the effective config (a dict: what `effective_config.json` records and `zero.Init` reads)
with the command's own builder, parses it once (`config.load_config`) and resolves the batch triple for the
data-parallel ranks the job has (world size over the tensor-, sequence- and pipeline-parallel sizes the config
gives). The model, the data wiring and `zerotrain.initialize` all take this one object: `initialize` is handed the
parsed config itself (no second parse; its batch triple already agrees with the ranks).

With `--num-train-epochs` alone the steps (a decaying schedule's `total_num_steps`) are known once the data is read,
after the model (which the data's packing asks) is built. The schedule is late-bound, as transformers'
`trainer_config_finalize` binds it: the builder leaves the keys counted in the run's steps "auto"
(`config.hf_arguments.LATE_STEPS`), and `schedule_over(steps)` fills them in the same dict and the same parsed object
(`ZeroTrainConfig.fill_schedule`) once the data is read: no second build, no second parse; nothing else (dtype,
stage, batch) depends on the steps.

`train_config` is `zerotrain train`'s builder (HF flags over the `--config` file, ZeRO-3 by default, stage 1 with a
pipeline).
"""
from __future__ import annotations

import argparse
import copy
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

from zerotrain.command import CLIError

if TYPE_CHECKING:
    from zerotrain.config import ZeroTrainConfig

__all__ = ["RunConfig", "train_run_config", "train_config", "TRAIN_DEFAULTS"]

# where `zerotrain train`'s defaults differ from TrainingArguments' (HF names): a progress line every 10 steps
TRAIN_DEFAULTS = {"logging_steps": 10}


class RunConfig:
    """One run's config: `values` (the effective config dict), `parsed` (a `ZeroTrainConfig`, the batch triple
    resolved for `dp_world_size` data-parallel ranks), `steps` (the optimizer steps its schedule is laid out over;
    None until `schedule_over` when the builder left them open)."""

    def __init__(self, values: dict, *, world_size: int, steps: Optional[int],
                 fill: Optional[Callable[[int], Mapping[str, Any]]] = None) -> None:
        """Parse the built config `values` for `world_size` ranks, once. `steps` None: `values` was built with
        `LATE_STEPS`, its schedule's step counts "auto" until `schedule_over` fills them with `fill(steps)` (the
        dotted `STEP_KEYS` values, `config.hf_arguments.schedule_values` of the run's arguments)."""
        from zerotrain.config.base import is_auto
        from zerotrain.config.hf_arguments import STEP_KEYS

        self.world_size = world_size
        self.steps = steps
        self.values: dict = values
        params = (values.get("scheduler") or {}).get("params") or {}
        # the keys counted in the run's steps, still open: "auto" until the data is read
        self._late = [key.rsplit(".", 1)[1] for key in STEP_KEYS
                      if steps is None and is_auto(params.get(key.rsplit(".", 1)[1]))]
        if self._late and fill is None:
            raise ValueError("RunConfig: the schedule's steps are open ('auto') and nothing is given to fill them")
        self._fill = fill
        # parsed with a stand-in where the steps are open (the parse wants a positive count there): schedule_over
        # sets the real ones in this same object
        stand_in = copy.deepcopy(values)
        for key in self._late:
            stand_in["scheduler"]["params"][key] = 1
        self.parsed: "ZeroTrainConfig" = self._parse(stand_in)

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

    @property
    def scheduled(self) -> bool:
        """Whether the schedule's step counts are set (what an engine needs of its config)."""
        return not self._late

    def schedule_over(self, steps: int) -> None:
        """Lay the schedule out over `steps` optimizer steps (known once the data is read): the open step counts
        filled in `values` and `parsed` alike, no rebuild, no parse. Steps the config was built for already: nothing
        to do (others are a ValueError: the config was built for those)."""
        from zerotrain.config import ConfigError

        if self.steps is not None:
            if steps != self.steps:
                raise ValueError(f"RunConfig: built for {self.steps} steps, asked to lay them over {steps}")
            return
        self.steps = steps
        if not self._late:
            return  # nothing in the config counts the steps (a constant schedule, or the file's own numbers)
        if steps < 1:
            key = f"scheduler.params.{self._late[0]}"
            raise ConfigError(f"{key}: the run makes {steps} optimizer steps; its schedule decays over at least 1",
                              key=key)
        filled = self._fill(steps)
        params = {key: filled[f"scheduler.params.{key}"] for key in self._late}
        self.values["scheduler"]["params"].update(params)
        self.parsed.fill_schedule(params)
        self._late = []


def train_run_config(args: argparse.Namespace, *, world_size: int, hidden_size: Optional[int] = None) -> RunConfig:
    """`zerotrain train`'s `RunConfig`, built and parsed once: over --max-steps, or (--num-train-epochs alone) with
    the schedule's step counts open until the data is read (`RunConfig.schedule_over`)."""
    from zerotrain.config.hf_arguments import LATE_STEPS
    from zerotrain.train.flags import schedule_values

    values = train_config(args, world_size=world_size, hidden_size=hidden_size,
                          steps=LATE_STEPS if args.steps is None else None)
    return RunConfig(values, world_size=world_size, steps=args.steps,
                     fill=lambda steps: schedule_values(args, steps, defaults=TRAIN_DEFAULTS))


def train_config(args: argparse.Namespace, *, world_size: int, hidden_size: Optional[int] = None,
                 steps: Union[int, str, None] = None) -> dict:
    """`zerotrain train`'s effective config (a dict): the --config file with the HF flags over it and its "auto"
    values filled, or the flags alone (ZeRO-3); `zerotrain.train.flags.effective_config` for `steps` optimizer steps
    (default --max-steps). With --num-train-epochs alone the steps are known only once the data is read: `steps`
    `LATE_STEPS` leaves the schedule's step counts "auto" until then (`train_run_config`); None with no --max-steps
    is refused for a schedule that decays over the run (`--print-config`: one clear error)."""
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
