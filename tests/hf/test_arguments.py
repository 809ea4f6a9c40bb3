"""`zerotrain.hf.TrainingArguments` and the Trainer's refusals, in one process (no ranks needed).

The config never reaches transformers' DeepSpeed path (no HfTrainerDeepSpeedConfig, no DeepSpeed plugin,
even with ACCELERATE_USE_DEEPSPEED set), its "auto" values are filled from the arguments, a fixed value
that disagrees with an argument is refused naming both, and unsupported Trainer features are refused by name.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from zerotrain.config import ConfigError  # noqa: E402


@pytest.fixture
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, intermediate_size=32))


def _args(tmp_path, **kw):
    from zerotrain.hf import TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


def test_config_is_zerotrains_and_auto_is_filled(tmp_path, monkeypatch):
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # e.g. left by `accelerate launch --use_deepspeed`
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    args = _args(tmp_path, deepspeed=config, per_device_train_batch_size=3, max_grad_norm=0.25, learning_rate=2e-4)
    assert args.deepspeed is config  # kept as given
    assert args.deepspeed_plugin is None and not is_deepspeed_zero3_enabled()
    assert getattr(args, "hf_deepspeed_config", None) is None
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "true"  # restored
    filled = args.zerotrain_config
    assert filled["train_micro_batch_size_per_gpu"] == 3 and filled["gradient_clipping"] == 0.25
    assert filled["optimizer"]["params"]["lr"] == 2e-4
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=4 vs per_device_train_batch_size=3"):
        _args(tmp_path, deepspeed={"train_micro_batch_size_per_gpu": 4}, per_device_train_batch_size=3)


def test_mixed_precision_is_put_into_the_config_as_accelerate_does(tmp_path):
    # accelerate enables a DeepSpeed config's missing bf16/fp16 block from the Trainer's precision (TRL's SFTConfig
    # defaults to bf16=True), disables the other one, and refuses the opposite precision
    stage2 = {"zero_optimization": {"stage": 2}}
    assert _args(tmp_path, deepspeed=stage2, bf16=True).zerotrain_config["bf16"] == {"enabled": True}
    fp16 = _args(tmp_path, deepspeed=stage2, fp16=True).zerotrain_config
    assert fp16["fp16"] == {"enabled": True} and fp16["bf16"] == {"enabled": False}
    kept = {**stage2, "bf16": {"enabled": "auto"}}
    assert _args(tmp_path, deepspeed=kept).zerotrain_config["bf16"] == {"enabled": False}
    with pytest.raises(ConfigError, match="^fp16.enabled: the config disagrees with the training arguments"):
        _args(tmp_path, deepspeed={**stage2, "fp16": {"enabled": True}}, bf16=True)


@pytest.mark.parametrize("name, value", [("torch_compile", True), ("auto_find_batch_size", True)])
def test_unsupported_features_are_refused_by_name(tmp_path, tiny_model, name, value):
    from zerotrain.hf import Trainer

    with pytest.raises(ValueError, match=f"^{name}: not supported by zerotrain.hf.Trainer"):
        Trainer(model=tiny_model, args=_args(tmp_path, **{name: value}))


def test_transformers_deepspeed_arguments_are_refused(tmp_path, tiny_model):
    pytest.importorskip("deepspeed")
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from zerotrain.hf import Trainer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                     deepspeed={"zero_optimization": {"stage": 2}})
        with pytest.raises(ValueError, match="use zerotrain.hf.TrainingArguments"):
            Trainer(model=tiny_model, args=args)
    finally:
        unset_hf_deepspeed_config()


def test_trainer_clips_at_max_grad_norm_where_the_config_leaves_it_out(tmp_path, tiny_model):
    """zerotrain.hf.Trainer keeps HF's clipping: `max_grad_norm` (1.0 by default) where its config has no
    gradient_clipping, or without a config."""
    import types

    from zerotrain.hf import ZeroTrainMixin

    stage2 = {"zero_optimization": {"stage": 2}}
    for deepspeed, given, clip in ((stage2, {}, 1.0), (None, {}, 1.0), (stage2, {"max_grad_norm": 0.3}, 0.3)):
        trainer = types.SimpleNamespace(args=_args(tmp_path, deepspeed=deepspeed, **given))
        assert ZeroTrainMixin.zerotrain_config(trainer, tiny_model, 10)["gradient_clipping"] == clip, (deepspeed, given)


def test_deepspeed_goes_through_the_upstream_argument_parsers(tmp_path):
    """The upstream scripts parse `--deepspeed ds.json` with HfArgumentParser (transformers' examples) or TRL's
    TrlParser (command line or a YAML `--config`): the field keeps transformers' type `dict | str | None` (a path,
    a JSON object on the command line, a mapping in the YAML), and the config becomes zerotrain's."""
    import dataclasses
    import json

    from transformers import HfArgumentParser

    from zerotrain.hf import TrainingArguments

    @dataclasses.dataclass
    class ModelArguments:  # as run_clm.py's first dataclass
        model_name_or_path: str = dataclasses.field(default="tiny")

    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    path = tmp_path / "ds_z2.json"
    path.write_text(json.dumps(config))
    common = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none", "--per_device_train_batch_size",
              "3", "--learning_rate", "2e-4"]

    def check(args, given):
        assert args.deepspeed == given and args.deepspeed_plugin is None
        filled = args.zerotrain_config
        assert filled["zero_optimization"] == {"stage": 2} and filled["train_micro_batch_size_per_gpu"] == 3
        assert filled["optimizer"]["params"]["lr"] == 2e-4

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parser = HfArgumentParser((ModelArguments, TrainingArguments))
        model_args, args = parser.parse_args_into_dataclasses([*common, "--deepspeed", str(path)])
        assert isinstance(args, TrainingArguments) and model_args.model_name_or_path == "tiny"
        check(args, str(path))
        _, args = parser.parse_args_into_dataclasses([*common, "--deepspeed", json.dumps(config)])
        check(args, config)  # a JSON object: a dict, as transformers makes it

    trl = pytest.importorskip("trl")
    yaml = pytest.importorskip("yaml")
    from zerotrain.hf import SFTConfig

    parser = trl.TrlParser((trl.ScriptArguments, SFTConfig, trl.ModelConfig))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, args, _ = parser.parse_args_and_config(["--dataset_name", "d", *common, "--deepspeed", str(path)])
        assert isinstance(args, SFTConfig)
        check(args, str(path))
        for value in (str(path), config):  # the YAML's `deepspeed: path` and `deepspeed: {mapping}`
            recipe = tmp_path / "sft.yaml"
            recipe.write_text(yaml.safe_dump({"dataset_name": "d", "output_dir": str(tmp_path), "use_cpu": True,
                                              "report_to": "none", "per_device_train_batch_size": 3,
                                              "learning_rate": 2e-4, "deepspeed": value}))
            _, args, _ = parser.parse_args_and_config(["--config", str(recipe)])
            check(args, value)


def test_trls_trainers_come_from_zerotrain_hf_on_first_use_and_an_unknown_name_is_refused():
    """`from zerotrain.hf import SFTTrainer` (any of TRL's eight names) gives zerotrain.hf.trl's class, imported
    only then (TRL is optional); another name is an AttributeError naming it."""
    pytest.importorskip("trl")
    import zerotrain.hf as hf
    from zerotrain.hf import trl as ours

    for name in ("SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "RewardTrainer", "RewardConfig", "GRPOTrainer",
                 "GRPOConfig"):
        assert getattr(hf, name) is getattr(ours, name), name
    with pytest.raises(AttributeError, match="^module 'zerotrain.hf' has no attribute 'PPOTrainer'$"):
        hf.PPOTrainer  # noqa: B018


@pytest.mark.parametrize("trainer, name", [("GRPO", "use_vllm"), ("GRPO", "use_transformers_continuous_batching"),
                                           ("GRPO", "sync_ref_model")])
def test_trl_features_not_built_are_refused_by_name(tmp_path, tiny_llama_dir, trainer, name):
    """Each refused TRL option is one ValueError naming it, before any engine is built (the same trainers without
    it train in test_grpo.py; DPO's sync_ref_model and precompute_ref_log_probs train in test_dpo.py)."""
    pytest.importorskip("trl")
    import zerotrain.hf as hf
    from datasets import Dataset

    config_class, trainer_class = getattr(hf, f"{trainer}Config"), getattr(hf, f"{trainer}Trainer")
    data = Dataset.from_list([{"prompt": "alpha beta ->", "chosen": " gamma", "rejected": " delta"}] * 4)
    extra = {"reward_funcs": lambda completions, **kw: [0.0] * len(completions)} if trainer == "GRPO" else {}
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, max_steps=1,
                  per_device_train_batch_size=2, **({"num_generations": 2} if trainer == "GRPO" else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = config_class(**common)
        setattr(args, name, True)  # set after __post_init__, which would need vLLM / a sync interval first
        with pytest.raises(ValueError, match=f"^{name}: "):
            trainer_class(model=str(tiny_llama_dir), args=args, train_dataset=data, **extra)


def test_the_reference_models_engine_config_is_forward_only_zero3():
    """DPO's and GRPO's reference engine: the training config without optimizer, scheduler or optimizer offload, at
    ZeRO-3 whatever the training stage (as TRL's prepare_deepspeed holds a ZeRO-3 reference); the rest kept, and
    the training config itself untouched."""
    pytest.importorskip("trl")
    from zerotrain.hf.trl import reference_config

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR"},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 7}}
    before = json.dumps(config, sort_keys=True)
    assert reference_config(config) == {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                                        "zero_optimization": {"stage": 3, "reduce_bucket_size": 7}}
    assert json.dumps(config, sort_keys=True) == before
    assert reference_config({"train_micro_batch_size_per_gpu": 1}) == {"train_micro_batch_size_per_gpu": 1,
                                                                      "zero_optimization": {"stage": 3}}
