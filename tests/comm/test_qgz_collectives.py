"""qgZ and qwZ collectives on real gloo ranks, against the exact sums and a local simulation.

- The quantized reduce-scatter (one hop, and two hops over 2 pretend nodes of 2 ranks at
  world 4) lands within the quantization bound of the exact reduce-scatter, and equals a
  local simulation of the same arithmetic.
- LoCo: the error buffer after each call equals e ← β·e + (1 − β)(c − deQ(Q(c))) with
  c = g + e (to the 8-bit storage of e), and the reduced output is the sum of the
  compensated, quantized contributions.
- Byte counters: wire bytes follow the layout (1/8 of fp32 plus scales for int4).
- qwZ all-gather: every rank gets the same dequantized full tensors, within half an int8 step.
"""
from __future__ import annotations

import pytest
import torch

from distributed import run_distributed

S, BLOCK, BETA = 333, 64, 0.8  # S: a chunk length no block size divides


def rank_input(rank: int, world: int, call: int = 0) -> torch.Tensor:
    """Rank `rank`'s gradient buffer (world·S values), chunks of very different magnitudes."""
    generator = torch.Generator().manual_seed(1000 * call + rank)
    values = torch.randn(world, S, generator=generator)
    values *= torch.logspace(-3, 1, world).unsqueeze(1)
    values[:, 100:170] = 0.0  # a whole zero block in every chunk
    return values.reshape(-1)


def _deq(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from zerotrain.comm.quant import quantize_rows
    q = quantize_rows(rows, bits, BLOCK)
    half = (q.scales / 2).repeat_interleave(q.block, dim=1)[:, :rows.shape[1]]
    return q.dequantize(), half


def simulate_one_hop(inputs: list[torch.Tensor], rank: int, bits: int):
    """(what rank `rank` should get, its error bound) for a one-hop quantized reduce-scatter."""
    world = len(inputs)
    rows, bounds = [], []
    for x in inputs:
        deq, half = _deq(x.view(world, S), bits)
        rows.append(deq[rank])
        bounds.append(half[rank])
    return torch.stack(rows).sum(0), torch.stack(bounds).sum(0)


def simulate_two_hops(inputs: list[torch.Tensor], rank: int, per_node: int, bits: int):
    world = len(inputs)
    nodes = world // per_node
    node, local = divmod(rank, per_node)
    partials, partial_bounds = [], []
    for n in range(nodes):  # hop 1 on the ranks with local index `local` of every node
        rows, bounds = [], []
        for member in range(n * per_node, (n + 1) * per_node):
            arranged = inputs[member].view(nodes, per_node, S).transpose(0, 1).reshape(per_node, nodes * S)
            deq, half = _deq(arranged, bits)
            rows.append(deq[local])
            bounds.append(half[local])
        partials.append(torch.stack(rows).sum(0))
        partial_bounds.append(torch.stack(bounds).sum(0).view(nodes, S)[node])
    rows, bounds = [], []
    for partial in partials:  # hop 2 across nodes
        deq, half = _deq(partial.view(nodes, S), bits)
        rows.append(deq[node])
        bounds.append(half[node])
    return torch.stack(rows).sum(0), torch.stack(bounds).sum(0) + torch.stack(partial_bounds).sum(0)


def qgz_on_ranks(per_node: int) -> dict:
    import torch.distributed as dist

    from zerotrain.comm import Comm, CommCounters
    from zerotrain.comm.compressed import QuantizedReduceScatter
    from zerotrain.comm.quant import row_wire_bytes
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    world, rank = topology.world_size, topology.rank
    counters = CommCounters()
    comm = Comm.data_parallel(topology, counters)
    inputs = [rank_input(r, world) for r in range(world)]
    exact = torch.stack(inputs).sum(0).view(world, S)[rank]
    out = {}
    for bits in (4, 8):
        reducer = QuantizedReduceScatter(comm, S, bits=bits, block_size=BLOCK)
        result, handle = reducer(inputs[rank].clone())
        handle.wait()
        expected, bound = simulate_one_hop(inputs, rank, bits)
        out[f"one_hop_{bits}"] = (result, expected, bound, exact)
    wire = counters.snapshot()["reduce_scatter_q4"]
    out["wire"] = (wire["bytes"], (world - 1) * row_wire_bytes(S, 4, BLOCK), wire["logical_bytes"], (world - 1) * S * 4)
    if per_node:
        intra = Comm(*_group(topology.partition_group(per_node)), counters)
        inter = Comm(*_group(topology.strided_group(per_node)), counters)
        reducer = QuantizedReduceScatter(comm, S, bits=4, block_size=BLOCK, hierarchy=(intra, inter))
        assert reducer.two_hop
        result, handle = reducer(inputs[rank].clone())
        handle.wait()
        expected, bound = simulate_two_hops(inputs, rank, per_node, 4)
        out["two_hops"] = (result, expected, bound, exact)
        snap = counters.snapshot()
        out["two_hop_kinds"] = sorted(k for k in snap if k.startswith("reduce_scatter_q4_"))
        nodes = world // per_node
        out["two_hop_wire"] = (snap["reduce_scatter_q4_intra"]["bytes"] + snap["reduce_scatter_q4_inter"]["bytes"],
                               (per_node - 1) * row_wire_bytes(nodes * S, 4, BLOCK)
                               + (nodes - 1) * row_wire_bytes(S, 4, BLOCK))
    out["loco"] = loco_on_ranks(comm, inputs, rank, world)
    out["qwz"] = qwz_on_ranks(comm, rank, world)
    dist.barrier()
    return out


def _group(info):
    group, rank, size = info
    return group, rank, size


def loco_on_ranks(comm, inputs, rank, world) -> dict:
    from zerotrain.comm.compressed import ErrorFeedback, QuantizedReduceScatter
    from zerotrain.comm.quant import quantize_rows

    reducer = QuantizedReduceScatter(comm, S, bits=4, block_size=BLOCK, loco_beta=BETA)
    feedback = reducer.feedbacks[0]
    # Every rank's error buffer, simulated locally with the same arithmetic.
    sims = [ErrorFeedback(world, S, BETA) for _ in range(world)]
    checks = []
    for call in range(3):
        grads = [rank_input(r, world, call) for r in range(world)]
        previous = feedback.error()
        result, handle = reducer(grads[rank].clone())
        handle.wait()
        c = grads[rank].view(world, S) + (previous if previous is not None else 0)
        deq = quantize_rows(c, 4, BLOCK).dequantize()
        formula = (1 - BETA) * (c - deq) + (BETA * previous if previous is not None else 0)
        stored = feedback.error()
        half8 = (feedback.stored.scales / 2).repeat_interleave(feedback.stored.block, dim=1)[:, :S]
        # Simulate all ranks' compensated contributions to this rank's chunk.
        rows = []
        for r in range(world):
            c_r, e_r = sims[r].compensate(grads[r].view(world, S))
            q_r = quantize_rows(c_r, 4, BLOCK).dequantize()
            sims[r].update(c_r, q_r, e_r)
            rows.append(q_r[rank])
        checks.append({"stored": stored, "formula": formula, "half8": half8,
                       "result": result, "expected": torch.stack(rows).sum(0),
                       "sim_error": sims[rank].error()})
    return checks


def qwz_on_ranks(comm, rank, world) -> dict:
    from zerotrain.comm.compressed import QuantizedAllGather

    full = [torch.randn(world * 50, generator=torch.Generator().manual_seed(7)),
            torch.randn(world * 3, generator=torch.Generator().manual_seed(8)) * 100]
    shards = [t.view(world, -1)[rank].clone() for t in full]
    gather = QuantizedAllGather(comm, bits=8, block_size=BLOCK)
    handle = gather(shards)
    handle.wait()
    # the counter's logical bytes: what the fp32 gather of the whole tensors would have sent
    logical = comm.counters.snapshot()["all_gather_q8"]["logical_bytes"]
    diverged = shards[0].clone()
    if rank == 1:
        diverged[0] = float("inf")
    nonfinite = gather([diverged])
    nonfinite.wait()
    return {"full": full, "gathered": handle.result, "nonfinite": nonfinite.result[0].view(world, -1),
            "logical": (logical, sum(t.numel() * 4 for t in full) * (world - 1) / world)}


def _check_close(result, expected, bound, exact, what):
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} vs simulation: {m}")
    slack = 1e-5 * exact.abs() + 1e-6
    excess = ((result - exact).abs() - bound - slack).max().item()
    assert excess <= 0, f"{what}: off the exact reduce-scatter by more than the quantization bound ({excess})"
    assert (result - exact).abs().max() > 0, f"{what}: suspiciously exact"


@pytest.mark.parametrize("world,per_node", [(2, 0), (4, 2)])
def test_quantized_reduce_scatter_and_loco(world, per_node):
    outs = run_distributed(qgz_on_ranks, world, per_node)
    for rank, out in enumerate(outs):
        for bits in (4, 8):
            _check_close(*out[f"one_hop_{bits}"], f"rank {rank}, one hop, int{bits}")
        sent, expected_wire, logical, expected_logical = out["wire"]
        assert sent == expected_wire and logical == expected_logical, out["wire"]
        assert sent / logical < 1 / 6  # short chunks: 1/8 plus a 4-byte scale per 64 values
        if per_node:
            _check_close(*out["two_hops"], f"rank {rank}, two hops")
            assert out["two_hop_kinds"] == ["reduce_scatter_q4_inter", "reduce_scatter_q4_intra"]
            assert out["two_hop_wire"][0] == out["two_hop_wire"][1]
        for call, check in enumerate(out["loco"]):
            what = f"rank {rank}, LoCo call {call}"
            # e after the call is the formula, up to its 8-bit storage (half an int8 step).
            error = (check["stored"] - check["formula"]).abs()
            assert (error <= check["half8"] * (1 + 1e-5) + 1e-7).all(), what
            assert check["stored"].abs().max() > 0, what
            torch.testing.assert_close(check["stored"], check["sim_error"], rtol=0, atol=0)
            torch.testing.assert_close(check["result"], check["expected"], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{what}: {m}")
        qwz = out["qwz"]
        for full, gathered in zip(qwz["full"], qwz["gathered"]):
            step = full.abs().max() / 127  # at most the largest block scale
            assert gathered.shape == full.shape
            assert ((gathered - full).abs() <= step / 2 * (1 + 1e-5)).all()
        assert qwz["logical"][0] == pytest.approx(qwz["logical"][1]), qwz["logical"]
        # a diverged shard (rank 1's) arrives as nan on every rank, the others' as numbers
        assert torch.isnan(qwz["nonfinite"][1]).all() and torch.isfinite(qwz["nonfinite"][0]).all()
    for out in outs[1:]:  # every rank dequantized the same weights
        for mine, first in zip(out["qwz"]["gathered"], outs[0]["qwz"]["gathered"]):
            assert torch.equal(mine, first)
