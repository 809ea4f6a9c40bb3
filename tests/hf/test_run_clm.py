"""transformers' own `examples/pytorch/language-modeling/run_clm.py`, verbatim, after an imports-only edit
(`Trainer`, `TrainingArguments` from `zerotrain.hf`), with its normal command line (`torchrun --nproc_per_node 2
run_clm.py --model_name_or_path DIR --train_file x.txt --do_train --deepspeed ds.json ...`), against the unedited
script under DeepSpeed 0.19.8.

The script is not in transformers' pip package: it is read from ZEROTRAIN_UPSTREAM_TRANSFORMERS (a transformers
checkout; default /work/upstream/transformers) and the tests skip, saying where to put it, when it is absent. It
imports `evaluate` (`pip install evaluate`; only `--do_eval` downloads a metric, so the runs train only).

- fast (default suite): the edit touches import lines only, and the edited script's own `HfArgumentParser` takes
  the command line with `--deepspeed ds.json` into zerotrain's `TrainingArguments` (the file's stage, the `"auto"`
  batch sizes filled from the flags).
- slow: both scripts under `torchrun` at world 2 (CPU, gloo, fp32; the unedited one through a shim that first
  initialises deepspeed.comm over gloo, which accelerate leaves to DeepSpeed on the CPU) on the tiny Llama of
  tests/conftest.py and a local text file, ZeRO-2 and ZeRO-3: every step's loss, gradient norm and learning rate within 1e-5
  (hf_compare.assert_same_steps, read from each run's `trainer_state.json`), and the weights `save_model` wrote load
  with `from_pretrained`.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port
from hf_compare import assert_same_steps

UPSTREAM = Path(os.environ.get("ZEROTRAIN_UPSTREAM_TRANSFORMERS", "/work/upstream/transformers"))
RUN_CLM = UPSTREAM / "examples" / "pytorch" / "language-modeling" / "run_clm.py"
ZEROTRAIN_NAMES = {"Trainer", "TrainingArguments"}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
STEPS = 3

pytestmark = [
    pytest.mark.skipif(not RUN_CLM.is_file(), reason=f"put transformers' examples/pytorch/language-modeling/run_clm.py at "
                                                     f"{RUN_CLM} (or set ZEROTRAIN_UPSTREAM_TRANSFORMERS to a checkout)"),
    pytest.mark.skipif(importlib.util.find_spec("evaluate") is None, reason="run_clm.py imports evaluate: pip install evaluate"),
]


def imports_only_edit(source: str) -> str:
    """`source` with the names zerotrain.hf has (`Trainer`, `TrainingArguments`) taken out of its `from transformers
    import ...` statements (one line or a parenthesized block) and imported from zerotrain.hf right after them, as
    docs/hf.md says. No other line changes."""
    pattern = re.compile(r"^from transformers import (\((?:[^()]*)\)|[^\n(]+)\n", re.M)

    def rewrite(match: re.Match) -> str:
        body = match.group(1)
        names = [n.strip() for n in body.strip("()").replace("\n", " ").split(",") if n.strip()]
        ours = [n for n in names if n in ZEROTRAIN_NAMES]
        if not ours:
            return match.group(0)
        if body.startswith("("):
            kept = "".join(line + "\n" for line in match.group(0).splitlines()
                           if line.strip().rstrip(",") not in ZEROTRAIN_NAMES)
        else:
            kept = f"from transformers import {', '.join(n for n in names if n not in ZEROTRAIN_NAMES)}\n"
        return kept + f"from zerotrain.hf import {', '.join(ours)}\n"

    return pattern.sub(rewrite, source)


def _text_file(path: Path) -> str:
    rng = random.Random(7)
    path.write_text("".join(" ".join(rng.choices(WORDS, k=rng.randint(8, 20))) + "\n" for _ in range(64)))
    return str(path)


def _ds_config(path: Path, stage: int) -> str:
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    path.write_text(json.dumps({"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                                "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto"}))
    return str(path)


def _argv(model_dir: str, train_file: str, ds_config: str, out: Path) -> list:
    """run_clm.py's command line, as its README gives it, with --deepspeed and a short fp32 CPU run."""
    return ["--model_name_or_path", model_dir, "--train_file", train_file, "--do_train", "--deepspeed", ds_config,
            "--output_dir", str(out), "--block_size", "32", "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2", "--max_steps", str(STEPS), "--learning_rate", "5e-3",
            "--logging_steps", "1", "--use_cpu", "--report_to", "none", "--seed", "5", "--dtype", "float32",
            "--save_strategy", "steps", "--save_steps", str(STEPS), "--disable_tqdm", "True"]


def _edited(tmp_path: Path) -> tuple[str, Path]:
    source = RUN_CLM.read_text()
    edited = imports_only_edit(source)
    removed = [line for line in source.splitlines() if line not in edited.splitlines()]
    added = [line for line in edited.splitlines() if line not in source.splitlines()]
    assert sorted(line.strip() for line in removed) == ["Trainer,", "TrainingArguments,"], removed
    assert added == ["from zerotrain.hf import Trainer, TrainingArguments"], added
    script = tmp_path / "run_clm.py"
    script.write_text(edited)
    return source, script


def test_run_clm_edit_parses_its_command_line_into_zerotrain(tiny_llama_dir, tmp_path, monkeypatch):
    """The edited script's own parser (its dataclasses and zerotrain's TrainingArguments) takes `--deepspeed ds.json`."""
    import runpy

    _, script = _edited(tmp_path)
    module = runpy.run_path(str(script), run_name="run_clm")  # its definitions, not main()
    from zerotrain.hf import TrainingArguments

    assert module["TrainingArguments"] is TrainingArguments
    parser = module["HfArgumentParser"]((module["ModelArguments"], module["DataTrainingArguments"], TrainingArguments))
    argv = _argv(str(tiny_llama_dir), _text_file(tmp_path / "train.txt"), _ds_config(tmp_path / "ds.json", 2),
                 tmp_path / "out")
    model_args, data_args, args = parser.parse_args_into_dataclasses(argv)
    assert (model_args.model_name_or_path, data_args.block_size) == (str(tiny_llama_dir), 32)
    assert args.deepspeed == str(tmp_path / "ds.json") and args.deepspeed_plugin is None
    config = args.zerotrain_config
    assert config["zero_optimization"]["stage"] == 2
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)
    assert config["gradient_clipping"] == 1.0


def _trainer_log(out: Path) -> list:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in state["log_history"] if "loss" in h]


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("stage", [2, 3])
def test_run_clm_with_zerotrain_imports_against_deepspeed(stage, tiny_llama_dir, tmp_path):
    source, script = _edited(tmp_path)
    train_file = _text_file(tmp_path / "train.txt")
    ds_config = _ds_config(tmp_path / "ds.json", stage)
    repo = str(Path(__file__).resolve().parents[2])
    # DeepSpeed on the CPU: accelerate leaves deepspeed.comm uninitialised, so at ZeRO-3 the zero.Init of run_clm's
    # from_pretrained would see a world of 1 ("train_batch_size 8 != 2 * 2 * 1"); torchrun starts this shim, which
    # initialises it over gloo (as tests/hf/test_scripts.py does) and runs the unedited script as __main__
    shim = tmp_path / "deepspeed_gloo_shim.py"
    shim.write_text("import runpy, sys\nimport deepspeed\n\ndeepspeed.init_distributed(dist_backend='gloo')\n"
                    f"sys.argv[0] = {str(RUN_CLM)!r}\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")
    logs = {}
    for side, path in (("zt", script), ("ds", shim)):
        out = tmp_path / side
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               "DS_ACCELERATOR": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(free_port()), str(path), *_argv(str(tiny_llama_dir), train_file, ds_config, out)]
        done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1400)
        assert done.returncode == 0, (side, done.stdout[-3000:], done.stderr[-6000:])
        logs[side] = _trainer_log(out)
    assert_same_steps(f"run_clm zero-{stage}", logs["zt"], logs["ds"], steps=STEPS)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "zt")  # the weights save_model wrote
