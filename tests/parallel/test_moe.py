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
    # a rank's share with no token (rank 0's): its loss is 0, not NaN, and the exchanges both ways still run with
    # the others' tokens (a hang or a NaN gradient here otherwise)
    x = torch.randn(0 if rank == 0 else 4, D_MODEL, generator=torch.Generator().manual_seed(9))
    y, aux = layer(x)
    (y.sum() + aux).backward()
    empty_share = (aux.item(), all(bool(p.grad.isfinite().all()) for p in layer.parameters()))
    return losses, state, layer.w_in.ep_slice, empty_share


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
    results = run_distributed(expert_parallel_training, world, timeout=120)
    assert results[0][3] == (0.0, True) and all(r[3][0] > 0 and r[3][1] for r in results[1:]), [r[3] for r in results]
    for losses, state, expert_slice, _ in results:
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


def _dense(layer, x, top_k=TOP_K):
    """The layer's math written out token by token with every expert at hand (`layer` holds them all)."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ layer.gate.weight.T, dim=-1)
    rows, chosen = [], torch.zeros(EXPERTS)
    for token, p in zip(tokens, probs):
        top = sorted(range(EXPERTS), key=lambda e: -p[e].item())[:top_k]
        out = torch.zeros(D_MODEL)
        for e in top:
            hidden = torch.nn.functional.gelu(layer.w_in[e] @ token + layer.b_in[e])
            out = out + p[e] * (layer.w_out[e] @ hidden + layer.b_out[e])
            chosen[e] += 1
        rows.append(out)
    aux = EXPERTS * ((chosen / chosen.sum()) * probs.mean(dim=0)).sum()
    return torch.stack(rows).view(x.shape), aux


def test_no_tokens_give_a_zero_load_balancing_loss_with_its_graph():
    """An empty micro-batch (zero tokens reach the gate): the load-balancing loss is 0, not NaN (DeepSpeed's
    `topkgating` takes the mean over an empty dim: NaN), and still reaches the gate (a zero gradient); the output
    is empty. Next to a micro-batch with tokens, the summed losses and gradients are that micro-batch's alone
    (the plain mixture, `_dense`)."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.moe import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 0, 1), top_k=TOP_K)
    y, aux = layer(torch.zeros(0, 5, D_MODEL))
    assert y.shape == (0, 5, D_MODEL) and aux.item() == 0.0 and aux.requires_grad
    (gate_grad,) = torch.autograd.grad(aux, [layer.gate.weight])
    assert torch.equal(gate_grad, torch.zeros_like(layer.gate.weight))
    x = torch.randn(2, 3, D_MODEL, generator=torch.Generator().manual_seed(3))
    _, empty_aux = layer(x[:0])
    _, full_aux = layer(x)
    _, want_aux = _dense(layer, x)
    got = torch.autograd.grad(empty_aux + full_aux, [layer.gate.weight])[0]
    want = torch.autograd.grad(want_aux, [layer.gate.weight])[0]
    torch.testing.assert_close(empty_aux + full_aux, want_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_one_rank_layer_is_the_top_k_mixture_and_a_rank_holds_its_experts_initialised_alike():
    """In-process (world of one): output, load-balancing loss and every gradient equal the mixture written
    token by token; rank 1 of 2 is built with experts 2-3 of the whole layer, drawn alike; reset_parameters draws
    a layer's experts again as at construction; refusals name ep_size."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.moe import ExpertParallelMoE

    torch.manual_seed(0)
    layer = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 0, 1), top_k=TOP_K)
    with torch.no_grad():  # non-zero biases, so a dropped bias shows
        layer.b_in.normal_()
        layer.b_out.normal_()
    x = torch.randn(3, 5, D_MODEL, generator=torch.Generator().manual_seed(1))
    target = torch.randn(3, 5, D_MODEL, generator=torch.Generator().manual_seed(2))
    y, aux = layer(x)
    want_y, want_aux = _dense(layer, x)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(((y - target) ** 2).mean() + 0.01 * aux, list(layer.parameters()))
    want = torch.autograd.grad(((want_y - target) ** 2).mean() + 0.01 * want_aux, list(layer.parameters()))
    for (name, _), g, w in zip(layer.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    one = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 0, 1), top_k=1)  # one token, one choice
    for got_one, want_one in zip(one(x[:1, :1]), _dense(one, x[:1, :1], top_k=1)):
        torch.testing.assert_close(got_one, want_one, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    whole = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 0, 1), top_k=TOP_K)
    torch.manual_seed(0)
    second = ExpertParallelMoE(D_MODEL, D_HIDDEN, EXPERTS, Comm(None, 1, 2), top_k=TOP_K)
    assert second.first_expert == 2 and second.w_in.ep_slice.pieces == ((2, 2),)
    for name in ("w_in", "w_out"):
        assert torch.equal(getattr(second, name), getattr(whole, name)[2:]), name
        assert not torch.equal(getattr(whole, name)[0], getattr(whole, name)[1]), name  # each expert its own draw
        bound = 1.0 / D_HIDDEN ** 0.5 if name == "w_out" else 1.0 / D_MODEL ** 0.5
        assert 0.8 * bound < getattr(whole, name).abs().max() <= bound, name  # U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert not whole.b_in.any() and not whole.b_out.any()
    torch.manual_seed(0)
    layer.reset_parameters()  # the trained layer's experts (biases made non-zero above) drawn again, alike
    for name in ("w_in", "b_in", "w_out", "b_out"):
        assert torch.equal(getattr(layer, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match=r"4 experts do not split over ep_size=3"):
        ExpertParallelMoE(D_MODEL, D_HIDDEN, 4, Comm(None, 0, 3))
    with pytest.raises(ValueError, match=r"top_k=0 must be between 1 and num_experts=4"):
        ExpertParallelMoE(D_MODEL, D_HIDDEN, 4, Comm(None, 0, 1), top_k=0)
    ExpertParallelMoE(D_MODEL, D_HIDDEN, 4, Comm(None, 0, 4), top_k=4)  # the boundaries are allowed
