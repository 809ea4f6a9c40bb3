"""Offload timings on this machine (one process, world 1):

* step time of a deep MLP with no offload, cpu offload and cpu offload + super_offload
  (the speculative CPU step overlaps the rest of backward on a second core);
* NVMe swap: one optimizer step over a large bucket through the async swapper, in GB/s of
  state read and written, next to `dd` with O_DIRECT on the same directory.

    .venv/bin/python benchmarks/offload_step.py [--layers 24 --width 1024 --batch 8 --steps 6]
                                                [--nvme-numel 20000000 --nvme-path /tmp]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import torch


def mlp(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                 for _ in range(layers)])


def step_time(block, args) -> tuple[float, dict]:
    import zerotrain

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1e9, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 2, "reduce_bucket_size": args.width * args.width * 2,
                                    **({"offload_optimizer": block} if block else {})}}
    engine, *_ = zerotrain.initialize(model=mlp(args.layers, args.width), config=config)
    x = torch.randn(args.batch, args.width)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
    stats = dict(getattr(engine.zero_optimizer, "stats", {}))
    engine.zero_optimizer.close() if hasattr(engine.zero_optimizer, "close") else None
    return min(times[1:]), stats


def nvme_swap(args) -> None:
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    param = torch.nn.Parameter(torch.randn(args.nvme_numel))
    bucket = FlatBucket(0, [("w", param)], 0, ShardGroup.local())
    torch_opt = torch.optim.AdamW([param], fused=True)
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as directory:
        opt = NvmeOffloadOptimizer([bucket], None, torch_opt, [[param]], 0.0, nvme_path=directory, buffer_count=4)
        grad = torch.randn(args.nvme_numel)
        opt.step([grad.clone()], 1.0)  # first step: states created, written
        r0, w0 = opt.records.io.bytes_read, opt.records.io.bytes_written
        start = time.perf_counter()
        opt.step([grad.clone()], 1.0)
        elapsed = time.perf_counter() - start
        read, written = opt.records.io.bytes_read - r0, opt.records.io.bytes_written - w0
        print(f"nvme swap step, {args.nvme_numel:,} params, chunk {opt.records.chunk_numel:,}, O_DIRECT {opt.records.io.direct}: "
              f"{elapsed:.3f} s, read {read / 2**30:.2f} GiB + wrote {written / 2**30:.2f} GiB "
              f"= {(read + written) / elapsed / 1e9:.2f} GB/s combined")
        opt.close()
        target = os.path.join(directory, "dd.bin")
        count = max(1, (read + written) // 2 // 2**24)
        for what, cmd in (("write", f"dd if=/dev/zero of={target} bs=16M count={count} oflag=direct"),
                          ("read", f"dd if={target} of=/dev/null bs=16M count={count} iflag=direct")):
            done = subprocess.run(cmd.split(), capture_output=True, text=True)
            print(f"dd {what} O_DIRECT: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nvme-numel", type=int, default=20_000_000)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--skip-nvme", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    params = args.layers * (args.width * args.width + args.width)
    print(f"MLP {args.layers}x{args.width} ({params / 1e6:.1f}M params), batch {args.batch}, 1 compute thread")
    for name, block in (("no offload", None), ("cpu offload", {"device": "cpu"}),
                        ("cpu offload + super_offload", {"device": "cpu", "super_offload": True})):
        seconds, stats = step_time(block, args)
        extra = {k: stats[k] for k in ("committed", "rollbacks") if k in stats}
        print(f"{name:30s} {seconds * 1e3:8.1f} ms/step {extra or ''}")
    if not args.skip_nvme:
        nvme_swap(args)


if __name__ == "__main__":
    main()
