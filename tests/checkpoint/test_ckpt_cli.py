"""The command line: `zerotrain train` saves and resumes; `zerotrain ckpt inspect|verify|export`.

Every command runs as a process of its own (`python -m zerotrain.cli` forked from the test helpers'
forkserver, `run_cli`: its own cwd, environment, output and exit status without importing torch again; a
launch's torchrun agent and ranks too, `served_python`;
the piped commands as real shell pipelines), as a user would run it.
One module-scoped fixture trains the tiny GPT three times at world size 2 (ZeRO stage 3):
6 steps uninterrupted; 4 steps saving every step asynchronously with keep_last 2; then a
resume to step 6. The corpus is small enough that step 6 starts a second epoch, so the
resumed run must find its exact data position (and RNG) to reproduce the losses.
The uninterrupted run also carries DeepSpeed's `tensorboard` and `csv_monitor` blocks and
`wall_clock_breakdown` (rather than a launch of its own): its events are checked against its metrics.jsonl; and
two keys zerotrain ignores, each warned about once for the job.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distributed import run_cli, served_python

REPO = Path(__file__).resolve().parents[2]
CORPUS_BYTES = "3000"  # 91 blocks of 32 tokens: 11 micro-batches per rank and epoch
# keys a DeepSpeed config may carry that zerotrain ignores, each with one warning for the whole job -> its text
ODD_KEYS = {"cuda_visible_devices": 0, "flops_profiler": {"enabled": True}}
ODD_WARNINGS = ("unknown top-level key 'cuda_visible_devices' is ignored",
                "flops_profiler is a DeepSpeed key that zerotrain does not implement")


def zerotrain(*args: str, cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    # the launcher, its torchrun agent and ranks forked from the test forkserver (served_python as torch's PYTHON_EXEC)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON_EXEC=served_python(),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return run_cli(args, cwd=cwd, env=env, timeout=timeout)


def train(cwd: Path, config: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    proc = zerotrain("train", "--config", str(config), "--nproc", "2", "--model", "tiny",
                     "--steps", str(steps), "--max-corpus-bytes", CORPUS_BYTES, *extra, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def losses(log_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_runs")
    config = json.loads((REPO / "examples/zero3.json").read_text())
    sync_config = root / "sync.json"
    monitors = {"wall_clock_breakdown": True, "tensorboard": {"enabled": True, "output_path": "monitors", "job_name": "tb"},
                "csv_monitor": {"enabled": True, "output_path": "monitors", "job_name": "csv"},
                **ODD_KEYS}  # warned about once for the job
    sync_config.write_text(json.dumps(dict(config, **monitors)))
    config["checkpoint"] = {"async_save": True, "keep_last": 2, "verify_on_load": True}
    async_config = root / "async.json"
    async_config.write_text(json.dumps(config))
    full = train(root, sync_config, 6, "--log-dir", "full", "--save-dir", "full_ckpt")
    first = train(root, async_config, 4, "--log-dir", "resumed", "--save-every", "1")  # default --save-dir
    second = train(root, async_config, 6, "--log-dir", "resumed", "--resume", "--save-every", "1")
    return {"root": root, "full": full, "first": first, "second": second}


def test_train_saves_where_it_says(runs):
    root = runs["root"]
    out = runs["full"].stdout
    assert f"checkpoint of step 6 saved: {root / 'full_ckpt' / 'global_step6'}" in out
    assert (root / "full_ckpt" / "latest").read_text().strip() == "global_step6"
    assert (root / "full_ckpt" / "global_step6" / "manifest.json").is_file()


def test_config_warnings_are_printed_once_for_the_job(runs):
    """The launcher checks the config before it starts the 2 ranks, and each rank reads it again: each warning is
    still printed once (by global rank 0), one line with the whole message."""
    err = runs["full"].stderr
    for said in ODD_WARNINGS:
        lines = [line for line in err.splitlines() if said in line]
        assert len(lines) == 1 and "ConfigWarning: " in lines[0], err


def test_config_block_async_save_and_keep_last_are_honoured(runs):
    root = runs["root"]
    assert "checkpoint of step 1 being written in the background" in runs["first"].stdout
    # keep_last 2, saved every step: after the resumed run only steps 5 and 6 remain (default --save-dir).
    kept = sorted(p.name for p in (root / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["global_step5", "global_step6"]
    assert (root / "checkpoints" / "latest").read_text().strip() == "global_step6"


def test_resume_continues_at_saved_step_with_the_same_losses(runs):
    root = runs["root"]
    assert f"resumed from {root / 'checkpoints' / 'global_step4'} at step 4" in runs["second"].stdout
    assert f"weights from {root / 'checkpoints' / 'global_step4'})" in runs["second"].stdout  # not "random init"
    full, resumed = losses(root / "full"), losses(root / "resumed")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # the resumed run appended steps 5 and 6
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step
    # the final weights agree too (both saved in fp32 at step 6)
    a = load_file(str(root / "full_ckpt/global_step6/model-00001-of-00002.safetensors"))
    b = load_file(str(root / "checkpoints/global_step6/model-00001-of-00002.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_ckpt_inspect_lists_tensors_step_and_topology(runs):
    root = runs["root"]
    proc = zerotrain("ckpt", "inspect", "full_ckpt", cwd=root)  # a save dir: its latest checkpoint
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "global_step6" in text and "step        6" in text
    assert "world_size=2" in text and "stage=3" in text
    assert "model.embed_tokens.weight" in text
    assert "optimizer:" in text and "exp_avg_sq" in text

    report = json.loads(zerotrain("ckpt", "inspect", "--json", "full_ckpt/global_step6", cwd=root).stdout)
    assert report["global_steps"] == 6 and report["topology"]["world_size"] == 2
    model = report["tensors"]["model"]
    assert all(row["dtype"] == "float32" for row in model)
    assert report["bytes"]["model"] == sum(row["bytes"] for row in model)
    with safe_open(str(root / "full_ckpt/global_step6" / model[0]["file"]), "pt") as f:
        assert list(f.get_slice(model[0]["name"]).get_shape()) == model[0]["shape"]


def test_ckpt_verify_passes_then_names_the_corrupt_file(runs, tmp_path):
    root = runs["root"]
    proc = zerotrain("ckpt", "verify", str(root / "full_ckpt"), cwd=root)
    assert proc.returncode == 0 and proc.stdout.startswith("OK "), proc.stdout + proc.stderr

    import shutil
    copy = tmp_path / "global_step6"
    shutil.copytree(root / "full_ckpt" / "global_step6", copy)
    victim = copy / "optimizer-00002-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte: same size, wrong checksum
    victim.write_bytes(bytes(data))
    proc = zerotrain("ckpt", "verify", str(copy), cwd=root)
    assert proc.returncode == 1
    assert "optimizer-00002-of-00002.safetensors" in proc.stderr and "checksum" in proc.stderr
    assert "Traceback" not in proc.stderr

    # every bad file is reported, not only the first
    second = copy / "model-00001-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-3])  # truncated
    proc = zerotrain("ckpt", "verify", str(copy), cwd=root)
    assert proc.returncode == 1
    assert "2 of " in proc.stderr and "files are bad" in proc.stderr
    assert "optimizer-00002-of-00002.safetensors" in proc.stderr and "model-00001-of-00002.safetensors" in proc.stderr

    (copy / "manifest.json").unlink()
    proc = zerotrain("ckpt", "verify", str(copy), cwd=root)
    assert proc.returncode == 1 and "manifest.json" in proc.stderr


def test_ckpt_tools_on_a_file_in_a_pipe_and_as_json_summary(runs):
    root = runs["root"]
    proc = zerotrain("ckpt", "inspect", "full_ckpt/global_step6/manifest.json", cwd=root)
    assert proc.returncode == 1 and "is a file" in proc.stderr and "global_step6" in proc.stderr

    summary = json.loads(zerotrain("ckpt", "inspect", "--json", "--summary", "full_ckpt", cwd=root).stdout)
    assert summary["tensors"]["model"] == len(json.loads(
        zerotrain("ckpt", "inspect", "--json", "full_ckpt", cwd=root).stdout)["tensors"]["model"])

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # the command writes into the shell's pipe itself: served_python forks it from the test forkserver with the
    # stub's own fds 0-2 (the pipe), so torch and zerotrain are not imported afresh for each of the two
    python = served_python()
    piped = subprocess.run(f"{python} -m zerotrain.cli ckpt inspect full_ckpt | head -n 1", shell=True,
                           cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert piped.stdout.startswith("checkpoint") and "Traceback" not in piped.stderr, piped.stderr
    # a reader that is gone before the first write (`true` exits at once): no BrokenPipeError traceback
    closed = subprocess.run(f"{python} -m zerotrain.cli ckpt inspect full_ckpt | true", shell=True,
                            cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in closed.stderr and "BrokenPipe" not in closed.stderr, closed.stderr


def test_ckpt_export_writes_hf_layout_in_bf16(runs, tmp_path):
    root = runs["root"]
    out = tmp_path / "exported"
    proc = zerotrain("ckpt", "export", "full_ckpt", str(out), "--dtype", "bf16", cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "model.safetensors.index.json"] or \
        (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    saved = json.loads((root / "full_ckpt/global_step6/model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(saved["weight_map"])
    exported = {}
    for file in set(index["weight_map"].values()):
        exported.update(load_file(str(out / file)))
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in exported.values())
    original = {}
    for file in set(saved["weight_map"].values()):
        original.update(load_file(str(root / "full_ckpt/global_step6" / file)))
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    assert not any(name.startswith("optimizer") for name in os.listdir(out))
    # The demo's preset is a Hugging Face architecture: the export (config + tokenizer) loads with from_pretrained.
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16 and model.config.model_type == "llama"
    assert transformers.AutoTokenizer.from_pretrained(out)("def")["input_ids"] == list(b"def")

    again = zerotrain("ckpt", "export", "full_ckpt", str(out), cwd=root)  # never overwrites
    assert again.returncode == 1 and "not empty" in again.stderr


def test_ckpt_help_explains_each_tool():
    for tool, words in (("inspect", ["--json", "topology"]), ("verify", ["manifest", "checksum"]),
                        ("export", ["--dtype", "Hugging Face"])):
        proc = zerotrain("ckpt", tool, "--help", cwd=REPO)
        assert proc.returncode == 0
        text = " ".join(proc.stdout.split())
        for word in words:
            assert word in text, (tool, word)
    proc = zerotrain("ckpt", "verify", "/nonexistent/dir", cwd=REPO)
    assert proc.returncode == 1 and "/nonexistent/dir" in proc.stderr


def test_monitors_write_deepspeeds_events_equal_to_the_metrics(runs):
    """TensorBoard events (read with tensorboard's own reader) and CSV files under DeepSpeed's names, at
    DeepSpeed's x (global samples), with the values of metrics.jsonl; only rank 0 writes; every field is
    in the documented schema."""
    import tensorboard  # noqa: F401 - in the dev extra: a missing install fails, never skips
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from zerotrain.monitor import FIELDS

    root = runs["root"]
    records = [json.loads(line) for line in (root / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [16 * step for step in range(1, 7)]  # train_batch_size 16
    for record in records:
        assert {k for k in record if not k.startswith("offload_")} <= set(FIELDS), record
        assert len(record["memory_bytes"]) == 2 and min(record["memory_bytes"]) > 0
        assert record["memory_kind"] == "peak_rss" and "mfu" not in record  # CPU: no known peak
        assert record["comm_bytes"] > 0 and record["grad_norm"] > 0
        assert record["elapsed_time_ms_backward"] >= record["elapsed_time_ms_backward_inner"] > 0
    assert "eval_loss" in records[-1] and "loss_scale" not in records[-1]  # fp32: DeepSpeed writes none

    tb = root / "monitors" / "tb"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1  # rank 0 alone
    events = EventAccumulator(str(tb))
    events.Reload()
    expected = {"Train/Samples/train_loss": "loss", "Train/Samples/lr": "next_lr", "Train/Samples/eval_loss": "eval_loss",
                **{f"Train/Samples/elapsed_time_ms_{t}": f"elapsed_time_ms_{t}"
                   for t in ("forward", "backward", "backward_inner", "backward_allreduce", "step")},
                **{f"Train/Samples/{f}": f for f in ("tokens_per_s", "samples_per_s", "grad_norm", "comm_bytes")},
                "Train/Samples/memory_bytes_rank1": None}
    assert set(expected) <= set(events.Tags()["scalars"])
    for tag, field in expected.items():
        want = [(r["samples"], r[field] if field else r["memory_bytes"][1]) for r in records
                if (field or "memory_bytes") in r]
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [x for x, _ in got] == [x for x, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag  # float32 in events
    assert records[1]["next_lr"] == pytest.approx(records[2]["lr"]) and records[1]["lr"] < records[1]["next_lr"]

    with open(root / "monitors" / "csv" / "Train_Samples_lr.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "lr"]  # DeepSpeed's header: the last part of the event name
    assert [(int(x), float(v)) for x, v in rows[1:]] == [(r["samples"], r["next_lr"]) for r in records]
    out = runs["full"].stdout
    assert f"tensorboard: {Path('monitors') / 'tb'}" in out and "metrics: full/metrics.jsonl" in out
