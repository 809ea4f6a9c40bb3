#!/usr/bin/env python
"""What a gradient-bucket collective costs on gloo (CPU), per way of doing a reduce-scatter.

Backs a finding of RESULTS.md: on gloo, `reduce_scatter_single` / `reduce_scatter_tensor`
clones the whole input on the calling thread, runs a full all-reduce of it, and copies the
chunk out on `wait()`, so it costs more than an in-place all-reduce of the same buffer;
`all_gather_single` is as slow. Sending each peer its chunk with `isend`/`irecv` (and summing
locally for a reduce-scatter) moves only the ring bytes and is the fastest way measured; it is
what `zerotrain.comm.Comm` does on gloo across hosts ("gloo sockets" rows); ranks on one host
read each other's chunks straight from memory instead ("same-host reads" rows,
`zerotrain.comm.same_host`). RS = reduce-scatter,
AG = all-gather, AR = all-reduce. Two ranks (gloo, 127.0.0.1, one thread each), one fp32
buffer of `--numel` elements:

    python benchmarks/gloo_collectives.py              # 2e7 elements = one 80 MB bucket
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

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rank_main(rank: int, world: int, port: int, numel: int, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    numel -= numel % world
    chunk = numel // world
    full = torch.randn(numel)
    shard = torch.empty(chunk)
    exchange = torch.empty(numel)  # persistent receive buffer for the all-to-all variant

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from zerotrain.comm import Comm
    comm = Comm(None, rank, world)  # what zerotrain uses: same-host reads here, else point-to-point on gloo
    socket_comm = Comm(None, rank, world, same_host_transport=False)  # point-to-point over gloo's sockets
    peer = 1 - rank if world == 2 else None
    received = torch.empty(chunk)
    own = slice(rank * chunk, (rank + 1) * chunk)

    def all_to_all_sum() -> None:  # reduce-scatter as one all-to-all + a local sum: ring bytes, no clone
        dist.all_to_all_single(exchange, full)
        torch.sum(exchange.view(world, chunk), dim=0, out=shard)

    def all_reduce_copy() -> None:  # reduce-scatter when the input may be clobbered: all-reduce + copy the chunk
        dist.all_reduce(full)
        shard.copy_(full[own])

    def p2p_sum() -> None:  # reduce-scatter, 2 ranks: send the peer's chunk, receive ours, add
        works = [dist.isend(full[peer * chunk:(peer + 1) * chunk], peer), dist.irecv(received, peer)]
        for work in works:
            work.wait()
        torch.add(full[own], received, out=shard)

    def batch_p2p_sum() -> None:  # the same through batch_isend_irecv
        ops = [dist.P2POp(dist.isend, full[peer * chunk:(peer + 1) * chunk], peer),
               dist.P2POp(dist.irecv, received, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        torch.add(full[own], received, out=shard)

    def all_reduce_gather() -> None:  # all-gather as an all-reduce of a buffer zero outside our own chunk
        full[:rank * chunk].zero_()
        full[(rank + 1) * chunk:].zero_()
        dist.all_reduce(full)

    def broadcast_gather() -> None:  # all-gather as one broadcast per rank, in place, all in flight at once
        works = [dist.broadcast(full[r * chunk:(r + 1) * chunk], r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()

    def p2p_gather() -> None:  # all-gather, 2 ranks: send our chunk, receive the peer's in place
        works = [dist.isend(full[own], peer), dist.irecv(full[peer * chunk:(peer + 1) * chunk], peer)]
        for work in works:
            work.wait()

    cases = [
        ("RS reduce_scatter_single (gloo)", lambda: _reduce_scatter(shard, full)),
        ("RS all_to_all_single + local sum", all_to_all_sum),
        ("RS all_reduce in place + copy chunk", all_reduce_copy),
        ("RS isend/irecv + local add", p2p_sum),
        ("RS batch_isend_irecv + local add", batch_p2p_sum),
        ("AR all_reduce, in place", lambda: dist.all_reduce(full)),
        ("AG all_gather_single (shard in place)", lambda: _all_gather(full, full[own])),
        ("AG all_reduce of zero-filled buffer", all_reduce_gather),
        ("AG broadcast per rank, async", broadcast_gather),
        ("AG isend/irecv in place", p2p_gather),
        ("RS zerotrain Comm, gloo sockets", lambda: socket_comm.reduce_scatter(shard, full)),
        ("AG zerotrain Comm, gloo sockets", lambda: socket_comm.all_gather(full, full[own])),
        ("RS zerotrain Comm, same-host reads", lambda: comm.reduce_scatter(shard, full)),
        ("AG zerotrain Comm, same-host reads", lambda: comm.all_gather(full, full[own])),
        ("clone (fresh allocation)", lambda: full.clone()),
        ("copy_ into resident buffer", lambda: exchange.copy_(full)),
    ]
    if world != 2:
        cases = [case for case in cases if "isend" not in case[0]]
    for name, fn in cases:
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{name:40s} median {statistics.median(times) * 1e3:8.1f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=float, default=2e7, help="elements in the buffer (default 2e7)")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # as in zero_speed_memory.py (read at exec)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"2 gloo ranks, fp32 buffer of {int(args.numel):,} elements ({args.numel * 4 / 1e6:.0f} MB)")
    mp.start_processes(_rank_main, args=(2, port, int(args.numel), args.reps), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
