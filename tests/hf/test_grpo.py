"""`zerotrain.hf.GRPOTrainer` against TRL's `GRPOTrainer` + DeepSpeed 0.19.8 on the same script and data.

One launch at world 2 (CPU, gloo, fp32, tiny Llama built offline; shared with the DPO and reward tests,
trl_launch.py), ZeRO-2 and ZeRO-3, beta 0.1 (the KL term: TRL
loads the reference model from the model's directory; zerotrain runs it on a forward-only ZeRO-3 engine, TRL on
DeepSpeed's ZeRO-3 inference engine or stage 0), a reward function in Python. Completions are sampled
(temperature 1) by transformers' `generate` on the gathered weights with `synced_gpus`; both sides reseed torch at
every step's start (`torch.manual_seed(100 + step)`, a callback), so with the same weights they draw the same
completions: checked (every completion rank 0 scored is the same text on both sides). Compared per step within 1e-5
(relative; absolute below 1, as tests/hf/hf_compare.py: GRPO's loss is a near-cancelling sum of advantage terms plus
beta x KL, ~1e-3): the loss, gradient norm, learning rate, KL, the rewards (mean, std) and the completions' mean
length; the reference engine is ZeRO-3 without an optimizer.
"""
from __future__ import annotations

import importlib.util

import pytest

from hf_compare import close
from trl_launch import of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                reason="needs deepspeed and trl")

STEPS = 3
KEYS = ("loss", "grad_norm", "learning_rate", "kl", "reward", "reward_std", "completions/mean_length")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _records(n: int = 24) -> list:
    import random

    rng = random.Random(3)
    return [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(3, 7))) + " ->"} for _ in range(n)]


SEEN: list = []  # the completions each run's reward function scored on this rank, in order


def reward_letters(completions: list, **kwargs) -> list:
    """A reward in Python: the share of the letter 'a' in each completion."""
    SEEN.extend(completions)
    return [text.count("a") / max(1, len(text)) for text in completions]


def _run(engine: str, model_dir: str, out: str, stage: int, variant: str = "fp32", reward_dir: str = "") -> dict:
    """One GRPO run; `variant` "fp32" (a reward function in Python) or "rm" (fp32, the reward model at `reward_dir`
    given by its path in `reward_funcs`, as TRL's grpo.py takes it, and `ds3_gather_for_generation=False`)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    gathers = []  # zerotrain: the gather calls each generation made on this rank
    if engine == "zt":
        from zerotrain.hf import GRPOConfig, GRPOTrainer as ZeroTrainGRPO

        def gather_calls(trainer) -> int:
            return sum(v["calls"] for k, v in trainer._zt_engine.counters.snapshot().items() if "gather" in k)

        class GRPOTrainer(ZeroTrainGRPO):
            def _generate_single_turn(self, *args, **kwargs):
                before = gather_calls(self)
                try:
                    return super()._generate_single_turn(*args, **kwargs)
                finally:
                    gathers.append(gather_calls(self) - before)
    else:
        from trl import GRPOConfig, GRPOTrainer

    class Reseed(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.manual_seed(100 + state.global_step)

    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}
    if stage == 3:  # every weight partitioned, the output heads too (read directly by TRL's fused LM head)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=STEPS,
                      learning_rate=5e-3, warmup_steps=0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
                      report_to="none", use_cpu=True, seed=5, deepspeed=config, disable_tqdm=True, bf16=False,
                      num_generations=4, max_completion_length=8, beta=0.1, temperature=1.0,
                      model_init_kwargs={"dtype": "float32"},
                      # zerotrain generates layer by layer in "rm"; DeepSpeed 0.19.8 with TRL 1.16 fails in the
                      # backward after such a generation at ZeRO-3 on the CPU (a released parameter, size 0), so its
                      # side gathers whole: the same generation math (the completions are compared)
                      ds3_gather_for_generation=not (variant == "rm" and engine == "zt"),
                      reward_weights=[1.0, 0.0] if variant == "rm" else None)
    # "rm": the reward model scores; the Python function, weighted 0, only records the completions it is shown
    rewards = [reward_dir, reward_letters] if variant == "rm" else reward_letters
    trainer = GRPOTrainer(model=model_dir, reward_funcs=rewards, args=args,
                          train_dataset=Dataset.from_list(_records()), callbacks=[Reseed()])
    SEEN.clear()
    trainer.train()
    log = [(h["step"], *(float(h[k]) for k in KEYS)) for h in trainer.state.log_history if "loss" in h]
    result = {"log": log, "completions": list(SEEN)}
    if engine == "zt":
        reference = trainer._zt_reference
        result["reference"] = {"stage": reference.zero_optimization_stage(),
                               "optimizer": reference.optimizer is not None, "training": reference.module.training}
        result["gathers"] = gathers
        result["params"] = sum(1 for _ in trainer.model.parameters())
    del trainer, args
    if engine == "ds":
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()
    return result


@pytest.mark.timeout(1600)
def test_grpo_trainer_on_zerotrain_against_trl_with_deepspeed(trl_results):
    results = of(trl_results, "grpo")  # the shared launch (trl_launch.py)
    for stage in (2, 3):
        zt, ds = results[f"zt{stage}"], results[f"ds{stage}"]
        # the same completions were sampled and scored (4 prompts x 4 generations a rank per step)
        assert len(ds["completions"]) == STEPS * 8 and len(set(ds["completions"])) > 1, ds["completions"]
        assert zt["completions"] == ds["completions"], (stage, zt["completions"], ds["completions"])
        assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
        # the policy moved away from the reference: a KL term after the first step
        assert all(row[1 + KEYS.index("kl")] > 1e-6 for row in ds["log"][1:]), ds["log"]
        bad = [(stage, got[0], key, a, b) for got, want in zip(zt["log"], ds["log"])
               for key, a, b in zip(KEYS, got[1:], want[1:]) if not close(a, b, 1e-5)]
        assert not bad, bad
        assert zt["reference"] == {"stage": 3, "optimizer": False, "training": False}, zt["reference"]
    # generation on the gathered weights: at ZeRO-3 each generation gathers every weight at most once (layer by
    # layer it would gather them again for each of its 9 forwards); at ZeRO-2 nothing is gathered
    gathers, params = results["zt3"]["gathers"], results["zt3"]["params"]
    assert len(gathers) == STEPS and all(0 < g <= params for g in gathers), (gathers, params)
    assert results["zt2"]["gathers"] == [0] * STEPS, results["zt2"]["gathers"]


@pytest.mark.slow  # a variant run of the shared launch (conftest.trl_results)
@pytest.mark.timeout(1600)
def test_grpo_with_reward_model_and_layerwise_generation_against_deepspeed(trl_results):
    """A reward model (a sequence-classification directory given in `reward_funcs`, as TRL's grpo.py passes it) and
    `ds3_gather_for_generation=False` at ZeRO-3: the reward model scores the completions (rewards vary), generation
    gathers layer by layer (each generation gathers more weights than the model has: its forwards gather them
    again), and every step's loss, gradient norm, learning rate, KL, reward and completion length are within 1e-5 of
    TRL + DeepSpeed's (the reward model on DeepSpeed's ZeRO-3 inference engine there, whole on each rank here)."""
    zt, ds = of(trl_results, "grpo_rm")["zt3"], of(trl_results, "grpo_rm")["ds3"]
    # the same completions sampled and scored (the Python function weighted 0 records them)
    assert len(ds["completions"]) == STEPS * 8 and len(set(ds["completions"])) > 1, ds["completions"]
    assert zt["completions"] == ds["completions"], (zt["completions"], ds["completions"])
    assert len({round(row[1 + KEYS.index("reward")], 6) for row in ds["log"]}) == STEPS, ds["log"]
    assert [s for s, *_ in zt["log"]] == [s for s, *_ in ds["log"]] == list(range(1, STEPS + 1))
    bad = [(got[0], key, a, b) for got, want in zip(zt["log"], ds["log"])
           for key, a, b in zip(KEYS, got[1:], want[1:]) if not close(a, b, 1e-5)]
    assert not bad, bad
    assert len(zt["gathers"]) == STEPS and all(g > zt["params"] for g in zt["gathers"]), (zt["gathers"], zt["params"])
