"""The schema: defaults, value checks, key screening, legacy keys, "auto"."""
import warnings

import pytest

from zerotrain.config import ConfigError, ConfigWarning, ZeroTrainConfig, load_config

BASE = {"train_batch_size": 8}


def load(**blocks):
    return load_config(dict(BASE, **blocks))


def error_of(config: dict) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert isinstance(info.value, ValueError)
    return info.value


# --- defaults ---------------------------------------------------------------------

def test_defaults_follow_deepspeed():
    cfg = load()
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None and cfg.wall_clock_breakdown is False
    assert cfg.comm_timeout_seconds == 1800.0 and cfg.seed is None
    assert cfg.optimizer is None and cfg.scheduler is None and cfg.precision == "fp32"
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.loss_scale, fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis,
            fp16.consecutive_hysteresis, fp16.min_loss_scale, fp16.auto_cast) == (False, 0.0, 16, 1000, 2, False, 1.0,
                                                                                  False)
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.overlap_comm is None and zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 10**9 and zero.stage3_max_reuse_distance == 10**9
    assert zero.stage3_gather_16bit_weights_on_model_save is False and zero.stage3_allgather_sequential is False
    assert zero.offload_optimizer is None and zero.offload_param is None and zero.zeropp_loco_param is None
    assert (zero.zero_quantized_weights, zero.zero_quantized_gradients, zero.zero_hpz_partition_size) == (False, False, 1)
    assert (cfg.checkpoint.async_save, cfg.checkpoint.keep_last, cfg.checkpoint.verify_on_load) == (False, None, True)


def test_overlap_comm_default_per_stage():
    assert load(zero_optimization={"stage": 3}).zero_optimization.resolved_overlap_comm is True
    assert load(zero_optimization={"stage": 2}).zero_optimization.resolved_overlap_comm is False
    assert load(zero_optimization={"stage": 2, "overlap_comm": True}).zero_optimization.resolved_overlap_comm


def test_nested_blocks_and_precision():
    cfg = load(bf16={"enabled": True}, zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "NVMe", "nvme_path": "/local_nvme", "ratio": 0.5},
        "offload_param": {"device": "cpu", "pin_memory": True}, "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 8},
        "zero_quantized_gradients": True, "stage3_allgather_sequential": True})
    zero = cfg.zero_optimization
    assert cfg.precision == "bf16" and load(fp16={"enabled": True}).precision == "fp16"
    assert zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.ratio == 0.5
    assert zero.offload_optimizer.buffer_count == 4 and zero.offload_param.buffer_count == 5
    assert zero.offload_param.pin_memory and zero.zeropp_loco_param.reset_T == 8


def test_whole_floats_become_ints():
    zero = load(zero_optimization={"reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7}).zero_optimization
    assert zero.reduce_bucket_size == 500_000_000 and type(zero.reduce_bucket_size) is int
    assert type(zero.stage3_prefetch_bucket_size) is int


# --- wrong values: ConfigError naming the dotted key --------------------------------

@pytest.mark.parametrize("config, key", [
    ({"zero_optimization": {"stage": 7}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"reduce_bucket_size": 5.5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": -1}}, "zero_optimization.stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "super_offload": True,
                                                              "nvme_path": "/x"}}},
     "zero_optimization.offload_optimizer.super_offload"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True,
                                                              "super_offload_speculation": "sometimes"}}},
     "zero_optimization.offload_optimizer.super_offload_speculation"),
    ({"comm_same_host_transport": "maybe"}, "comm_same_host_transport"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": 0}}},
     "zero_optimization.offload_param.buffer_size"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "zero_optimization.offload_param"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer"),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 1.0}}}, "zero_optimization.zeropp_loco_param.err_beta"),
    ({"zero_optimization": {"zeropp_loco_param": {"err_beta": -0.1}}}, "zero_optimization.zeropp_loco_param.err_beta"),
    ({"zero_optimization": {"zero_hpz_partition_size": 0}}, "zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": "stage 2"}, "zero_optimization"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping"),
    ({"gradient_clipping": float("nan")}, "gradient_clipping"),
    ({"steps_per_print": -1}, "steps_per_print"),
    ({"comm_timeout_seconds": 0}, "comm_timeout_seconds"),
    ({"seed": 1.5}, "seed"),
    ({"fp16": {"enabled": "true"}}, "fp16.enabled"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
    ({"optimizer": {"type": "Adamm"}}, "optimizer.type"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "optimizer.params.nesterov"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": [1]}}, "optimizer.params"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.params.cycle_min_lr"),
    ({"scheduler": {"type": "LRRangeTest"}}, "scheduler.type"),
    ({"scheduler": {"type": "Cosine"}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, "scheduler.params.warmup_type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -0.1}}}, "scheduler.params.warmup_max_lr"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 0}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 100}}}, "scheduler.params.total_num_steps"),
    ({"scheduler": {"type": "HFSchedule", "params": {"name": "polynomial", "num_training_steps": 5}}},
     "scheduler.params.name"),
    ({"scheduler": {"type": "HFSchedule", "params": {"name": "cosine"}}}, "scheduler.params.num_training_steps"),
    ({"scheduler": {"type": "HFSchedule", "params": {"num_warmup_steps": -1, "num_training_steps": 5}}},
     "scheduler.params.num_warmup_steps"),
])
def test_wrong_values_name_the_key(config, key):
    err = error_of(dict(BASE, **config))
    assert key in str(err), str(err)


@pytest.mark.parametrize("config, key", [
    ({"fp16": {"enabled": True, "initial_scale_power": -1}}, "fp16.initial_scale_power"),
    ({"fp16": {"initial_scale_power": 65}}, "fp16.initial_scale_power"),
    ({"fp16": {"initial_scale_power": 1.5}}, "fp16.initial_scale_power"),
    ({"fp16": {"initial_scale_power": "16"}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"loss_scale": "dynamic"}}, "fp16.loss_scale"),
    ({"fp16": {"loss_scale": float("inf")}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window"),
    ({"fp16": {"loss_scale_window": 2.5}}, "fp16.loss_scale_window"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"hysteresis": -2}}, "fp16.hysteresis"),
    ({"fp16": {"hysteresis": True}}, "fp16.hysteresis"),
    ({"zero_optimization": {"allgather_bucket_size": -1}}, "zero_optimization.allgather_bucket_size"),
    ({"zero_optimization": {"allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size"),
    ({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
    ({"optimizer": {"type": "Adam", "params": {"bias_correction": "no"}}}, "optimizer.params.bias_correction"),
    ({"optimizer": {"type": 5}}, "optimizer.type"),
    ({"optimizer": {"type": ["AdamW"]}}, "optimizer.type"),
    ({"optimizer": {"type": None}}, "optimizer.type"),
    ({"scheduler": {"type": 1}}, "scheduler.type"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": "yes"}},
     "zero_optimization.cpu_offload_use_pin_memory"),
    ({"zero_optimization": {"cpu_offload_use_pin_memory": 1}}, "zero_optimization.cpu_offload_use_pin_memory"),
])
def test_more_wrong_values_name_the_key(config, key):
    """fp16 scaler knobs, bucket sizes, optimizer type/params, legacy offload switches: key in message and .key."""
    err = error_of(dict(BASE, **config))
    assert key in str(err), str(err)
    assert err.key == key


def test_errors_report_every_problem():
    err = error_of({"train_batch_size": 8, "gradient_clipping": -1, "steps_per_print": True})
    assert "gradient_clipping" in str(err) and "steps_per_print" in str(err)


# --- keys: unknown, DeepSpeed-only, commented out --------------------------------------

def test_misspelled_key_suggests_the_closest():
    err = error_of({"train_batch_size": 8, "zero_optimization": {"stgae": 2}})
    assert str(err) == "unknown key 'zero_optimization.stgae'; did you mean 'stage'?"
    assert err.key == "zero_optimization.stgae"
    assert "did you mean 'gradient_clipping'" in str(error_of({"train_batch_size": 8, "gradient_cliping": 1.0}))
    assert "did you mean 'lr'" in str(error_of({"train_batch_size": 8, "optimizer": {"type": "adam",
                                                                                      "params": {"lrr": 1}}}))


def test_nested_key_at_top_level_points_to_its_block():
    err = error_of({"train_batch_size": 8, "stage": 2})
    assert "did you mean 'zero_optimization.stage'" in str(err)


def test_unknown_key_without_close_match_lists_valid_keys():
    err = error_of({"train_batch_size": 8, "checkpoint": {"qqqqqqq": 1}})
    assert "checkpoint.qqqqqqq" in str(err) and "async_save" in str(err)
    err = error_of({"train_batch_size": 8, "zero_optimization": {"cuda_visible_devices": 0}})  # inside a block
    assert err.key == "zero_optimization.cuda_visible_devices"


def test_unknown_top_level_key_that_is_no_typo_is_ignored_with_a_warning():
    """DeepSpeed ignores unknown top-level keys (DeepSpeedExamples' imagenet config sets cuda_visible_devices)."""
    with pytest.warns(ConfigWarning, match="unknown top-level key 'my_run_name' is ignored"), \
            pytest.warns(ConfigWarning, match="unknown top-level key 'cuda_visible_devices' is ignored"):
        cfg = load(cuda_visible_devices=0, my_run_name="x")
    assert cfg.train_batch_size == 8 and cfg.strict_config is False
    err = error_of(dict(BASE, cuda_visible_devices=0, strict_config=True))
    assert err.key == "cuda_visible_devices" and "strict_config" in str(err)
    for typo, meant in [("optimiser", "optimizer"), ("schedular", "scheduler"), ("train_batch_sise", "train_batch_size"),
                        ("zero_optimisation", "zero_optimization"), ("bf_16", "bf16")]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an error, never a warning
            assert f"did you mean '{meant}'" in str(error_of(dict(BASE, **{typo: {}}))), typo


class _Recording(dict):
    """A config dict that records each key DeepSpeed's config reader asks it for (as 'block.key')."""

    def __init__(self, path: str, seen: set, **items):
        super().__init__(**items)
        self.path, self.seen = path, seen

    def _ask(self, key):
        self.seen.add(self.path + str(key))

    def get(self, key, *default):
        self._ask(key)
        return super().get(key, *default)

    def __contains__(self, key):
        self._ask(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self._ask(key)
        return super().__getitem__(key)


def _known_keys(block) -> set:
    return set(block.model_fields) | set(block.LEGACY) | set(block.DEEPSPEED_ONLY)


def test_every_key_deepspeed_reads_is_known():
    """Every key DeepSpeed 0.19.8 reads is read by zerotrain, renamed, or accepted with the "no effect"
    warning (never "unknown"), taken from DeepSpeed's own config code: the keys its DeepSpeedConfig asks a
    config dict for (top level, and the dict-read blocks checkpoint, aio, activation_checkpointing), and
    the fields (names and aliases) of its pydantic block models."""
    import deepspeed  # noqa: F401 - in the dev extra: a missing install fails, never skips
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    from zerotrain.config import (AdamParams, AioConfig, BF16Config, CheckpointConfig,
                                  CSVMonitorConfig, FP16Config, OffloadOptimizerConfig, OffloadParamConfig,
                                  TensorBoardConfig as OurTB, WandbConfig as OurWandb,
                                  ZeroConfig)
    from zerotrain.config.schema import ActivationCheckpointingConfig, TensorParallelConfig

    seen: set = set()
    dict_blocks = {"checkpoint": CheckpointConfig, "aio": AioConfig,
                   "activation_checkpointing": ActivationCheckpointingConfig}
    config = _Recording("", seen, train_batch_size=8, train_micro_batch_size_per_gpu=8,
                        gradient_accumulation_steps=1,
                        **{name: _Recording(f"{name}.", seen) for name in dict_blocks})
    config["checkpoint"]["parallel_write"] = {}
    DeepSpeedConfig(config)
    top = {key for key in seen if "." not in key}
    assert len(top) > 40 and {"zero_optimization", "datastates_ckpt"} <= top  # the recording saw DeepSpeed read
    problems = {"": sorted(top - _known_keys(ZeroTrainConfig))}
    for name, ours in dict_blocks.items():
        read = {key.split(".")[1] for key in seen if key.startswith(f"{name}.")}
        assert read, name
        problems[name] = sorted(read - _known_keys(ours))
    legacy_values = {"cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"}  # rewritten by _prepare
    for theirs, ours in [(DeepSpeedZeroConfig, ZeroConfig), (DeepSpeedZeroOffloadOptimizerConfig,
                                                             OffloadOptimizerConfig),
                         (DeepSpeedZeroOffloadParamConfig, OffloadParamConfig), (DeepSpeedFP16Config, FP16Config),
                         (DeepSpeedBF16Config, BF16Config), (TPTrainingConfig, TensorParallelConfig),
                         (TensorBoardConfig, OurTB), (CSVConfig, CSVMonitorConfig), (WandbConfig, OurWandb)]:
        names = set(theirs.model_fields) | {f.alias for f in theirs.model_fields.values() if f.alias}
        problems[ours.PATH] = sorted(names - _known_keys(ours) - legacy_values)  # DeepSpeed populates by name too
    # Adam's params beyond torch's: what DeepSpeed's engine pops (torch_adam, adam_w_mode, fp32_optimizer_states,
    # foreach) or its FusedAdam takes (bias_correction, set_grad_none)
    problems["optimizer.params"] = sorted({"torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach",
                                           "bias_correction", "set_grad_none"} - _known_keys(AdamParams))
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}
    with pytest.warns(ConfigWarning, match="log_level is a DeepSpeed key that zerotrain does not implement"), \
            pytest.warns(ConfigWarning, match="tensor_parallel.preset_model is a DeepSpeed key"):
        cfg = load(log_level="info", tensor_parallel={"autotp_size": 0, "preset_model": "llama"},
                   zero_optimization={"allgather_sequential": True})
    assert cfg.tensor_parallel.autotp_size == 1  # DeepSpeed's 0: no AutoTP
    assert cfg.zero_optimization.stage3_allgather_sequential is True and "log_level" in cfg.unimplemented


def test_configuration_reference_lists_every_key():
    """docs/configuration.md names every key the schema reads (and its legacy spellings) under "Keys zerotrain
    reads", and every DeepSpeed key accepted without effect under its own heading, so the reference cannot
    fall behind the schema."""
    import pathlib
    import re

    from zerotrain.config.base import Block

    def blocks(cls=Block):
        for sub in cls.__subclasses__():
            yield sub
            yield from blocks(sub)

    text = (pathlib.Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    reads, _, rest = text.partition("## DeepSpeed keys accepted without effect")
    no_effect = rest.partition("## Environment variables")[0]
    assert reads and no_effect

    def named(section: str, key: str) -> bool:
        return re.search(r"`(?:[\w.]*\.)?%s`" % re.escape(key), section) is not None

    missing = []
    for block in set(blocks()):
        if not block.PATH and block is not ZeroTrainConfig:
            continue
        missing += [f"{block.key_path(k)} (reads)" for k in [*block.model_fields, *block.LEGACY]
                    if k not in block.INERT and not named(reads, k)]
        missing += [f"{block.key_path(k)} (no effect)" for k in block.DEEPSPEED_ONLY | block.INERT
                    if not named(no_effect + reads, k)]
    assert len(set(blocks())) > 15 and not missing, sorted(missing)
    # and every ZEROTRAIN_* environment variable the package reads
    package = pathlib.Path(__file__).parents[2] / "zerotrain"
    variables = {v for path in package.rglob("*.py") for v in re.findall(r"ZEROTRAIN_[A-Z_]+", path.read_text())}
    table = text.partition("## Environment variables")[2]
    assert len(variables) > 5 and not [v for v in variables if f"`{v}" not in table], sorted(variables)


def test_monitor_blocks_have_deepspeeds_keys_and_defaults():
    """tensorboard / csv_monitor / wandb are read (no longer 'no effect'), field for field as DeepSpeed's models."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(tensorboard={"enabled": True, "output_path": "runs", "job_name": "j"},
                   csv_monitor={"enabled": True}, wandb={"enabled": True, "team": "t", "group": "g"},
                   wall_clock_breakdown=True)
    assert not cfg.unimplemented and cfg.wall_clock_breakdown is True
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("runs", "j")
    assert (cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.wandb.project, cfg.wandb.team, cfg.wandb.group) == ("deepspeed", "t", "g")
    assert error_of(dict(BASE, csv_monitor={"enabeld": True})).key == "csv_monitor.enabeld"
    import deepspeed  # noqa: F401 - in the dev extra: a missing install fails, never skips
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.monitor.config import CSVConfig, TensorBoardConfig, WandbConfig
    from zerotrain.config import CSVMonitorConfig, TensorBoardConfig as OurTB, WandbConfig as OurWandb
    for theirs, ours in [(TensorBoardConfig, OurTB), (CSVConfig, CSVMonitorConfig), (WandbConfig, OurWandb)]:
        defaults = {name: field.default for name, field in theirs.model_fields.items()}
        assert defaults == {name: field.default for name, field in ours.model_fields.items()}, ours.PATH


def test_zenflow_is_accepted_without_effect():
    with pytest.warns(ConfigWarning, match="zero_optimization.zenflow is a DeepSpeed key"):
        cfg = load(zero_optimization={"stage": 2, "zenflow": {"topk_ratio": 0.1}})
    assert "zero_optimization.zenflow" in cfg.unimplemented


@pytest.mark.parametrize("config, key", [
    ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
    ({"comet": {"enabled": True, "project": "x"}}, "comet"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"communication_data_type": "fp32"}, "communication_data_type"),
    ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
    ({"zero_optimization": {"sub_group_size": 1e9}}, "zero_optimization.sub_group_size"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pipeline_read": True}}},
     "zero_optimization.offload_optimizer.pipeline_read"),
    ({"bf16": {"immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"checkpoint": {"tag_validation": "Warn"}}, "checkpoint.tag_validation"),
    ({"optimizer": {"type": "adamw", "legacy_fusion": True}}, "optimizer.legacy_fusion"),
])
def test_deepspeed_only_keys_warn_and_load(config, key):
    with pytest.warns(ConfigWarning, match=key):
        cfg = load_config(dict(BASE, **config))
    assert key in cfg.unimplemented
    assert key.split(".")[0] in cfg.raw


def test_deepspeed_only_keys_switched_off_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(comet={"enabled": False}, prescale_gradients=False, gradient_predivide_factor=1.0)
    assert "comet" in cfg.unimplemented


@pytest.mark.parametrize("config, key, value", [
    ({"zero_optimization": {"allgather_bucket_size": 2e8}}, "zero_optimization.allgather_bucket_size", 200_000_000),
    ({"zero_optimization": {"stage": 2, "allgather_bucket_size": 1}}, "zero_optimization.allgather_bucket_size", 1),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast", True),
])
def test_accepted_but_unimplemented_keys_warn_when_set(config, key, value):
    """Keys zerotrain validates but does not act on: a non-default value warns naming the key."""
    with pytest.warns(ConfigWarning, match=key.replace(".", r"\.")) as record:
        cfg = load_config(dict(BASE, **config))
    assert any("no effect" in str(w.message) for w in record)
    assert cfg.unimplemented[key] == value
    block, _, name = key.rpartition(".")
    assert getattr(getattr(cfg, block) if block else cfg, name) == value  # still validated and kept


def test_unimplemented_keys_at_their_default_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load(wall_clock_breakdown=False, fp16={"auto_cast": False},
                   zero_optimization={"allgather_bucket_size": 5e8})
    assert not cfg.unimplemented


def test_underscore_keys_are_ignored_at_any_level():
    cfg = load(_comment="x", zero_optimization={"_stage": 99, "stage": 1, "_offload_optimizer": {"device": "gpu"}},
               optimizer={"type": "AdamW", "params": {"_lr": "whatever", "lr": 0.1}, "_note": 1},
               scheduler={"type": "WarmupLR", "params": {"_warmup_num_steps": -1}})
    assert cfg.zero_optimization.stage == 1 and cfg.optimizer.params == {"lr": 0.1}
    assert "_comment" not in cfg.raw and "_stage" not in cfg.raw["zero_optimization"]


# --- "auto" -------------------------------------------------------------------------

def test_auto_means_default_with_a_warning():
    with pytest.warns(ConfigWarning) as record:
        cfg = load(gradient_clipping="auto", fp16={"enabled": "auto"},
                   zero_optimization={"stage": 3, "reduce_bucket_size": "auto",
                                      "stage3_prefetch_bucket_size": "auto"},
                   optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
                   scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10}})
    messages = " ".join(str(w.message) for w in record)
    for key in ("gradient_clipping", "fp16.enabled", "zero_optimization.reduce_bucket_size",
                "zero_optimization.stage3_prefetch_bucket_size", "optimizer.params.lr", "optimizer.params.betas",
                "scheduler.params.warmup_max_lr"):
        assert key in messages
    assert cfg.gradient_clipping == 1.0 and cfg.fp16.enabled is False
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.optimizer.params == {} and cfg.scheduler.params == {"warmup_num_steps": 10}


def test_auto_without_default_is_an_error():
    err = error_of(dict(BASE, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}))
    assert "scheduler.params.total_num_steps" in str(err) and "auto" in str(err)


# --- legacy keys --------------------------------------------------------------------

def test_bfloat16_is_bf16():
    cfg = load(bfloat16={"enabled": True})
    assert cfg.bf16.enabled and cfg.precision == "bf16"
    assert "bfloat16" in str(error_of(dict(BASE, bfloat16={"enabled": True}, bf16={"enabled": False})))


def test_cpu_offload_is_offload_optimizer_cpu():
    with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload"):
        cfg = load(zero_optimization={"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    assert load(zero_optimization={"stage": 2, "cpu_offload": False}).zero_optimization.offload_optimizer is None
    err = error_of(dict(BASE, zero_optimization={"stage": 2, "cpu_offload": True,
                                                 "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}))
    assert "zero_optimization.cpu_offload" in str(err)
    # a block the legacy switch completes: no device or device cpu in any case is not a conflict
    for block in ({"buffer_count": 7}, {"device": "CPU", "buffer_count": 7}):
        with pytest.warns(ConfigWarning, match="zero_optimization.cpu_offload_param"):
            zero = load(zero_optimization={"stage": 3, "cpu_offload_param": True, "offload_param": block}).zero_optimization
        assert zero.offload_param.device == "cpu" and zero.offload_param.buffer_count == 7


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zeropp_keys_warn_exactly_at_the_stages_where_they_do_nothing(stage):
    """qgZ needs stage 1-3, qwZ and hpZ stage 3, LoCo qgZ: each warns, naming its key, only where it has no effect."""
    keys = {"zero_quantized_gradients": (True, stage == 0), "zero_quantized_weights": (True, stage != 3),
            "zero_hpz_partition_size": (2, stage != 3)}
    for key, (value, no_effect) in keys.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load(zero_optimization={"stage": stage, key: value})
        said = [str(w.message) for w in caught if f"zero_optimization.{key} has no effect" in str(w.message)]
        assert len(said) == (1 if no_effect else 0), (key, stage, said)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(zero_optimization={"stage": stage, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}})
    assert any("zeropp_loco_param has no effect: it needs zero_quantized_gradients" in str(w.message) for w in caught)


def test_legacy_zero_names():
    zero = load(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                   "prefetch_bucket_size": 1000}).zero_optimization
    assert zero.stage3_gather_16bit_weights_on_model_save is True and zero.stage3_prefetch_bucket_size == 1000
    with pytest.warns(ConfigWarning, match="legacy"):
        assert load(zero_optimization=True).zero_optimization.stage == 1
    err = error_of(dict(BASE, zero_optimization={"stage3_gather_fp16_weights_on_model_save": True,
                                                 "stage3_gather_16bit_weights_on_model_save": False}))
    assert "stage3_gather_16bit_weights_on_model_save" in str(err)


# --- optimizer and scheduler blocks --------------------------------------------------------

@pytest.mark.parametrize("type_, params, normalized, resolved", [
    ("Adam", {}, "adam", "adamw"),
    ("adam", {"adam_w_mode": False}, "adam", "adam"),
    ("AdamW", {"adam_w_mode": False}, "adamw", "adamw"),
    ("ADAMW", {}, "adamw", "adamw"),
    ("SGD", {"momentum": 0.9, "nesterov": True}, "sgd", "sgd"),
])
def test_optimizer_type(type_, params, normalized, resolved):
    opt = load(optimizer={"type": type_, "params": params}).optimizer
    assert opt.type == normalized and opt.resolved_type == resolved


def test_optimizer_params_keep_what_was_given():
    opt = load(optimizer={"type": "AdamW", "params": {"lr": 1, "betas": [0.8, 0.9], "torch_adam": True}}).optimizer
    assert opt.params == {"lr": 1.0, "betas": (0.8, 0.9), "torch_adam": True}
    assert load(optimizer={"type": "AdamW"}).optimizer.params == {}


def test_scheduler_type_and_params():
    sched = load(scheduler={"type": "warmupcosinelr", "params": {"total_num_steps": 1e3}}).scheduler
    assert sched.type == "WarmupCosineLR" and sched.params == {"total_num_steps": 1000}
    sched = load(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}).scheduler
    assert sched.params["warmup_max_lr"] == [0.1, 0.2]


# --- round trips --------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:zero_optimization.zeropp_loco_param has no effect")  # set on purpose: dumped too
def test_model_dump_round_trips():
    cfg = load(optimizer={"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
               scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 100}},
               zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                                  "zeropp_loco_param": {"err_beta": 0.7}},
               fp16={"enabled": True}, checkpoint={"keep_last": 2}, seed=3)
    again = load_config(cfg.model_dump())
    assert again.model_dump() == cfg.model_dump()
    assert load_config(cfg.raw).model_dump() == cfg.model_dump()


def test_direct_construction_uses_the_same_schema():
    cfg = ZeroTrainConfig(train_batch_size=4, zero_optimization={"stage": 2})
    assert cfg.zero_optimization.stage == 2
    assert load_config(cfg.raw).zero_optimization.stage == 2


def test_aio_thread_count_is_read_as_intra_op_parallelism_with_a_warning():
    from zerotrain.config import ConfigWarning, load_config

    with pytest.warns(ConfigWarning, match=r"aio\.thread_count is the older name of aio\.intra_op_parallelism"):
        cfg = load_config({"train_micro_batch_size_per_gpu": 1, "aio": {"thread_count": 3}})
    assert cfg.aio.intra_op_parallelism == 3


def test_aio_and_pipeline_defaults_are_deepspeeds():
    """The `aio` block against deepspeed/runtime/swap_tensor/constants.py, the pipeline's checkpoint interval against
    PipelineModule's own default (issue #48, round 4)."""
    import inspect

    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.swap_tensor import constants as ds

    aio = load_config({}).aio
    assert (aio.block_size, aio.queue_depth, aio.intra_op_parallelism, aio.single_submit, aio.overlap_events,
            aio.use_gds) == (ds.AIO_BLOCK_SIZE_DEFAULT, ds.AIO_QUEUE_DEPTH_DEFAULT, ds.AIO_INTRA_OP_PARALLELISM_DEFAULT,
                             ds.AIO_SINGLE_SUBMIT_DEFAULT, ds.AIO_OVERLAP_EVENTS_DEFAULT, ds.AIO_USE_GDS_DEFAULT)
    interval = inspect.signature(PipelineModule).parameters["activation_checkpoint_interval"].default
    assert load_config({}).pipeline.activation_checkpoint_interval == interval == 0


def test_one_stage_per_rank_needs_no_multi_stage_schedule_and_the_bf16_masters_warning_reads_whole():
    assert load_config({"pipeline": {"stages_per_rank": 1}}).pipeline.stages_per_rank == 1  # 1f1b's own count
    with pytest.raises(ConfigError, match="pipeline.stages_per_rank: 2 needs a multi-stage schedule"):
        load_config({"pipeline": {"stages_per_rank": 2}})
    with pytest.warns(ConfigWarning, match="^bf16.bf16_master_weights_and_grads: bf16 masters and optimizer states "
                                           "are implemented on the offloaded optimizer"):
        load_config({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    with pytest.raises(ConfigError, match="checkpoint.on_save_error.*expected one of 'raise', 'warn', got"):
        load_config({"checkpoint": {"on_save_error": "ignore"}})  # the default first, as the docs list them
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # where bf16 masters are implemented: no warning, and used
        cfg = load_config({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.bf16_records is True


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_an_nvme_path_that_is_a_file_is_a_config_error_naming_the_key(tmp_path, block):
    """A file where the swap directory must go (the path itself, or a parent of a path still to create) is refused
    with the config, naming the key and the file; a path that does not exist yet (the engine creates it) and an
    existing directory are accepted, for both offload blocks."""
    blocker = tmp_path / "swapfile"
    blocker.write_text("")
    for path in (blocker, blocker / "sub" / "dir"):
        err = error_of(dict(BASE, zero_optimization={"stage": 3, block: {"device": "nvme", "nvme_path": str(path)}}))
        assert err.key == f"zero_optimization.{block}.nvme_path" and f"{blocker} is a file" in str(err), err
    for path in (tmp_path, tmp_path / "new" / "dir"):
        config = load(zero_optimization={"stage": 3, block: {"device": "nvme", "nvme_path": str(path)}})
        assert getattr(config.zero_optimization, block).nvme_path == str(path)
    assert not (tmp_path / "new").exists()  # checking creates nothing
