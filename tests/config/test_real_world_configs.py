"""Real DeepSpeed configs from public repositories (tests/config/real_world/, see its README) keep working.

Every stored file either loads, with every value it sets read back unchanged, or is refused with a
message naming the offending key. "auto" is filled as HF's Trainer does (`fill_auto` with
`hf_auto_values`); the files themselves are never edited. Two of them train at world 2.
"""
from __future__ import annotations

import copy
import pathlib
import warnings

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training, train_global_step
from zerotrain.config import (ConfigError, ConfigWarning, fill_auto, hf_auto_values, load_config,
                              read_config_file)
from zerotrain.config.base import Block, is_auto
from zerotrain.optim import build_optimizer
from zerotrain.schedules import build_scheduler

REAL = pathlib.Path(__file__).parent / "real_world"
DP = 2
HF_ARGS = dict(micro_batch_per_gpu=2, gradient_accumulation_steps=2, dp_world_size=DP, learning_rate=3e-4,
               betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05, max_grad_norm=0.5, warmup_steps=10,
               total_steps=100, hidden_size=64)
HIDDEN_SQ = 64 * 64

# file -> (stage, offload_optimizer device, offload_param device, precision, gradient_clipping,
#          reduce_bucket_size, optimizer type as built, scheduler type, (tbs, micro, gas) at DP ranks)
LOADS = {
    "hf_transformers_zero2.json": (2, "cpu", None, "fp32", 0.5, 200_000_000, "adamw", "WarmupLR", (8, 2, 2)),
    "hf_accelerate_zero3.json": (3, "cpu", "cpu", "fp32", 0.5, HIDDEN_SQ, "adamw", "WarmupLR", (4, 2, 1)),
    "llamafactory_z0.json": (0, None, None, "fp32", 0.5, 500_000_000, None, None, (8, 2, 2)),
    "llamafactory_z2.json": (2, None, None, "fp32", 0.5, 500_000_000, None, None, (8, 2, 2)),
    "llamafactory_z2_offload.json": (2, "cpu", None, "fp32", 0.5, 500_000_000, None, None, (8, 2, 2)),
    "llamafactory_z3.json": (3, None, None, "fp32", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "llamafactory_z3_offload.json": (3, "cpu", "cpu", "fp32", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "axolotl_zero1.json": (1, None, None, "fp32", 1.0, 500_000_000, "adamw", None, (8, 2, 2)),
    "axolotl_zero2.json": (2, "cpu", None, "fp32", 0.5, 500_000_000, None, None, (8, 2, 2)),
    "axolotl_zero3.json": (3, None, None, "fp32", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "axolotl_zero3_bf16.json": (3, None, None, "bf16", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "axolotl_zero3_bf16_cpuoffload_all.json": (3, "cpu", "cpu", "bf16", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "axolotl_zero3_bf16_cpuoffload_params.json": (3, None, "cpu", "bf16", 0.5, HIDDEN_SQ, None, None, (8, 2, 2)),
    "dsexamples_cifar.json": (2, "cpu", None, "fp16", 1.0, 50_000_000, "adamw", "WarmupLR", (4, 2, 1)),
    "dsexamples_megatron_zero2.json": (2, None, None, "fp16", 1.0, 500_000_000, "adamw", None, (16, 8, 1)),
    "dsexamples_qanet_onecycle.json": (0, None, None, "fp32", 1.0, 500_000_000, "adamw", "OneCycle", (512, 32, 8)),
    # written for test_deepspeed_parity.py, one per scheduler type (README)
    "written_warmuplr_zero1.json": (1, None, None, "fp32", 0.5, 500_000_000, "adamw", "WarmupLR", (8, 2, 2)),
    "written_warmupdecaylr_zero2.json": (2, None, None, "fp32", 1.0, 200_000_000, "adamw", "WarmupDecayLR",
                                         (8, 2, 2)),
    "written_warmupcosinelr_zero3.json": (3, None, None, "fp32", 0.5, HIDDEN_SQ, "adamw", "WarmupCosineLR", (8, 2, 2)),
    "written_onecycle_zero0.json": (0, None, None, "fp32", 1.0, 500_000_000, "adamw", "OneCycle", (8, 2, 2)),
}

# file -> (the key the error names, text the message must hold, dotted keys whose removal makes it load)
REFUSED = {
    "hf_transformers_zero3_2021.json": ("zero_optimization.reduce_bucket_size", "greater than or equal to 1",
                                        ["zero_optimization.reduce_bucket_size"]),
    "dsexamples_bert_lamb_64k.json": ("optimizer.type", "'Lamb' is a DeepSpeed type that zerotrain does not "
                                      "implement", ["optimizer"]),
    "dsexamples_bing_bert_squad.json": ("optimizer.params.max_grad_norm", "gradient_clipping",
                                        ["optimizer.params.max_grad_norm", "optimizer.params.bias_correction"]),
    "dsexamples_megatron_zero_infinity.json": ("zero_optimization.stage3_param_persitance_threshold",
                                               "did you mean 'stage3_param_persistence_threshold'",
                                               ["zero_optimization.stage3_param_persitance_threshold"]),
}


def hf_filled(name: str, **changes) -> dict:
    """The file's dict with "auto" filled from HF_ARGS (gradient_accumulation_steps follows a fixed one)."""
    data = read_config_file(REAL / name)
    args = dict(HF_ARGS, **changes)
    if isinstance(data.get("gradient_accumulation_steps"), int):
        args["gradient_accumulation_steps"] = data["gradient_accumulation_steps"]
    return fill_auto(data, hf_auto_values(**args))


def load_quietly(source, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(source, **kwargs)
    return cfg, [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]


def drop(data: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        data = data[part]
    del data[leaf]


def assert_as_written(block: Block, written: dict, unimplemented: dict) -> None:
    """Every value the file sets (not "auto") reads back unchanged from `block`; DeepSpeed-only keys are
    listed in `unimplemented` with their value."""
    cls = type(block)
    for key, value in written.items():
        path = cls.key_path(key)
        if key.startswith("_") or is_auto(value):
            continue
        if key in cls.DEEPSPEED_ONLY:  # accepted, recorded, and ignored
            assert unimplemented[path] == value, path
            continue
        if key == "cpu_offload":  # DeepSpeed's legacy switch
            assert block.offload_optimizer.device == ("cpu" if value else "none"), path
            continue
        if not cls.PATH and key not in cls.model_fields and key not in cls.LEGACY:  # ignored, as DeepSpeed does
            assert key == "cuda_visible_devices", path  # the only one the stored files have
            continue
        got = getattr(block, cls.LEGACY.get(key, key))
        if key in ("optimizer", "scheduler"):
            assert got.type.lower() == value["type"].lower(), path
            given = {k: v for k, v in value.get("params", {}).items() if not is_auto(v)}
            assert got.params == {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}, path
        elif isinstance(got, Block):
            assert_as_written(got, value, unimplemented)
        elif isinstance(value, str):
            assert got.lower() == value.lower(), path
        else:
            assert got == value and isinstance(got, bool) == isinstance(value, bool), (path, got, value)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_real_config_loads_as_written(name):
    stage, opt_dev, param_dev, precision, clip, bucket, opt_type, sched_type, batch = LOADS[name]
    data = hf_filled(name, bf16=LOADS[name][3] == "bf16")
    cfg, messages = load_quietly(data, dp_world_size=DP)
    zero = cfg.zero_optimization
    assert zero.stage == stage
    assert (zero.offload_optimizer.device if zero.offload_optimizer else None) == opt_dev
    assert (zero.offload_param.device if zero.offload_param else None) == param_dev
    assert (cfg.precision, cfg.gradient_clipping, zero.reduce_bucket_size) == (precision, clip, bucket)
    assert (cfg.optimizer.resolved_type if cfg.optimizer else None) == opt_type
    assert (cfg.scheduler.type if cfg.scheduler else None) == sched_type
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == batch
    assert_as_written(cfg, data, cfg.unimplemented)
    assert not any("'auto'" in m for m in messages), messages  # HF's values filled every "auto"
    assert len(messages) == len(set(messages)), messages  # one warning per key


def test_every_stored_file_is_checked():
    assert sorted(p.name for p in REAL.glob("*.json")) == sorted(set(LOADS) | set(REFUSED))
    assert len(LOADS) + len(REFUSED) >= 12


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_real_config_names_the_key(name):
    key, text, culprits = REFUSED[name]
    with pytest.raises(ConfigError) as info:
        load_quietly(REAL / name)
    assert info.value.key == key and key in str(info.value) and text in str(info.value), str(info.value)
    assert name in str(info.value) and info.value.file == str(REAL / name)
    data = read_config_file(REAL / name)
    for dotted in culprits:  # nothing else in the file is refused
        drop(data, dotted)
    cfg, _ = load_quietly(data)
    assert cfg.zero_optimization.stage == read_config_file(REAL / name).get("zero_optimization", {}).get("stage", 0)


def test_unimplemented_deepspeed_keys_warn_once_and_say_no_effect():
    cases = {"llamafactory_z0.json": ["zero_allow_untested_optimizer", "comms_config", "monitor_config",
                                      "zero_optimization.round_robin_gradients"],
             "dsexamples_cifar.json": ["fp16.fp16_master_weights_and_grads"],
             "axolotl_zero3.json": ["zero_optimization.sub_group_size"]}
    for name, keys in cases.items():
        cfg, messages = load_quietly(hf_filled(name))
        for key in keys:
            about = [m for m in messages if m.startswith(key + " ")]
            assert len(about) == 1 and "no effect" in about[0], (name, key, messages)
            assert key in cfg.unimplemented


def test_auto_left_in_means_defaults_with_a_warning_naming_each_key():
    cfg, messages = load_quietly(REAL / "hf_transformers_zero2.json")
    for key in ("gradient_clipping", "optimizer.params.lr", "optimizer.params.betas", "fp16.enabled",
                "scheduler.params.warmup_num_steps"):
        assert sum(m.startswith(f"{key} is 'auto'") for m in messages) == 1, (key, messages)
    assert cfg.gradient_clipping == 1.0 and cfg.optimizer.params == {} and cfg.train_batch_size is None


def test_fill_auto_changes_only_auto_and_follows_legacy_names():
    data = read_config_file(REAL / "axolotl_zero3_bf16.json")
    snapshot = copy.deepcopy(data)
    filled = fill_auto(data, hf_auto_values(**HF_ARGS))
    assert data == snapshot  # the input is not modified
    zero = filled["zero_optimization"]
    assert (zero["prefetch_bucket_size"], zero["param_persistence_threshold"]) == (int(0.9 * HIDDEN_SQ), 640)
    assert zero["max_live_parameters"] == 0 and filled["bf16"] == {"enabled": True}  # as written
    cfg, _ = load_quietly(filled)
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * HIDDEN_SQ)
    assert cfg.zero_optimization.stage3_max_live_parameters == 0


def test_typo_in_a_real_config_is_still_rejected():
    data = read_config_file(REAL / "llamafactory_z2.json")
    data["zero_optimization"]["reduce_bucket_sise"] = data["zero_optimization"].pop("reduce_bucket_size")
    with pytest.raises(ConfigError, match="did you mean 'reduce_bucket_size'") as info:
        load_quietly(data)
    assert info.value.key == "zero_optimization.reduce_bucket_sise"


def test_real_optimizers_build_as_configured():
    cfg, _ = load_quietly(REAL / "dsexamples_cifar.json")
    model = OddMLP()
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    group = optimizer.param_groups[0]
    assert type(optimizer) is torch.optim.AdamW  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.001, (0.8, 0.999), 1e-8, 3e-7)
    plain = fill_auto(read_config_file(REAL / "hf_accelerate_zero3.json"), hf_auto_values(**HF_ARGS))
    plain["optimizer"]["params"]["adam_w_mode"] = False
    cfg, _ = load_quietly(plain)  # as in DeepSpeed, type "AdamW" is AdamW whatever adam_w_mode says
    assert type(build_optimizer(cfg.optimizer, model.parameters())) is torch.optim.AdamW
    plain["optimizer"]["type"] = "Adam"  # ... and "Adam" with adam_w_mode false is Adam (L2 in the gradient)
    cfg, _ = load_quietly(plain)
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    assert type(optimizer) is torch.optim.Adam and optimizer.param_groups[0]["weight_decay"] == 0.05


@pytest.mark.parametrize("kind, params, lrs", [
    # DeepSpeed's engine: step t runs at the schedule's value for t - 1 (and the cosine's first step at 0)
    ("WarmupLR", {}, [0.0, 0.0, 1.5e-4, 3e-4, 3e-4]),
    ("WarmupDecayLR", {"total_num_steps": "auto"}, [0.0, 0.0, 1.5e-4, 3e-4, 1.5e-4]),
    ("WarmupCosineLR", {"total_num_steps": "auto"}, [0.0, 0.0, 1.5e-4, 1.5e-4, 0.0]),
])
def test_schedulers_in_hf_style_configs_work(kind, params, lrs):
    """The HF zero2 file's scheduler, and the other two types HF configs use, with "auto" filled."""
    data = read_config_file(REAL / "hf_transformers_zero2.json")
    if kind == "WarmupCosineLR":  # its params are ratios of the optimizer's lr
        data["scheduler"] = {"type": kind, "params": {"warmup_num_steps": "auto", "warmup_type": "linear",
                                                       "cos_min_ratio": 0.0, **params}}
    else:
        data["scheduler"]["type"] = kind
        data["scheduler"]["params"].update(params, warmup_type="linear")
    args = dict(HF_ARGS, warmup_steps=2, total_steps=4)
    cfg, _ = load_quietly(fill_auto(data, hf_auto_values(**args)))
    optimizer = build_optimizer(cfg.optimizer, OddMLP().parameters())
    scheduler = build_scheduler(cfg.scheduler, optimizer)
    seen = []
    for _ in lrs:
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx(lrs, abs=1e-12), seen


# --- end to end: two real files train at world 2 and match plain PyTorch ---------------------------------

LR, WD, STEPS = 1e-2, 0.01, 2
E2E = {  # file -> (HF arguments the test trains with, micro batch, accumulation)
    "hf_transformers_zero2.json": (dict(gradient_accumulation_steps=2), 2, 2),
    # hidden_size 2 sets HF's persistence threshold to 20, so OddMLP's two weights are partitioned
    "hf_accelerate_zero3.json": (dict(gradient_accumulation_steps=1, hidden_size=2), 2, 1),
}


def e2e_config(name: str) -> dict:
    changes, micro, _ = E2E[name]
    args = dict(HF_ARGS, micro_batch_per_gpu=micro, learning_rate=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD,
                max_grad_norm=1.0, warmup_steps=0, **changes)
    data = fill_auto(read_config_file(REAL / name), hf_auto_values(**args))
    # A constant lr, as the plain-PyTorch reference has (the schedules are checked against DeepSpeed's engine
    # in test_deepspeed_parity.py): HF fills the shortest warmup (2 steps), from min = max.
    data["scheduler"]["params"]["warmup_min_lr"] = LR
    return data


def train_real_configs() -> list:
    import zerotrain

    results = []
    for name, (_, micro, accumulation) in E2E.items():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            engine, _, _, scheduler = zerotrain.initialize(model=OddMLP(), config=e2e_config(name))
        setup = (engine.config.zero_optimization.stage, engine.config.zero_optimization.offload_optimizer.device,
                 engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), type(scheduler).__name__)
        losses = [train_global_step(engine, batch, micro) for batch in make_batches(STEPS, micro * accumulation * DP)]
        results.append((name, setup, losses, engine.full_state_dict()))
        engine.close()
    return results


def test_real_zero2_and_zero3_offload_configs_train_like_pytorch():
    results = run_distributed(train_real_configs, DP, timeout=120)[0]
    expected_setup = {"hf_transformers_zero2.json": (2, "cpu", 2, 2, "WarmupLR"),
                      "hf_accelerate_zero3.json": (3, "cpu", 2, 1, "WarmupLR")}
    for name, setup, losses, weights in results:
        assert setup == expected_setup[name], (name, setup)
        _, micro, accumulation = E2E[name]
        ref_losses, ref_weights = reference_training(OddMLP, make_batches(STEPS, micro * accumulation * DP),
                                                     lr=LR, weight_decay=WD, clip=1.0)
        assert_same_training(losses, weights, ref_losses, ref_weights)
