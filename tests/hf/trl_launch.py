"""One world-2 launch (CPU, gloo, fp32) for the TRL trainers compared with TRL + DeepSpeed 0.19.8: DPO, reward and
GRPO, each at ZeRO-2 and ZeRO-3, zerotrain's runs first, then DeepSpeed's (after `deepspeed.init_distributed`);
DPO and reward also in bf16 (DPO at ZeRO-3, reward at ZeRO-2) and with a PEFT LoRA adapter in fp32 (DPO at ZeRO-3,
reward at ZeRO-2), GRPO with a reward model and `ds3_gather_for_generation=False` (ZeRO-3), DPO's
`sync_ref_model` (ZeRO-3) and `precompute_ref_log_probs` (ZeRO-2): one stage each, the other stage's path being
the same code as the fp32 runs above; these variant runs only when a selected (slow) test reads them.
SFT's own set (test_sft.runs) follows each engine's TRL runs. Each test module (test_dpo.py, test_reward.py,
test_grpo.py, test_sft.py) holds its own runs and checks; they share this launch through the session fixture
`trl_results` (tests/hf/conftest.py): one process start and import for the four."""
from __future__ import annotations

import os
import warnings

# (trainer, variant, stages): variant "fp32" keys its runs "NAME/ENGINESTAGE", any other "NAME_VARIANT/ENGINESTAGE"
RUNS = (("dpo", "fp32", (2, 3)), ("reward", "fp32", (2, 3)), ("grpo", "fp32", (2, 3)),
        ("dpo", "bf16", (3,)), ("reward", "bf16", (2,)), ("dpo", "lora", (3,)), ("reward", "lora", (2,)),
        ("grpo", "rm", (3,)), ("dpo", "sync", (3,)), ("dpo", "precompute", (2,)))


def worker(model_dir: str, reward_dir: str, root: str, variants: bool = True) -> dict:
    """`{"NAME/ENGINESTAGE": that run's result}` (e.g. "dpo/zt3", "grpo/ds2", "dpo_bf16/zt3") on rank 0; {} elsewhere."""
    import test_dpo
    import test_grpo
    import test_reward
    import test_sft
    from distributed import freeze_imports

    # what every run imports, out of the garbage collector's walks (each Trainer run calls gc.collect())
    freeze_imports("trl", "datasets", "accelerate", "peft", "transformers.trainer")
    warnings.simplefilter("ignore")
    runs = {"dpo": (test_dpo._run, model_dir), "reward": (test_reward._run, reward_dir),
            "grpo": (test_grpo._run, model_dir)}
    results = {}
    for engine in ("zt", "ds"):
        if engine == "ds":
            os.environ["DS_ACCELERATOR"] = "cpu"
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            freeze_imports("deepspeed")
        for name, variant, stages in RUNS:
            if variant != "fp32" and not variants:  # only the slow tests read them (conftest.trl_results)
                continue
            run, directory = runs[name]
            for stage in stages:
                key = f"{name if variant == 'fp32' else name + '_' + variant}/{engine}{stage}"
                extra = {"reward_dir": reward_dir} if name == "grpo" else {}
                results[key] = run(engine, directory, os.path.join(root, key.replace("/", "-")), stage, variant, **extra)
        # SFT (test_sft.py): its own set of runs per engine, keyed "sft/NAME"
        results.update({f"sft/{key}": value for key, value in test_sft.runs(engine, model_dir,
                                                                              os.path.join(root, "sft")).items()})
    return results if int(os.environ["RANK"]) == 0 else {}


def of(results: dict, name: str) -> dict:
    """One trainer's runs: {"zt2": ..., "zt3": ..., "ds2": ..., "ds3": ...}."""
    return {key.split("/", 1)[1]: value for key, value in results.items() if key.startswith(name + "/")}
