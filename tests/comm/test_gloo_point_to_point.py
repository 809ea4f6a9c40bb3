"""On gloo, Comm's reduce-scatter and all-gather run as point-to-point transfers; they must give
what gloo's own collectives give, synchronously and asynchronously, in place or not, on subgroups,
with several in flight at once, and count the same ring bytes.

The same launch checks every other `Comm` method and the differentiable collectives of `comm.autograd`
against what one process holding every rank's tensor computes (each rank rebuilds its peers' seeded
inputs), and the ring bytes against the formula (issue #48, round 5: their mutants survived before)."""
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
    out: dict = {"reference": every_method_against_reference(world, rank, dtype)}  # first: no transport set up yet
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


def _inputs(rank: int, shape: tuple, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank `rank`'s seeded input: every rank can rebuild every peer's."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * salt + rank)).to(dtype)


def every_method_against_reference(world: int, rank: int, dtype: torch.dtype) -> list:
    """(name, got, expected) for every Comm method and comm.autograd function, at this rank."""
    import torch.distributed as dist

    from zerotrain.comm import Comm, CommCounters, all_gather_with_grad, all_reduce_with_grad, all_to_all_with_grad
    from zerotrain.comm import core

    checks: list = []
    peers = range(world)
    size = dtype.itemsize
    # reduce-scatter and all-gather on each path: gloo's own, point-to-point over sockets, same-host memory
    for name, options in (("native", {"gloo_point_to_point": False}), ("sockets", {"same_host_transport": False}),
                          ("same_host", {})):
        comm = Comm(None, rank, world, CommCounters(), **options)
        chunk = 5
        whole = sum(_inputs(r, (world * chunk,), torch.float64, 1).to(dtype).double() for r in peers)
        for async_op in (False, True):
            output = torch.full((chunk,), 7.0, dtype=dtype)
            handle = comm.reduce_scatter(output, _inputs(rank, (world * chunk,), torch.float64, 1).to(dtype),
                                         async_op=async_op)
            if async_op:
                handle.wait()
            checks.append((f"{name} reduce_scatter async={async_op}", output,
                           whole[rank * chunk:(rank + 1) * chunk]))
            gathered = torch.full((world * 3,), 7.0, dtype=dtype)
            handle = comm.all_gather(gathered, _inputs(rank, (3,), dtype, 2), async_op=async_op)
            if async_op:
                handle.wait()
            checks.append((f"{name} all_gather async={async_op}", gathered,
                           torch.cat([_inputs(r, (3,), dtype, 2) for r in peers])))
        # only the same-host comm's collectives set its transport up (the others never take that path)
        checks.append((f"{name} same-host transport set up by the collectives", bool(core._SAME_HOST),
                       name == "same_host"))
        checks.append((f"{name} counters", comm.counters.snapshot(),
                        {"all_gather": {"calls": 2, "bytes": 2 * (world * 3 * size * (world - 1) // world)},
                         "reduce_scatter": {"calls": 2, "bytes": 2 * (world * chunk * size * (world - 1) // world)}}))
    comm = Comm(None, rank, world, CommCounters())
    # all-reduce: each op, a named kind, async
    mine = _inputs(rank, (4,), torch.float32, 3)
    every = torch.stack([_inputs(r, (4,), torch.float32, 3) for r in peers])
    for op, expected in ((dist.ReduceOp.SUM, every.sum(0)), (dist.ReduceOp.MAX, every.amax(0)),
                         (dist.ReduceOp.MIN, every.amin(0))):
        value = mine.clone()
        comm.all_reduce(value, op=op)
        checks.append((f"all_reduce {op}", value, expected))
    value = mine.clone()
    comm.all_reduce(value, async_op=True, kind="all_reduce_amax").wait()
    checks.append(("all_reduce async", value, every.sum(0)))
    checks.append(("sum_scalar", comm.sum_scalar(mine[:1].clone()), every[:, :1].sum(0)))
    checks.append(("any_true (rank 1 only)", comm.any_true(rank == 1, torch.device("cpu")), True))
    checks.append(("any_true (none)", comm.any_true(False, torch.device("cpu")), False))
    checks.append(("min_ints", comm.min_ints([10 - rank, 5 + rank], torch.device("cpu")), [11 - world, 5]))
    comm.barrier()
    # all-to-all: row r of the input goes to rank r; row r of the output comes from rank r
    rows = torch.stack([torch.full((2,), 10.0 * rank + r) for r in peers])
    received = torch.empty_like(rows)
    comm.all_to_all(received, rows, async_op=True, logical_bytes=4 * rows.numel() * 4).wait()
    checks.append(("all_to_all", received, torch.stack([torch.full((2,), 10.0 * r + rank) for r in peers])))
    # gather on rank 1, broadcast from rank 1
    gathered = comm.gather_to(mine, dst=1)
    checks.append(("gather_to", gathered if gathered is None else torch.stack(gathered),
                   every if rank == 1 else None))
    value = mine.clone()
    comm.broadcast(value, src=1)
    checks.append(("broadcast", value, every[1]))
    checks.append(("all_gather_object", comm.all_gather_object({"rank": rank}), [{"rank": r} for r in peers]))
    # on a group of the first and the last rank (at world 3 without rank 1): its rank 1 is global rank world - 1
    members = [0, world - 1]
    group = dist.new_group(members)
    if rank in members:
        pair = Comm(group, members.index(rank), 2, CommCounters())
        value = mine.clone()
        pair.broadcast(value, src=1)
        checks.append(("pair broadcast", value, every[world - 1]))
        gathered = pair.gather_to(mine, dst=1)
        checks.append(("pair gather_to", gathered if gathered is None else torch.stack(gathered),
                       every[members] if rank == world - 1 else None))
    # uneven all-to-all of bytes: rank r sends r + 1 + s bytes (valued 10 r + s) to rank s
    sends = [torch.full((rank + 1 + s,), 10 * rank + s, dtype=torch.uint8) for s in peers]
    output = torch.empty(sum(r + 1 + rank for r in peers), dtype=torch.uint8)
    comm.all_to_all_bytes(output, torch.cat(sends), [r + 1 + rank for r in peers], [len(t) for t in sends])
    checks.append(("all_to_all_bytes", output,
                   torch.cat([torch.full((r + 1 + rank,), 10 * r + rank, dtype=torch.uint8) for r in peers])))
    other = sum(rank + 1 + s for s in peers if s != rank)
    fraction = (world - 1) / world
    snapshot = comm.counters.snapshot()
    checks.append(("counters", {kind: snapshot[kind] for kind in ("all_to_all", "gather", "broadcast", "all_reduce",
                                                                  "all_reduce_amax", "all_gather_object")}, {
        "all_to_all": {"calls": 2, "bytes": int(world * 2 * 4 * fraction) + other,
                       "logical_bytes": int(world * 2 * 4 * 4 * fraction)},
        "gather": {"calls": 1, "bytes": 0 if rank == 1 else 16},
        "broadcast": {"calls": 1, "bytes": 16 if rank == 1 else 0},
        "all_reduce_amax": {"calls": 1, "bytes": int(2 * 16 * fraction)},
        "all_gather_object": {"calls": 1, "bytes": 0},
        # SUM, MAX, MIN of 16 bytes; sum_scalar and any_true twice of 4; min_ints of 16
        "all_reduce": {"calls": 7, "bytes": 4 * int(2 * 16 * fraction) + 3 * int(2 * 4 * fraction)}}))
    # a subgroup shares the counters; a new CPU comm has its own over the same ranks
    sub = comm.subgroup(None, rank, world)
    value = mine.clone()
    sub.all_reduce(value)
    checks.append(("subgroup all_reduce", value, every.sum(0)))
    cpu = comm.new_cpu_comm(timeout_seconds=60)
    value = mine.clone()
    cpu.all_reduce(value)
    checks.append(("new_cpu_comm all_reduce", value, every.sum(0)))
    checks.append(("new_cpu_comm counters", (cpu.counters.snapshot(), comm.counters.snapshot()["all_reduce"]["calls"]),
                   ({"all_reduce": {"calls": 1, "bytes": int(2 * 16 * fraction)}}, 8)))
    # comm.autograd: forwards and the exact gradients of a loss summed over ranks
    weights = [_inputs(r, (world * 2, 3), torch.float64, 4) for r in peers]  # rank r's loss weights
    x = _inputs(rank, (2, 3), torch.float64, 5).requires_grad_()
    gathered = all_gather_with_grad(comm, x)
    (gathered * weights[rank]).sum().backward()
    checks.append(("all_gather_with_grad", gathered.detach(),
                   torch.cat([_inputs(r, (2, 3), torch.float64, 5) for r in peers])))
    checks.append(("all_gather_with_grad grad", x.grad, sum(weights)[rank * 2:(rank + 1) * 2]))
    x = _inputs(rank, (2, 3), torch.float64, 6).requires_grad_()
    total = all_reduce_with_grad(comm, x)
    (total * weights[rank][:2]).sum().backward()
    checks.append(("all_reduce_with_grad", total.detach(), sum(_inputs(r, (2, 3), torch.float64, 6) for r in peers)))
    checks.append(("all_reduce_with_grad grad", x.grad, sum(w[:2] for w in weights)))
    # Ulysses: (heads of world * 2) x (a sequence shard of 3) -> (2 heads) x (the whole sequence), and back
    x = _inputs(rank, (world * 2, 3, 2), torch.float64, 7).requires_grad_()
    heads = all_to_all_with_grad(comm, x, 0, -2)
    every_x = [_inputs(r, (world * 2, 3, 2), torch.float64, 7) for r in peers]
    checks.append(("all_to_all_with_grad", heads.detach(),
                   torch.cat([e[rank * 2:(rank + 1) * 2] for e in every_x], dim=1)))
    loss_weights = [_inputs(r, (2, world * 3, 2), torch.float64, 8) for r in peers]
    (heads * loss_weights[rank]).sum().backward()
    checks.append(("all_to_all_with_grad grad", x.grad,
                   torch.cat([w[:, rank * 3:(rank + 1) * 3] for w in loss_weights], dim=0)))
    return checks


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_point_to_point_matches_gloo_collectives(world, dtype):
    for rank, result in enumerate(run_distributed(collectives_both_ways, world, dtype)):
        for name, got, expected in result["reference"]:
            if isinstance(expected, torch.Tensor):
                tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5  # bf16: the sum rounded once
                torch.testing.assert_close(got, expected.to(got.dtype), rtol=tol, atol=tol, msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}")
            else:
                assert got == expected, (rank, name, got, expected)
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


def test_a_comm_made_without_a_timeout_waits_as_long_as_torch_and_deepspeed_do():
    """`zerotrain.dist`'s groups and the run layer's world Comm take no timeout: a silent peer is named after
    torch's default process-group timeout (DeepSpeed's `default_pg_timeout`, 30 minutes), not sooner or later."""
    from torch.distributed.constants import default_pg_timeout

    from zerotrain.comm import Comm

    comm = Comm(None, 0, 2)
    assert comm.timeout_seconds == default_pg_timeout.total_seconds() == 1800
    assert comm.subgroup(None, 1, 2).timeout_seconds == 1800


def test_a_world_of_one_copies_waits_at_once_and_counts_nothing():
    """Size 1 (no process group needed): every collective is the identity or a copy, an async one returns a handle
    that waits at once, and nothing is counted (nothing is sent)."""
    from zerotrain.comm import Comm

    comm = Comm(None, 0, 1)
    x = torch.arange(6.0)
    for async_op in (False, True):
        out = torch.zeros(6)
        handles = [comm.reduce_scatter(out, x, async_op=async_op)]
        assert torch.equal(out, x)
        out = torch.zeros(6)
        handles.append(comm.all_gather(out, x, async_op=async_op))
        assert torch.equal(out, x)
        rows, received = x.view(1, 6), torch.zeros(1, 6)
        handles.append(comm.all_to_all(received, rows, async_op=async_op))
        assert torch.equal(received, rows)
        value = x.clone()
        handles.append(comm.all_reduce(value, async_op=async_op))
        assert torch.equal(value, x)
        assert all(h.wait() for h in handles) if async_op else handles == [None] * 4
    assert comm.gather_to(x)[0] is x and comm.all_gather_object("a") == ["a"]
    comm.broadcast(x)
    comm.barrier()
    assert comm.any_true(True, x.device) and not comm.any_true(False, x.device)
    assert comm.min_ints([3, -1], x.device) == [3, -1] and comm.sum_scalar(x[:1].clone()).item() == 0.0
    output = torch.zeros(4, dtype=torch.uint8)
    comm.all_to_all_bytes(output, torch.arange(4, dtype=torch.uint8), [4], [4])
    assert output.tolist() == [0, 1, 2, 3]
    assert comm.new_cpu_comm().size == 1 and comm.counters.snapshot() == {}
