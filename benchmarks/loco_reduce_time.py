#!/usr/bin/env python
"""What qgZ costs in time on a CPU: the quantized reduce vs the exact reduce-scatter, world 2.

Two ranks (gloo over 127.0.0.1, one thread each) reduce one fp32 gradient bucket of
`--numel` elements, rank-major, each way, through `zerotrain.comm`:

- exact: `Comm.reduce_scatter` (fp32 on the wire);
- qgZ int8 / int4 / int4+LoCo: `QuantizedReduceScatter` (quantize every chunk, one
  all-to-all of the packed bytes and scales, dequantize, sum in fp32; LoCo adds c = g + e
  and the 8-bit update of e);
- and, without any communication, the arithmetic alone of int4 and int4+LoCo (what one
  rank computes per call), so the split between compute and wire is visible.

Per case: median wall time per call over `--reps` (ranks start each call together after a
barrier; the slower rank's time counts), bytes this rank sent (from the Comm counters) and
both as ratios to exact. Loopback moves bytes at memory speed, so this measures the
quantization overhead against a nearly free wire; on a real network the bytes column is
what would shrink the time.

    .venv/bin/python benchmarks/loco_reduce_time.py                     # 2^22 and 2^24 elements
    .venv/bin/python benchmarks/loco_reduce_time.py --numel 1048576 --reps 5
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, port: int, sizes: list[int], reps: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from zerotrain.comm import Comm
    from zerotrain.comm.compressed import ErrorFeedback, QuantizedReduceScatter
    from zerotrain.comm.quant import quantize_rows

    rows = []
    for numel in sizes:
        shard = numel // world
        generator = torch.Generator().manual_seed(rank)
        source = torch.randn(world * shard, generator=generator) * 1e-3
        output = torch.empty(shard)

        def exact(comm: Comm):
            return lambda: comm.reduce_scatter(output, source)

        def quantized(bits: int, loco: bool):
            def make(comm: Comm):
                reduce = QuantizedReduceScatter(comm, shard, bits=bits, loco_beta=0.8 if loco else None)

                def run() -> None:
                    _, handle = reduce(source, output)
                    handle.wait()
                return run
            return make

        def arithmetic_only(loco: bool):
            def make(_comm: Comm):
                feedback = ErrorFeedback(world, shard, 0.8) if loco else None

                def run() -> None:
                    chunks = source.view(world, shard)
                    compensated, error = feedback.compensate(chunks) if feedback else (chunks, None)
                    decompressed = quantize_rows(compensated, 4, check_finite=False).dequantize()
                    if feedback:
                        feedback.update(compensated, decompressed, error)
                    decompressed.sum(dim=0)  # stands in for the owner's sum of what arrived
                return run
            return make

        cases = [("exact reduce-scatter (fp32)", exact),
                 ("qgZ int8", quantized(8, False)),
                 ("qgZ int4", quantized(4, False)),
                 ("qgZ int4 + LoCo", quantized(4, True)),
                 ("int4 arithmetic only (no comm)", arithmetic_only(False)),
                 ("int4 + LoCo arithmetic only (no comm)", arithmetic_only(True))]
        for name, make in cases:
            comm = Comm(None, rank, world)
            fn = make(comm)
            fn()  # warm-up (allocations, LoCo's first e)
            sent_before = sum(comm.counters.bytes.values())
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                fn()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(elapsed.item())
            sent = (sum(comm.counters.bytes.values()) - sent_before) / reps
            rows.append({"numel": numel, "case": name, "ms": statistics.median(times) * 1e3, "sent": sent})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="4194304,16777216", help="comma-separated bucket sizes (elements)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    sizes = [int(float(s)) for s in args.numel.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(_rank_main, args=(2, port, sizes, args.reps, queue), nprocs=2, start_method="spawn")
    rows = queue.get()
    print(f"# world 2 (gloo, 127.0.0.1, 1 thread/rank), fp32 buckets, median of {args.reps} calls, block 256")
    print("| bucket (elements, MB fp32) | case | ms/call | vs exact | bytes sent/rank | vs exact |")
    print("|---|---|---|---|---|---|")
    for numel in sizes:
        mine = [r for r in rows if r["numel"] == numel]
        exact = mine[0]
        for r in mine:
            sent = f"{r['sent']:,.0f} | {r['sent'] / exact['sent']:.3f}" if r["sent"] else "0 | -"
            print(f"| {numel:,} ({numel * 4 / 1e6:.0f} MB) | {r['case']} | {r['ms']:.1f} | "
                  f"{r['ms'] / exact['ms']:.2f} | {sent} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
