"""TRL's own example scripts, as shipped with the installed TRL (`trl/scripts/sft.py`, `dpo.py`, `reward.py`,
`grpo.py`), after an imports-only edit (the trainer and config classes taken from `zerotrain.hf`), with their normal
command lines including `--deepspeed ds.json`, against the unedited scripts under DeepSpeed 0.19.8.

Each script runs at world 2 (CPU, gloo, fp32), ZeRO-2 and ZeRO-3, on a tiny Llama built offline and a local JSON-lines dataset given as
`--dataset_name DIR`, as a torchrun rank runs it (`runpy` of the script with its `sys.argv`); the logged steps are
read from the Trainer's `trainer_state.json` in the last checkpoint. Checked: the edit touches import lines only;
every step's loss, gradient norm and learning rate within 1e-5 of DeepSpeed's (hf_compare.assert_same_steps), and
the trained weights `save_model` wrote load with `from_pretrained`. Slow (about a minute a script): the trainers
themselves are compared with DeepSpeed in the default suite (test_sft.py, test_dpo.py, test_reward.py,
test_grpo.py).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import warnings
from pathlib import Path

import pytest

from distributed import run_distributed
from hf_compare import assert_same_steps

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("trl") is None,
                                 reason="needs deepspeed and trl")]

STEPS = 3
ZEROTRAIN_NAMES = {"SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig", "RewardTrainer", "RewardConfig", "GRPOTrainer",
                   "GRPOConfig"}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def imports_only_edit(source: str) -> str:
    """The script with its `from trl import ...` lines split: the trainers and configs zerotrain.hf has from
    zerotrain.hf, the rest from trl. No other line changes."""
    out = []
    for line in source.splitlines(keepends=True):
        match = re.fullmatch(r"(\s*)from trl import (.+)\n", line)
        if match is None:
            out.append(line)
            continue
        indent, names = match.group(1), [n.strip() for n in match.group(2).split(",")]
        ours = [n for n in names if n in ZEROTRAIN_NAMES]
        rest = [n for n in names if n not in ZEROTRAIN_NAMES]
        if rest:
            out.append(f"{indent}from trl import {', '.join(rest)}\n")
        if ours:
            out.append(f"{indent}from zerotrain.hf import {', '.join(ours)}\n")
    return "".join(out)


def _run_script(script: str, argv: list, deepspeed: bool, cwd: str) -> None:
    import runpy

    warnings.simplefilter("ignore")
    os.chdir(cwd)  # grpo.py imports `--reward_funcs module.function` from the working directory
    if deepspeed:  # as tests/hf/test_dpo.py: on CPU, accelerate leaves the gloo group to DeepSpeed's own init
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _dataset(directory: Path, kind: str) -> str:
    import random

    rng = random.Random(7)
    words = lambda lo, hi: " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))  # noqa: E731
    if kind == "sft":
        rows = [{"text": words(8, 20)} for _ in range(32)]
    elif kind == "dpo":
        rows = [{"prompt": words(3, 8) + " ->", "chosen": " " + words(2, 6), "rejected": " " + words(2, 6)}
                for _ in range(32)]
    elif kind == "reward":
        rows = [{"chosen": words(4, 12), "rejected": words(4, 12)} for _ in range(32)]
    else:
        rows = [{"prompt": words(3, 7) + " ->"} for _ in range(32)]
    directory.mkdir(parents=True)
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(directory)


def _log(out: Path) -> list:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in state["log_history"] if "loss" in h]


REWARDS = '''
def letters(completions, **kwargs):
    """The share of the letter 'a' in each completion."""
    return [text.count("a") / max(1, len(text)) for text in completions]
'''

SCRIPTS = {  # script -> (dataset kind, its own arguments)
    "sft": ("sft", ["--max_length", "48"]),
    "dpo": ("dpo", ["--max_length", "48", "--beta", "0.1"]),
    "reward": ("reward", ["--max_length", "48"]),
    # a reward function in Python by its import path; sampled completions (temperature 1, the same seed both sides)
    "grpo": ("grpo", ["--reward_funcs", "rewards_for_test.letters", "--num_generations", "4",
                      "--max_completion_length", "8", "--beta", "0.1", "--per_device_train_batch_size", "4"]),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_trl_script_with_zerotrain_imports_against_deepspeed(name, stage, tiny_llama_dir, tmp_path):
    import trl

    original = Path(trl.__file__).parent / "scripts" / f"{name}.py"
    source = original.read_text()
    edited = imports_only_edit(source)
    changed = [line for line in set(edited.splitlines()) ^ set(source.splitlines())]
    assert changed and all(re.fullmatch(r"\s*from (trl|zerotrain\.hf) import .+", line) for line in changed), changed
    assert "from zerotrain.hf import" in edited
    script = tmp_path / f"{name}.py"
    script.write_text(edited)
    kind, extra = SCRIPTS[name]
    data = _dataset(tmp_path / "data", kind)
    (tmp_path / "rewards_for_test.py").write_text(REWARDS)
    model_dir = str(tiny_llama_dir)
    if name == "reward":  # a sequence-classification model with its score head saved (no random head either side)
        from test_reward import reward_model_dir
        model_dir = reward_model_dir(tiny_llama_dir, tmp_path / "reward_model")
    ds_config = tmp_path / "ds.json"
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    ds_config.write_text(json.dumps({"zero_optimization": zero,
                                     "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                     "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))
    logs = {}
    for side, path in (("zt", str(script)), ("ds", str(original))):
        out = tmp_path / side
        argv = ["--model_name_or_path", model_dir, "--dataset_name", data, "--dtype", "float32",
                "--learning_rate", "5e-3", "--max_steps", str(STEPS), "--per_device_train_batch_size", "2",
                "--gradient_accumulation_steps", "2", "--output_dir", str(out), "--deepspeed", str(ds_config),
                "--bf16", "False", "--use_cpu", "--report_to", "none", "--logging_steps", "1", "--save_strategy",
                "steps", "--save_steps", str(STEPS), "--seed", "5", "--disable_tqdm", "True", *extra]
        run_distributed(_run_script, 2, path, argv, side == "ds", str(tmp_path), timeout=840)
        logs[side] = _log(out)
    assert_same_steps(f"{name} ZeRO-{stage}", logs["zt"], logs["ds"], steps=STEPS)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    auto = AutoModelForSequenceClassification if name == "reward" else AutoModelForCausalLM
    auto.from_pretrained(tmp_path / "zt")  # save_model's weights
