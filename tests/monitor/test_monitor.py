"""The metrics schema and the monitors, in one process: the record a Trainer step writes (fp16's loss scale
included), the CSV monitor's files, a missing library named with its key and pip extra, the schema's
documentation. The TensorBoard events of a real world-2 run are checked in
tests/checkpoint/test_ckpt_cli.py (it carries the monitor blocks in a launch it makes anyway)."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
from rich.console import Console

from zerotrain.cli import main
from zerotrain.config import load_config
from zerotrain.monitor import FIELDS, MonitorUnavailable, Monitors, check_monitor_libraries, events
from zerotrain.topology import Topology
from zerotrain.trainer import Trainer
from zerotrain.training_engine import TrainingEngine

REPO = Path(__file__).resolve().parents[2]
BASE = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


class Fp16StandIn(TrainingEngine):
    """The slice of the engine API the Trainer reads, on a linear model; fp16-like: a loss scale that
    halves every step (as an overflow would lower it)."""

    def __init__(self, tmp_path: Path):
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.5)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.global_steps = self.global_samples = self.micro_steps = 0
        self.loss_scale = 2.0 ** 16
        self.config = load_config(dict(BASE, fp16={"enabled": True},
                                       csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "csv"}),
                                  dp_world_size=1)
        self.topology = Topology(rank=0, world_size=1, dp_group=None, dp_rank=0, dp_size=1, device=torch.device("cpu"))

    def __call__(self, x, y):
        loss = torch.nn.functional.mse_loss(self.module(x.float()).squeeze(-1), y.float())
        return None, loss

    def backward(self, loss):
        (loss / 2).backward()

    def step(self):
        if self.micro_steps % 2 == 1:
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            self.global_steps += 1
            self.global_samples += 4
            self.loss_scale /= 2
        self.micro_steps += 1

    def gradient_accumulation_steps(self):
        return 2

    def train_micro_batch_size_per_gpu(self):
        return 2

    def train_batch_size(self):
        return 4

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return 1.5


def test_a_step_record_feeds_metrics_and_the_csv_monitor_under_deepspeeds_names(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_PEAK_TFLOPS", "1e-9")  # a peak of 1000 FLOP/s: MFU is reported (never on CPU else)
    engine = Fp16StandIn(tmp_path)
    data = [(torch.randn(2, 4), torch.randn(2)) for _ in range(6)]
    out = io.StringIO()
    summary = Trainer(engine, data, total_steps=3, log_dir=tmp_path / "log", console=Console(file=out)).train()
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [4, 8, 12]
    assert [r["lr"] for r in records] == [0.5, 0.25, 0.125]  # the rate each update applied
    assert [r["next_lr"] for r in records] == [0.25, 0.125, 0.0625]  # DeepSpeed's Train/Samples/lr
    assert [r["loss_scale"] for r in records] == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13]
    assert all(r["samples_per_s"] > 0 and r["grad_norm"] == 1.5 and len(r["memory_bytes"]) == 1 for r in records)
    assert [r["mfu"] for r in records] == pytest.approx([6 * 5 * r["tokens_per_s"] / 1e3 for r in records])  # 5 params
    assert "comm_bytes" not in records[0] and "elapsed_time_ms_forward" not in records[0]  # not counted / no timers
    for name, field in [("loss_scale", "loss_scale"), ("lr", "next_lr"), ("train_loss", "loss")]:
        with open(tmp_path / "csv" / f"Train_Samples_{name}.csv", newline="") as handle:
            rows = list(csv.reader(handle))
        assert rows[0] == ["step", name]
        assert [(int(x), float(v)) for x, v in rows[1:]] == [(r["samples"], r[field]) for r in records], name
    assert summary.outputs["csv_monitor"] == str(tmp_path / "csv")
    assert f"csv_monitor: {tmp_path / 'csv'}" in out.getvalue()


def _wandb_history(run_file: Path, runs: Optional[list] = None) -> list[dict]:
    """The history rows of an offline run's ``.wandb`` file (its run records appended to `runs`, if given). wandb (>= 0.18, the Go core) ships no Python reader
    any more, so we walk its container ourselves: a 7-byte header (":W&B", magic, version), then LevelDB's log
    format (32 KiB blocks of [crc32c u32, length u16, type u8] chunks: 1 full, 2 first, 3 middle, 4 last)
    holding wandb's own protobuf ``Record`` messages, parsed with wandb's generated classes."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pending, rows = run_file.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif record.WhichOneof("record_type") == "run" and runs is not None:
                runs.append(record.run)
    return rows


def test_the_wandb_block_logs_offline_under_deepspeeds_names(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - in the dev extra: a missing install fails, never skips
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_MODE")  # unset: zerotrain must choose offline itself (restored after the test)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens: any network use would fail
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    engine = Fp16StandIn(tmp_path)
    engine.config = load_config(dict(BASE, fp16={"enabled": True}, wandb={"enabled": True, "project": "zt-test",
                                                                          "group": "g1"}), dp_world_size=1)
    (tmp_path / "log").mkdir()  # an earlier run's --log-dir (a resumed job logs into it again)
    data = [(torch.randn(2, 4), torch.randn(2)) for _ in range(6)]
    summary = Trainer(engine, data, total_steps=3, log_dir=tmp_path / "log", console=Console(file=io.StringIO())).train()
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    runs = sorted((tmp_path / "log" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one offline run, under --log-dir"
    assert summary.outputs["wandb"] == str(runs[0].parent)
    run_records: list = []
    rows = _wandb_history(runs[0], run_records)
    assert {(run.project, run.run_group) for run in run_records} == {("zt-test", "g1")}  # the block's, each its own
    assert [row["_step"] for row in rows] == [r["samples"] for r in records] == [4, 8, 12]  # x = global samples
    for row, record in zip(rows, records):
        assert row["Train/Samples/train_loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert row["Train/Samples/lr"] == record["next_lr"]
        assert row["Train/Samples/loss_scale"] == record["loss_scale"]
        assert row["Train/Samples/tokens_per_s"] == pytest.approx(record["tokens_per_s"])
        assert row["Train/Samples/memory_bytes_rank0"] == record["memory_bytes"][0]


def test_events_of_a_record():
    record = {"step": 2, "samples": 32, "loss": 2.0, "lr": 1e-3, "next_lr": 2e-3, "loss_scale": 1024.0,
              "eval_loss": None, "memory_bytes": [10, 20], "memory_kind": "peak_rss", "elapsed_s": 1.0}
    assert sorted(events(record)) == sorted([
        ("Train/Samples/train_loss", 2.0, 32), ("Train/Samples/lr", 2e-3, 32), ("Train/Samples/loss_scale", 1024.0, 32),
        ("Train/Samples/memory_bytes_rank0", 10.0, 32), ("Train/Samples/memory_bytes_rank1", 20.0, 32)])


@pytest.mark.parametrize("block, module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_a_monitor_without_its_library_is_an_error_naming_key_and_extra(block, module, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError, as when not installed
    config = load_config(dict(BASE, **{block: {"enabled": True}}))
    with pytest.raises(MonitorUnavailable, match=rf"{block}\.enabled .* pip install 'zerotrain\[{block}\]'") as info:
        check_monitor_libraries(config)
    assert info.value.key == f"{block}.enabled"
    with pytest.raises(MonitorUnavailable):  # on every rank, before training: not only rank 0 at its first write
        Trainer(SimpleNamespace(config=config), [], total_steps=1)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(dict(BASE, **{block: {"enabled": True}})))
    assert main(["train", "--config", str(path), "--nproc", "2"]) == 2  # refused before any process starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{block}.enabled" in err[0] and f"zerotrain[{block}]" in err[0]


def test_disabled_blocks_build_no_monitor():
    assert not Monitors.build(load_config(dict(BASE, tensorboard={"enabled": False}, wandb={"project": "x"})))


def test_docs_describe_every_field_of_the_schema():
    text = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9_*]+)` \|", text, flags=re.M))
    assert documented == set(FIELDS), (sorted(set(FIELDS) - documented), sorted(documented - set(FIELDS)))
    for name in ("Train/Samples/lr", "Train/Samples/loss_scale", "Train/Samples/train_loss", "Train/Samples/eval_loss",
                 "Train/Samples/elapsed_time_ms_backward_allreduce"):
        assert name in text


def test_the_monitor_blocks_take_deepspeeds_defaults():
    """config/monitor.py against DeepSpeed 0.19's own models (deepspeed/monitor/config.py): every key's default, and
    a block given without `enabled` builds no monitor."""
    from deepspeed.monitor import config as ds

    config = load_config(BASE)
    for ours, theirs in ((config.tensorboard, ds.TensorBoardConfig()), (config.csv_monitor, ds.CSVConfig()),
                         (config.wandb, ds.WandbConfig())):
        assert ours.model_dump() == theirs.model_dump(), type(ours).__name__
    assert not Monitors.build(load_config(dict(BASE, tensorboard={"output_path": "tb"}, csv_monitor={"job_name": "j"},
                                               wandb={"team": "t"})))


class _Listener:
    """What a MemoryTimeline is told by the timers: (event, phase) in order."""

    def __init__(self) -> None:
        self.events: list = []

    def begin(self, name):
        self.events.append(("begin", name))

    def end(self, name):
        self.events.append(("end", name))

    def phase(self, name):
        self.events.append(("phase", name))
        return contextlib.nullcontext()

    def step_done(self):
        self.events.append(("step", None))


def test_wall_clock_timers_sum_micro_steps_per_optimizer_step_in_ms(monkeypatch):
    """monitor/timers.py with a fake clock: each name sums its regions over one optimizer step, close_step() keeps
    the totals (every DeepSpeed name, 0 for unused) and starts over; a region that raises counts too; disabled
    timers keep nothing; the listener hears every region under its phase name, timed or not."""
    from zerotrain.monitor import timers as module
    from zerotrain.monitor.memory_timeline import PHASE_OF_TIMER

    clock = iter(float(t) for t in range(0, 1000, 1))
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock) / 1000.0)  # +1 ms per reading
    timers = module.WallClockTimers(enabled=True, device=torch.device("cpu"))
    listener = timers.listener = _Listener()
    for _ in range(2):  # two micro-steps
        with timers("fwd"):
            pass
        with timers("bwd"):
            with timers("bwd_inner"):
                pass
    with pytest.raises(RuntimeError):
        with timers("step"):
            raise RuntimeError("overflow")
    timers.close_step()
    assert timers.last == pytest.approx({"fwd": 2.0, "bwd": 6.0, "bwd_inner": 2.0, "bwd_allreduce": 0.0, "step": 1.0})
    with timers("fwd"):
        pass
    timers.close_step()
    assert timers.last == pytest.approx({"fwd": 1.0, "bwd": 0.0, "bwd_inner": 0.0, "bwd_allreduce": 0.0, "step": 0.0})
    assert listener.events[:4] == [("begin", PHASE_OF_TIMER.get("fwd", "fwd")), ("end", PHASE_OF_TIMER.get("fwd", "fwd")),
                                   ("begin", PHASE_OF_TIMER.get("bwd", "bwd")),
                                   ("begin", PHASE_OF_TIMER.get("bwd_inner", "bwd_inner"))]
    assert ("end", PHASE_OF_TIMER.get("step", "step")) in listener.events
    assert listener.events.count(("step", None)) == 2
    timers.phase("gather")
    assert listener.events[-1] == ("phase", PHASE_OF_TIMER.get("gather", "gather"))
    off = module.WallClockTimers(enabled=False, device=torch.device("cpu"))
    with off("fwd"):
        pass
    off.close_step()
    assert off.last == {}
    assert isinstance(off.phase("save"), contextlib.nullcontext)  # no listener: nothing to tell
    off.listener = _Listener()
    with off("bwd"):
        pass
    assert off.listener.events == [("begin", PHASE_OF_TIMER.get("bwd", "bwd")), ("end", PHASE_OF_TIMER.get("bwd", "bwd"))]


# Dense bf16/fp16 tensor-core peaks from the vendors' data sheets, by the name torch reports for the device.
DATA_SHEET_TFLOPS = {"NVIDIA GB200": 2500.0, "NVIDIA B200": 2250.0, "NVIDIA H200": 989.4, "NVIDIA H100 PCIe": 756.0,
                     "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H800": 989.4, "NVIDIA A100-SXM4-80GB": 312.0,
                     "NVIDIA A800 80GB PCIe": 312.0, "NVIDIA L40S": 362.1, "NVIDIA L40": 181.0, "NVIDIA A10G": 125.0,
                     "NVIDIA A10": 125.0, "NVIDIA L4": 121.0, "Tesla V100-SXM2-32GB": 125.0,
                     "AMD Instinct MI300X": 1307.4, "AMD Instinct MI250X": 383.0}


def test_peak_flops_are_the_data_sheets_for_16_bit_training_only(monkeypatch):
    """monitor/measure.py: the peak behind MFU, by device name (the most specific part first: an H100 PCIe is not an
    SXM H100, an L40S not an L40), None for fp32, CPUs and unknown devices, ZEROTRAIN_PEAK_TFLOPS over all."""
    from zerotrain.monitor import measure

    monkeypatch.delenv(measure.PEAK_TFLOPS_ENV, raising=False)
    cuda = torch.device("cuda", 0)
    for name, tflops in DATA_SHEET_TFLOPS.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert measure.peak_flops(cuda, "bf16") == measure.peak_flops(cuda, "fp16") == tflops * 1e12, name
        assert measure.peak_flops(cuda, "fp32") is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA T4")
    assert measure.peak_flops(cuda, "bf16") is None
    assert measure.peak_flops(torch.device("cpu"), "bf16") is None
    monkeypatch.setenv(measure.PEAK_TFLOPS_ENV, "123.5")
    assert measure.peak_flops(torch.device("cpu"), "fp32") == 123.5e12
    monkeypatch.setenv(measure.PEAK_TFLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="ZEROTRAIN_PEAK_TFLOPS='fast' is not a number"):
        measure.peak_flops(cuda, "bf16")


def test_memory_is_the_process_peak_rss_in_bytes_on_the_cpu():
    from zerotrain.monitor import measure

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith(field + ":"))

    rss = status_kib("VmRSS") * 1024
    measured = measure.memory_bytes(torch.device("cpu"))
    # the kernel's own high-water mark (ru_maxrss trails VmRSS by the pages touched since its last accounting)
    assert 0.9 * rss <= measured <= status_kib("VmHWM") * 1024 * 1.01 + (1 << 20)
    assert measure.memory_kind(torch.device("cpu")) == "peak_rss"
    assert measure.memory_kind(torch.device("cuda", 0)) == "cuda_max_allocated"
    model = torch.nn.Linear(3, 2)
    model.weight.ds_numel = 60  # a ZeRO-3 shard knows its whole size
    assert measure.parameter_count(model) == 60 + 2


def test_events_use_deepspeeds_names_for_eval_loss_and_the_timers_and_skip_flags():
    record = {"step": 3, "samples": 48, "eval_loss": 1.5, "elapsed_time_ms_forward": 12.0,
              "elapsed_time_ms_backward_allreduce": 3.0, "skipped": True, "note": "x"}
    assert sorted(events(record)) == sorted([
        ("Train/Samples/eval_loss", 1.5, 48), ("Train/Samples/elapsed_time_ms_forward", 12.0, 48),
        ("Train/Samples/elapsed_time_ms_backward_allreduce", 3.0, 48)])


def test_the_tensorboard_monitor_writes_deepspeeds_events_in_process(tmp_path):
    """monitor/writers.py's TensorBoard writer without a launch (test_ckpt_cli.py checks a world-2 run's): the
    directory output_path/job_name, one event file, each event at DeepSpeed's x (global samples)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monitors = Monitors.build(load_config(dict(BASE, tensorboard={"enabled": True, "output_path": str(tmp_path),
                                                                  "job_name": "tb"})))
    assert monitors.paths() == {"tensorboard": str(tmp_path / "tb")}
    for step in (1, 2):
        monitors.write({"step": step, "samples": 4 * step, "loss": 1.0 / step, "next_lr": 0.1 * step})
    monitors.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("Train/Samples/train_loss")] == [(4, 1.0), (8, 0.5)]
    assert [(e.step, round(e.value, 6)) for e in accumulator.Scalars("Train/Samples/lr")] == [(4, 0.1), (8, 0.2)]
    resumed = Monitors.build(load_config(dict(BASE, tensorboard={"enabled": True, "output_path": str(tmp_path),
                                                                 "job_name": "tb"})))  # a resume: the same directory
    resumed.write({"step": 3, "samples": 12, "loss": 0.25})
    resumed.close()


def test_building_a_monitor_without_its_library_is_the_named_refusal(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MonitorUnavailable, match="tensorboard.enabled"):
        Monitors.build(load_config(dict(BASE, tensorboard={"enabled": True})))
