"""The expert-parallel MoE layer computes what the same layer with every expert local computes."""
from __future__ import annotations


import pytest
import torch

from distributed import run_distributed

D_MODEL, D_HIDDEN, EXPERTS, TOP_K, STEPS, LR = 8, 16, 4, 2, 3, 1e-3


def rank_batches(world: int):
    """Per step, per rank: (input tokens, regression target)."""
    generator = torch.Generator().manual_seed(5)
    return [[(torch.randn(3, 5, D_MODEL, generator=generator), torch.randn(3, 5, D_MODEL, generator=generator))
             for _ in range(world)] for _ in range(STEPS)]


def rank_loss(layer, x, target):
    y, aux = layer(x)
    return ((y - target) ** 2).mean() + 0.01 * aux


def expert_parallel_training() -> tuple[list[float], dict]:
    import torch.distributed as dist

    from zerotrain.comm import Comm
    from zerotrain.parallel.moe import ExpertParallelMoE
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    world, rank = topology.world_size, topology.rank
    comm = Comm.data_parallel(topology)
    torch.manual_seed(0)
    layer = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, comm, top_k=TOP_K)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=LR)
    losses = []
    for step in rank_batches(world):
        loss = rank_loss(layer, *step[rank])
        loss.backward()
        # The gate is replicated: average its gradient. An expert's gradient already holds every
        # rank's tokens routed to it; the mean over ranks' losses divides it by the world size.
        dist.all_reduce(layer.gate.weight.grad)
        for param in layer.parameters():
            param.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state = {name: p.detach().clone() for name, p in layer.named_parameters()}
    return losses, state, layer.w_in.ep_slice


def reference(world: int) -> tuple[list[float], dict]:
    from zerotrain.comm import Comm
    from zerotrain.parallel.moe import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 0, 1), top_k=TOP_K)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=LR)
    losses = []
    for step in rank_batches(world):
        loss = sum(rank_loss(layer, x, target) for x, target in step) / world
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in layer.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_moe_matches_all_local_experts(world):
    ref_losses, ref_state = reference(world)
    for losses, state, expert_slice in run_distributed(expert_parallel_training, world, timeout=120):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
        torch.testing.assert_close(state["gate.weight"], ref_state["gate.weight"], rtol=1e-5, atol=1e-6)
        (first, count), = expert_slice.pieces  # this rank's experts, by the record the weights carry
        assert count == EXPERTS // world
        for name in ("w_in", "b_in", "w_out", "b_out"):
            torch.testing.assert_close(state[name], ref_state[name][first:first + count], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")


def test_bad_expert_counts_are_refused():
    from zerotrain.comm import Comm
    from zerotrain.parallel.moe import ExpertParallelMoE

    with pytest.raises(ValueError, match="top_k=5 must be between 1 and num_experts=4"):
        ExpertParallelMoE(D_MODEL, D_HIDDEN, 4, Comm(None, 0, 1), top_k=5)
