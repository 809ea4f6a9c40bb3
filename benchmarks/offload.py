#!/usr/bin/env python
"""Offload side by side in one run: CPU Adam throughput, offloaded step time, NVMe swap bandwidth.

1. Optimizer-step throughput (parameters/s) on one fp32 tensor of `--numel` elements, at 1 and
   2 threads, interleaved: zerotrain's CPU Adam kernel (`offload/cpu_adam.py`) alone and with the
   unscale/clip multiply and the bf16 copy-back folded in, zerotrain's whole offload update, torch's
   fused CPU AdamW alone and with the separate multiply and copy passes it needed, torch
   AdamW(foreach=True), and DeepSpeedCPUAdam (when it imports and builds).
2. Step time of the ~70M GPT at world size 2 (gloo, 1 thread per rank, ZeRO-2) with
   cpu offload and cpu offload + super_offload, with clipping at 1.0 and without clipping: each
   launch builds both engines (same seed, same batches) and alternates their steps, so that a slow
   spell of the machine hits both alike; "vs plain" is the median over steps of the per-step ratio.
   The speculative steps / rollbacks / redone steps come from `engine.offload_stats()`.
   `--world 1` runs one rank whose compute uses one thread, leaving the second core to the
   host optimizer: the layout of a GPU job (the device computes, the host's cores are free),
   where super_offload's overlap can pay; small batches (`--batch 1 --seq-len 32`) make the
   compute short next to the optimizer step, as a GPU does.
3. NVMe swap: write and read GB/s of zerotrain's swapper (`aio.AsyncFileIO` + `AlignedBuffers`,
   the records the NVMe optimizer moves, with the config's aio defaults) next to `dd` with
   O_DIRECT on the same directory, and the effective I/O rate of one NVMe optimizer step.

    .venv/bin/python benchmarks/offload.py                       # all parts (~5 min)
    .venv/bin/python benchmarks/offload.py --parts adam,nvme --numel 10000000   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


# --- 1. CPU Adam --------------------------------------------------------------------------
ADAM_CONTENDERS = ("zerotrain CPU Adam kernel", "zerotrain kernel + unscale/clip + bf16 copy-back",
                   "zerotrain offload update (unscale/clip + step)", "torch fused AdamW",
                   "torch fused + mul_ + bf16 copy (3 passes)", "torch AdamW foreach", "DeepSpeedCPUAdam")


def _adam_contender(name: str, numel: int, opt_cfg, DeepSpeedCPUAdam):
    """A callable doing one optimizer step of `name` on its own fresh 50M-element tensors."""
    from zerotrain.offload import OffloadOptimizer
    from zerotrain.offload.cpu_adam import CpuAdamStepper
    from zerotrain.optim import build_optimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    param = torch.nn.Parameter(torch.randn(numel))
    grad = torch.randn(numel) * 1e-3
    copy = torch.empty(numel, dtype=torch.bfloat16)
    if name == "DeepSpeedCPUAdam":
        opt = DeepSpeedCPUAdam([param], lr=1e-3, weight_decay=0.01)
    elif name == "torch AdamW foreach":
        opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, foreach=True)
    else:
        opt = build_optimizer(opt_cfg, [param])
        assert opt.defaults.get("fused"), "zerotrain builds the fused kernel"
    if name.startswith("zerotrain offload update"):
        offload = OffloadOptimizer([FlatBucket(0, [("w", param)], 0, ShardGroup.local())], None, opt, [[param]], 1.0)
        return lambda: offload.update([grad], 0.999, [0])
    if name.startswith("zerotrain"):
        stepper = CpuAdamStepper(opt)
        if not stepper.supports(param, 0):
            raise RuntimeError("zerotrain's CPU Adam kernel is unavailable here")
        extras = dict(multiplier=0.999, copy_to=copy) if "copy-back" in name else {}
        return lambda: stepper.step(param, grad, 0, **extras)
    param.grad = grad
    if name.startswith("torch fused +"):
        def three_passes():  # what the offload path did before the kernel: scale, step, publish
            grad.mul_(0.999)
            opt.step()
            copy.copy_(param)
        return three_passes
    return opt.step


def adam_rows(numel: int, repeat: int, rounds: int = 3) -> list[tuple]:
    """Step time of each contender at 1 and 2 threads: `rounds` round-robin passes of `repeat` timed
    steps each (so a slow spell of the machine hits every contender alike), median of all."""
    from zerotrain.config import ZeroTrainConfig

    try:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        ds_error = None
    except Exception as error:  # noqa: BLE001 - reported in the table
        DeepSpeedCPUAdam, ds_error = None, f"{type(error).__name__}: {error}"
    opt_cfg = ZeroTrainConfig.model_validate({"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}).optimizer
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        steps, results = {}, {}
        for name in ADAM_CONTENDERS:
            try:
                if name == "DeepSpeedCPUAdam" and DeepSpeedCPUAdam is None:
                    raise RuntimeError(ds_error)
                steps[name] = _adam_contender(name, numel, opt_cfg, DeepSpeedCPUAdam)
                steps[name]()  # first step: states are created
            except Exception as error:  # noqa: BLE001 - reported in the table
                results[name] = f"{type(error).__name__}: {error}"
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(rounds):
            for name, fn in steps.items():
                for _ in range(repeat):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
        results.update({name: numel / statistics.median(values) for name, values in times.items()})
        steps.clear()
        ds = results.get("DeepSpeedCPUAdam")
        for name in ADAM_CONTENDERS:
            value = results[name]
            if isinstance(value, str):
                rows.append((threads, name, "skipped: " + value[:120], ""))
            else:
                ratio = f"{value / ds:.2f}" if isinstance(ds, float) else "-"
                rows.append((threads, name, f"{value / 1e6:,.0f} M/s ({numel / value * 1e3:.1f} ms)", ratio))
    torch.set_num_threads(1)
    return rows


# --- 2. offloaded step time of the GPT at world 2 (or 1) -------------------------------------
MODES = [("cpu offload, clip 1.0", {"device": "cpu"}, 1.0),
         ("cpu offload + super_offload, clip 1.0", {"device": "cpu", "super_offload": True}, 1.0),
         ("cpu offload, no clip", {"device": "cpu"}, 0.0),
         ("cpu offload + super_offload, no clip", {"device": "cpu", "super_offload": True}, 0.0)]


def build_engines(spec: dict) -> list:
    """An engine per mode in `spec["modes"]` (indices into MODES), each on the same seeded GPT (`spec["model"]`),
    ZeRO-2 with `spec["bucket"]` elements per bucket (also `benchmarks/blocked_time.py`'s)."""
    import zerotrain
    from zerotrain.models import GPT, GPTConfig

    engines = []
    for mode in spec["modes"]:
        _, block, clip = MODES[mode]
        torch.manual_seed(1234)
        model = GPT(GPTConfig.preset(spec["model"]))
        config = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_clipping": clip, "steps_per_print": 0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": spec["bucket"], "offload_optimizer": block}}
        engines.append(zerotrain.initialize(model=model, config=config)[0])
    return engines


def worker(spec: dict) -> None:
    """One rank: an engine per mode in `spec["modes"]` (same seed, same batches), their steps alternated
    (A, B, A, B, ...) so that a slow spell of the machine hits every mode alike."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    engines = build_engines(spec)
    gen = torch.Generator().manual_seed(rank)
    rows: list[list[list[float]]] = [[] for _ in engines]
    for _ in range(spec["warmup"] + spec["steps"]):
        x = torch.randint(0, 256, (spec["batch"], spec["seq_len"]), generator=gen)
        for engine, engine_rows in zip(engines, rows):
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(x, x)[1]
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            engine_rows.append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
    times = torch.tensor([r[spec["warmup"]:] for r in rows], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank, per step and phase
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps({"times": times.tolist(),
                                                 "stats": [engine.offload_stats() for engine in engines]}))
    for engine in engines:
        engine.close()
    dist.destroy_process_group()


def step_rows(args) -> list[tuple]:
    """Plain vs super_offload, with and without clipping: one launch per clipping setting, both engines
    in it, steps alternated; the ratio is the median over steps of super / plain of the same step."""
    rows = []
    for pair in ((0, 1), (2, 3)):
        with tempfile.TemporaryDirectory() as directory:
            out = os.path.join(directory, "out.json")
            spec = dict(modes=list(pair), out=out, model=args.model, batch=args.batch, seq_len=args.seq_len,
                        bucket=args.bucket, steps=args.steps, warmup=args.warmup)
            port = str(29500 + os.getpid() % 1000 + pair[0])
            procs = []
            for rank in range(args.world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                           MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
                procs.append(subprocess.Popen([sys.executable, __file__, "--_worker", json.dumps(spec)], env=env))
            codes = [p.wait(timeout=args.timeout) for p in procs]
            if any(codes) or not os.path.exists(out):
                rows.extend((MODES[mode][0], f"failed (exit codes {codes})", "", "", "", "", "") for mode in pair)
                continue
            result = json.loads(Path(out).read_text())
        plain_totals = [step[3] for step in result["times"][0]]
        for mode, times, stats in zip(pair, result["times"], result["stats"]):
            label = MODES[mode][0]
            med = [statistics.median(col) for col in zip(*times)]
            ratio = statistics.median(step[3] / plain for step, plain in zip(times, plain_totals))
            spec_info = (f"{stats.get('speculative_steps', 0)}/{stats.get('committed', 0)}/"
                         f"{stats.get('clip_redos', 0)}/{stats.get('not_speculated', 0)}" if "super" in label else "-")
            rows.append((label, f"{med[0]:.2f}", f"{med[1]:.2f}", f"{med[2]:.3f}", f"{med[3]:.2f}", f"{ratio:.2f}",
                         spec_info))
    return rows


# --- 3. NVMe swap ------------------------------------------------------------------------------
def _dd(command: str) -> float:
    done = subprocess.run(command.split(), capture_output=True, text=True)
    line = done.stderr.strip().splitlines()[-1] if done.stderr else ""
    nbytes, seconds = int(line.split()[0]), float(line.split(" s,")[0].split(", ")[-1])
    return nbytes / seconds / 1e9


def nvme_rows(args) -> list[tuple]:
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.offload import NvmeOffloadOptimizer, aio
    from zerotrain.offload.nvme import DEFAULT_CHUNK_NUMEL
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    cfg = ZeroTrainConfig.model_validate({"train_micro_batch_size_per_gpu": 1}).aio
    record = DEFAULT_CHUNK_NUMEL * 4 * 2  # one chunk's exp_avg + exp_avg_sq: what a step reads and writes
    count = max(2, int(args.nvme_gib * 2**30) // record)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
        direct = aio.direct_io_supported(directory)
        io = aio.AsyncFileIO(threads=cfg.intra_op_parallelism, direct=direct, block_size=cfg.block_size,
                             queue_depth=cfg.queue_depth)
        pool = aio.AlignedBuffers(4, record)
        fd = io.open(os.path.join(directory, "swap"), record * count)
        speeds = {}
        for what in ("write", "read"):
            futures = []
            start = time.perf_counter()
            for k in range(count):
                buffer = pool.acquire()
                call = io.write if what == "write" else io.read
                futures.append(call(fd, k * record, buffer, done=lambda b=buffer: pool.release(b)))
            for future in futures:
                future.result()
            speeds[what] = record * count / (time.perf_counter() - start) / 1e9
        io.shutdown()
        target = os.path.join(directory, "dd.bin")
        blocks = record * count // 2**24
        dd = {"write": _dd(f"dd if=/dev/zero of={target} bs=16M count={blocks} oflag=direct conv=fsync"),
              "read": _dd(f"dd if={target} of=/dev/null bs=16M count={blocks} iflag=direct")}
        for what in ("write", "read"):
            rows.append((f"swap {what} ({record * count / 2**30:.1f} GiB, O_DIRECT {direct}, block "
                         f"{cfg.block_size // 1024} KiB x {cfg.queue_depth} in flight)",
                         f"{speeds[what]:.2f}", f"{dd[what]:.2f}", f"{speeds[what] / dd[what]:.2f}"))
        param = torch.nn.Parameter(torch.randn(args.nvme_numel))
        torch_opt = torch.optim.AdamW([param], fused=True)
        bucket = FlatBucket(0, [("w", param)], 0, ShardGroup.local())
        opt = NvmeOffloadOptimizer([bucket], None, torch_opt, [[param]], 0.0,
                                   nvme_path=directory, buffer_count=4, aio=cfg)
        grad = torch.randn(args.nvme_numel)
        opt.step([grad.clone()], 1.0)
        r0, w0 = opt.records.io.bytes_read, opt.records.io.bytes_written
        start = time.perf_counter()
        opt.step([grad.clone()], 1.0)
        elapsed = time.perf_counter() - start
        moved = opt.records.io.bytes_read - r0 + opt.records.io.bytes_written - w0
        opt.close()
        rows.append((f"NVMe optimizer step, {args.nvme_numel / 1e6:.0f}M params (I/O + Adam, {elapsed:.2f} s)",
                     f"{moved / elapsed / 1e9:.2f}", f"{(dd['read'] + dd['write']) / 2:.2f}",
                     f"{moved / elapsed / 1e9 / ((dd['read'] + dd['write']) / 2):.2f}"))
    return rows


def table(header: tuple, rows: list[tuple]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="adam,step,nvme")
    parser.add_argument("--numel", type=int, default=50_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default="70m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=int(2e7), help="reduce_bucket_size for --parts step")
    parser.add_argument("--world", type=int, default=2, choices=(1, 2), help="ranks for --parts step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--nvme-gib", type=float, default=2.0)
    parser.add_argument("--nvme-numel", type=int, default=20_000_000)
    parser.add_argument("--_worker")
    args = parser.parse_args()
    if args._worker:
        worker(json.loads(args._worker))
        return 0
    parts = args.parts.split(",")
    if "adam" in parts:
        print(f"\nCPU Adam step, {args.numel / 1e6:.0f}M fp32 params (median of 3 interleaved rounds x {args.repeat}); "
              f"ratio vs DeepSpeedCPUAdam")
        print(table(("threads", "optimizer", "throughput", "vs DS"), adam_rows(args.numel, args.repeat)))
    if "step" in parts:
        print(f"\nGPT {args.model} at world {args.world}, ZeRO-2, batch {args.batch}x{args.seq_len}, median of "
              f"{args.steps} steps (slowest rank), seconds; super vs plain at the same clipping; "
              f"spec = speculative/committed/redone/not speculated (adaptive policy)")
        print(table(("mode", "fwd", "bwd", "step", "total", "vs plain", "spec"), step_rows(args)))
    if "nvme" in parts:
        print(f"\nNVMe swap vs dd (O_DIRECT, bs=16M) on {args.nvme_path}, GB/s")
        print(table(("what", "zerotrain", "dd", "ratio"), nvme_rows(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
