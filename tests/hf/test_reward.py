"""`zerotrain.hf.RewardTrainer` against TRL's `RewardTrainer` + DeepSpeed 0.19.8 on the same script and data.

One launch at world 2 (CPU, gloo, fp32; shared with the DPO and GRPO tests, trl_launch.py), ZeRO-2 and ZeRO-3.
The model is given as a directory path, as TRL's `reward.py` gives it: a tiny Llama sequence-classification model with its score head saved (built offline, so both
sides load the same weights and nothing is initialised at random). Checked: every logged step's loss, accuracy,
margin, min/mean/max reward, gradient norm and learning rate within 1e-5 of DeepSpeed's.
"""
from __future__ import annotations

import importlib.util

import pytest

from hf_compare import close
from models_for_tests import assert_tolerance_discriminates
from trl_launch import of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                reason="needs deepspeed and trl")

STEPS = 4
KEYS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "grad_norm", "learning_rate")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _records(n: int = 32) -> list:
    import random

    rng = random.Random(2)
    words = lambda lo, hi: " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))  # noqa: E731
    return [{"chosen": words(4, 12), "rejected": words(4, 12)} for _ in range(n)]


def _run(engine: str, model_dir: str, out: str, stage: int, variant: str = "fp32") -> dict:
    """One reward-model run; `variant` "fp32", "bf16" (`bf16=True`; the config has no `bf16` block: accelerate's,
    as TRL's default) or "lora" (fp32, `peft_config` a SEQ_CLS LoRA on q/v, the score head trained whole)."""
    from datasets import Dataset

    if engine == "zt":
        from zerotrain.hf import RewardConfig, RewardTrainer
    else:
        from trl import RewardConfig, RewardTrainer
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    args = RewardConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                        learning_rate=5e-3, warmup_steps=0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                        report_to="none", use_cpu=True, seed=5, deepspeed=config, disable_tqdm=True,
                        bf16=variant == "bf16", max_length=48, model_init_kwargs={"dtype": "float32"})
    peft_config = None
    if variant == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 lora_dropout=0.0)
    trainer = RewardTrainer(model=model_dir, args=args, train_dataset=Dataset.from_list(_records()),
                            peft_config=peft_config)
    trainer.train()
    log = [(h["step"], *(float(h[k]) for k in KEYS)) for h in trainer.state.log_history if "loss" in h]
    params = list(trainer.model.named_parameters())
    result = {"log": log, "dtypes": sorted({str(p.dtype) for _, p in params}),
              "trainable": sorted(name.split("base_model.model.", 1)[-1] for name, p in params if p.requires_grad)}
    if engine == "zt":
        result["bf16"] = trainer._zt_engine.bfloat16_enabled()
    del trainer, args
    if engine == "ds":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return result


def reward_model_dir(tiny_llama_dir, path) -> str:
    """The tiny Llama as a sequence-classification model (num_labels=1, score head drawn with seed 0), saved with its
    tokenizer: a directory both trainers load whole."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.timeout(1600)
def test_reward_trainer_on_zerotrain_against_trl_with_deepspeed(trl_results):
    results = of(trl_results, "reward")  # the shared launch (trl_launch.py)
    for stage in (2, 3):
        zt, ds = results[f"zt{stage}"], results[f"ds{stage}"]
        # the model learns: the margins move from step to step (a run that never stepped would repeat them)
        margins = [row[1 + KEYS.index("margin")] for row in ds["log"]]
        assert len(set(round(m, 6) for m in margins)) == STEPS, ds["log"]
        assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
        bad = [(stage, got[0], key, a, b) for got, want in zip(zt["log"], ds["log"])
               for key, a, b in zip(KEYS, got[1:], want[1:]) if not close(a, b, 1e-5)]
        assert not bad, bad


@pytest.mark.slow  # a variant run of the shared launch (conftest.trl_results)
@pytest.mark.timeout(1600)
def test_reward_bf16_against_trl_with_deepspeed(trl_results):
    """bf16 at ZeRO-2 (TRL's default precision path: accelerate's bf16 block): step 1's loss, accuracy and margin equal
    DeepSpeed's (the same bf16 weights and batch), its gradient norm within 1e-3; the later losses within bf16's
    run-to-run rounding: one bf16 step of the logged loss (2**-8 relative: the loss is a bf16 number, averaged over
    2 micro-batches; measured 2.7e-3 at step 4, while the fp32 run is 2.7e-2 away, at least 2x, checked)."""
    zt, ds, fp32 = of(trl_results, "reward_bf16")["zt2"], of(trl_results, "reward_bf16")["ds2"], of(trl_results, "reward")["zt2"]
    assert zt["bf16"] and zt["dtypes"] == ds["dtypes"] == ["torch.bfloat16"], (zt["dtypes"], ds["dtypes"])
    assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
    assert zt["log"][0][1:7] == ds["log"][0][1:7], (zt["log"][0], ds["log"][0])
    norm = 1 + KEYS.index("grad_norm")
    assert close(zt["log"][0][norm], ds["log"][0][norm], 1e-3), (zt["log"][0], ds["log"][0])
    losses = lambda run: [row[1] for row in run["log"]]  # noqa: E731
    assert_tolerance_discriminates("reward bf16 ZeRO-2 vs DeepSpeed's", (losses(ds), None), (losses(zt), None),
                                   (losses(fp32), None), loss_tol=2.0 ** -8)


@pytest.mark.slow  # a variant run of the shared launch (conftest.trl_results)
@pytest.mark.timeout(1600)
def test_reward_lora_against_trl_with_deepspeed(trl_results):
    """A PEFT LoRA adapter (SEQ_CLS: the score head trained whole) in fp32 at ZeRO-2: the same parameters train as
    under DeepSpeed, and every step's loss, accuracy, margin, rewards, gradient norm and learning rate within 1e-5."""
    zt, ds = of(trl_results, "reward_lora")["zt2"], of(trl_results, "reward_lora")["ds2"]
    assert zt["trainable"] == ds["trainable"] and zt["trainable"], (zt["trainable"], ds["trainable"])
    assert any("lora_" in name for name in zt["trainable"]) and any("score" in name for name in zt["trainable"])
    margins = [row[1 + KEYS.index("margin")] for row in ds["log"]]
    assert len(set(round(m, 6) for m in margins)) == STEPS, ds["log"]
    assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
    bad = [(got[0], key, a, b) for got, want in zip(zt["log"], ds["log"])
           for key, a, b in zip(KEYS, got[1:], want[1:]) if not close(a, b, 1e-5)]
    assert not bad, bad
