"""`zerotrain.hf.SFTTrainer` against TRL's `SFTTrainer` + DeepSpeed 0.19.8 on the same script and data.

At world 2 (CPU, gloo, tiny Llama built offline; in the launch the DPO, reward and GRPO tests share,
trl_launch.py): TRL's SFT on prompt/completion records with
packing (TRL's default `bfd`, padding-free) and completion-only loss.

- fp32 (`bf16=False`): zerotrain's `SFTTrainer`/`SFTConfig` at ZeRO-3 logs the same loss, learning rate and
  gradient norm at every step as TRL's + DeepSpeed at ZeRO-3 (1e-5).
- TRL's default precision (`SFTConfig` defaults to `bf16=True`; the config has no `bf16` block, which
  accelerate then enables in DeepSpeed's config): zerotrain at ZeRO-2 trains in bf16 as DeepSpeed does, and by
  the lossy-mode rule its losses and weights are near the fp32 run's while the untrained weights are not.
  (That default was why this comparison once agreed to 1e-3 only: TRL + DeepSpeed ran bf16, zerotrain fp32.)
- completion-only loss is in effect (a run without it logs another step-1 loss).
- bf16 against TRL + DeepSpeed in bf16, at ZeRO-2 (no bf16 block: accelerate's) and ZeRO-3 (`"bf16": {"enabled":
  "auto"}`): the rotary `inv_freq` stays fp32 on both, step 1's loss is equal, later steps within bf16's
  rounding while the fp32 run is not. (At ZeRO-3 the block matters to DeepSpeed itself: without it the model is
  built under its zero.Init before accelerate enables bf16, its parameters stay fp32 and it logs the fp32 run's
  step-1 loss.)
- bf16 keeps every float buffer fp32, as DeepSpeed 0.19 does, at ZeRO 0-3 (a tiny Llama with a persistent buffer
  added, zerotrain's and DeepSpeed's engines side by side): in the module, in the 16-bit state dict and in the
  checkpoint.
"""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from hf_compare import assert_same_steps, close, trainer_log
from models_for_tests import assert_tolerance_discriminates
from trl_launch import of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                reason="needs deepspeed and trl")

STEPS = 3
BF16_AUTO = {"bf16": {"enabled": "auto"}}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _records(n: int = 48) -> list:
    import random

    rng = random.Random(0)
    return [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(3, 9))) + " ->",
             "completion": " " + " ".join(rng.choices(WORDS, k=rng.randint(2, 7)))} for _ in range(n)]


def _run(engine: str, model_dir: str, out: str, completion_only: bool = True, stage: int = 3, steps: int = STEPS,
         blocks: dict | None = None, save: bool = False, **precision) -> dict:
    """One SFT run; `precision` (e.g. bf16=False) goes to SFTConfig, nothing given means TRL's default (bf16);
    `blocks` added to the DeepSpeed config; `save`: the model gets a persistent buffer and is saved (save_model)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if engine == "zt":
        from zerotrain.hf import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
              **(blocks or {})}
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
                     learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, seed=5, deepspeed=config, disable_tqdm=True, packing=True,
                     max_length=32, completion_only_loss=completion_only, **precision)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if save:  # a persistent fp32 buffer (unused by the forward), which save_model writes
        model.model.norm.register_buffer("shift", torch.linspace(-1, 1, model.config.hidden_size) / 3)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(_records()),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    result = {"log": trainer_log(trainer)}
    wrapped = trainer._zt_engine if engine == "zt" else trainer.deepspeed
    result["buffers"] = {n: b.dtype for n, b in wrapped.module.named_buffers()}
    if save:
        from safetensors.torch import load_file

        trainer.save_model(os.path.join(out, "final"))
        if int(os.environ["RANK"]) == 0:
            result["saved"] = {k: v.dtype for k, v in load_file(os.path.join(out, "final", "model.safetensors")).items()}
    if engine == "zt":
        result["bf16"] = trainer._zt_engine.bfloat16_enabled()
        result["weights"] = {k: v.float() for k, v in trainer._zt_engine.full_state_dict().items()}
    del trainer, args
    if engine == "ds":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return result


def _llama_with_buffers() -> "torch.nn.Module":
    """A tiny Llama (rotary `inv_freq`: fp32, not persistent) with a persistent fp32 buffer added (saved by
    checkpoints and exports), the same random weights on every rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    model.model.norm.register_buffer("shift", torch.randn(16) / 3)  # bf16 would round these values
    return model


def _buffers_in_bf16(engine_kind: str, stage: int, root: str) -> dict:
    """One bf16 training step at `stage` on zerotrain's or DeepSpeed's engine: the buffers' dtypes in the module,
    in the 16-bit state dict (ZeRO-3: the consolidated one; else the module's), in the checkpoint's module state
    (zerotrain: the buffer read back by a fresh engine's load_checkpoint, DeepSpeed: its model-states file)."""
    import glob

    import torch

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
              # torch's AdamW in DeepSpeed too (its FusedAdam is a JIT build of ~45 s in each new environment; the
              # optimizer is not what this checks)
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    ids = torch.arange(8).reshape(1, 8) + int(os.environ["RANK"])
    if engine_kind == "zt":
        import zerotrain as library
    else:
        import deepspeed as library
    engine, *_ = library.initialize(model=_llama_with_buffers(), config=config)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    out = {"module": {n: b.dtype for n, b in engine.module.named_buffers()}}
    sixteen = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else engine.module.state_dict()
    if int(os.environ["RANK"]) == 0:
        out["16bit"] = {n: t.dtype for n, t in sixteen.items() if n.endswith(("shift", "inv_freq"))}
        out["16bit_weight"] = sixteen["model.norm.weight"].dtype
    save = os.path.join(root, f"buffers_{engine_kind}{stage}")
    engine.save_checkpoint(save, tag="t")
    if engine_kind == "ds":
        states = torch.load(glob.glob(os.path.join(save, "t", "*model_states.pt"))[0], weights_only=False)
        out["checkpoint"] = {n: t.dtype for n, t in states["module"].items() if n.endswith("shift")}
    else:
        fresh, *_ = library.initialize(model=_llama_with_buffers(), config=config)
        fresh.module.model.norm.shift.zero_()
        fresh.load_checkpoint(save, tag="t")
        shift = fresh.module.model.norm.shift
        out["checkpoint"] = {"model.norm.shift": shift.dtype}
        out["shift_restored"] = torch.equal(shift, _llama_with_buffers().model.norm.shift)
    return out


def runs(engine: str, model_dir: str, root: str) -> dict:
    """This module's runs on one engine, in the shared TRL launch (trl_launch.py): "zt": zerotrain's four SFT runs
    (before DeepSpeed is imported); "ds": TRL + DeepSpeed's three (after `deepspeed.init_distributed`, which
    from_pretrained's zero.Init needs for the world size), then the buffer engines of both at every stage."""
    warnings.simplefilter("ignore")
    os.makedirs(root, exist_ok=True)
    if engine == "zt":
        return {"zt3": _run("zt", model_dir, os.path.join(root, "zt3"), bf16=False),
                "zt2_bf16": _run("zt", model_dir, os.path.join(root, "zt2"), stage=2, save=True),
                "zt3_bf16": _run("zt", model_dir, os.path.join(root, "zt3_bf16"), blocks=BF16_AUTO),
                "zt3_all_tokens": _run("zt", model_dir, os.path.join(root, "zt3_all"), completion_only=False, steps=1,
                                       bf16=False)}
    results = {"ds3": _run("ds", model_dir, os.path.join(root, "ds3"), bf16=False),
               "ds2_bf16": _run("ds", model_dir, os.path.join(root, "ds2_bf16"), stage=2, save=True),
               "ds3_bf16": _run("ds", model_dir, os.path.join(root, "ds3_bf16"), blocks=BF16_AUTO)}
    for stage in (0, 1, 2, 3):
        for kind in ("zt", "ds"):
            results[f"buffers_{kind}{stage}"] = _buffers_in_bf16(kind, stage, root)
    return results


@pytest.fixture(scope="module")
def launch(trl_results) -> dict:
    """The runs the tests below judge: this module's share of the TRL launch (trl_launch.py, one world-2 launch
    with DPO, reward and GRPO: one process start and import for all four trainers)."""
    return of(trl_results, "sft")


@pytest.mark.timeout(1600)  # the shared launch: seven SFT runs, eight small engines and the other trainers' runs
def test_sft_trainer_on_zerotrain_against_trl_with_deepspeed(launch, tiny_llama_dir):
    import torch
    from safetensors.torch import load_file

    results = launch
    zt3, ds3 = results["zt3"], results["ds3"]
    assert not zt3["bf16"]
    assert_same_steps("zt3 vs TRL + DeepSpeed ZeRO-3 (fp32)", zt3["log"], ds3["log"], steps=STEPS)
    assert zt3["log"][-1][3] > 1.0  # clipping is active (max_grad_norm 1.0)
    # TRL's default bf16=True: bf16 as under DeepSpeed (accelerate's bf16 block), near fp32, unlike no training
    bf16 = results["zt2_bf16"]
    assert bf16["bf16"], "SFTConfig's default bf16=True did not reach the engine"
    initial = {}
    for shard in tiny_llama_dir.glob("*.safetensors"):
        initial.update(load_file(shard))
    initial = {k: v.float() for k, v in initial.items() if k in zt3["weights"]}
    losses = [loss for _, loss, *_ in bf16["log"]]
    assert_tolerance_discriminates("SFT bf16 ZeRO-2 vs fp32", ([l for _, l, *_ in zt3["log"]], zt3["weights"]),
                                   (losses, bf16["weights"]), (None, initial), loss_tol=None, weight_tol=4e-3)
    # (the weights discriminate: the untrained ones are ~2e-2 away; the losses are only checked to be near)
    assert max(abs(a - b) / b for a, (_, b, *_) in zip(losses, zt3["log"])) <= 1e-2, (losses, zt3["log"])
    assert any(not torch.equal(bf16["weights"][k], zt3["weights"][k]) for k in initial)  # really another precision
    assert abs(results["zt3_all_tokens"]["log"][0][1] - zt3["log"][0][1]) / zt3["log"][0][1] > 1e-3  # completion-only


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_sft_steps_equal_deepspeeds_with_fp32_buffers(launch, stage):
    """TRL's default bf16 at ZeRO-2 and ZeRO-3: the parameters in bf16, the rotary `inv_freq` fp32 as DeepSpeed
    keeps it; step 1's loss equals DeepSpeed's (a bf16 `inv_freq` moves it by ~1e-5), the later steps within bf16's
    rounding of the reduction (a few 1e-6 in the loss, while the fp32 run is 1e-5..1e-4 away)."""
    zt, ds, fp32 = launch[f"zt{stage}_bf16"], launch[f"ds{stage}_bf16"], launch["zt3"]
    assert zt["bf16"]
    assert zt["buffers"] == ds["buffers"] and zt["buffers"]["model.rotary_emb.inv_freq"] == torch.float32
    if stage == 2:  # save_model: the parameters in bf16, the persistent buffer fp32, as the Trainer under DeepSpeed
        assert zt["saved"] == ds["saved"] and zt["saved"]["model.norm.shift"] == torch.float32, (zt["saved"], ds["saved"])
        assert zt["saved"]["model.norm.weight"] == torch.bfloat16
    assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
    assert close(zt["log"][0][1], ds["log"][0][1], 1e-7), (zt["log"][0], ds["log"][0])
    assert_tolerance_discriminates(f"SFT bf16 ZeRO-{stage} vs DeepSpeed's", ([l for _, l, *_ in ds["log"]], None),
                                   ([l for _, l, *_ in zt["log"]], None), ([l for _, l, *_ in fp32["log"]], None),
                                   loss_tol=1e-5)
    for (step, _, lr, norm), (_, _, ds_lr, ds_norm) in zip(zt["log"], ds["log"]):
        assert lr == ds_lr and close(norm, ds_norm, 1e-3), (step, norm, ds_norm)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_keeps_fp32_buffers_as_deepspeed(launch, stage):
    """bf16 casts the parameters only, as DeepSpeed 0.19: every float buffer stays fp32 in the module, in the 16-bit
    state dict (ZeRO-3's consolidated one: what `save_model`/`save_16bit_model` write) and in the checkpoint (read
    back bit for bit by a fresh engine), at every ZeRO stage; the same dtypes as DeepSpeed's at that stage."""
    zt, ds = launch[f"buffers_zt{stage}"], launch[f"buffers_ds{stage}"]
    assert set(zt["module"].values()) == {torch.float32}, zt
    for key in ("module", "16bit", "16bit_weight", "checkpoint"):
        assert zt[key] == ds[key], (key, zt[key], ds[key])
    assert zt["16bit_weight"] == torch.bfloat16  # the parameters are in bf16
    assert zt["shift_restored"]
