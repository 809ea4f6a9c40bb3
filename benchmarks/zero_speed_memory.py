#!/usr/bin/env python
"""Step time, peak memory and communication of ZeRO engines against DDP, on CPU.

One GPT (``zerotrain.models.GPT``, preset "70m" by default) is trained at world size 2
(gloo over 127.0.0.1, one compute thread per rank) by each engine in turn:

* ``ddp``          torch DistributedDataParallel
* ``fsdp2``        torch ``fully_shard`` on every transformer block and on the root
* ``ds1/ds2/ds3``  DeepSpeed ZeRO stages 1-3 (when ``import deepspeed`` works)
* ``zt0 ... zt3s`` zerotrain stages 0-3 (see ``ZEROTRAIN_VARIANTS``)

Every engine runs in its own fresh pair of processes, so no memory carries over, and
sees the same thing: the same initial weights (seeded init, identical on both ranks),
the same batches (byte-level blocks of the Python stdlib source, chosen by a seeded
generator per step and rank), the same AdamW (lr 1e-4, torch's implementation and
defaults) and gradient clipping at 1.0, the same number of warm-up and timed steps.

Per engine it reports the median step time (the slowest rank's time, per step), its
ratio to DDP, the median forward / backward / optimizer-step split, the peak live RSS
of each rank over the timed steps, and, for zerotrain, the bytes per step of every collective kind read from
``engine.memory_report()["comm"]`` next to the ring-algorithm theory, and `zerotrain estimate`'s
predicted peak (with the sizes the run's memory budget chose, plus the rank's RSS before the model was
built) beside the measured one.

Peak RSS is sampled inside the steps (`RssSampler`): a thread in every rank, whatever the engine,
reads /proc/self/statm every `--sample-ms` (2 ms) during the timed steps, so the peak includes what lives
only inside backward (gathered parameters, unsharded gradients, reduce buckets); the values at the
phase ends alone (what this benchmark sampled before) are printed beside it. The children run with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers go back to the OS and RSS tracks live memory.
`--where` names the module computing at each peak (module hooks), `--timeline DIR` writes zerotrain's
memory timeline (its own phases: gather, reduce, optimizer step) at the same period.

    python benchmarks/zero_speed_memory.py                     # the full run (minutes)
    python benchmarks/zero_speed_memory.py --model tiny --steps 2   # smoke run (< 60 s)
    python benchmarks/zero_speed_memory.py --engines ddp,zt1,zt2 --steps 12 --json out.json

Shapes (`--shape`, issue #27: ZeRO-3's memory on every shape, not only the benchmark's own model): the preset's
depth and width (or `--layers` x `--width`, heads of 64) as
  gpt          zerotrain's GPT: tied head, fused qkv, byte vocabulary (256) - the default
  gpt-untied   untied head, vocabulary 8192
  gpt-vocab    tied head, vocabulary 8192
  llama        Hugging Face LlamaForCausalLM: separate q/k/v, SwiGLU MLP (4 x width), untied head, vocabulary 8192
`--matrix` runs FSDP2 and zerotrain ZeRO-3 (`{"stage": 3}` only) on every shape at the issue's 8 layers x 768
(1 warm-up + 2 timed steps per run unless given), `--rounds` interleaved rounds, and prints per shape
peak/FSDP2 and step/FSDP2 (targets: <= 1.00 and <= 0.80) and ZeRO-3's measured peak / estimate (within 15%):

    python benchmarks/zero_speed_memory.py --matrix --rounds 3 --json matrix.json
    python benchmarks/zero_speed_memory.py --engines fsdp2,zt3d --shape gpt-untied --layers 8 --width 768 --where
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

WORLD_SIZE = 2
SEED = 1234
LR = 1e-4
CLIP = 1.0

# reduce_bucket_size for zerotrain (elements). The 70m model is ~6M parameters per transformer
# block, ~72M in all. 2e7 elements (80 MB fp32, ~3.4 blocks) gives 4 buckets: few enough that
# the fixed cost per gloo collective (and per-bucket bookkeeping) stays negligible, yet the first
# buckets' reductions can still start while backward computes the earlier layers. It also bounds
# stage 2's transient full-size gradient staging buffer to 80 MB instead of the whole model
# (DeepSpeed's default 5e8 would be one bucket = no overlap and a model-sized staging buffer).
# DDP's own default (25 MiB ≈ 6.5M elements ≈ one block) is the other natural choice; on a
# 2-core CPU there is little compute to overlap with, so fewer, larger collectives win.
DEFAULT_BUCKET = int(2e7)

# --- zerotrain variants ------------------------------------------------------------------------
# name -> extra keys of "zero_optimization". Stage 3 entries are ordinary list entries: when
# zerotrain.initialize raises NotImplementedError for one, the table shows "not available".
# DeepSpeed's own defaults for the stage-3 fetch keys, set explicitly (zerotrain's defaults differ when unset).
ZT3_DEEPSPEED = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000,
                 "stage3_max_reuse_distance": 1_000_000_000}
ZEROTRAIN_VARIANTS: list[tuple[str, str, dict]] = [
    # (engine key, label, zero_optimization overrides)
    ("zt0", "zerotrain ZeRO-0", {"stage": 0}),
    ("zt1", "zerotrain ZeRO-1", {"stage": 1}),
    ("zt2", "zerotrain ZeRO-2", {"stage": 2}),
    # ---- stage 3: add or remove entries here --------------------------------------------------
    # zt3/zt3s: no tuning keys, zerotrain's defaults (prefetch one recorded request ahead, release every
    # parameter after use: ZeroConfig.stage3_fetch_limits).
    # zt3r: DeepSpeed's defaults set explicitly (prefetch 5e7, reuse distance 1e9: on a 72M model every
    # parameter gathered in forward stays gathered for backward: fewer gathers, more memory).
    ("zt3", "zerotrain ZeRO-3 (bucketed)", {"stage": 3}),
    ("zt3s", "zerotrain ZeRO-3 (sequential)", {"stage": 3, "stage3_allgather_sequential": True}),
    ("zt3r", "zerotrain ZeRO-3 (DeepSpeed defaults)", {"stage": 3, **ZT3_DEEPSPEED}),
    # zt3d: {"stage": 3} and no other zero key (not even the benchmark's reduce_bucket_size): what --matrix runs
    ("zt3d", "zerotrain ZeRO-3 ({\"stage\": 3} only)", {"stage": 3, "_only": True}),
    # zt3b: as zt3d with a model-sized reduce bucket: what the memory budget chose on a quiet machine before its
    # stage-3 cap (at most the largest parameter), for the A/B of the untied-head diagnosis (issue #27)
    ("zt3b", "zerotrain ZeRO-3 (model-sized reduce bucket)", {"stage": 3, "reduce_bucket_size": 500_000_000,
                                                                "_only": True}),
    # zt2g/zt3g: as zt2/zt3 with the same-host transport off: every collective byte through gloo's
    # loopback sockets, as DDP and FSDP2 do here ("_config": top-level config keys).
    ("zt2g", "zerotrain ZeRO-2 (gloo sockets)", {"stage": 2, "_config": {"comm_same_host_transport": False}}),
    ("zt3g", "zerotrain ZeRO-3 (bucketed, gloo sockets)",
     {"stage": 3, "_config": {"comm_same_host_transport": False}}),
]

DEEPSPEED_VARIANTS: list[tuple[str, str, int]] = [
    ("ds1", "DeepSpeed ZeRO-1", 1),
    ("ds2", "DeepSpeed ZeRO-2", 2),
    ("ds3", "DeepSpeed ZeRO-3", 3),
]

ENGINES: dict[str, str] = {"ddp": "DDP", "fsdp2": "FSDP2"}
ENGINES.update({key: label for key, label, _ in DEEPSPEED_VARIANTS})
ENGINES.update({key: label for key, label, _ in ZEROTRAIN_VARIANTS})


class Unavailable(Exception):
    """This engine cannot run here (not installed, not implemented); the reason goes in the table."""


# =============================================================================================
# worker side: one rank of one engine
# =============================================================================================

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    """This process's resident bytes now (/proc/self/statm: microseconds; psutil elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * _PAGE
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


class RssSampler:
    """Peak RSS of this rank inside the measured steps, backward's peak included (issue #27).

    Sampling only at phase ends misses what lives inside a phase: a backward's gathered parameters, unsharded
    gradients and reduce buckets are all freed by the time `backward()` returns. A daemon thread reads
    /proc/self/statm every `period_s` (a `pread` of a held descriptor: a few microseconds; the GIL is free
    while torch computes or waits in a collective, so the samples land inside kernels and collectives too)
    and keeps the peak per `phase` ("fwd", "bwd", "step"; None: not measuring) and the `label` current at the
    peak (`--where`: the module whose forward or backward ran). Every phase boundary samples as well.
    """

    def __init__(self, period_s: float = 0.002):
        self.period_s = period_s
        try:
            self._fd: Optional[int] = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None
        self.phase: Optional[str] = None
        self.label = ""
        self.peaks: dict[str, int] = {}
        self.where: dict[str, str] = {}  # phase -> label at its peak
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def read(self) -> int:
        if self._fd is None:
            return _rss()
        return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE

    def _note(self, phase: Optional[str]) -> None:
        if phase is None:
            return
        rss = self.read()
        self.samples += 1
        if rss > self.peaks.get(phase, -1):
            self.peaks[phase] = rss
            self.where[phase] = self.label

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._note(self.phase)

    def enter(self, phase: Optional[str]) -> None:
        """Close the current phase (a last sample) and open `phase` (None: stop measuring)."""
        self._note(self.phase)
        self.phase = phase
        self._note(phase)

    def take(self) -> tuple[dict[str, int], dict[str, str]]:
        """The peaks (and labels) since the last take; cleared."""
        peaks, where = self.peaks, self.where
        self.peaks, self.where = {}, {}
        return peaks, where

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._fd is not None:
            os.close(self._fd)


def _label_modules(model, sampler: RssSampler) -> None:
    """`--where`: name the module computing now in the sampler's label (forward: its pre-hook; backward: its
    full backward pre-hook), for every module that owns parameters itself, so each peak says where it was."""
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue

        def forward_pre(mod, args, name=name):
            sampler.label = f"forward {name}"

        def backward_pre(mod, grad_output, name=name):
            sampler.label = f"backward {name}"
        module.register_forward_pre_hook(forward_pre)
        module.register_full_backward_pre_hook(backward_pre)


def _minor_faults() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _make_batches(n: int, batch: int, seq_len: int, rank: int) -> list:
    """`n` (x, y) pairs for this rank: byte blocks of the stdlib source at seeded offsets."""
    import torch
    try:
        from zerotrain.data import load_stdlib_corpus
        corpus = load_stdlib_corpus(max_bytes=4 * 1024 * 1024).long()
    except Exception:  # noqa: BLE001 - any failure: fall back to seeded random bytes
        corpus = torch.randint(0, 256, (4 * 1024 * 1024,), generator=torch.Generator().manual_seed(SEED))
    out = []
    for step in range(n):
        gen = torch.Generator().manual_seed(SEED * 1000 + step * WORLD_SIZE + rank)
        starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=gen)
        block = torch.stack([corpus[s:s + seq_len + 1] for s in starts.tolist()])
        out.append((block[:, :-1].contiguous(), block[:, 1:].contiguous()))
    return out


SHAPES = {"gpt": "tied head, fused qkv, V 256", "gpt-untied": "untied head, fused qkv, V 8192",
          "gpt-vocab": "tied head, fused qkv, V 8192", "llama": "HF Llama: separate q/k/v, untied head, V 8192"}
LARGE_VOCAB = 8192
# --matrix's defaults: the issue's shape (d 768, 8 layers: the untied-head GPT measured at 1.09x FSDP2's peak), 1 warm-up
# + 2 timed steps per engine run (the step time is a median over the rounds' steps; the peak does not need more)
MATRIX = {"layers": 8, "width": 768, "steps": 2, "warmup": 1}


def _dims(preset: str, layers: Optional[int] = None, width: Optional[int] = None) -> dict:
    """The preset's GPTConfig fields, with `layers` / `width` (heads of 64) in place of its depth / width."""
    dims = {}
    if layers:
        dims["n_layer"] = int(layers)
    if width:
        dims.update(n_embd=int(width), n_head=max(1, int(width) // 64))
    return dims


def _build_model(preset: str, shape: str = "gpt", layers: Optional[int] = None, width: Optional[int] = None):
    """The preset's depth and width (or `layers` x `width`) in one of `SHAPES`."""
    import torch
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(SEED)
    dims = _dims(preset, layers, width)
    config = GPTConfig.preset(preset, **dims)
    if shape == "gpt":
        return GPT(config)
    if shape in ("gpt-untied", "gpt-vocab"):
        return GPT(GPTConfig.preset(preset, vocab_size=LARGE_VOCAB, tie_weights=shape == "gpt-vocab", **dims))
    if shape == "llama":
        import transformers
        hf = transformers.LlamaConfig(vocab_size=LARGE_VOCAB, hidden_size=config.n_embd,
                                      intermediate_size=4 * config.n_embd, num_hidden_layers=config.n_layer,
                                      num_attention_heads=config.n_head, num_key_value_heads=config.n_head,
                                      max_position_embeddings=config.block_size, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(hf)
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def _engine_loss(wrapper, model, x, y):
    """The mean next-token loss through `wrapper` (the model itself, DDP or an engine) of either kind of `model`:
    zerotrain's GPT returns (logits, loss); a Hugging Face model `.loss` (labels shifted inside)."""
    if hasattr(getattr(model, "config", None), "model_type"):
        return wrapper(input_ids=x, labels=y).loss
    return wrapper(x, y)[1]


def _loss(model, x, y):
    return _engine_loss(model, model, x, y)


def _blocks(model) -> list:
    """The transformer blocks FSDP2 shards one by one."""
    inner = getattr(model, "transformer", None)
    return list(inner.h) if inner is not None else list(model.model.layers)


def _adamw_kwargs(impl: str) -> dict:
    return {"fused": True} if impl == "fused" else {"foreach": True}


class Runner:
    """forward(x, y) -> loss; backward(loss); step(); comm() -> counters or None; state() -> bytes;
    model: the module itself (for `--where`); resolved: zerotrain's chosen size keys (for the estimate)."""

    forward: Callable
    backward: Callable
    step: Callable
    model: Any = None
    resolved: Optional[dict] = None

    def watch(self, timeline) -> None:
        """zerotrain: report the engine's phases (gather, reduce ...) into a `MemoryTimeline`; others: nothing."""

    def comm(self) -> Optional[dict]:
        return None

    def state(self) -> Optional[dict]:
        return None


def _setup_ddp(args) -> Runner:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(_build_model(args.model, args.shape, args.layers, args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **_adamw_kwargs(args.adamw))
    r = Runner()
    r.model = model.module
    r.forward = lambda x, y: _engine_loss(model, model.module, x, y)
    r.backward = lambda loss: loss.backward()

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    r.step = step
    return r


def _setup_fsdp2(args) -> Runner:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as error:
        raise Unavailable(f"torch.distributed.fsdp.fully_shard: {error}") from error
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    model = _build_model(args.model, args.shape, args.layers, args.width)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, **_adamw_kwargs(args.adamw))
    r = Runner()
    r.model = model
    r.forward = lambda x, y: _loss(model, x, y)
    r.backward = lambda loss: loss.backward()

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    r.step = step
    return r


def _setup_deepspeed(args, stage: int) -> Runner:
    try:
        import deepspeed
    except Exception as error:  # noqa: BLE001 - ImportError, or a broken install raising anything
        raise Unavailable(f"import deepspeed failed: {type(error).__name__}: {error}") from error
    params: dict[str, Any] = {"lr": LR, "torch_adam": True}
    params.update(_adamw_kwargs(args.adamw))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    model = _build_model(args.model, args.shape, args.layers, args.width)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    r = Runner()
    r.model = model
    r.forward = lambda x, y: _engine_loss(engine, model, x, y)
    r.backward = lambda loss: engine.backward(loss)
    r.step = lambda: engine.step()
    return r


# the size keys the memory budget chooses when unset (zerotrain.budget): read back for the estimate
BUDGET_KEYS = ("reduce_bucket_size", "stage3_max_live_parameters")


def _zerotrain_config(args, overrides: dict, resolved: Optional[dict] = None) -> dict:
    """The config a zerotrain variant runs with (`resolved`: the sizes its budget chose, for the estimate)."""
    zero = {} if overrides.get("_only") else {"reduce_bucket_size": args.bucket}
    zero.update(overrides)
    zero.pop("_only", None)
    top_level = zero.pop("_config", {})
    zero.update(resolved or {})
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": CLIP,
        # weight_decay: torch AdamW's, as the DDP and DeepSpeed (torch_adam) runs have it
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "fused": args.adamw == "fused"}},
        "zero_optimization": zero,
        **top_level,
    }


def _setup_zerotrain(args, overrides: dict) -> Runner:
    import zerotrain
    config = _zerotrain_config(args, overrides)
    model = _build_model(args.model, args.shape, args.layers, args.width)
    try:
        engine, _, _, _ = zerotrain.initialize(model=model, config=config)
    except NotImplementedError as error:
        raise Unavailable(f"not available: {error}") from error
    r = Runner()
    r.model = model
    r.forward = lambda x, y: _engine_loss(engine, model, x, y)
    r.backward = lambda loss: engine.backward(loss)
    r.step = lambda: engine.step()
    r.comm = lambda: engine.memory_report()["comm"]
    r.watch = engine.watch_memory
    zero_config = engine.config.zero_optimization
    r.resolved = {key: int(getattr(zero_config, key)) for key in BUDGET_KEYS}

    def state():
        report = engine.memory_report()
        return {k: report[k] for k in ("parameters", "gradients", "optimizer_states")}
    r.state = state
    return r


def _setup(args, engine: str) -> Runner:
    if engine == "ddp":
        return _setup_ddp(args)
    if engine == "fsdp2":
        return _setup_fsdp2(args)
    for key, _, stage in DEEPSPEED_VARIANTS:
        if key == engine:
            return _setup_deepspeed(args, stage)
    for key, _, overrides in ZEROTRAIN_VARIANTS:
        if key == engine:
            return _setup_zerotrain(args, overrides)
    raise ValueError(f"unknown engine {engine!r}")


def _phase_times(runner: Runner, batches: list, warmup: int, sampler: RssSampler) -> dict:
    """Run every batch through forward/backward/step; per-step times and RSS: the sampler's peak inside each
    phase (`rss_fwd` ...), and the value at each phase's end as before (`end_fwd` ...)."""
    import torch.distributed as dist
    rows = []
    comm_before = None
    for index, (x, y) in enumerate(batches):
        if index == warmup:
            comm_before = runner.comm()
        dist.barrier()  # start every step together, outside the timed region
        sampler.take()
        faults0 = _minor_faults()
        cpu0 = time.process_time()
        sampler.enter("fwd")
        t0 = time.perf_counter()
        loss = runner.forward(x, y)
        t1 = time.perf_counter()
        end_fwd = _rss()
        sampler.enter("bwd")
        runner.backward(loss)
        t2 = time.perf_counter()
        end_bwd = _rss()
        sampler.enter("step")
        runner.step()
        t3 = time.perf_counter()
        sampler.enter(None)
        cpu = time.process_time() - cpu0
        end_step = _rss()
        peaks, where = sampler.take()
        phase = max(peaks, key=peaks.get)
        rows.append({"minflt": _minor_faults() - faults0, "cpu": cpu, "fwd": t1 - t0, "bwd": t2 - t1, "step": t3 - t2,
                     "total": t3 - t0, "rss": peaks[phase], "rss_fwd": peaks["fwd"], "rss_bwd": peaks["bwd"],
                     "rss_step": peaks["step"], "peak_phase": phase, "peak_where": where.get(phase, ""),
                     "end_fwd": end_fwd, "end_bwd": end_bwd, "end_step": end_step,
                     "loss": float(loss.detach().float().item())})
    comm_after = runner.comm()
    comm = None
    if comm_after is not None:
        before = comm_before or {}
        comm = {kind: {"calls": v["calls"] - before.get(kind, {}).get("calls", 0),
                       "bytes": v["bytes"] - before.get(kind, {}).get("bytes", 0)}
                for kind, v in comm_after.items()}
    return {"rows": rows, "comm": comm}


def worker_main(spec: dict) -> int:
    """One rank: set up the engine, train, write a JSON result file."""
    out_path = Path(spec["out"])
    result: dict[str, Any] = {"engine": spec["engine"], "rank": int(os.environ["RANK"])}
    sampler = None
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        rank = int(os.environ["RANK"])
        args = argparse.Namespace(**spec["args"])
        import datetime
        import zerotrain  # noqa: F401 - imported before the runtime is measured (every engine pays the same)
        if args.shape == "llama":
            import transformers  # noqa: F401
        import torch._dynamo  # noqa: F401 - every torch optimizer imports it when built (torch._compile): runtime
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        batches = _make_batches(args.warmup + args.steps, args.batch, args.seq_len, rank)
        # the runtime: Python, torch, zerotrain (transformers), gloo and the batches, before any model exists
        result["rss_start"] = _rss()
        sampler = RssSampler(args.sample_ms / 1000.0)
        runner = _setup(args, spec["engine"])
        result["rss_setup"] = _rss()
        if args.where:
            _label_modules(runner.model, sampler)
        timeline = None
        if args.timeline and runner.resolved is not None:  # zerotrain: its own phases, every sample on file
            from zerotrain.monitor import MemoryTimeline
            directory = Path(args.timeline) / spec["engine"]
            directory.mkdir(parents=True, exist_ok=True)
            timeline = MemoryTimeline(directory, rank=rank, interval_s=args.sample_ms / 1000.0)
            runner.watch(timeline)
        measured = _phase_times(runner, batches, args.warmup, sampler)
        if timeline is not None:
            timeline.close()
        result.update(measured)
        result["samples"] = sampler.samples
        result["state"] = runner.state()
        result["resolved"] = runner.resolved
        result["status"] = "ok"
        # Average the losses over ranks once, after timing: the loss curve of the global batch.
        losses = torch.tensor([row["loss"] for row in measured["rows"]], dtype=torch.float64)
        dist.all_reduce(losses)
        result["mean_losses"] = (losses / dist.get_world_size()).tolist()
        dist.barrier()
        dist.destroy_process_group()
    except Unavailable as why:
        result.update(status="unavailable", reason=str(why))
    except Exception as error:  # noqa: BLE001 - report, the parent prints it
        result.update(status="failed", reason=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    finally:
        if sampler is not None:
            sampler.stop()
    out_path.write_text(json.dumps(result))
    return 0 if result["status"] != "failed" else 1


# =============================================================================================
# parent side: launch, collect, print
# =============================================================================================

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(rank: int, port: int, engine: str) -> dict:
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
        "LOCAL_WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        # Freed buffers of 64 KiB and more are unmapped at once, so RSS follows live memory.
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "DS_ACCELERATOR": "cpu",
        "PYTHONUNBUFFERED": "1",
    })
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_engine(engine: str, args, workdir: Path) -> dict:
    """Launch both ranks of one engine in fresh processes; merge their results."""
    port = _free_port()
    procs, logs, outs = [], [], []
    spec_args = {k: getattr(args, k) for k in ("model", "steps", "warmup", "batch", "seq_len", "bucket", "adamw", "shape",
                                                 "layers", "width", "sample_ms", "where", "timeline")}
    started = time.perf_counter()
    for rank in range(WORLD_SIZE):
        out = workdir / f"{engine}.rank{rank}.json"
        log = open(workdir / f"{engine}.rank{rank}.log", "w")
        spec = {"engine": engine, "out": str(out), "args": spec_args}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(spec)],
                                      env=_child_env(rank, port, engine), stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
        outs.append(out)
    deadline = time.monotonic() + args.timeout
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:  # a rank that failed leaves its peer waiting in a collective; an interrupt leaves both
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    wall = time.perf_counter() - started
    ranks = []
    for rank, out in enumerate(outs):
        if out.exists():
            ranks.append(json.loads(out.read_text()))
        else:
            tail = (workdir / f"{engine}.rank{rank}.log").read_text()[-1500:]
            ranks.append({"status": "failed", "reason": ("timed out" if timed_out else "no result") + "\n" + tail})
    return _merge(engine, ranks, args, wall)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _merge(engine: str, ranks: list[dict], args, wall: float) -> dict:
    """One run (a fresh pair of processes) of one engine: per-step lists, slowest rank per step."""
    merged: dict[str, Any] = {"engine": engine, "label": ENGINES[engine], "wall_s": wall}
    statuses = [r.get("status") for r in ranks]
    if any(s == "unavailable" for s in statuses) and all(s in ("unavailable", "ok") for s in statuses):
        merged.update(status="unavailable",
                      reason=next(r["reason"] for r in ranks if r.get("status") == "unavailable"))
        return merged
    if any(s != "ok" for s in statuses):
        bad = next(r for r in ranks if r.get("status") != "ok")
        merged.update(status="failed", reason=bad.get("reason", "?"), traceback=bad.get("traceback"))
        return merged
    timed = [r["rows"][args.warmup:] for r in ranks]
    n = len(timed[0])
    # A step ends when its slowest rank ends: per step, the max over ranks.
    per_step = {key: [max(t[i][key] for t in timed) for i in range(n)] for key in ("total", "fwd", "bwd", "step", "cpu")}
    merged.update(
        status="ok",
        step_times=per_step["total"], fwd_times=per_step["fwd"], bwd_times=per_step["bwd"],
        opt_times=per_step["step"], cpu_times=per_step["cpu"],
        minor_faults_per_step=[_median([row["minflt"] for row in t]) for t in timed],
        peak_rss=[max(row["rss"] for row in t) for t in timed],
        peak_rss_phase=[{ph: max(row[f"rss_{ph}"] for row in t) for ph in ("fwd", "bwd", "step")} for t in timed],
        # the phase-end values alone (what this benchmark sampled before the in-step sampler)
        peak_rss_ends=[max(max(row[f"end_{ph}"] for ph in ("fwd", "bwd", "step")) for row in t) for t in timed],
        # where each rank's peak step peaked: (phase, module label with --where)
        peak_at=[[max(t, key=lambda row: row["rss"])[key] for key in ("peak_phase", "peak_where")] for t in timed],
        samples=[r.get("samples", 0) for r in ranks],
        resolved=ranks[0].get("resolved"),
        rss_setup=[r["rss_setup"] for r in ranks],
        rss_start=[r["rss_start"] for r in ranks],
        losses=ranks[0]["mean_losses"],
        state=[r.get("state") for r in ranks],
    )
    if ranks[0].get("comm") is not None:
        merged["comm_per_step"] = {kind: {"calls": v["calls"] / n, "bytes": v["bytes"] / n}
                                   for kind, v in ranks[0]["comm"].items()}
    return merged


def _summarize(runs: list[dict]) -> dict:
    """All runs (rounds) of one engine: medians over every timed step of every round."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < len(runs):
        bad = next(r for r in runs if r["status"] != "ok")
        return dict(bad, rounds=runs)
    out = {k: ok[0][k] for k in ("engine", "label", "status", "losses", "state") if k in ok[0]}
    cat = {key: [t for r in ok for t in r[key]] for key in ("step_times", "fwd_times", "bwd_times", "opt_times", "cpu_times")}
    out.update(
        step_s=_median(cat["step_times"]), fwd_s=_median(cat["fwd_times"]), bwd_s=_median(cat["bwd_times"]),
        opt_s=_median(cat["opt_times"]), cpu_s=_median(cat["cpu_times"]), step_min_s=min(cat["step_times"]), step_max_s=max(cat["step_times"]),
        round_medians=[_median(r["step_times"]) for r in ok],
        peak_rss=[max(r["peak_rss"][i] for r in ok) for i in range(WORLD_SIZE)],
        minor_faults_per_step=[_median([r["minor_faults_per_step"][i] for r in ok]) for i in range(WORLD_SIZE)],
        peak_rss_ends=[max(r["peak_rss_ends"][i] for r in ok) for i in range(WORLD_SIZE)],
        peak_at=max(ok, key=lambda r: max(r["peak_rss"]))["peak_at"],
        rss_start=[max(r["rss_start"][i] for r in ok) for i in range(WORLD_SIZE)],
        resolved=ok[0].get("resolved"),
        same_losses_every_round=all(r["losses"] == ok[0]["losses"] for r in ok),
        rounds=runs,
    )
    if "comm_per_step" in ok[0]:
        out["comm_per_step"] = ok[0]["comm_per_step"]
    return out


def _cpu_counters() -> tuple[float, float]:
    """(total, steal) jiffies of all CPUs from /proc/stat, or zeros where there is none."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields[:8]), fields[7] if len(fields) > 7 else 0.0
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold default (zerotrain and DeepSpeed)


def _param_bytes(preset: str, shape: str = "gpt", layers: Optional[int] = None,
                 width: Optional[int] = None) -> tuple[int, int, int]:
    """(parameters, Ψ = fp32 parameter bytes, bytes of the parameters stage 3 keeps whole)."""
    import torch
    with torch.device("meta"):
        model = _build_model(preset, shape, layers, width)
    numel = sum(p.numel() for p in model.parameters())
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= PERSISTENCE_THRESHOLD)
    return numel, numel * 4, persistent * 4  # fp32


def _theory(engine: str, psi: float, persistent: float) -> dict:
    """Bytes one rank sends per step under a ring algorithm (N ranks, Ψ parameter bytes).

    Stage 3 gathers each partitioned parameter for forward and again for backward; the
    small ones it keeps whole (`persistent` bytes) are all-gathered once, after the step.
    """
    frac = (WORLD_SIZE - 1) / WORLD_SIZE
    stage = next((o.get("stage") for k, _, o in ZEROTRAIN_VARIANTS if k == engine), None)
    if stage == 0:
        return {"all_reduce": 2 * psi * frac}
    if stage in (1, 2):
        return {"all_gather": psi * frac, "reduce_scatter": psi * frac}
    if stage == 3:
        return {"all_gather": (2 * (psi - persistent) + persistent) * frac, "reduce_scatter": psi * frac}
    return {}


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}" if nbytes >= 5e4 else f"{nbytes:.0f}B"


def _fmt_comm(engine: str, result: dict, psi: float, persistent: float) -> tuple[str, str]:
    comm = result.get("comm_per_step")
    if comm is None:
        return "", ""
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    measured = " ".join(f"{short[k]} {_mb(comm[k]['bytes'])}"
                        for k in ("all_gather", "reduce_scatter", "all_reduce") if comm.get(k, {}).get("bytes"))
    theory = " ".join(f"{short[k]} {_mb(v)}" for k, v in _theory(engine, psi, persistent).items())
    return measured or "-", theory


def predicted_peak(args, engine: str, resolved: Optional[dict]) -> Optional[dict]:
    """`zerotrain estimate`'s peak per rank for a zerotrain run (None for other engines): the same model on the
    meta device, the same config with the sizes its budget chose (`resolved`), world 2, a CPU run (the device is
    host memory): states + activations of one micro-batch (no checkpointing here) + the transient step buffers
    (gathered parameters, the largest whole gradient, reduce staging). The runtime (Python, torch, gloo) is not in
    it: the ratio is taken against this plus the rank's RSS before the model was built (`rss_start`)."""
    overrides = next((o for key, _, o in ZEROTRAIN_VARIANTS if key == engine), None)
    if overrides is None or resolved is None:
        return None
    import torch
    from zerotrain.config import load_config
    from zerotrain.estimate import config_option, device_peak, estimate
    config = _zerotrain_config(args, overrides, resolved)
    with torch.device("meta"):
        model = _build_model(args.model, args.shape, args.layers, args.width)
    result = estimate(model, config, WORLD_SIZE, options=[config_option(load_config(config))], device_type="cpu",
                      seq_len=args.seq_len, micro_batch=args.batch)
    option = result["options"][0]
    acts = dict(result["activations"])
    acts["with_checkpointing"] = acts["without_checkpointing"]  # this benchmark checkpoints nothing
    return {"bytes": device_peak(option, acts) + option["totals"]["host"], "states": option["totals"]["device"],
            "activations": acts["without_checkpointing"], "transient": option["transient"]}


def _estimate_ratio(args, result: dict) -> tuple[str, Optional[float]]:
    """("estimate MiB (+ runtime)", measured peak / (estimate + runtime)) of one engine's summary; ("", None) when
    there is no estimate (not a zerotrain engine)."""
    predicted = predicted_peak(args, result["engine"], result.get("resolved"))
    if predicted is None:
        return "", None
    runtime = max(result["rss_start"])
    result["predicted"] = dict(predicted, runtime=runtime)
    ratio = max(result["peak_rss"]) / (predicted["bytes"] + runtime)
    return f"{predicted['bytes'] / 2**20:.0f} (+ {runtime / 2**20:.0f})", ratio


def render(results: list[dict], args, numel: int, psi: int, persistent: int) -> str:
    base = next((r for r in results if r["engine"] == "ddp" and r["status"] == "ok"), None)
    header = ["engine", "step s", "vs DDP", "fwd / bwd / opt s", "min-max s", "CPU s", "peak RSS MiB r0/r1",
              "vs DDP", "peak at", "phase ends MiB", "estimate MiB (+ runtime)", "peak / est.",
              "comm MB/step (AG RS AR)", "theory MB", "loss first→last"]
    lines = []
    for r in results:
        if r["status"] != "ok":
            reason = r["reason"].strip().splitlines()[0] if r.get("reason") else ""
            lines.append([r["label"], r["status"] + (": " + reason[:90] if reason else "")] + [""] * (len(header) - 2))
            continue
        peak = max(r["peak_rss"])
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "-"
        mem_ratio = f"{peak / max(base['peak_rss']):.2f}" if base else "-"
        measured, theory = _fmt_comm(r["engine"], r, psi, persistent)
        estimate, est_ratio = _estimate_ratio(args, r)
        lines.append([
            r["label"], f"{r['step_s']:.3f}", ratio,
            f"{r['fwd_s']:.2f} / {r['bwd_s']:.2f} / {r['opt_s']:.2f}",
            f"{r['step_min_s']:.2f}-{r['step_max_s']:.2f}", f"{r['cpu_s']:.2f}",
            "/".join(f"{v / 2**20:.0f}" for v in r["peak_rss"]), mem_ratio, _fmt_at(r["peak_at"]),
            "/".join(f"{v / 2**20:.0f}" for v in r["peak_rss_ends"]), estimate,
            "" if est_ratio is None else f"{est_ratio:.2f}", measured, theory,
            f"{r['losses'][0]:.4f}→{r['losses'][-1]:.4f}",
        ])
    widths = [max(len(h), *(len(row[i]) for row in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for row in lines:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    dims = f"{args.layers or 'its'} layers x width {args.width or 'its'}" if args.layers or args.width else "its shape"
    caption = (f"GPT preset {args.model} ({dims}; {args.shape}: {SHAPES[args.shape]}; {numel / 1e6:.1f}M params, "
               f"Ψ = {psi / 1e6:.1f} MB fp32), world size "
               f"{WORLD_SIZE} (gloo, CPU, 1 thread/rank), B={args.batch}/rank, T={args.seq_len}, AdamW lr {LR} "
               f"({args.adamw}), clip {CLIP}; {args.warmup} warm-up + {args.steps} timed steps"
               f"{f' × {args.rounds} rounds' if args.rounds > 1 else ''}, median of the slowest rank per step (CPU s: "
               f"process CPU time per step, all threads, slowest rank); peak RSS sampled every {args.sample_ms:g} ms "
               f"inside the timed steps ('phase ends': sampled after forward, backward and step only); estimate: "
               f"`zerotrain estimate` with the sizes the run chose, + the rank's RSS before the model was built; "
               f"zerotrain reduce_bucket_size {args.bucket:.0e} (variants marked 'only': the budget's choice).")
    return caption + "\n\n" + "\n".join(out)


def _fmt_phases(result: dict) -> str:
    """The larger rank's peak per phase, MiB: "fwd F / bwd B / step S"."""
    return " / ".join(f"{phase} {max(p[phase] for p in result['peak_rss_phase']) / 2**20:.0f}" for phase in ("fwd", "bwd", "step"))


def _fmt_at(peak_at: list) -> str:
    """Where the ranks' peaks were: the phase, and the module with --where (one entry when the ranks agree)."""
    shown = [f"{phase}" + (f": {where}" if where else "") for phase, where in peak_at]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="all",
                        help=f"comma-separated subset of: {', '.join(ENGINES)} (default: all)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"timed steps per engine (default 8; --matrix {MATRIX['steps']})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed warm-up steps (default 2; --matrix {MATRIX['warmup']})")
    parser.add_argument("--model", default="70m", help="GPT preset: 70m (default), small, tiny (smoke run)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"transformer blocks instead of the preset's (--matrix default {MATRIX['layers']})")
    parser.add_argument("--width", type=int, default=None,
                        help=f"hidden size instead of the preset's, heads of 64 (--matrix default {MATRIX['width']})")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default 128, capped at the preset's block_size)")
    parser.add_argument("--batch", type=int, default=4, help="micro-batch per rank (default 4)")
    parser.add_argument("--bucket", type=float, default=DEFAULT_BUCKET,
                        help=f"zerotrain reduce_bucket_size in elements (default {DEFAULT_BUCKET:.0e})")
    parser.add_argument("--adamw", choices=("fused", "foreach"), default="fused",
                        help="torch AdamW implementation, the same for every engine (default fused: "
                             "zerotrain's own default on CPU)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole engine list this many times, interleaved, and take medians over "
                             "all rounds' steps (evens out background load; default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine before it is killed")
    parser.add_argument("--json", dest="json_path", default=None, help="also write all results to this JSON file")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="gpt",
                        help="the model's shape at the preset's depth and width (see the module docstring)")
    parser.add_argument("--matrix", action="store_true",
                        help="FSDP2 and zerotrain ZeRO-3 ({\"stage\": 3}) on every shape: peak and step vs FSDP2")
    parser.add_argument("--sample-ms", type=float, default=2.0,
                        help="RSS sampling period inside the timed steps, per rank (default 2 ms)")
    parser.add_argument("--where", action="store_true",
                        help="label every sample with the module whose forward / backward runs (module hooks: "
                             "slower steps, same memory) and print where each peak was")
    parser.add_argument("--timeline", default=None, metavar="DIR",
                        help="zerotrain engines: write the memory timeline (zerotrain.monitor.MemoryTimeline, the "
                             "engine's own phases: gather, reduce, optimizer step) every --sample-ms under DIR/ENGINE")
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._worker is not None:
        return worker_main(json.loads(args._worker))
    for key in ("steps", "warmup", "layers", "width"):  # --matrix: the issue's shape, a short run per engine
        if getattr(args, key) is None:
            setattr(args, key, MATRIX[key] if args.matrix else {"steps": 8, "warmup": 2}.get(key))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_engine's cleanup runs on kill

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from zerotrain.models import GPTConfig
    block = GPTConfig.preset(args.model).block_size
    args.seq_len = min(args.seq_len or 128, block)
    args.bucket = int(args.bucket)
    engines = list(ENGINES) if args.engines == "all" else [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; known: {', '.join(ENGINES)}")
    if "ddp" in engines:  # the baseline first
        engines.remove("ddp")
        engines.insert(0, "ddp")
    if args.matrix:
        return run_matrix(args)
    numel, psi, persistent = _param_bytes(args.model, args.shape, args.layers, args.width)

    runs: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory(prefix="zt-bench-") as tmp:
        for round_index in range(args.rounds):
            for engine in engines:
                if runs[engine] and runs[engine][-1]["status"] != "ok":
                    continue  # unavailable or failed: once is enough
                tag = f"[{ENGINES[engine]}" + (f" round {round_index + 1}]" if args.rounds > 1 else "]")
                print(f"{tag} running ...", flush=True)
                total0, steal0 = _cpu_counters()
                workdir = Path(tmp) / f"round{round_index}"
                workdir.mkdir(exist_ok=True)
                result = run_engine(engine, args, workdir)
                total1, steal1 = _cpu_counters()
                result["loadavg_1m_after"] = _loadavg()
                result["steal_pct"] = 100.0 * (steal1 - steal0) / max(total1 - total0, 1.0)
                runs[engine].append(result)
                if result["status"] == "ok":
                    print(f"{tag} step {_median(result['step_times']):.3f} s (median; "
                          f"{', '.join(f'{t:.2f}' for t in result['step_times'])}), peak RSS "
                          f"{'/'.join(f'{v / 2**20:.0f}' for v in result['peak_rss'])} MiB at "
                          f"{_fmt_at(result['peak_at'])} (peaks {_fmt_phases(result)}; phase ends {'/'.join(f'{v / 2**20:.0f}' for v in result['peak_rss_ends'])}), "
                          f"minor faults/step "
                          f"{'/'.join(f'{v / 1e3:.0f}k' for v in result['minor_faults_per_step'])}, wall "
                          f"{result['wall_s']:.0f} s, load {result['loadavg_1m_after']:.2f}, steal "
                          f"{result['steal_pct']:.1f}%", flush=True)
                else:
                    print(f"{tag} {result['status']}: {result['reason'].strip()}", flush=True)
                    if result.get("traceback"):
                        print(result["traceback"], flush=True)
    results = [_summarize(runs[e]) for e in engines]
    print()
    print(render(results, args, numel, psi, persistent))
    if args.json_path:
        payload = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "params": numel, "param_bytes": psi, "persistent_param_bytes": persistent, "world_size": WORLD_SIZE, "results": results}
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json_path}")
    return 0 if all(r["status"] != "failed" for r in results) else 1


def run_matrix(args) -> int:
    """`--matrix`: FSDP2 and zt3d ({"stage": 3} only) on every shape, fresh processes each run, rounds interleaved
    (round-major: every shape once per round, the two engines' order alternating between rounds); per shape the
    peak and step ratios (medians over the rounds) and `zerotrain estimate`'s peak next to the measured one."""
    engines = ("fsdp2", "zt3d")
    runs: dict[str, dict[str, list[dict]]] = {shape: {e: [] for e in engines} for shape in SHAPES}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zt-matrix-") as tmp:
        for round_index in range(args.rounds):
            for shape in SHAPES:
                args.shape = shape
                for engine in engines if round_index % 2 == 0 else engines[::-1]:
                    workdir = Path(tmp) / f"{shape}-{round_index}"
                    workdir.mkdir(exist_ok=True)
                    result = run_engine(engine, args, workdir)
                    result["loadavg_1m_after"] = _loadavg()
                    runs[shape][engine].append(result)
                    shown = (f"step {_median(result['step_times']):.3f} s, peak RSS "
                             f"{'/'.join(f'{v / 2**20:.0f}' for v in result['peak_rss'])} MiB at "
                             f"{_fmt_at(result['peak_at'])} (peaks {_fmt_phases(result)}; phase ends "
                             f"{'/'.join(f'{v / 2**20:.0f}' for v in result['peak_rss_ends'])})"
                             if result["status"] == "ok" else f"{result['status']}: {result.get('reason', '')[:200]}")
                    print(f"[round {round_index + 1} {shape} {ENGINES[engine]}] {shown}, wall {result['wall_s']:.0f} s, "
                          f"load {result['loadavg_1m_after']:.1f}", flush=True)
    rows, payload = [], {}
    for shape in SHAPES:
        args.shape = shape
        fsdp, zt3 = (_summarize(runs[shape][e]) for e in engines)
        params = _param_bytes(args.model, shape, args.layers, args.width)[0]
        payload[shape] = {"fsdp2": fsdp, "zt3": zt3, "params": params}
        if fsdp["status"] != "ok" or zt3["status"] != "ok":
            rows.append(f"| {shape} | {SHAPES[shape]} | {fsdp['status']} / {zt3['status']} | | | | | | | |")
            continue
        # per round the larger rank's peak; the ratio of the medians over the rounds (and each round's ratio)
        peaks = {name: [max(r["peak_rss"]) for r in summary["rounds"]] for name, summary in (("fsdp2", fsdp), ("zt3", zt3))}
        peak = {name: _median(values) for name, values in peaks.items()}
        per_round = ", ".join(f"{z / f:.2f}" for f, z in zip(peaks["fsdp2"], peaks["zt3"]))
        step_rounds = ", ".join(f"{z / f:.2f}" for f, z in zip(fsdp["round_medians"], zt3["round_medians"]))
        estimate, ratio = _estimate_ratio(args, dict(zt3, peak_rss=[peak["zt3"]]))
        payload[shape]["estimate_ratio"] = ratio
        rows.append(f"| {shape} | {SHAPES[shape]} | {params / 1e6:.1f}M | "
                    f"{peak['fsdp2'] / 2**20:.0f} / {peak['zt3'] / 2**20:.0f} | **{peak['zt3'] / peak['fsdp2']:.2f}** "
                    f"({per_round}) | {_fmt_at(fsdp['peak_at'])} / {_fmt_at(zt3['peak_at'])} | "
                    f"{fsdp['step_s']:.3f} / {zt3['step_s']:.3f} | **{zt3['step_s'] / fsdp['step_s']:.2f}** "
                    f"({step_rounds}) | {estimate} | **{ratio:.2f}** |")
    print(f"\npreset {args.model} at {args.layers} layers x width {args.width}, world {WORLD_SIZE}, B={args.batch}/rank, "
          f"T={args.seq_len}, fp32 AdamW ({args.adamw}), clip {CLIP}, {args.warmup} + {args.steps} steps x {args.rounds} "
          f"rounds (interleaved; medians, each round's ratio in brackets); peak RSS sampled every {args.sample_ms:g} ms "
          f"inside the timed steps; zerotrain: {{\"stage\": 3}} only (targets: peak <= 1.00x, step <= 0.80x FSDP2, "
          f"measured / estimate within 15%); wall {time.perf_counter() - started:.0f} s\n")
    print("| shape | what | params | peak RSS MiB FSDP2 / ZeRO-3 | peak / FSDP2 | peak at | step s FSDP2 / ZeRO-3 | "
          "step / FSDP2 | ZeRO-3 estimate MiB (+ runtime) | peak / estimate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()
                                                             if not k.startswith("_")}, "shapes": payload}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
