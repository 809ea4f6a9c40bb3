"""`zerotrain.hf.DPOTrainer` against TRL's `DPOTrainer` + DeepSpeed 0.19.8 on the same script and data.

One launch at world 2 (CPU, gloo, fp32, tiny Llama built offline; shared with the reward and GRPO tests,
trl_launch.py), ZeRO-2 and ZeRO-3 training; the reference model
(loaded by TRL from the model's directory at ZeRO-2; passed as `ref_model`, in train mode, at ZeRO-3) on a forward-only ZeRO-3 engine (zerotrain) / DeepSpeed's ZeRO-3
inference engine or stage 0 (TRL's `prepare_deepspeed`). Checked: every logged step's loss, rewards (chosen,
rejected, margins), gradient norm and learning rate within 1e-5 of DeepSpeed's; the reference engine holds no
optimizer and its parameters are partitioned.
"""
from __future__ import annotations

import importlib.util

import pytest

from hf_compare import close
from trl_launch import of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                reason="needs deepspeed and trl")

STEPS = 4
KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "grad_norm", "learning_rate")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _records(n: int = 32) -> list:
    import random

    rng = random.Random(1)
    words = lambda lo, hi: " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))  # noqa: E731
    return [{"prompt": words(3, 8) + " ->", "chosen": " " + words(2, 6), "rejected": " " + words(2, 6)}
            for _ in range(n)]


def _run(engine: str, model_dir: str, out: str, stage: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if engine == "zt":
        from zerotrain.hf import DPOConfig, DPOTrainer
    else:
        from trl import DPOConfig, DPOTrainer
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    args = DPOConfig(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                     learning_rate=5e-3, warmup_steps=0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                     report_to="none", use_cpu=True, seed=5, deepspeed=config, disable_tqdm=True, bf16=False,
                     max_length=48, beta=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # at ZeRO-3 the reference is passed (in train mode, as a user may build it); at ZeRO-2 TRL loads it itself
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train() if stage == 3 else None
    trainer = DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=Dataset.from_list(_records()),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    trainer.train()
    log = [(h["step"], *(float(h[k]) for k in KEYS)) for h in trainer.state.log_history if "loss" in h]
    result = {"log": log}
    if engine == "zt":
        from zerotrain.zero.stage3.partition import ZeroParameter

        reference = trainer._zt_reference
        params = list(reference.module.parameters())
        result["reference"] = {"stage": reference.zero_optimization_stage(),
                               "optimizer": reference.optimizer is not None,
                               "training": reference.module.training,
                               "zero_params": all(isinstance(p, ZeroParameter) for p in params),
                               "held": sum(p._zero.shard_numel for p in params if isinstance(p, ZeroParameter)),
                               "total": sum(p.numel() for p in params)}
    del trainer, args
    if engine == "ds":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return result


@pytest.mark.timeout(1600)
def test_dpo_trainer_on_zerotrain_against_trl_with_deepspeed(trl_results):
    results = of(trl_results, "dpo")  # the shared launch (trl_launch.py)
    for stage in (2, 3):
        zt, ds = results[f"zt{stage}"], results[f"ds{stage}"]
        # the policy moved away from the reference: the rewards are not trivially zero after the first step
        assert all(abs(row[1 + KEYS.index("rewards/margins")]) > 1e-3 for row in ds["log"][1:]), ds["log"]
        assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
        bad = [(stage, got[0], key, a, b) for got, want in zip(zt["log"], ds["log"])
               for key, a, b in zip(KEYS, got[1:], want[1:]) if not close(a, b, 1e-5)]
        assert not bad, bad
        reference = zt["reference"]  # partitioned: this rank holds about half of the weights
        # forward-only and in eval mode (as TRL's prepare_deepspeed puts it; dropout would change its log-probs)
        assert reference["stage"] == 3 and not reference["optimizer"] and reference["zero_params"], reference
        assert reference["training"] is False, reference
        assert reference["held"] < 0.6 * reference["total"], reference
