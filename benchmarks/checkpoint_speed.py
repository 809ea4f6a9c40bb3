"""Checkpoint save/load speed: zerotrain vs torch.distributed.checkpoint (FSDP2) vs DeepSpeed.

The ~70M GPT (``zerotrain.models.GPT``, preset ``70m``) + AdamW, trained a few steps at
world size 2 on the CPU (gloo over 127.0.0.1, one thread per rank) so that every
optimizer state exists, then, in the same pair of processes:

* **save s / GB/s**: a synchronous save, timed from the call to its return on the slowest
  rank; GB/s = bytes of the checkpoint directory / seconds. zerotrain and DCP fsync every
  file before returning (durable); DeepSpeed's ``torch.save`` files do not, so its row
  also gives the time of fsyncing them afterwards ("+ fsync").
* **async stall**: how long the training loop is blocked by an asynchronous save, whole: the
  call's return plus, for zerotrain, the snapshot fence of the next step (the deferred copy
  into host buffers that the next ``step()`` waits for, ``Checkpointer.last_fence_seconds``);
  shown for a save that reuses the host buffers, and in brackets for the first, which
  allocates them. Also how much slower the training steps run while the background writer
  works: the next step, and the mean of the two steps during the save, each minus a no-save
  step taken just before that save.
* **ztp** (zerotrain, process writer; ``ckpt_process_writer.py``, benchmark-only): the same
  snapshot in shared memory, written and committed by a writer process per rank instead of
  a thread, to measure issue #4's "thread or process"; its load is zerotrain's.
* **load s**: same topology; **reshard load s**: the world-2 ZeRO-3 (FSDP2) checkpoint read by
  one process at ZeRO stage 1 (a plain model). Before every load the checkpoint's files are
  fsynced and dropped from the page cache (posix_fadvise DONTNEED), so every engine reads
  from the disk.
* **load rounds** (``--load-rounds N``): after the main phases, N rounds in which every engine,
  in an order rotated each round, starts fresh processes, trains ``--warmup`` steps (so that
  every optimizer state exists to load into) and times one cold load of its ``sync0``; the
  engines alternate, so a busy moment of a shared machine hits them all alike. Medians and
  ratios to zerotrain. **ztn** (load rounds only) loads zerotrain's checkpoint with
  ``verify_on_load: false`` (no crc32 check: each rank reads what it needs straight into the engine).
  ``--load-only`` skips the main phases and loads the checkpoints an
  earlier ``--keep --dir D`` run left in ``D``.

    .venv/bin/python benchmarks/checkpoint_speed.py                     # all engines, ~6 min
    .venv/bin/python benchmarks/checkpoint_speed.py --engines zt,ztp    # thread vs process writer
    .venv/bin/python benchmarks/checkpoint_speed.py --model tiny --repeats 1   # smoke run
    .venv/bin/python benchmarks/checkpoint_speed.py --engines zt,dcp --json out.json
    .venv/bin/python benchmarks/checkpoint_speed.py --engines zt,dcp,ds --repeats 1 --load-rounds 5
    .venv/bin/python benchmarks/checkpoint_speed.py --engines zt,ds,ztn --repeats 1 --load-rounds 6   # #21's judge

DeepSpeed runs with ``DS_ACCELERATOR=cpu`` when ``import deepspeed`` works; otherwise its
row says why it was skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from checkpoint_profile import print_profiles
from checkpoint_report import ENGINES, LOAD_ONLY, launch, print_load_rounds, print_table

LR = 1e-4
# the run that judges #21's load target (verified cold load <= the fastest peer's): on a quiet machine
FINAL_RUN = ".venv/bin/python benchmarks/checkpoint_speed.py --engines zt,ds,ztn --repeats 1 --load-rounds 6"


# =============================================================================================
# worker side
# =============================================================================================

def _barrier_time(fn) -> float:
    """Seconds `fn()` takes on the slowest rank (ranks start together)."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _drop_cache(path: Path) -> None:
    """fsync every file of `path`, then drop it from the page cache: the next read comes from disk."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            _drop_cache_file(f)


def _batches(count: int, batch: int, seq: int, vocab: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    data = torch.randint(0, vocab, (count, batch, seq + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


# benchmark-only shapes beside zerotrain's presets: the bandwidth-bound row (#50)
BENCH_PRESETS = {"1b": dict(n_layer=20, n_head=16, n_embd=2048, block_size=512),  # 1.007e9 parameters
                 # 0.505e9: the largest of these shapes whose DeepSpeed pair fits a 24 GiB host (at 1b and 0.7b its
                 # ranks were OOM-killed at 12.2 GB each: runs 29, 33), so DeepSpeed has a bandwidth-bound row
                 "500m": dict(n_layer=10, n_head=16, n_embd=2048, block_size=512)}


def model_parameters(name: str) -> int:
    """Parameters of GPT shape `name` (a zerotrain preset or BENCH_PRESETS), from its shape alone."""
    from zerotrain.models import GPTConfig
    c = GPTConfig(**BENCH_PRESETS[name]) if name in BENCH_PRESETS else GPTConfig.preset(name)
    d, hidden = c.n_embd, c.mlp_hidden
    per_layer = 2 * 2 * d + 3 * d * d + 3 * d + d * d + d + d * hidden + hidden + hidden * d + d
    return c.vocab_size * d + c.block_size * d + c.n_layer * per_layer + 2 * d + (0 if c.tie_weights else d * c.vocab_size)


def _model(args):
    import torch
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(0)
    config = GPTConfig(**BENCH_PRESETS[args.model]) if args.model in BENCH_PRESETS else GPTConfig.preset(args.model)
    args.seq_len = min(args.seq_len, config.block_size)
    return GPT(config)


class Job:
    """One engine's saves and loads; subclasses say how (zerotrain, DCP, DeepSpeed)."""

    async_supported = True

    def __init__(self, args, root: Path, rank: int):
        self.args, self.root, self.rank = args, root, rank
        self.vocab = 256

    def run(self) -> dict:
        import torch.distributed as dist
        args, out = self.args, {}
        batches = _batches(args.warmup + 2 + 3 * args.repeats + 4, args.batch, args.seq_len, self.vocab, self.rank)
        it = iter(batches)
        for _ in range(args.warmup):
            self.train_step(*next(it))
        out["step_s"] = statistics.mean(_barrier_time(lambda: self.train_step(*next(it))) for _ in range(2))
        saves = []
        for i in range(args.repeats):
            saves.append(_barrier_time(lambda: self.save(f"sync{i}")))
        out["save_s"] = min(saves)
        out["save_all_s"] = saves
        out["bytes"] = _dir_bytes(self.root / "sync0")
        if not self.durable:
            out["fsync_s"] = _barrier_time(lambda: _fsync_tree(self.root / f"sync{args.repeats - 1}"))
        if self.async_supported and not args.no_async:
            stalls, fences, wholes, slow, next_slow = [], [], [], [], []
            for i in range(args.repeats):
                before = _barrier_time(lambda: self.train_step(*next(it)))  # this save's no-save step
                stalls.append(_barrier_time(lambda: self.save_async(f"async{i}")))
                during = [_barrier_time(lambda: self.train_step(*next(it))) for _ in range(2)]
                fences.append(_max_over_ranks(self.fence_seconds()))
                wholes.append(stalls[-1] + fences[-1])
                slow.append(statistics.mean(during) - before)
                next_slow.append(during[0] - before)
                out.setdefault("async_wait_s", []).append(_barrier_time(self.wait))
                if hasattr(getattr(self, "engine", None), "checkpointer") and \
                        hasattr(self.engine.checkpointer, "last_send_seconds"):
                    out.setdefault("send_s", []).append(self.engine.checkpointer.last_send_seconds)
            out["stall_first_s"], out["stall_s"] = stalls[0], min(stalls[1:] or stalls)
            out["stall_all_s"], out["fence_all_s"], out["whole_stall_all_s"] = stalls, fences, wholes
            # the whole stall of a save that reuses its buffers: the call plus the next step's snapshot fence
            out["whole_stall_s"] = min(wholes[1:] or wholes)
            out["step_slowdown_s"] = statistics.mean(slow)
            out["next_step_slowdown_s"] = statistics.mean(next_slow[1:] or next_slow)
        loads = []
        for _ in range(args.repeats):
            if self.rank == 0:
                _drop_cache(self.root / "sync0")
            dist.barrier()
            loads.append(_barrier_time(lambda: self.load("sync0")))
        out["load_s"] = min(loads)
        out["load_all_s"] = loads
        return out

    durable = True

    def save_async(self, tag: str) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def fence_seconds(self) -> float:
        """How long the first step after the last async save waited for a deferred snapshot (0: none)."""
        return 0.0


class ZerotrainJob(Job):
    def __init__(self, args, root, rank, stage: int = 3, process_writer: bool = False):
        super().__init__(args, root, rank)
        import zerotrain
        model = _model(args)
        self.vocab = model.config.vocab_size
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 2e7}, "steps_per_print": 0,
                  "checkpoint": {"verify_on_load": args.verify_on_load}}
        if getattr(args, "memory_budget_gib", None) is not None:  # the 1b pair on a 24 GiB host needs more than the default 50%
            config["zero_optimization"]["memory_budget_bytes"] = int(args.memory_budget_gib * 2 ** 30)
        self.engine, *_ = zerotrain.initialize(model=model, config=config)
        if process_writer:  # async saves written by a writer process per rank (benchmark-only variant)
            from ckpt_process_writer import ProcessWriterCheckpointer
            self.engine.checkpointer = ProcessWriterCheckpointer(self.engine.checkpoint_state())

    def train_step(self, x, y) -> None:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()

    def save(self, tag: str) -> None:
        self.engine.save_checkpoint(str(self.root), tag=tag, async_save=False)

    def save_async(self, tag: str) -> None:
        self.engine.save_checkpoint(str(self.root), tag=tag, async_save=True)

    def wait(self) -> None:
        self.engine.wait_checkpoint()

    def fence_seconds(self) -> float:
        return self.engine.checkpointer.last_fence_seconds or 0.0

    def load(self, tag: str) -> None:
        self.engine.load_checkpoint(str(self.root), tag=tag)


class DcpJob(Job):
    def __init__(self, args, root, rank, sharded: bool = True):
        super().__init__(args, root, rank)
        import torch
        model = _model(args)
        self.vocab = model.config.vocab_size
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.future = None
        # DCP's documented set-up for async_save: a separate gloo group, so the background
        # writer's collectives never interleave with the training step's (on one group they deadlock)
        import torch.distributed as dist
        self.ckpt_group = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None

    def train_step(self, x, y) -> None:
        import torch
        _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, tag: str) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(self._state(), checkpoint_id=str(self.root / tag))

    def save_async(self, tag: str) -> None:
        import torch.distributed.checkpoint as dcp
        self.future = dcp.async_save(self._state(), checkpoint_id=str(self.root / tag),
                                     process_group=self.ckpt_group)

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def load(self, tag: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.root / tag))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


class DeepSpeedJob(Job):
    async_supported = False
    durable = False

    def __init__(self, args, root, rank):
        super().__init__(args, root, rank)
        import deepspeed
        model = _model(args)
        self.vocab = model.config.vocab_size
        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
                  "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 9}
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def train_step(self, x, y) -> None:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        self.engine.step()

    def save(self, tag: str) -> None:
        self.engine.save_checkpoint(str(self.root), tag=tag)

    def load(self, tag: str) -> None:
        self.engine.load_checkpoint(str(self.root), tag=tag)


def _disk_read_bytes() -> int:
    """Bytes this process has had read from the disk so far (/proc/self/io's read_bytes; 0 where there is none)."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return 0


def _load_round(job: Job) -> dict:
    """A fresh job trains `load_warmup` steps (default `warmup`; 0: a resume at start-up, the optimizer without
    state), then one cold load of `sync0` (the load-rounds phase)."""
    import torch.distributed as dist
    warmup = job.args.warmup if job.args.load_warmup is None else job.args.load_warmup
    for x, y in _batches(warmup, job.args.batch, job.args.seq_len, job.vocab, job.rank):
        job.train_step(x, y)
    if job.args.prewarm_gib:  # a diagnostic (run 36): memory touched and freed just before the load, untimed
        import torch
        torch.ones(int(job.args.prewarm_gib * 2**30) // 4)  # made, filled and freed
    if job.rank == 0:
        _drop_cache(job.root / "sync0")
    dist.barrier()
    usage: dict = {}

    def load() -> None:  # the load's CPU and page faults too (where a CPU-bound load's time goes: run 36)
        before, disk = resource.getrusage(resource.RUSAGE_SELF), _disk_read_bytes()
        job.load("sync0")
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage.update(user_s=after.ru_utime - before.ru_utime, sys_s=after.ru_stime - before.ru_stime,
                     faults=after.ru_minflt - before.ru_minflt, disk_gb=(_disk_read_bytes() - disk) / 1e9)

    seconds = _barrier_time(load)
    return {"load_s": seconds, "load_usage": {key: _max_over_ranks(value) for key, value in usage.items()}}


def _save_round(job: Job) -> dict:
    """A fresh job trains `warmup` steps, then one durable save of tag `round` (the save-rounds phase):
    DeepSpeed's seconds include the fsync of its files, zerotrain's and DCP's saves fsync by themselves."""
    batches = _batches(job.args.warmup, job.args.batch, job.args.seq_len, job.vocab, job.rank)
    for x, y in batches:
        job.train_step(x, y)
    save = _barrier_time(lambda: job.save("round"))
    fsync = 0.0 if job.durable else _barrier_time(lambda: _fsync_tree(job.root / "round"))
    return {"save_s": save + fsync, "fsync_s": fsync}


def _profile(job: Job) -> dict:
    """One save and one cold load under cProfile (checkpoint_profile.py); with `--load-warmup 0` the load is a
    new job's (a resume at start-up)."""
    import torch.distributed as dist
    from checkpoint_profile import profile_run
    for x, y in _batches(job.args.warmup, job.args.batch, job.args.seq_len, job.vocab, job.rank):
        job.train_step(x, y)
    fresh = None
    if job.args.load_warmup == 0:  # the load profiled is a resume at start-up: a new job, no optimizer state
        fresh = lambda: type(job)(job.args, job.root, job.rank)  # noqa: E731
    return {"profile": profile_run(job, job.root, "", job.rank, _fsync_tree, _drop_cache, dist.barrier, fresh)}


def _reshard_stage(world: int) -> int:
    """The ZeRO stage a reshard load runs at: 1 in one process (a plain model's whole states), else 3."""
    return 1 if world == 1 else 3


def _reshard_load(args, root: Path, engine: str) -> dict:
    """Load the world-2 checkpoint `sync0` at world `--reshard-world`: one process at ZeRO stage 1 (zerotrain) / a
    plain model (DCP), or ZeRO-3 over that many ranks (zerotrain; the 1b row, whose states fit no single process
    here). The first load is a resume at start-up (a fresh engine, no optimizer state), later ones load into it."""
    import torch.distributed as dist
    world, rank = dist.get_world_size(), dist.get_rank()
    if engine in ("zt", "zto"):
        job = ZerotrainJob(args, root, rank, stage=_reshard_stage(world))
    elif world == 1:
        job = DcpJob(args, root, 0, sharded=False)
    else:
        raise _Unavailable(f"--reshard-world {world}: the benchmark reshards {engine} into one process only")
    loads = []
    for _ in range(args.repeats):
        if rank == 0:
            _drop_cache(root / "sync0")
        dist.barrier()
        loads.append(_barrier_time(lambda: job.load("sync0")))
    return {"reshard_load_s": min(loads), "reshard_load_all_s": loads}


def _check_space(args, root: Path, engines: list) -> str | None:
    """A line saying why the run cannot fit on the disk of `root`, or None. Needed: the checkpoints kept for the
    load rounds (sync0 of each engine) plus one engine's working set (its saves, async saves and profile
    checkpoint at once), each checkpoint = parameters x 12 bytes (fp32 weights and Adam's two states) + 5%."""
    checkpoint = int(model_parameters(args.model) * 12 * 1.05)
    savers = [e for e in engines if e not in LOAD_ONLY]
    at_once = args.repeats * (1 if args.no_async else 2) + 1
    needed = checkpoint * (len(savers) + at_once) + (checkpoint if args.dd else 0)
    free = shutil.disk_usage(root).free
    print(f"disk: {free / 1e9:.1f} GB free in {root}, the run needs about {needed / 1e9:.1f} GB "
          f"({checkpoint / 1e9:.2f} GB per checkpoint)", flush=True)
    if free < needed + (2 << 30):
        return (f"checkpoint_speed.py: not enough free disk in {root}: {free / 1e9:.1f} GB free, the run needs about "
                f"{needed / 1e9:.1f} GB plus 2 GB to spare (--model {args.model}, engines {','.join(savers)}); "
                f"free space or pass --dir on a larger disk")
    return None


def _dd_speed(root: Path, nbytes: int) -> dict:
    """dd writing `nbytes` (rounded to 16 MiB blocks) with O_DIRECT and a final fsync into `root`, then reading
    them back cold with O_DIRECT: the disk's own pace for a checkpoint's bytes. The file is removed after."""
    import subprocess
    block = 16 << 20
    count = max(1, -(-nbytes // block))
    target = root / ".ddtest"
    try:
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={count}", "oflag=direct",
                        "conv=fsync"], check=True, capture_output=True)
        write = time.perf_counter() - t0
        _drop_cache_file(target)
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={target}", "of=/dev/null", f"bs={block}", "iflag=direct"], check=True,
                       capture_output=True)
        read = time.perf_counter() - t0
    finally:
        target.unlink(missing_ok=True)
    return {"bytes": count * block, "write_s": write, "read_s": read}


def _drop_cache_file(path: Path) -> None:
    """fsync one file, then drop it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def worker_main(spec: dict) -> int:
    result: dict[str, Any] = {"engine": spec["engine"], "phase": spec["phase"]}
    try:
        import datetime

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        args = argparse.Namespace(**spec["args"])
        root, engine = Path(spec["root"]), spec["engine"]
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
        rank = dist.get_rank()
        if spec["phase"] == "reshard":
            result.update(_reshard_load(args, root, engine))
        else:
            if engine == "ds":
                try:
                    import deepspeed  # noqa: F401
                except Exception as error:  # noqa: BLE001 - ImportError, or a broken install
                    raise _Unavailable(f"import deepspeed failed: {type(error).__name__}: {error}") from error
            if engine == "ztp":
                job = ZerotrainJob(args, root, rank, process_writer=True)
            elif engine == "ztn":  # zerotrain's checkpoint loaded without the crc32 check
                job = ZerotrainJob(argparse.Namespace(**{**vars(args), "verify_on_load": False}), root, rank)
            elif engine == "ztr":  # zerotrain's world-2 checkpoint loaded at world --reshard-world
                job = ZerotrainJob(args, root, rank, stage=_reshard_stage(dist.get_world_size()))
            else:  # zto: zerotrain of another checkout (--old-code), for interleaved before/after rounds
                job = {"zt": ZerotrainJob, "zto": ZerotrainJob, "dcp": DcpJob, "ds": DeepSpeedJob}[engine](args, root, rank)
            phases = {"load": _load_round, "save": _save_round, "profile": _profile}
            result.update(phases[spec["phase"]](job) if spec["phase"] in phases else job.run())
        result["status"] = "ok"
        dist.barrier()
        dist.destroy_process_group()
    except _Unavailable as why:
        result.update(status="unavailable", reason=str(why))
    except Exception as error:  # noqa: BLE001 - reported by the parent
        result.update(status="failed", reason=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


class _Unavailable(Exception):
    pass


# =============================================================================================
# parent side
# =============================================================================================

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engines", default="zt,ztp,dcp,ds", help="comma list of " + ", ".join(ENGINES))
    parser.add_argument("--model", "--size", dest="model", default="70m",
                        help="zerotrain GPT preset, or " + ", ".join(BENCH_PRESETS) + " (with dd's times beside)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1, help="training steps before anything is timed")
    parser.add_argument("--repeats", type=int, default=2, help="saves and loads of each kind (best is shown)")
    parser.add_argument("--no-verify-on-load", dest="verify_on_load", action="store_false",
                        help="zerotrain: skip the crc32 check of the files a load reads")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory "
                                                     "under the current one, removed at the end)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per phase")
    parser.add_argument("--load-warmup", type=int, default=None,
                        help="training steps before each load round's load (default --warmup; 0: a resume at "
                             "start-up, before the first step: no optimizer state yet)")
    parser.add_argument("--prewarm-gib", type=float, default=0.0,
                        help="a diagnostic: each load round's ranks fill and free this many GiB just before the load "
                             "(untimed), so the load's new tensors land on pages touched a moment ago (run 36: on this "
                             "VM, pages not touched for a while cost ~6 us each at first touch, recent ones ~1 us)")
    parser.add_argument("--load-rounds", type=int, default=0,
                        help="rounds of cold loads in fresh processes, engines interleaved (medians reported)")
    parser.add_argument("--load-only", action="store_true",
                        help="skip the main phases: load rounds on the checkpoints of an earlier --keep --dir run")
    parser.add_argument("--save-rounds", type=int, default=0,
                        help="rounds of one durable save in fresh processes, engines interleaved (DeepSpeed's "
                             "with the fsync of its files; medians reported)")
    parser.add_argument("--profile", action="store_true",
                        help="first, per engine: one save and one cold load per rank under cProfile, by phase")
    parser.add_argument("--old-code", default=None,
                        help="a checkout of zerotrain (its repository root) that engine zto imports: before/after "
                             "rounds interleaved in one invocation")
    parser.add_argument("--memory-budget-gib", type=float, default=None,
                        help="zerotrain's zero_optimization.memory_budget_bytes per rank, in GiB (default: its own "
                             "default, 50%% of the rank's share of the host's available memory; the 1b row needs ~8.1)")
    parser.add_argument("--reshard-world", type=int, default=1,
                        help="ranks that load the world-2 checkpoint in the reshard rows (the main phase's reshard "
                             "load and engine ztr's load rounds): 1 = one process at ZeRO stage 1, more = ZeRO-3 "
                             "(the 1b row: its whole states fit no single process on a 24 GiB host)")
    parser.add_argument("--no-async", action="store_true", help="main phase: skip the asynchronous saves")
    parser.add_argument("--no-main", action="store_true",
                        help="skip the main phase (only --profile, --save-rounds, --load-rounds)")
    parser.add_argument("--dd", action="store_true",
                        help="also time dd writing (O_DIRECT, fsync) and reading (O_DIRECT) the checkpoint's bytes "
                             "on the same disk (default with --model 1b)")
    args = parser.parse_args(argv)
    if "zto" in args.engines.split(",") and not args.old_code:
        parser.error("engine zto needs --old-code DIR (a zerotrain checkout to compare with)")
    args.dd = args.dd or args.model in BENCH_PRESETS
    if args.load_only and (args.dir is None or not args.load_rounds):
        parser.error("--load-only needs --dir (holding an earlier --keep run's checkpoints) and --load-rounds")
    if args.dir is None:
        # on the same disk as the project (not /tmp, which may be tmpfs)
        root = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=os.getcwd()))
    else:
        root = Path(args.dir)
        root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for engine in engines:
        if engine not in ENGINES:
            parser.error(f"unknown engine {engine!r} (choose from {', '.join(ENGINES)})")
    rounds: dict[str, list] = {}
    save_rounds: dict[str, list] = {}
    usages: dict[str, list] = {}  # the load rounds' CPU seconds, faults and disk bytes (the slowest rank's of each)
    profiles: dict[str, list] = {}
    disk: dict[str, float] = {}
    if not args.load_only:
        problem = _check_space(args, root, engines)
        if problem:
            print(problem, file=sys.stderr)
            return 2
    try:
        if args.dd:
            disk = _dd_speed(root, model_parameters(args.model) * 12)
        for engine in [e for e in engines if e not in LOAD_ONLY] if args.profile else []:
            result = launch(engine, "profile", 2, args, root)
            if result.get("status") != "ok":
                print(result.get("traceback", result.get("reason")), file=sys.stderr)
                continue
            other = json.loads((root / f"{engine}.profile.rank1.json").read_text())
            profiles[engine] = [result["profile"], other["profile"]]
            shutil.rmtree(root / engine / "prof", ignore_errors=True)
        for index in range(args.save_rounds):
            savers = [e for e in engines if e not in LOAD_ONLY]
            order = savers[index % len(savers):] + savers[:index % len(savers)]
            for engine in order:
                shutil.rmtree(root / engine / "round", ignore_errors=True)
                result = launch(engine, "save", 2, args, root)
                shutil.rmtree(root / engine / "round", ignore_errors=True)
                if result.get("status") != "ok":
                    print(result.get("traceback", result.get("reason")), file=sys.stderr)
                    continue
                save_rounds.setdefault(engine, []).append(result["save_s"])
            print(f"save round {index + 1}: " + ", ".join(f"{e} {save_rounds[e][-1]:.3f}s" for e in order
                                                         if len(save_rounds.get(e, [])) == index + 1), flush=True)
        for engine in [] if args.load_only or args.no_main else [e for e in engines if e not in LOAD_ONLY]:
            started = time.perf_counter()
            result = launch(engine, "main", 2, args, root)
            if result.get("status") == "ok":
                if engine == "ds":
                    result["reshard_note"] = "n/a: needs offline ds_to_universal"
                elif engine == "ztp":
                    result["reshard_note"] = "as zt (same loader)"
                else:
                    reshard = launch(engine, "reshard", args.reshard_world, args, root)
                    if reshard.get("status") == "ok":
                        result.update(reshard)
                    else:
                        result["reshard_note"] = "failed: " + reshard.get("reason", "").splitlines()[0][:60]
                        print(reshard.get("traceback", reshard.get("reason")), file=sys.stderr)
            elif result.get("status") == "failed":
                print(result.get("traceback", result.get("reason")), file=sys.stderr)
            results[engine] = result
            print(f"{engine}: {result.get('status')} in {time.perf_counter() - started:.0f}s", flush=True)
            for extra in (root / engine).glob("*") if (root / engine).is_dir() else ():
                if extra.name != "sync0":  # only sync0 is loaded again: the rest goes now (a 1b row is 12 GB each)
                    shutil.rmtree(extra, ignore_errors=True) if extra.is_dir() else extra.unlink()
        loadable = [e for e in engines if (root / LOAD_ONLY.get(e, e) / "sync0").is_dir()]
        if args.load_rounds and not loadable:
            print(f"--load-rounds: no checkpoint to load under {root} (the main phase writes them: drop --no-main, "
                  f"or use --load-only --dir D of a --keep run)", file=sys.stderr)
        for index in range(args.load_rounds if loadable else 0):
            order = loadable[index % len(loadable):] + loadable[:index % len(loadable)]
            for engine in order:
                result = launch(engine, "load", args.reshard_world if engine == "ztr" else 2, args, root)
                if result.get("status") != "ok":
                    print(result.get("traceback", result.get("reason")), file=sys.stderr)
                    continue
                rounds.setdefault(engine, []).append(result["load_s"])
                usages.setdefault(engine, []).append(result["load_usage"])
            print(f"load round {index + 1}: " + ", ".join(
                f"{e} {rounds[e][-1]:.3f}s (cpu {usages[e][-1]['user_s']:.2f}+{usages[e][-1]['sys_s']:.2f} sys, "
                f"{usages[e][-1]['faults'] / 1e3:.0f}k faults, {usages[e][-1]['disk_gb']:.2f} GB read)" for e in order
                if len(rounds.get(e, [])) == index + 1), flush=True)
    finally:
        if not args.keep:
            for engine in engines:
                shutil.rmtree(root / LOAD_ONLY.get(engine, engine), ignore_errors=True)
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if profiles:
        print_profiles(profiles)
    if results:
        print_table(results, args)
    if disk:
        print(f"\ndd on the same disk, {disk['bytes'] / 1e9:.2f} GB (the checkpoint's size, one stream, 16 MiB blocks): "
              f"write O_DIRECT + fsync {disk['write_s']:.2f}s ({disk['bytes'] / 1e9 / disk['write_s']:.2f} GB/s), "
              f"cold read O_DIRECT {disk['read_s']:.2f}s ({disk['bytes'] / 1e9 / disk['read_s']:.2f} GB/s)")
        for engine, result in results.items():  # the main phase's best save and load beside dd's (#50: <= 1.2x)
            if result.get("status") == "ok":
                save = result["save_s"] + result.get("fsync_s", 0.0)
                print(f"  {engine}: durable save {save:.2f}s = {save / disk['write_s']:.2f}x dd's write, cold load "
                      f"{result['load_s']:.2f}s = {result['load_s'] / disk['read_s']:.2f}x dd's read")
    if save_rounds:
        print_load_rounds(save_rounds, "durable saves", disk.get("write_s"))
    if rounds:
        print_load_rounds(rounds, dd_seconds=disk.get("read_s"))
    print(f"\nload average {' '.join('%.2f' % x for x in os.getloadavg())} at the end. The #21 load target is judged "
          "on a quiet machine (nothing else running), with:\n  " + FINAL_RUN)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "load_rounds": rounds,
                                               "load_rounds_usage": usages,
                                               "save_rounds": save_rounds, "profiles": profiles, "dd": disk},
                                              indent=2))
    return 0 if all(r.get("status") in ("ok", "unavailable") for r in results.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_worker":
        sys.exit(worker_main(json.loads(sys.argv[2])))
    sys.exit(main())
