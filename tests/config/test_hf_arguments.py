"""`zerotrain.config.hf_arguments`: "auto" filled exactly as transformers fills it, and configs from arguments alone.

The reference is transformers' own `HfTrainerDeepSpeedConfig` (trainer_config_process at
TrainingArguments time, trainer_config_finalize with the model and the step count), run on every
stored real-world config that holds "auto" values, with arguments that differ from every default.
"""
from __future__ import annotations

import copy
import pathlib
import types
import warnings

import pytest

from zerotrain.config import ConfigError, load_config, read_config_file
from zerotrain.config.hf_arguments import (ARGUMENT_DEFAULTS, FILL_ONLY_KEYS, arguments_of, auto_values,
                                          config_from_arguments, fill_auto, hf_auto_values, override)

REAL = pathlib.Path(__file__).parent / "real_world"
WORLD = 2
ARGS = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, learning_rate=3e-4, adam_beta1=0.8,
            adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05, max_grad_norm=0.5, warmup_steps=0.1)
STEPS, HIDDEN = 37, 48


def _transformers_filled(config: dict, args) -> dict:
    """What transformers 5.x makes of `config` with these TrainingArguments (its own code)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    try:
        hf.trainer_config_process(args)
        model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=HIDDEN))
        hf.trainer_config_finalize(args, model, STEPS)
        return hf.config
    finally:
        unset_hf_deepspeed_config()


def _training_arguments(tmp_path, **changes):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                              **dict(ARGS, **changes))
    return args


@pytest.mark.parametrize("name", sorted(p.name for p in REAL.glob("*.json") if '"auto"' in p.read_text()))
def test_fill_auto_is_what_transformers_fills(name, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = _training_arguments(tmp_path)
    config = read_config_file(REAL / name)
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"):
        if isinstance(config.get(key), int):  # a fixed value is a mismatch by design; the next test checks that
            config[key] = "auto"
    stage = config.get("zero_optimization", {}).get("stage", 0)
    values = auto_values(arguments_of(args), world_size=args.world_size, num_training_steps=STEPS,
                         hidden_size=HIDDEN, zero_stage=stage)
    try:
        expected = _transformers_filled(config, args)
    except ValueError as refused:  # a fixed value that disagrees with the arguments: refused by both, same keys
        with pytest.raises(ConfigError) as err:
            fill_auto(config, values)
        for line in str(refused).splitlines():
            if line.startswith("- ds "):
                assert line[5:].split("=")[0] + "=" in str(err.value)
        return
    assert fill_auto(config, values) == expected


def test_mismatches_are_refused_together_like_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = _training_arguments(tmp_path)
    config = read_config_file(REAL / "hf_transformers_zero2.json")
    config["gradient_clipping"] = 2.0
    config["optimizer"]["params"]["lr"] = 1.0
    config["scheduler"]["params"]["warmup_min_lr"] = 7  # fill-only in transformers: never a mismatch
    with pytest.raises(ValueError, match="gradient_clipping=2.0 vs hf max_grad_norm"):
        _transformers_filled(config, args)
    values = auto_values(arguments_of(args), world_size=1, num_training_steps=STEPS, hidden_size=HIDDEN)
    with pytest.raises(ConfigError) as err:
        fill_auto(config, values)
    assert "gradient_clipping=2.0 vs max_grad_norm=0.5" in str(err.value)
    assert "optimizer.params.lr=1.0 vs learning_rate=0.0003" in str(err.value)
    assert "warmup_min_lr" not in str(err.value)
    assert fill_auto(config, values, check=False)["gradient_clipping"] == 2.0


def test_arguments_alone_give_a_complete_zero3_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing in it is without effect
        cfg = load_config(config_from_arguments(ARGS, world_size=WORLD, num_training_steps=STEPS),
                          dp_world_size=WORLD)
    assert cfg.zero_optimization.stage == 3
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (12, 3, 2)
    assert cfg.gradient_clipping == 0.5
    assert cfg.optimizer.type.lower() == "adamw"
    assert cfg.optimizer.params["lr"] == 3e-4 and tuple(cfg.optimizer.params["betas"]) == (0.8, 0.95)
    assert cfg.scheduler.type == "HFSchedule"  # transformers' own curve, not DeepSpeed's WarmupDecayLR
    assert cfg.scheduler.params == {"name": "linear", "num_warmup_steps": 4, "num_training_steps": STEPS}
    # the HF Trainer subclass builds its own optimizer and scheduler (as under DeepSpeed without those blocks)
    bare = config_from_arguments({"bf16": True}, world_size=WORLD, optimizer_and_scheduler=False)
    assert "optimizer" not in bare and "scheduler" not in bare and bare["bf16"] == {"enabled": True}
    assert bare["train_micro_batch_size_per_gpu"] == 8  # TrainingArguments' default
    with pytest.raises(ConfigError, match="lr_scheduler_type: 'polynomial'"):
        config_from_arguments({"lr_scheduler_type": "polynomial"}, world_size=1, num_training_steps=STEPS)
    with pytest.raises(ConfigError, match="learning_rte: not a training argument"):
        config_from_arguments({"learning_rte": 1.0}, world_size=1)


def test_override_sets_only_the_given_arguments():
    config = read_config_file(REAL / "written_warmupdecaylr_zero2.json")
    out = override(config, {"learning_rate": 1e-3, "per_device_train_batch_size": 4, "save_total_limit": 2},
                   world_size=WORLD)
    assert out["optimizer"]["params"]["lr"] == 1e-3
    assert out["scheduler"]["params"]["warmup_max_lr"] == 1e-3
    assert out["train_micro_batch_size_per_gpu"] == 4
    assert out["checkpoint"]["keep_last"] == 2
    assert out["gradient_clipping"] == config["gradient_clipping"]  # not given: the file's value
    assert out["zero_optimization"] == config["zero_optimization"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the file's allgather_bucket_size: a DeepSpeed key without effect here
        load_config(out, dp_world_size=WORLD)


def test_hf_schedule_auto_is_filled_from_the_arguments_or_refused_by_key():
    """An HFSchedule block (zerotrain's: transformers' schedule) with "auto" takes lr_scheduler_type, the Trainer's
    warmup steps and the run's steps; read without arguments to fill it, each "auto" is refused naming its key."""
    block = {"type": "HFSchedule", "params": {"name": "auto", "num_warmup_steps": "auto", "num_training_steps": "auto"}}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "scheduler": block}
    arguments = {"lr_scheduler_type": "cosine", "warmup_steps": 0.1, "per_device_train_batch_size": 2, "learning_rate": 1e-3}
    filled = fill_auto(config, auto_values(arguments, world_size=WORLD, num_training_steps=STEPS))
    assert filled["scheduler"]["params"] == {"name": "cosine", "num_warmup_steps": 4, "num_training_steps": STEPS}
    assert load_config(filled, dp_world_size=WORLD).scheduler.params == filled["scheduler"]["params"]
    # fill-only: a file's own schedule is kept, not a mismatch with the arguments
    fixed = dict(config, scheduler={"type": "HFSchedule", "params": {"name": "linear", "num_warmup_steps": 9,
                                                                      "num_training_steps": 99}})
    assert fill_auto(fixed, auto_values(arguments, world_size=WORLD, num_training_steps=STEPS)) == fixed
    # the steps unknown (e.g. epochs before the data is read): the name and a whole warmup are filled, the rest stays
    early = fill_auto(config, auto_values(dict(arguments, lr_scheduler_type="linear", warmup_steps=3), world_size=WORLD))
    assert early["scheduler"]["params"] == {"name": "linear", "num_warmup_steps": 3, "num_training_steps": "auto"}
    for key in ("name", "num_warmup_steps", "num_training_steps"):
        one = copy.deepcopy(filled)
        one["scheduler"]["params"][key] = "auto"
        with pytest.raises(ConfigError, match=f"^scheduler.params.{key} is 'auto', which only the Hugging Face "):
            load_config(one)


def test_the_defaults_are_training_arguments_own(tmp_path):
    """Every argument this module reads defaults to TrainingArguments' own default (transformers' dataclass)."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert arguments_of(args) == ARGUMENT_DEFAULTS
    assert arguments_of(types.SimpleNamespace()) == ARGUMENT_DEFAULTS  # an object without the fields: the defaults


# transformers' names for the argument behind each checked key (`trainer_config_process`'s fill_match)
REPORTED = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
            "gradient_accumulation_steps": "gradient_accumulation_steps",
            "train_batch_size": "train_batch_size (calculated)", "gradient_clipping": "max_grad_norm",
            "optimizer.params.lr": "learning_rate", "optimizer.params.betas": "adam_beta1+adam_beta2",
            "optimizer.params.eps": "adam_epsilon", "optimizer.params.weight_decay": "weight_decay",
            "scheduler.params.warmup_max_lr": "learning_rate", "fp16.enabled": "fp16|fp16_full_eval",
            "bf16.enabled": "bf16|bf16_full_eval", "scheduler.params.total_num_steps": "num_training_steps (calculated)",
            "scheduler.params.warmup_num_steps": "warmup_steps"}


def test_each_mismatch_names_its_key_and_the_argument_behind_it():
    values = auto_values(dict(ARGS, fp16=True), world_size=WORLD, num_training_steps=STEPS, hidden_size=HIDDEN)
    assert sorted(k for k in values if k not in FILL_ONLY_KEYS) == sorted(REPORTED)
    for key, name in REPORTED.items():
        hf_value = values[key]
        wrong = (not hf_value if isinstance(hf_value, bool) else [b / 2 for b in hf_value]
                 if isinstance(hf_value, list) else hf_value * 2 + 1)
        config = {}
        node = config
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = wrong
        with pytest.raises(ConfigError) as err:
            fill_auto(config, values)
        assert f"{key}={wrong!r} vs {name}={hf_value!r}" in str(err.value), (key, str(err.value))
        assert str(err.value).startswith(f"{key}: ")


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup", "constant"])
def test_each_scheduler_type_gets_transformers_curve_or_none(kind):
    config = config_from_arguments({"lr_scheduler_type": kind, "warmup_steps": 3}, world_size=1,
                                   num_training_steps=STEPS)
    if kind == "constant":  # a constant lr: no scheduler block (the optimizer's lr throughout)
        assert "scheduler" not in config
        return
    decays = kind != "constant_with_warmup"
    assert config["scheduler"] == {"type": "HFSchedule", "params": {
        "name": kind, "num_warmup_steps": 3, **({"num_training_steps": STEPS} if decays else {})}}
    assert load_config(config, dp_world_size=1).scheduler.params["name"] == kind


def test_hf_auto_values_puts_each_of_its_own_names_in_its_key():
    values = hf_auto_values(micro_batch_per_gpu=3, gradient_accumulation_steps=2, dp_world_size=2, learning_rate=3e-4,
                            betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, max_grad_norm=0.5, warmup_steps=0,
                            total_steps=STEPS, hidden_size=HIDDEN, bf16=True, save_16bit_model=True)
    assert (values["train_micro_batch_size_per_gpu"], values["gradient_accumulation_steps"],
            values["train_batch_size"]) == (3, 2, 12)
    assert values["optimizer.params.lr"] == values["scheduler.params.warmup_max_lr"] == 3e-4
    assert values["optimizer.params.betas"] == [0.8, 0.95] and values["optimizer.params.eps"] == 1e-6
    assert values["optimizer.params.weight_decay"] == 0.05 and values["gradient_clipping"] == 0.5
    assert values["bf16.enabled"] is True and values["fp16.enabled"] is False
    assert values["scheduler.params.warmup_num_steps"] == 1  # max(1, 0): DeepSpeed 0.19.6+ refuses 0
    assert values["scheduler.params.total_num_steps"] == STEPS
    assert values["zero_optimization.reduce_bucket_size"] == HIDDEN * HIDDEN
    assert values["zero_optimization.stage3_gather_16bit_weights_on_model_save"] is True


def test_fill_auto_fills_a_legacy_spelling_of_its_key_only():
    """A value keyed by the current name fills the file's legacy spelling of that key (`prefetch_bucket_size`) and
    no other key's legacy spelling, nor a key the file set (issue #48: `new == name` -> `!=` survived)."""
    from zerotrain.config.auto import fill_auto as plain_fill

    config = {"zero_optimization": {"prefetch_bucket_size": "auto", "max_live_parameters": "auto",
                                    "stage3_param_persistence_threshold": 10}, "bfloat16": {"enabled": "auto"}}
    filled = plain_fill(config, {"zero_optimization.stage3_prefetch_bucket_size": 123,
                                 "zero_optimization.stage3_param_persistence_threshold": 5, "bf16.enabled": True})
    assert filled == {"zero_optimization": {"prefetch_bucket_size": 123, "max_live_parameters": "auto",
                                            "stage3_param_persistence_threshold": 10}, "bfloat16": {"enabled": True}}
    assert config["zero_optimization"]["prefetch_bucket_size"] == "auto"  # a copy: the given config unchanged
