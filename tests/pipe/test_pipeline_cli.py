"""`zerotrain train --pipeline-parallel-size 2` end to end: a Llama directory and a local data file, 2 ranks = 2
stages; the run trains (each step's loss on every rank, the weights move), and its checkpoint is a Hugging Face
directory of the model's own names that `from_pretrained` reads, holding the trained weights of both stages; its
evaluation (`--eval-data`, through `eval_batch`) equals the saved model's single-process loss on the same
micro-batches. The launches' torchrun agents and ranks are forked from the test forkserver (`served_python` as
torch's PYTHON_EXEC: torch, zerotrain and transformers not imported afresh by each of the three processes)."""
from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from distributed import run_cli, served_python

pytest.importorskip("transformers")


def _served_env() -> dict:
    """The launch's environment: its agent and ranks forked from the forkserver (no test here reads the process
    tree)."""
    return {**os.environ, "PYTHON_EXEC": served_python()}


def test_train_pipeline_parallel_size_2_on_a_data_file(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n"}) + "\n"
                            for i in range(48)))
    evals = tmp_path / "eval.jsonl"  # 10 samples: 5 micro-batches of 2, evaluated as 2 batches of 2 (accumulation)
    evals.write_text("".join(json.dumps({"text": f"def h{i}(z):\n    return z ** {i % 4}" + " + z" * (i % 3)}) + "\n"
                             for i in range(10)))
    save, log = tmp_path / "ck", tmp_path / "log"
    result = run_cli(["train", "--model", str(tiny_llama_dir), "--data", str(data), "--nproc", "2",
                      "--pipeline-parallel-size", "2", "--max-steps", "2", "--seq-len", "32",
                      "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2",
                      "--learning-rate", "1e-2", "--lr-scheduler-type", "constant", "--save-dir", str(save),
                      "--log-dir", str(log), "--no-packing", "--eval-data", str(evals)],
                     env=_served_env(), timeout=400)  # padded batches: padded again to --seq-len
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pipeline: 2 stages (1f1b)" in result.stdout, result.stdout
    assert "evaluation 4 micro-batches per rank through eval_batch" in result.stdout, result.stdout
    records = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r.get("step")]
    assert [r["step"] for r in steps] == [1, 2] and all(0 < r["loss"] < 20 for r in steps), records
    assert "eval_loss" not in steps[0], steps[0]  # evaluated after the last step only (no --eval-steps)
    # the run's input tokens: the first stage's padded micro-batches (2 steps x 2 x 2 samples x 32), the second
    # stage's ranks adding none
    assert json.loads((log / "summary.json").read_text())["tokens"] == 2 * 2 * 2 * 32
    latest = (save / "latest").read_text().strip()
    trained = AutoModelForCausalLM.from_pretrained(str(save / latest), dtype=torch.float32)
    # the eval loss: the trained model in one process, plain PyTorch, on the same 4 micro-batches (the eval set's
    # first 4 of 2 samples, unpadded), the mean of their losses
    from transformers import AutoTokenizer

    from zerotrain.data import DataConfig, build_data
    eval_set = build_data(DataConfig(paths=[str(evals)], seq_len=32, packing=False, seed=1234),
                          AutoTokenizer.from_pretrained(str(tiny_llama_dir)), model=trained)
    with torch.no_grad():
        losses = [trained(**batch).loss.item()
                  for batch in itertools.islice(eval_set.eval_loader(micro_batch_size=2), 4)]
    expected = sum(losses) / len(losses)
    assert len(set(losses)) == 4  # the batches differ: a wrong mean over them shows
    assert steps[1]["eval_loss"] == pytest.approx(expected, rel=1e-5), (steps[1], losses)
    assert f"eval_loss {expected:.4f}" in result.stdout, result.stdout  # printed as without a pipeline
    initial = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    # step 1's loss (the Trainer's one reduction over the pipeline's ranks: the last stage's loss) is the initial
    # model's single-process loss on the run's first batch: the mean of its 2 micro-batches' (padding is ignored)
    train_set = build_data(DataConfig(paths=[str(data)], seq_len=32, packing=False, seed=1234),
                           AutoTokenizer.from_pretrained(str(tiny_llama_dir)), model=initial)
    with torch.no_grad():
        first = [initial(**batch).loss.item() for batch in itertools.islice(
            train_set.loader(micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_size=1), 2)]
    assert steps[0]["loss"] == pytest.approx(sum(first) / 2, rel=1e-5), (steps[0], first)
    names = dict(initial.named_parameters())
    moved = {n for n, p in trained.named_parameters() if not torch.equal(p, names[n])}
    # both stages' layers trained (embedding on the first, the head on the last)
    assert "model.embed_tokens.weight" in moved and "lm_head.weight" in moved and "model.norm.weight" in moved, moved


def test_train_pipeline_parallel_size_2_with_lora(tmp_path, tiny_llama_dir):
    """`--lora-r` with `--pipeline-parallel-size 2` at the default gradient accumulation (one micro-batch per step,
    fewer than the stages): each stage trains its adapters only, and the checkpoint's adapter files (written from
    both stages) load with peft onto the untouched base, its LoRA weights trained."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def g{i}(y):\n    return y - {i}\n"}) + "\n" for i in range(32)))
    save = tmp_path / "ck"
    result = run_cli(["train", "--model", str(tiny_llama_dir), "--data", str(data), "--nproc", "2",
                      "--pipeline-parallel-size", "2", "--lora-r", "4", "--max-steps", "2", "--seq-len", "32",
                      "--per-device-train-batch-size", "2",  # gradient accumulation 1: one micro-batch per step
                      "--learning-rate", "1e-2", "--lr-scheduler-type", "constant", "--save-dir", str(save),
                      "--no-packing"],  # (issue 44: torch's 1F1B refused it; GPipe runs it)
                     env=_served_env(), timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("pipeline: 2 stages (gpipe in place of 1f1b: 1 micro-batch(es) per step, fewer than the stages)"
            in result.stdout and "LoRA: trainable params" in result.stdout), result.stdout
    checkpoint = save / (save / "latest").read_text().strip()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    untouched = {n: p.detach().clone() for n, p in base.named_parameters()}
    adapted = PeftModel.from_pretrained(base, str(checkpoint))
    lora = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    # peft starts lora_B at zero: a trained B on the first and on the last stage's layers
    layers = {n.split(".layers.")[1].split(".")[0] for n, p in lora.items() if "lora_B" in n and p.abs().sum() > 0}
    from transformers import AutoConfig
    last = str(AutoConfig.from_pretrained(str(tiny_llama_dir)).num_hidden_layers - 1)
    assert {"0", last} <= layers, layers
    for name, param in adapted.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(param, untouched[name.replace(".base_layer", "")]), name


def test_pipeline_flag_config_and_refusals(capsys):
    """The flag sets `pipeline_parallel_size`, ZeRO-1 by default and a batch of world / N data-parallel ranks; what it
    cannot run is one line naming the flag, before any process starts (rc 2)."""
    from zerotrain.cli import main

    assert main(["train", "--nproc", "4", "--pipeline-parallel-size", "2", "--per-device-train-batch-size", "3",
                 "--gradient-accumulation-steps", "2", "--max-steps", "4", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["pipeline_parallel_size"] == 2 and printed["zero_optimization"]["stage"] == 1
    assert printed["train_batch_size"] == 3 * 2 * 2  # micro x accumulation x (4 ranks / 2 stages)
    assert main(["train", "--nproc", "3", "--pipeline-parallel-size", "2"]) == 2
    assert "--pipeline-parallel-size 2 does not divide the 3 ranks" in capsys.readouterr().err
    # evaluation runs whole batches of gradient_accumulation_steps micro-batches: the rest left out, less refused
    from zerotrain.train.pipeline import eval_micro_batches
    assert [eval_micro_batches(n, 2) for n in (2, 3, 5, 8)] == [2, 2, 4, 8]
    with pytest.raises(ValueError, match=r"1 evaluation micro-batch\(es\) per rank, fewer than the 2"):
        eval_micro_batches(1, 2)
