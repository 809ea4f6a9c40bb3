"""An `optimizer` block's unset params take DeepSpeed 0.19.8's defaults (issues #48, #44).

DeepSpeed's engine (runtime/engine.py `_configure_basic_optimizer`, `get_optimizer_configuration`) builds, for an
Adam/AdamW block, its FusedAdam (ops/adam/fused_adam.py), or its DeepSpeedCPUAdam (ops/adam/cpu_adam.py) when the
optimizer is offloaded (CPU, NVMe; SuperOffload steps the same CPU Adam), or, with `torch_adam: true`, torch's
AdamW/Adam; "AdamW" is AdamW whatever `adam_w_mode` says, "Adam" is AdamW unless `adam_w_mode` is false. SGD is
`torch.optim.SGD(params, **block_params)`. The expected values here are read from DeepSpeed's own classes (their
signatures: building FusedAdam / DeepSpeedCPUAdam compiles their C++ ops) and from torch's optimizers built from the
same block; each is compared with the param group zerotrain builds. The engine tests step through the offload paths
with a block that leaves `weight_decay` out and compare with single-process AdamW at DeepSpeed's 0.
"""
from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from zerotrain.config import load_config
from zerotrain.optim import build_optimizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
# Keys DeepSpeed's engine pops before building the optimizer (engine.py), so no optimizer class sees them.
ENGINE_KEYS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")


def block(type_: str, **params) -> object:
    return load_config({"train_batch_size": 1, "optimizer": {"type": type_, "params": params}}).optimizer


def params() -> list[torch.Tensor]:
    return [torch.zeros(5, requires_grad=True)]


def deepspeed_class(name: str):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    return {"FusedAdam": FusedAdam, "DeepSpeedCPUAdam": DeepSpeedCPUAdam}[name]


def signature_defaults(cls) -> dict:
    """The keyword defaults of a class's constructor (or of a function)."""
    signature = inspect.signature(cls.__init__ if isinstance(cls, type) else cls)
    return {name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}


def deepspeed_adam_group(cls_name: str, given: dict) -> tuple[dict, bool]:
    """(the group DeepSpeed's `cls_name` gets from a block with params `given`, whether it decouples the decay)."""
    defaults = signature_defaults(deepspeed_class(cls_name))
    group = {key: given.get(key, defaults[key]) for key in ADAM_KEYS}
    group["betas"] = tuple(group["betas"])
    assert defaults["bias_correction"] is True  # zerotrain's only mode (bias_correction: false is refused)
    return group, defaults["adam_w_mode" if cls_name == "FusedAdam" else "adamw_mode"]


CASES = [("Adam", {}), ("AdamW", {}), ("adam", {"adam_w_mode": False}), ("AdamW", {"adam_w_mode": False}),
         ("Adam", {"lr": 0.1, "betas": [0.8, 0.9]}), ("AdamW", {"eps": 1e-6, "amsgrad": True}),
         ("Adam", {"weight_decay": 0.05, "adam_w_mode": False})]


@pytest.mark.parametrize("cls_name", ["FusedAdam", "DeepSpeedCPUAdam"])
@pytest.mark.parametrize("type_, given", CASES)
def test_adam_block_takes_deepspeeds_defaults(cls_name, type_, given):
    """FusedAdam (no offload) and DeepSpeedCPUAdam (offload_optimizer cpu/nvme, SuperOffload) default alike; the
    param group zerotrain builds equals theirs, key by key, and decouples the decay exactly when DeepSpeed does."""
    expected, adamw_default = deepspeed_adam_group(cls_name, given)
    decoupled = type_.lower() == "adamw" or given.get("adam_w_mode", adamw_default)
    optimizer = build_optimizer(block(type_, **given), params())
    group = optimizer.param_groups[0]
    assert {key: group[key] for key in ADAM_KEYS} == expected
    assert type(optimizer) is (torch.optim.AdamW if decoupled else torch.optim.Adam)


@pytest.mark.parametrize("cls_name", ["FusedAdam", "DeepSpeedCPUAdam"])
def test_ops_adam_shims_have_deepspeeds_signature_defaults(cls_name):
    """`zerotrain.ops.adam.FusedAdam` / `DeepSpeedCPUAdam` (what `zerotrain port` puts in DeepSpeed-Chat's scripts)
    take DeepSpeed's defaults, and build the param group DeepSpeed's class would."""
    from zerotrain.ops import adam

    shim = getattr(adam, cls_name)
    assert signature_defaults(shim) == signature_defaults(deepspeed_class(cls_name))
    expected, _ = deepspeed_adam_group(cls_name, {})
    assert {key: shim(params()).param_groups[0][key] for key in ADAM_KEYS} == expected


@pytest.mark.parametrize("type_, given", CASES)
def test_torch_adam_takes_torchs_own_defaults(type_, given):
    """`torch_adam: true`: DeepSpeed builds torch's AdamW/Adam from the block, so AdamW's weight_decay is torch's."""
    decoupled = type_.lower() == "adamw" or given.get("adam_w_mode", True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = cls(params(), **{k: v for k, v in given.items() if k not in ENGINE_KEYS})
    optimizer = build_optimizer(block(type_, torch_adam=True, **given), params())
    assert type(optimizer) is cls
    assert {key: optimizer.param_groups[0][key] for key in ADAM_KEYS} == \
        {key: tuple(v) if key == "betas" else v for key, v in
         ((key, reference.param_groups[0][key]) for key in ADAM_KEYS)}


@pytest.mark.parametrize("given", [{}, {"lr": 0.1, "momentum": 0.9}, {"weight_decay": 1e-4, "dampening": 0.1}])
def test_sgd_block_takes_torchs_sgd_defaults(given):
    """DeepSpeed builds `torch.optim.SGD(params, **block_params)`."""
    reference = torch.optim.SGD(params(), **given).param_groups[0]
    group = build_optimizer(block("SGD", **given), params()).param_groups[0]
    assert {key: group[key] for key in SGD_KEYS} == {key: reference[key] for key in SGD_KEYS}


OFFLOADS = {"cpu stage 2": (2, {"device": "cpu"}), "nvme stage 3": (3, {"device": "nvme"}),
            "super_offload stage 2": (2, {"device": "cpu", "super_offload": True})}


def test_offload_paths_step_with_deepspeeds_weight_decay(tmp_path):
    """Each offload path (CPU, NVMe, SuperOffload: DeepSpeedCPUAdam's weight_decay 0 in DeepSpeed) trains, from a
    block without `weight_decay`, as single-process AdamW with weight_decay 0 (1e-5; torch's 0.01 is 1e-4 away)."""
    import zerotrain
    from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training

    batches = make_batches(3, 4)
    ref_losses, ref_weights = reference_training(OddMLP, batches, lr=1e-2, weight_decay=0.0)
    started = torch.distributed.is_initialized()
    try:
        for mode, (stage, offload) in OFFLOADS.items():
            if offload["device"] == "nvme":
                offload = dict(offload, nvme_path=str(tmp_path))
            config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 0,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                      "zero_optimization": {"stage": stage, "offload_optimizer": offload}}
            torch.manual_seed(0)
            engine, *_ = zerotrain.initialize(model=OddMLP(), config=config)
            try:
                losses = []
                for x, y in batches:
                    loss = engine(x, y)
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                assert_same_training(losses, engine.full_state_dict(), ref_losses, ref_weights, mode)
                assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.0], mode
            finally:
                engine.close()
    finally:
        if not started and torch.distributed.is_initialized():  # a world of one, this test's own
            torch.distributed.destroy_process_group()


def test_hf_trainer_optimizer_block_takes_deepspeeds_defaults_and_no_block_the_trainers(tmp_path):
    """zerotrain.hf.Trainer, as transformers' Trainer under DeepSpeed: a config `optimizer` block without
    `weight_decay` decays by DeepSpeed's 0 (transformers fills only "auto" keys from the arguments), whatever
    `weight_decay` the arguments give; without a block the Trainer's own AdamW decays its decay parameters by the
    arguments' `weight_decay` (and not the biases and norms)."""
    pytest.importorskip("transformers")
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.hf import Trainer, TrainingArguments

    data = [{"input_ids": torch.arange(8) % 64, "labels": torch.arange(8) % 64} for _ in range(2)]
    started = torch.distributed.is_initialized()
    seen = {}
    try:
        for name, optimizer in (("block", {"type": "AdamW", "params": {"lr": 1e-3}}), ("no block", None)):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, intermediate_size=32))
            config = {"zero_optimization": {"stage": 2}}
            if optimizer is not None:
                config["optimizer"] = optimizer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args = TrainingArguments(output_dir=str(tmp_path / name.replace(" ", "_")), use_cpu=True,
                                         report_to="none", deepspeed=config, weight_decay=0.1, max_steps=1, learning_rate=1e-3,
                                         per_device_train_batch_size=2, save_strategy="no")
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
            engine = trainer.model_wrapped
            seen[name] = sorted({g["weight_decay"] for g in engine.optimizer.param_groups})
            engine.close()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert seen == {"block": [0.0], "no block": [0.0, 0.1]}, seen


def test_checkpoint_saved_with_the_old_implicit_weight_decay_resumes_with_it(tmp_path):
    """A checkpoint written by zerotrain before this change (AdamW blocks without `weight_decay` then decayed by
    torch's 0.01, which the checkpoint's param groups record) resumes with the 0.01 it was saved with, as torch's and
    DeepSpeed's `load_state_dict` restore saved group hyperparameters, under a config that leaves the key out: the
    resumed run continues the uninterrupted 0.01 run's losses and weights (1e-5); a fresh run from that config
    decays by 0."""
    import zerotrain
    from models_for_tests import OddMLP, assert_same_training, make_batches, reference_training

    batches = make_batches(4, 4)
    ref_losses, ref_weights = reference_training(OddMLP, batches, lr=1e-2, weight_decay=0.01)

    def config(**params):
        return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "steps_per_print": 0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, **params}}, "zero_optimization": {"stage": 2}}

    def train(engine, steps):
        losses = []
        for x, y in steps:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    started = torch.distributed.is_initialized()
    try:
        torch.manual_seed(0)
        old, *_ = zerotrain.initialize(model=OddMLP(), config=config(weight_decay=0.01))  # what the old default built
        losses = train(old, batches[:2])
        old.save_checkpoint(str(tmp_path), tag="old")
        old.close()
        torch.manual_seed(1)
        resumed, *_ = zerotrain.initialize(model=OddMLP(), config=config())
        assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.0]  # the new default, before loading
        resumed.load_checkpoint(str(tmp_path), tag="old")
        assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.01]
        losses += train(resumed, batches[2:])
        assert_same_training(losses, resumed.full_state_dict(), ref_losses, ref_weights, "resumed")
        resumed.close()
    finally:
        if not started and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
