"""The largest model this machine trains: ZeRO-3, bf16, parameters and optimizer states on NVMe (issue #15).

Builds a `zerotrain.models.GPT` (or a Hugging Face Llama) under `zerotrain.zero.Init` at world 2 (gloo on
127.0.0.1, one thread per rank), with `offload_param` and `offload_optimizer` on NVMe, activation
checkpointing, AdamW, micro-batch B and sequence T, and trains `--steps` steps. It reports, side by side:

- parameters, peak RSS per rank (sampled every 50 ms by a thread in each rank, the whole run: build,
  initialize and the steps), the bytes of the swap files on disk (per rank and per parameter);
- per step: the slowest rank's step time, and where it goes: forward / backward / optimizer step (the
  engine's wall-clock timers), the wall time the disk was busy (the union of every `pread`/`pwrite`
  interval of the I/O threads, any rank), the bytes moved to and from NVMe, the time inside
  collectives (`Comm` calls and handle waits);
- the disk's own bandwidth (`dd` with O_DIRECT on the same directory, write then read), the compute time
  of the step measured alone (one transformer block's forward + recompute + backward at the run's shapes,
  times the blocks, plus the embedding and head; no I/O, no communication), and the overlap ratio
  step / max(compute, NVMe bytes / dd bandwidth) (target ≤ 1.3).

Before writing anything it checks the free space of `--nvme-path` against the bytes it will write (14 per
parameter plus the spare records and buffers) and refuses a size that would leave less than
`--keep-free` (5 GB); it deletes its files afterwards, also on failure or Ctrl-C. With `--plots DIR` it
writes each rank's memory timeline (`zerotrain.monitor.MemoryTimeline`: host RSS every 0.1 s under the
phases init = zero.Init building the model, initialize, then the engine's forward / backward / gather /
reduce / optimizer step) as `DIR/scale_{model}_{size}b_memory_timeline_rank{R}.png`.

    python benchmarks/scale.py --layers 4 --width 1024                   # ~80M, a smoke run
    python benchmarks/scale.py --params 1e9 --plots benchmarks/results   # + the memory timeline PNGs
    python benchmarks/scale.py --params 4e9 --steps 3 --json out.json    # the largest size
    python benchmarks/scale.py --model llama --params 1e9
    python benchmarks/scale.py --params 1e9 --defaults   # no size key: zerotrain's memory budget sizes them

With `--defaults` the config sets no size key and no activation checkpointing (what a new user runs, issue
#27): rank 0 prints the memory budget and the sizes it chose, and the table gives peak RSS / budget per rank.
It keeps DeepSpeed's defaults, `gradient_clipping` 1.0 included (issue #43: the engine then takes the norm from a
first backward and streams the clipped step in a second; with `--spill` the NVMe optimizer spills the gradient
shards to disk during backward instead; the table gives the host bytes held for gradients, counted by the
optimizer, and the spill file's bytes). `--no-clip` runs the same with `gradient_clipping: 0` (the gradients
streamed into the step) as its own named row; `--compare-no-clip` runs both rows, one after the other, and
prints the clipped row's step time and peaks over the no-clip row's.

    python benchmarks/scale.py --params 2.4e9 --defaults --compare-no-clip   # both rows, the issue-43 targets

`--optimizer-device cpu` (with `--defaults`) puts the optimizer on plain CPU offload (masters and Adam moments in
host memory; with `--bf16-records` in bf16: `bf16_master_weights_and_grads` + `bf16_optimizer_states`), the
parameters still on NVMe: its own named row.

    python benchmarks/scale.py --layers 9 --width 1280 --defaults --optimizer-device cpu --bf16-records
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
VOCAB = 50304
SPARE_RECORDS = 8  # the NVMe optimizer's default spare extents per rank (see zerotrain/offload/nvme_records.py)
RECORD_BYTES = (1 << 22) * 12  # one 4M-element record: fp32 master + exp_avg + exp_avg_sq


# --- model shapes -----------------------------------------------------------------
def gpt_params(layers: int, width: int, seq: int) -> int:
    """Parameters of zerotrain's GPT (tied head, biases, MLP 4x)."""
    block = 12 * width * width + 13 * width
    return VOCAB * width + seq * width + layers * block + 2 * width


def llama_params(layers: int, width: int) -> int:
    """Parameters of a Llama with untied head, MLP 8/3 x (rounded to 256), MHA."""
    inner = _llama_inner(width)
    return 2 * VOCAB * width + layers * (4 * width * width + 3 * width * inner + 2 * width) + width


def _llama_inner(width: int) -> int:
    return int(math.ceil(8 * width / 3 / 256) * 256)


def shape_for(kind: str, target: float, seq: int) -> tuple[int, int]:
    """(layers, width) near `target` parameters: width grows with depth as in GPT-3's table."""
    best = None
    for width in range(1024, 8193, 256):
        layers = max(1, round(width / 128))  # depth ~ width/128 (e.g. 2048 -> 16, 4096 -> 32)
        count = gpt_params(layers, width, seq) if kind == "gpt" else llama_params(layers, width)
        if best is None or abs(count - target) < abs(best[2] - target):
            best = (layers, width, count)
    # then adjust depth at that width to get closer
    layers, width, _ = best
    per_layer = (gpt_params(2, width, seq) - gpt_params(1, width, seq)) if kind == "gpt" else \
        (llama_params(2, width) - llama_params(1, width))
    base = gpt_params(0, width, seq) if kind == "gpt" else llama_params(0, width)
    return max(1, round((target - base) / per_layer)), width


# --- measurements in the parent -----------------------------------------------------
def dd_bandwidth(directory: str, nbytes: int = 1 << 30) -> dict:
    """GB/s of `dd` writing then reading `nbytes` with O_DIRECT (bs=16M) in `directory`; the file is removed."""
    path = os.path.join(directory, f"zt-scale-dd-{os.getpid()}")
    count = max(1, nbytes >> 24)
    out = {}
    try:
        for what, cmd in (("write", ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}",
                                     "oflag=direct", "conv=fsync"]),
                          ("read", ["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"])):
            start = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            out[what] = count * (1 << 24) / (time.perf_counter() - start) / 1e9
    finally:
        if os.path.exists(path):
            os.remove(path)
    out["mean"] = (out["read"] + out["write"]) / 2
    return out


def disk_needed(params: int, bf16_records: bool = False, clipped: bool = False, optimizer_on_disk: bool = True) -> int:
    """Bytes the run writes on disk at most: 14 per parameter (fp32 master and Adam moments, bf16 weights; 8
    with `--bf16-records`), each rank's spare records, shard padding (one record per rank per bucket at worst),
    and dd's file. Clipping adds nothing here: the bf16 gradients are spilled into the parameters' own extents
    (issue #43; only the persistent parameters' go to a spill file: kilobytes per layer, within the 1 GiB slack)."""
    if not optimizer_on_disk:  # --optimizer-device cpu: the bf16 parameters only
        return 2 * params + (1 << 30)
    return (8 if bf16_records else 14) * params + \
        WORLD * (SPARE_RECORDS + 16) * RECORD_BYTES + (1 << 30)


def du(path: str) -> int:
    """Bytes allocated on disk under `path` (sparse holes not counted)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# --- the worker ------------------------------------------------------------------------
class Sampler:
    """Peak RSS of this process (and the swap files' size on disk), sampled every `period` seconds."""

    def __init__(self, nvme_dir: str, period: float = 0.05):
        import psutil
        self.process, self.nvme_dir, self.period = psutil.Process(), nvme_dir, period
        self.peak = 0
        self.peak_phase = "start"
        self.phase = "start"
        self.disk_peak = 0
        self.peaks: dict[str, int] = {}  # peak RSS per phase: build (zero.Init), initialize, step{i}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ticks = 0
        while not self._stop.is_set():
            rss = self.process.memory_info().rss
            if rss > self.peak:
                self.peak, self.peak_phase = rss, self.phase
            stage = self.phase.split(":")[0]
            self.peaks[stage] = max(self.peaks.get(stage, 0), rss)
            ticks += 1
            if ticks % 20 == 0:
                self.disk_peak = max(self.disk_peak, du(self.nvme_dir))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Intervals:
    """The union of busy intervals of several threads (the disk's busy wall time)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.active = 0
        self.since = 0.0
        self.busy = 0.0

    def enter(self) -> None:
        with self.lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1

    def leave(self) -> None:
        with self.lock:
            self.active -= 1
            if self.active == 0:
                self.busy += time.perf_counter() - self.since


def _instrument_io(intervals: Intervals) -> None:
    """Count the wall time the swap I/O threads spend in pread/pwrite (benchmark-only wrapper)."""
    import zerotrain.offload.aio as aio
    for name in ("_pread", "_pwrite"):
        real = getattr(aio, name)

        def timed(fd, buffers, offset, _real=real):
            intervals.enter()
            try:
                return _real(fd, buffers, offset)
            finally:
                intervals.leave()
        setattr(aio, name, timed)


def _instrument_comm(intervals: Intervals) -> None:
    """Count the wall time the main thread spends in collectives and in waits on their handles."""
    from zerotrain.comm import core, handles
    for cls, names in ((core.Comm, ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sum_scalar",
                                    "any_true")),):
        for name in names:
            real = getattr(cls, name, None)
            if real is None:
                continue

            def timed(self, *args, _real=real, **kwargs):
                intervals.enter()
                try:
                    return _real(self, *args, **kwargs)
                finally:
                    intervals.leave()
            setattr(cls, name, timed)
    for cls in [core._PointToPoint] + [getattr(handles, n) for n in dir(handles)
                                        if isinstance(getattr(handles, n), type)]:
        real = cls.__dict__.get("wait")
        if real is None:
            continue

        def timed_wait(self, *args, _real=real, **kwargs):
            intervals.enter()
            try:
                return _real(self, *args, **kwargs)
            finally:
                intervals.leave()
        cls.wait = timed_wait


def build_model(spec: dict, config: dict):
    import torch

    import zerotrain
    from zerotrain.zero import Init

    torch.manual_seed(0)
    init = Init(config=config, dtype=torch.bfloat16)
    if spec["model"] == "gpt":
        from zerotrain.models import GPT, GPTConfig
        with init:
            model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=spec["layers"], n_head=spec["width"] // 128,
                                  n_embd=spec["width"], block_size=spec["seq"], bias=True))
        return model
    from transformers import LlamaConfig, LlamaForCausalLM
    from zerotrain.checkpointing import enable_hf_gradient_checkpointing
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=spec["width"], intermediate_size=_llama_inner(spec["width"]),
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["width"] // 128,
                      num_key_value_heads=spec["width"] // 128, max_position_embeddings=max(spec["seq"], 128),
                      tie_word_embeddings=False, use_cache=False)
    with init:
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.config.use_cache = False
    if not spec.get("defaults"):
        enable_hf_gradient_checkpointing(model)
    del zerotrain
    return model


def engine_config(spec: dict) -> dict:
    if spec.get("defaults"):  # what a new user runs: no size key, no activation checkpointing (issue #27)
        nvme = {"device": "nvme", "nvme_path": spec["nvme_dir"]}
        zero = {"stage": 3, "offload_param": dict(nvme), "offload_optimizer": dict(nvme)}
        if spec.get("optimizer_device") == "cpu":  # plain CPU offload: masters and Adam moments in host memory
            zero["offload_optimizer"] = {"device": "cpu"}
        elif spec.get("spill"):  # clipping by the gradient spill, not the norm from a first backward (#43)
            zero["offload_optimizer"]["norm_first_pass"] = False
        if spec.get("budget"):
            zero["memory_budget_bytes"] = int(spec["budget"])
        for key, value in (spec.get("resolved") or {}).items():  # the sizes the run chose (for the estimate)
            block, _, name = key.rpartition(".")
            (zero[block] if block else zero)[name] = value
        bf16 = {"enabled": True}
        if spec.get("bf16_records"):  # masters and Adam moments stored in bf16 (on NVMe, or in host memory)
            bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        config = {"train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
                  "bf16": bf16, "wall_clock_breakdown": True,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
                  "zero_optimization": zero, "steps_per_print": 0, "comm_timeout_seconds": 1800}
        if spec.get("no_clip"):  # the second row; else DeepSpeed's default gradient_clipping 1.0 (no key)
            config["gradient_clipping"] = 0.0
        return config
    nvme = {"device": "nvme", "nvme_path": spec["nvme_dir"], "buffer_count": 4}
    return {
        "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": 0.0, "wall_clock_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_param": dict(nvme, buffer_count=8, max_in_cpu=int(spec["cache"])),
                              "offload_optimizer": nvme, "reduce_bucket_size": int(spec["bucket"]),
                              "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {"partition_activations": False},
        "steps_per_print": 0, "comm_timeout_seconds": 1800,
    }


def worker(spec: dict) -> None:
    import torch
    torch.set_num_threads(1)
    import zerotrain
    from zerotrain import dist as zdist

    rank = int(os.environ["RANK"])
    sampler = Sampler(spec["nvme_dir"])
    io_busy, comm_busy = Intervals(), Intervals()
    _instrument_io(io_busy)
    _instrument_comm(comm_busy)
    from zerotrain.monitor import MemoryTimeline
    config = engine_config(spec)
    # the per-rank memory timeline (plotted by main): our phases "init" (zero.Init building the model) and
    # "initialize", then the engine's own (forward, backward, gather, reduce, optimizer step)
    timeline = MemoryTimeline(os.path.join(spec["out_dir"], "timeline"), rank=rank, interval_s=0.1)
    t0 = time.perf_counter()
    sampler.phase = "build"
    with timeline.phase("init"):
        model = build_model(spec, config)
    sampler.phase = "initialize"
    printed = io.StringIO()  # rank 0's memory budget lines (zerotrain.budget, on stderr), kept for the report
    with timeline.phase("initialize"), contextlib.redirect_stderr(printed):
        engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    sys.stderr.write(printed.getvalue())
    budget_lines = [line for line in printed.getvalue().splitlines() if "memory budget" in line or
                    line.startswith("  zero_optimization.")]
    zero = engine.config.zero_optimization
    resolved = {"reduce_bucket_size": zero.reduce_bucket_size,
                "stage3_max_live_parameters": zero.stage3_max_live_parameters,
                **{f"offload_param.{k}": getattr(zero.offload_param, k) for k in ("max_in_cpu", "buffer_count",
                                                                                  "buffer_size")},
                "offload_optimizer.buffer_count": zero.offload_optimizer.buffer_count}
    engine.watch_memory(timeline)
    setup_s = time.perf_counter() - t0
    params = sum(p._zero.numel if hasattr(p, "_zero") else p.numel() for p in engine.module.parameters())
    generator = torch.Generator().manual_seed(1234 + rank)
    steps = []
    opt_stats = engine.zero_optimizer.stats
    store = engine.param_store
    for step in range(spec["steps"]):
        tokens = torch.randint(0, VOCAB, (spec["micro"], spec["seq"] + 1), generator=generator)
        zdist.barrier()
        before = (io_busy.busy, comm_busy.busy, _nvme_bytes(engine))
        start = time.perf_counter()
        sampler.phase = f"step{step}:fwd"
        if spec["model"] == "gpt":
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
        else:
            loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        sampler.phase = f"step{step}:bwd"
        engine.backward(loss)
        sampler.phase = f"step{step}:step"
        engine.step()
        elapsed = time.perf_counter() - start
        after = (io_busy.busy, comm_busy.busy, _nvme_bytes(engine))
        timers = engine.get_wall_clock_timers()
        steps.append({"s": elapsed, "loss": float(loss.detach().float()), "io_busy_s": after[0] - before[0],
                      "comm_s": after[1] - before[1], "nvme_read": after[2][0] - before[2][0],
                      "nvme_written": after[2][1] - before[2][1],
                      **{k: v / 1000 for k, v in timers.items()}, "rss_peak_so_far": sampler.peak})
        print(f"rank {rank} step {step}: {elapsed:.1f} s, loss {steps[-1]['loss']:.4f}, "
              f"peak RSS {sampler.peak / 2**30:.2f} GiB ({sampler.peak_phase})", flush=True)
    sampler.disk_peak = max(sampler.disk_peak, du(spec["nvme_dir"]))
    sampler.stop()
    engine.watch_memory(None)
    timeline.close()
    result = {"rank": rank, "params": params, "setup_s": setup_s, "steps": steps, "peak_rss": sampler.peak,
              "peak_rss_phase": sampler.peak_phase, "peak_rss_by_phase": sampler.peaks, "disk_peak_all_ranks": sampler.disk_peak,
              "optimizer_stats": {k: v for k, v in opt_stats.items() if isinstance(v, (int, float))},
              "param_store_stats": dict(getattr(store, "stats", {}) or {}),
              "memory_report": _jsonable(engine.memory_report()), "budget_lines": budget_lines,
              "resolved": resolved}
    engine.close()
    with open(os.path.join(spec["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _nvme_bytes(engine) -> tuple[int, int]:
    """Bytes read and written by the optimizer's and the parameter store's swap I/O so far."""
    read = written = 0
    ios = [getattr(getattr(engine.zero_optimizer, "records", None), "io", None),
           getattr(engine.param_store, "io", None)]
    for io in ios:
        if io is not None:
            read, written = read + io.bytes_read, written + io.bytes_written
    return read, written


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


# --- compute alone ---------------------------------------------------------------------
def compute_time(spec: dict) -> float:
    """Seconds of one training step's arithmetic at the run's shapes on one thread, without I/O or
    communication: one block's forward, recompute and backward in bf16 (best of 3) times the blocks, plus
    the head, plus the CPU Adam kernel over one rank's shard (a 4M-element chunk timed, scaled). Measured in
    a fresh process so its memory is not counted."""
    code = f"""
import time, torch, json, sys
sys.path.insert(0, {ROOT!r})
torch.set_num_threads(1)
torch.manual_seed(0)
spec = json.loads({json.dumps(json.dumps(spec))})
B, T, W, L = spec['micro'], spec['seq'], spec['width'], spec['layers']
if spec['model'] == 'gpt':
    from zerotrain.models.gpt import Block, GPTConfig
    block = Block(GPTConfig(vocab_size=8, n_layer=1, n_head=W // 128, n_embd=W, block_size=T)).to(torch.bfloat16)
    run = lambda x: block(x)
else:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=W, intermediate_size=spec['inner'], num_attention_heads=W // 128,
                      num_key_value_heads=W // 128, max_position_embeddings=max(T, 128))
    block = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16)
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(T)[None]
    def run(x):
        out = block(x, position_embeddings=rope(x, pos), attention_mask=None)
        return out[0] if isinstance(out, tuple) else out
head = torch.nn.Linear(W, {VOCAB}, bias=False).to(torch.bfloat16)
best_block = best_head = 1e9
for _ in range(3):
    s = time.perf_counter(); x = torch.randn(B, T, W, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad(): run(x)
    y = run(x); y.float().sum().backward(); best_block = min(best_block, time.perf_counter() - s)
    s = time.perf_counter(); h = torch.randn(B, T, W, dtype=torch.bfloat16, requires_grad=True)
    logits = head(h); torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), torch.zeros(B * T, dtype=torch.long)).backward()
    best_head = min(best_head, time.perf_counter() - s)
from zerotrain.offload.cpu_adam import adam_step
n = 1 << 22
p, g, m, v, w = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
best_adam = 1e9
for i in range(3):
    s = time.perf_counter()
    adam_step(p, g, m, v, torch.tensor(float(i + 1)), lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
              decoupled=True, copy_to=w, threads=1)
    best_adam = min(best_adam, time.perf_counter() - s)
adam = best_adam * spec['params'] / {WORLD} / n  # each rank steps its shard
print(json.dumps({{'block': best_block, 'head': best_head, 'adam': adam,
                  'total': best_block * L + best_head + adam}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"compute-time probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- `zerotrain estimate` next to the measurement ---------------------------------------
def predict(spec: dict) -> dict:
    """`zerotrain estimate` for this run, per rank: the same model built on the meta device, the same config,
    world 2, a CPU run (its "device" is host memory). Host RSS = the states in memory (device + host rows:
    parameter shards and cache, aligned I/O buffers, ...) + the activations with checkpointing + the transient
    step buffers; it leaves out the runtime itself (Python, torch, gloo: a few hundred MB), so the ratio nears 1
    as the model grows. NVMe = one rank's swap files at their peak (records once, spares, alignment; with the
    optimizer on the CPU the parameter file as zero.Init leaves it, a tied head's first shard still in it)."""
    import torch

    from zerotrain.estimate import config_option, device_peak, estimate

    config = engine_config(spec)
    with torch.device("meta"):
        if spec["model"] == "gpt":
            from zerotrain.models import GPT, GPTConfig
            model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=spec["layers"], n_head=spec["width"] // 128,
                                  n_embd=spec["width"], block_size=spec["seq"], bias=True))
        else:
            from transformers import LlamaConfig, LlamaForCausalLM
            model = LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=spec["width"], intermediate_size=_llama_inner(spec["width"]),
                num_hidden_layers=spec["layers"], num_attention_heads=spec["width"] // 128,
                num_key_value_heads=spec["width"] // 128, max_position_embeddings=max(spec["seq"], 128),
                tie_word_embeddings=False, use_cache=False))
    from zerotrain.config import load_config
    result = estimate(model, config, WORLD, options=[config_option(load_config(config))], device_type="cpu",
                      seq_len=spec["seq"], micro_batch=spec["micro"])
    option = result["options"][0]
    acts = dict(result["activations"])
    if spec.get("defaults"):  # no activation checkpointing in this run
        acts["with_checkpointing"] = acts["without_checkpointing"]
        if any("norm from a first backward" in note for note in option["notes"]):
            # the run left max_in_cpu to the budget (its resolved value is set here only to size the cache):
            # the cache gives way to the first pass's activations, as the estimate's `first_pass_cache` says
            option["first_pass_cache"] = option["rows"]["parameters"]["host"]
    return {"rss": device_peak(option, acts) + option["totals"]["host"],
            "nvme": option["nvme_files_peak"], "rows": option["rows"], "transient": option["transient"],
            "activations": result["activations"]}


def estimate_columns(spec: dict, ranks: list[dict]) -> list[dict]:
    """Per rank: the prediction (`predict`) next to what the run measured (NVMe: the peak on disk of both
    ranks / 2). The RSS ratio is taken against the prediction plus the runtime the estimate leaves out: the
    rank's own RSS at start (Python, torch, zerotrain imported; before the model is built)."""
    predicted = predict(dict(spec, resolved=ranks[0]["resolved"]) if spec.get("defaults") else spec)
    rss, nvme = predicted["rss"], predicted["nvme"]
    disk = max(r["disk_peak_all_ranks"] for r in ranks) / WORLD
    return [{"rank": r["rank"], "rss_predicted": rss, "rss_measured": r["peak_rss"],
             "runtime": r["peak_rss_by_phase"].get("start", 0),
             "rss_ratio": r["peak_rss"] / (rss + r["peak_rss_by_phase"].get("start", 0)),
             "nvme_predicted": nvme, "nvme_measured": disk,
             "nvme_ratio": disk / nvme if nvme else float("nan")} for r in ranks]


def print_estimate(rows: list[dict]) -> None:
    print("| rank | host RSS estimate GiB (+ runtime at start) | measured peak GiB | measured / (estimate + runtime) "
          "| NVMe estimate GB | measured GB (disk / 2) | measured / estimate |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['rank']} | {row['rss_predicted'] / 2**30:.2f} (+ {row['runtime'] / 2**30:.2f}) "
              f"| {row['rss_measured'] / 2**30:.2f} | {row['rss_ratio']:.2f} | {row['nvme_predicted'] / 1e9:.2f} "
              f"| {row['nvme_measured'] / 1e9:.2f} | {row['nvme_ratio']:.2f} |")


def print_prediction(args, layers: int, width: int, params: int) -> int:
    """--estimate-only: the prediction for this shape, nothing run or written."""
    spec = {"model": args.model, "params": params, "layers": layers, "width": width, "seq": args.seq,
            "micro": args.micro, "steps": args.steps, "bucket": args.bucket, "cache": args.cache,
            "inner": _llama_inner(width), "nvme_dir": os.path.join(args.nvme_path, "unused"), "out_dir": "",
            "defaults": args.defaults, "bf16_records": args.bf16_records, "no_clip": args.no_clip,
            "optimizer_device": args.optimizer_device, "spill": args.spill}
    predicted = predict(spec)  # with --defaults: the size keys at DeepSpeed's values (the budget is not run)
    print(f"{args.model} {layers}x{width}: {params / 1e9:.3f}B parameters; zerotrain estimate per rank: host RSS "
          f"{predicted['rss'] / 2**30:.2f} GiB (+ the runtime), NVMe files {predicted['nvme'] / 1e9:.2f} GB "
          f"(both ranks {WORLD * predicted['nvme'] / 1e9:.2f} GB = {WORLD * predicted['nvme'] / params:.2f} B/param)")
    print(json.dumps({k: predicted[k] for k in ("rows", "transient", "activations")}))
    return 0


# --- the parent ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(spec: dict, timeout: float) -> list[dict]:
    port = _free_port()
    procs = []
    env_base = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    try:
        for rank in range(WORLD):
            env = dict(env_base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                       LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
                                          env=env, start_new_session=True))
        deadline = time.time() + timeout
        for proc in procs:
            left = deadline - time.time()
            if proc.wait(timeout=max(1, left)) != 0:
                raise RuntimeError(f"a rank exited with {proc.returncode}")
    finally:
        for proc in procs:  # on failure, Ctrl-C or a timeout: stop our own ranks (their process groups)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    results = []
    for rank in range(WORLD):
        with open(os.path.join(spec["out_dir"], f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def summarize(spec: dict, ranks: list[dict], dd: dict, compute: dict, load: tuple) -> dict:
    params = ranks[0]["params"]
    steps = []
    for i in range(spec["steps"]):
        rows = [r["steps"][i] for r in ranks]
        slow = max(rows, key=lambda r: r["s"])
        moved = sum(r["nvme_read"] + r["nvme_written"] for r in rows)  # both ranks share the one disk
        steps.append({"s": slow["s"], "fwd": slow.get("fwd", 0), "bwd": slow.get("bwd", 0),
                      "opt": slow.get("step", 0), "io_busy": max(r["io_busy_s"] for r in rows),
                      "comm": max(r["comm_s"] for r in rows), "nvme_gb": moved / 1e9,
                      "nvme_read_gb": sum(r["nvme_read"] for r in rows) / 1e9,
                      "nvme_written_gb": sum(r["nvme_written"] for r in rows) / 1e9,
                      "loss": sum(r["loss"] for r in rows) / len(rows)})
    last = steps[-1]
    io_bound = last["nvme_gb"] / dd["mean"]
    bound = max(compute["total"], io_bound)
    disk = max(r["disk_peak_all_ranks"] for r in ranks)
    return {"model": spec["model"], "layers": spec["layers"], "width": spec["width"], "params": params,
            "seq": spec["seq"], "micro": spec["micro"], "setup_s": max(r["setup_s"] for r in ranks),
            "peak_rss_gib": [r["peak_rss"] / 2**30 for r in ranks],
            "peak_rss_phase": [r["peak_rss_phase"] for r in ranks],
            "peak_rss_gib_by_phase": [{k: v / 2**30 for k, v in r["peak_rss_by_phase"].items()} for r in ranks],
            "disk_bytes": disk, "disk_bytes_per_param": disk / params, "steps": steps,
            "dd_gbps": dd, "compute_s": compute, "io_bound_s": io_bound,
            "overlap_ratio": last["s"] / bound, "load_before_after": load,
            "defaults": bool(spec.get("defaults")), "row": row_name(spec),
            "grad_host_peak_bytes": [r["optimizer_stats"].get("grad_host_peak_bytes", 0) for r in ranks],
            "nvme_spill_bytes": [r["optimizer_stats"].get("nvme_spill_bytes", 0) for r in ranks],
            "budget_lines": next((r["budget_lines"] for r in ranks
                                                                          if r["budget_lines"]), []),
            "budget_bytes": _budget_bytes(next((r["budget_lines"] for r in ranks if r["budget_lines"]), [])),
            "resolved": ranks[0]["resolved"],
            "optimizer_stats": [r["optimizer_stats"] for r in ranks],
            "param_store_stats": [r["param_store_stats"] for r in ranks]}


def row_name(spec: dict) -> str:
    """The table row a run is: --defaults with DeepSpeed's clipping 1.0, or with --no-clip; else the tuned run."""
    if not spec.get("defaults"):
        return "tuned (activation checkpointing, size keys set, no clipping)"
    row = "defaults, no clipping (--no-clip)" if spec.get("no_clip") else "defaults (gradient_clipping 1.0)"
    if spec.get("spill") and not spec.get("no_clip"):
        row += ", gradients spilled (--spill)"
    if spec.get("optimizer_device") == "cpu":
        row += ", optimizer on CPU" + (" with bf16 masters and moments" if spec.get("bf16_records") else "")
    elif spec.get("bf16_records"):
        row += ", bf16 records"
    return row


def _budget_bytes(lines: list[str]) -> Optional[int]:
    """The per-rank budget the run printed ("zerotrain memory budget: 5.61 GiB per rank ...")."""
    match = re.search(r"memory budget: ([0-9.]+) (B|KiB|MiB|GiB|TiB)", lines[0]) if lines else None
    if match is None:
        return None
    return int(float(match.group(1)) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].index(match.group(2)))


def print_table(summary: dict) -> None:
    s = summary
    how = ("no size key set, no activation checkpointing (--defaults)" if s.get("defaults")
           else "activation checkpointing, tuned size keys")
    print(f"\n{s['model']} {s['layers']}x{s['width']}: {s['params'] / 1e9:.3f}B parameters, world {WORLD}, "
          f"B={s['micro']} T={s['seq']}, bf16, ZeRO-3, params on NVMe, {how}; row: {s.get('row')}")
    if "grad_host_peak_bytes" in s:
        print("host bytes held for gradients (optimizer's grad_host_peak_bytes) per rank: "
              + ", ".join(f"{b / 2**20:.1f} MiB" for b in s["grad_host_peak_bytes"])
              + "; gradient spill file per rank: " + ", ".join(f"{b / 1e9:.2f} GB" for b in s["nvme_spill_bytes"]))
    if s.get("budget_lines"):
        print("\n".join(s["budget_lines"]))
        if s.get("budget_bytes"):
            print("peak RSS per rank / budget: " + ", ".join(f"{g * 2**30 / s['budget_bytes']:.2f}"
                                                            for g in s["peak_rss_gib"]))
    print(f"setup (zero.Init + initialize): {s['setup_s']:.1f} s; peak RSS per rank: "
          + ", ".join(f"{g:.2f} GiB ({p})" for g, p in zip(s["peak_rss_gib"], s["peak_rss_phase"])))
    print("peak RSS by phase (GiB): " + "; ".join(
        f"rank {rank}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        for rank, phases in enumerate(s["peak_rss_gib_by_phase"])))
    print(f"on disk (peak, both ranks): {s['disk_bytes'] / 1e9:.2f} GB = {s['disk_bytes_per_param']:.2f} B/param")
    print(f"dd O_DIRECT: write {s['dd_gbps']['write']:.2f} GB/s, read {s['dd_gbps']['read']:.2f} GB/s")
    print("| step | time s | fwd s | bwd s | opt step s | disk busy s | comm s | NVMe GB (r/w) | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, st in enumerate(s["steps"]):
        print(f"| {i} | {st['s']:.1f} | {st['fwd']:.1f} | {st['bwd']:.1f} | {st['opt']:.1f} | {st['io_busy']:.1f} "
              f"| {st['comm']:.1f} | {st['nvme_read_gb']:.1f}/{st['nvme_written_gb']:.1f} | {st['loss']:.4f} |")
    print(f"compute alone {s['compute_s']['total']:.1f} s (of which Adam {s['compute_s']['adam']:.1f} s), NVMe bytes / dd mean {s['io_bound_s']:.1f} s: "
          f"step / max(...) = {s['overlap_ratio']:.2f} (target <= 1.3); load average before/after "
          f"{s['load_before_after'][0]:.2f}/{s['load_before_after'][1]:.2f}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    parser.add_argument("--params", type=float, default=None, help="target parameter count (picks layers x width)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket", type=float, default=5e7, help="reduce_bucket_size (elements)")
    parser.add_argument("--cache", type=float, default=1e8, help="offload_param max_in_cpu (elements)")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--keep-free", type=float, default=5e9, help="bytes that must stay free on the disk")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--defaults", action="store_true",
                        help="no size key set (zerotrain's memory budget chooses them), no activation checkpointing")
    parser.add_argument("--budget", type=float, default=None,
                        help="with --defaults: zero_optimization.memory_budget_bytes (else half the available memory)")
    parser.add_argument("--bf16-records", action="store_true",
                        help="with --defaults: bf16.bf16_master_weights_and_grads + bf16_optimizer_states (the NVMe "
                             "records in bf16: ~8 bytes per parameter on disk instead of 14)")
    parser.add_argument("--optimizer-device", choices=("nvme", "cpu"), default="nvme",
                        help="with --defaults: offload_optimizer.device (cpu: masters and Adam moments in host "
                             "memory, bf16 ones with --bf16-records; the parameters stay on NVMe)")
    parser.add_argument("--no-clip", action="store_true",
                        help="with --defaults: gradient_clipping 0 (the no-clip row; else DeepSpeed's default 1.0)")
    parser.add_argument("--spill", action="store_true",
                        help="with --defaults: offload_optimizer.norm_first_pass false (clipping spills the gradients "
                             "to disk instead of taking the norm from a first backward)")
    parser.add_argument("--compare-no-clip", action="store_true",
                        help="with --defaults: run the clipped row, then the no-clip row, and compare them")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plots", default=None, help="folder for the per-rank memory timeline PNGs")
    parser.add_argument("--estimate-only", action="store_true",
                        help="print `zerotrain estimate`'s per-rank host RSS and NVMe bytes for this shape; "
                             "run nothing")
    args = parser.parse_args(argv)
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    layers, width = shape_for(args.model, args.params, args.seq) if args.params else (args.layers, args.width)
    params = gpt_params(layers, width, args.seq) if args.model == "gpt" else llama_params(layers, width)
    if args.estimate_only:
        return print_prediction(args, layers, width, params)
    if args.optimizer_device != "nvme" and not args.defaults:
        parser.error("--optimizer-device needs --defaults")
    if args.bf16_records and not args.defaults:
        parser.error("--bf16-records needs --defaults")
    if (args.no_clip or args.compare_no_clip) and not args.defaults:
        parser.error("--no-clip / --compare-no-clip need --defaults")
    if args.no_clip and args.compare_no_clip:
        parser.error("--compare-no-clip runs the no-clip row itself; give one of them")
    rows = [False, True] if args.compare_no_clip else [bool(args.no_clip)]  # no_clip per row, run in turn
    summaries = []
    for no_clip in rows:
        code, summary = run_row(args, layers, width, params, no_clip)
        if code:
            return code
        summaries.append(summary)
    if len(summaries) == 2:
        clipped, plain = summaries
        print(f"\nclipped / no-clip: step {clipped['steps'][-1]['s'] / plain['steps'][-1]['s']:.2f}x (last step, "
              f"target <= 1.15), peak RSS " + ", ".join(f"{a / b:.2f}x" for a, b in zip(clipped["peak_rss_gib"],
                                                                                       plain["peak_rss_gib"]))
              + f", disk {clipped['disk_bytes'] / plain['disk_bytes']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summaries[0] if len(summaries) == 1 else summaries, f, indent=1)
    return 0


def run_row(args, layers: int, width: int, params: int, no_clip: bool) -> tuple[int, Optional[dict]]:
    """One row: check the disk, run the ranks, print the table; (exit code, summary)."""
    clipped = args.defaults and not no_clip
    need = disk_needed(params, args.bf16_records, clipped, optimizer_on_disk=args.optimizer_device == "nvme")
    free = shutil.disk_usage(args.nvme_path).free
    if free - need < args.keep_free:
        print(f"refusing {args.model} {layers}x{width} ({params / 1e9:.2f}B parameters): it writes up to "
              f"{need / 1e9:.1f} GB under {args.nvme_path}, which has {free / 1e9:.1f} GB free; at least "
              f"{args.keep_free / 1e9:.1f} GB must stay free", file=sys.stderr)
        return 2, None
    work = tempfile.mkdtemp(prefix="zt-scale-", dir=args.nvme_path)
    spec = {"model": args.model, "params": params, "layers": layers, "width": width, "seq": args.seq, "micro": args.micro,
            "steps": args.steps, "bucket": args.bucket, "cache": args.cache, "inner": _llama_inner(width),
            "nvme_dir": os.path.join(work, "swap"), "out_dir": work, "defaults": args.defaults,
            "budget": args.budget, "bf16_records": args.bf16_records, "no_clip": no_clip,
            "optimizer_device": args.optimizer_device, "spill": args.spill}
    os.makedirs(spec["nvme_dir"])
    print(f"{args.model} {layers}x{width}: {params / 1e9:.3f}B parameters; writes up to {need / 1e9:.1f} GB, "
          f"{free / 1e9:.1f} GB free; files under {work}", flush=True)
    try:
        load_before = os.getloadavg()[0]
        dd = dd_bandwidth(work)
        compute = compute_time(spec)
        ranks = run(spec, args.timeout)
        summary = summarize(spec, ranks, dd, compute, (load_before, os.getloadavg()[0]))
        summary["estimate"] = estimate_columns(spec, ranks)
        if args.plots:
            from zerotrain.plots import plot_memory_timelines
            prefix = f"scale_{args.model}_{params / 1e9:.2f}b_"
            summary["memory_plots"] = [os.path.relpath(p, ROOT) for p in
                                       plot_memory_timelines(os.path.join(work, "timeline"), args.plots, prefix)]
            print("memory timelines:", ", ".join(summary["memory_plots"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the swap files, dd's file, the ranks' reports
    print_table(summary)
    print_estimate(summary["estimate"])
    return 0, summary


if __name__ == "__main__":
    sys.exit(main())
