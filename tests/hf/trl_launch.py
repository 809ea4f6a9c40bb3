"""One world-2 launch (CPU, gloo, fp32) for the TRL trainers compared with TRL + DeepSpeed 0.19.8: DPO, reward and
GRPO, each at ZeRO-2 and ZeRO-3, and SFT's own set (test_sft.runs), zerotrain's runs first, then DeepSpeed's (after
`deepspeed.init_distributed`). Each test module (test_dpo.py, test_reward.py, test_grpo.py, test_sft.py) holds its
own runs and checks; they share this launch through the session fixture `trl_results` (tests/hf/conftest.py): one
process start and import for the four."""
from __future__ import annotations

import os
import warnings

RUNS = ("dpo", "reward", "grpo", "sft")


def worker(model_dir: str, reward_dir: str, root: str) -> dict:
    """`{"NAME/ENGINESTAGE": that run's result}` (e.g. "dpo/zt3", "grpo/ds2") on rank 0; {} elsewhere."""
    import test_dpo
    import test_grpo
    import test_reward
    import test_sft

    warnings.simplefilter("ignore")
    runs = {"dpo": (test_dpo._run, model_dir), "reward": (test_reward._run, reward_dir),
            "grpo": (test_grpo._run, model_dir)}
    results = {}
    for engine in ("zt", "ds"):
        if engine == "ds":
            os.environ["DS_ACCELERATOR"] = "cpu"
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        for name, (run, directory) in runs.items():
            for stage in (2, 3):
                key = f"{name}/{engine}{stage}"
                results[key] = run(engine, directory, os.path.join(root, key.replace("/", "-")), stage)
        # SFT (test_sft.py): its own set of runs per engine, keyed "sft/NAME"
        results.update({f"sft/{key}": value for key, value in test_sft.runs(engine, model_dir,
                                                                              os.path.join(root, "sft")).items()})
    return results if int(os.environ["RANK"]) == 0 else {}


def of(results: dict, name: str) -> dict:
    """One trainer's runs: {"zt2": ..., "zt3": ..., "ds2": ..., "ds3": ...}."""
    return {key.split("/", 1)[1]: value for key, value in results.items() if key.startswith(name + "/")}
