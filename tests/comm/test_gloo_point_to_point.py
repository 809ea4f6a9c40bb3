"""On gloo, Comm's reduce-scatter and all-gather run as point-to-point transfers; they must give
what gloo's own collectives give, synchronously and asynchronously, in place or not, on subgroups,
with several in flight at once, and count the same ring bytes."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed


def collectives_both_ways(dtype_name: str) -> dict:
    import torch.distributed as dist

    from zerotrain.comm import Comm, CommCounters
    from zerotrain.topology import Topology

    dtype = getattr(torch, dtype_name)
    Topology.build()  # the process group (gloo here)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    out: dict = {}
    for fast in (True, False):
        comm = Comm(None, rank, world, CommCounters(), gloo_point_to_point=fast)
        gen = torch.Generator().manual_seed(10 + rank)
        chunk = 1000 + 7
        inputs = [torch.randn(world * chunk, generator=gen).to(dtype) for _ in range(4)]
        # reduce-scatter: sync, async (several in flight, waited in reverse), in place into own chunk
        sync = torch.empty(chunk, dtype=dtype)
        comm.reduce_scatter(sync, inputs[0].clone())
        outputs = [torch.empty(chunk, dtype=dtype) for _ in range(3)]
        sources = [t.clone() for t in inputs[1:]]
        handles = [comm.reduce_scatter(o, s, async_op=True) for o, s in zip(outputs, sources)]
        for handle in reversed(handles):
            handle.wait()
        in_place = inputs[0].clone()
        own = in_place[rank * chunk:(rank + 1) * chunk]
        comm.reduce_scatter(own, in_place)
        # all-gather: in place (input is output's own chunk), and from a separate input, async
        full = torch.zeros(world * chunk, dtype=dtype)
        full[rank * chunk:(rank + 1) * chunk] = inputs[0][:chunk]
        comm.all_gather(full, full[rank * chunk:(rank + 1) * chunk])
        gathered = torch.empty(world * chunk, dtype=dtype)
        comm.all_gather(gathered, inputs[1][:chunk].clone(), async_op=True).wait()
        # a subgroup without rank 1: group ranks differ from global ranks
        members = [r for r in range(world) if r != 1]
        group = dist.new_group(members)
        sub = None
        if rank in members:
            sub_comm = Comm(group, members.index(rank), len(members), CommCounters(), gloo_point_to_point=fast)
            sub = torch.empty(chunk, dtype=dtype)
            sub_comm.reduce_scatter(sub, inputs[2][:len(members) * chunk].clone())
        out[fast] = {"sync": sync, "async": outputs, "in_place": own.clone(), "gather": full,
                     "gather_async": gathered, "sub": sub, "counters": comm.counters.snapshot()}
    return out


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_point_to_point_matches_gloo_collectives(world, dtype):
    for rank, result in enumerate(run_distributed(collectives_both_ways, world, dtype)):
        fast, native = result[True], result[False]
        assert fast["counters"] == native["counters"], rank
        # Two ranks sum a + b either way (bitwise equal); three may sum in another order.
        tol = {"rtol": 0, "atol": 0} if world == 2 else {"rtol": 1e-6, "atol": 1e-6}
        for key in ("sync", "in_place", "gather", "gather_async"):
            torch.testing.assert_close(fast[key], native[key], **tol, msg=f"rank {rank} {key}")
        for a, b in zip(fast["async"], native["async"]):
            torch.testing.assert_close(a, b, **tol, msg=f"rank {rank} async")
        if fast["sub"] is not None:
            torch.testing.assert_close(fast["sub"], native["sub"], **tol, msg=f"rank {rank} subgroup")
