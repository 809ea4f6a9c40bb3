"""Tensor-parallel layers compute what the unsplit model computes: forward, gradients, training."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

STEPS, BATCH, SEQ, LR = 4, 4, 16, 1e-3


def gpt_config():
    from zerotrain.models import GPTConfig
    return GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_embd=32, block_size=SEQ, n_inner=64)


def batches():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train(model, params) -> list[float]:
    # eps=1e-6: see EPS in test_tensor_parallel_engine.py (the key bias's zero gradient, every tensor compared)
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, eps=1e-6)
    losses = []
    for batch in batches():
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_weights(model, tp) -> dict[str, torch.Tensor]:
    """Reassemble every parameter from the tp_slice each split one carries."""
    from zerotrain.parallel import tensor_slice_of
    out = {}
    for name, param in model.named_parameters():
        tensor_slice = tensor_slice_of(param)
        if tensor_slice is None:
            out[name] = param.detach().clone()
            continue
        stacked = torch.empty(tp.size * param.numel())
        tp.all_gather(stacked, param.detach().contiguous().view(-1))
        stacked = stacked.view((tp.size,) + tuple(param.shape))
        full = torch.empty(tensor_slice.full_shape)
        for rank in range(tp.size):
            from zerotrain.parallel import split_slice
            pieces = len(tensor_slice.pieces)
            split_slice(tensor_slice.full_shape, tensor_slice.dim, rank, tp.size, pieces).place(stacked[rank], full)
        out[name] = full
    return out


def tensor_parallel_training(tp_size: int) -> tuple:
    from zerotrain.models import GPT
    from zerotrain.parallel import (GPT_PLAN, apply_tensor_parallel, assemble_full_tensors, tensor_parallel_comm,
                                    tensor_slice_of)
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60, tp_size=tp_size)
    tp = tensor_parallel_comm(topology)
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(gpt_config()), GPT_PLAN, tp)
    assert model.lm_head.weight is model.transformer.wte.weight  # tying survives the split
    local_numel = {name: p.numel() for name, p in model.named_parameters()}
    losses = train(model, model.parameters())
    # what full_state_dict joins (parallel.gather): the whole tensors on TP rank 0, nothing elsewhere; the split
    # ones carry their slices, a whole one (ln_f) is passed through; compared with full_weights below
    local = {name: p.detach() for name, p in model.named_parameters()}
    slices = {name: tensor_slice_of(p) for name, p in model.named_parameters() if tensor_slice_of(p) is not None}
    assembled = assemble_full_tensors(local, slices, tp)
    return losses, full_weights(model, tp), local_numel, sum_grad_against_one_process(tp), assembled


def sum_grad_against_one_process(tp) -> tuple:
    """A SumGrad module (kept whole, each rank seeing its own slice of an activation) gets the sum over the
    group of every rank's gradient: (its gradients here, what one process computes from every rank's input)."""
    from zerotrain.parallel import SumGrad, apply_tensor_parallel

    def inputs(rank: int) -> torch.Tensor:
        return torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    torch.manual_seed(5)
    norm = apply_tensor_parallel(torch.nn.Sequential(torch.nn.LayerNorm(4)), {"0": SumGrad()}, tp)[0]
    reference = torch.nn.LayerNorm(4)
    reference.load_state_dict(norm.state_dict())
    (norm(inputs(tp.rank)) ** 2).sum().backward()
    for rank in range(tp.size):
        (reference(inputs(rank)) ** 2).sum().backward()
    return ((norm.weight.grad, norm.bias.grad), (reference.weight.grad, reference.bias.grad))


def reference() -> tuple[list[float], dict]:
    from zerotrain.models import GPT
    torch.manual_seed(0)
    model = GPT(gpt_config())
    losses = train(model, model.parameters())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_tensor_parallel_matches_single_process(world):
    ref_losses, ref_weights = reference()
    results = run_distributed(tensor_parallel_training, world, world, timeout=120)
    for rank, (losses, weights, local_numel, (summed, expected), assembled) in enumerate(results):
        for got, want in zip(summed, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert list(assembled) == (list(weights) if rank == 0 else [])
        for name, tensor in assembled.items():
            assert torch.equal(tensor, weights[name]), name
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5
        assert weights.keys() == ref_weights.keys()
        for name, expected in ref_weights.items():
            got = weights[name]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # Split weights hold 1/world of the full tensor on each rank.
        assert local_numel["transformer.h.0.mlp.c_fc.weight"] * world == ref_weights["transformer.h.0.mlp.c_fc.weight"].numel()
        assert local_numel["transformer.wte.weight"] * world == ref_weights["transformer.wte.weight"].numel()
        assert local_numel["transformer.ln_f.weight"] == ref_weights["transformer.ln_f.weight"].numel()


def grid_groups(tp_size: int) -> tuple:
    import torch.distributed as dist

    from zerotrain.comm import Comm
    from zerotrain.parallel import tensor_parallel_comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60, tp_size=tp_size)
    rank = int(os.environ["RANK"])
    tp_sum = torch.tensor([float(rank)])
    tensor_parallel_comm(topology).all_reduce(tp_sum)
    dp_sum = torch.tensor([float(rank)])
    Comm.data_parallel(topology).all_reduce(dp_sum)
    return (topology.tp_rank, topology.tp_size, topology.dp_rank, topology.dp_size, tp_sum.item(), dp_sum.item(),
            dist.get_process_group_ranks(topology.dp_group))


def test_grid_of_four_ranks_with_two_way_tensor_parallelism():
    results = run_distributed(grid_groups, 4, 2, timeout=60)
    # ranks (0,1) and (2,3) are tensor-parallel blocks; (0,2) and (1,3) data-parallel groups
    assert [r[:4] for r in results] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert [r[4] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[5] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert [r[6] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_bad_splits_and_plans_name_the_module():
    from zerotrain.comm import Comm
    from zerotrain.models import GPT
    from zerotrain.parallel import GPT_PLAN, Column, apply_tensor_parallel, split_slice

    with pytest.raises(ValueError, match=r"h.0.attn.c_attn.weight: dimension 0 of size 96 does not split into 3"):
        split_slice((96, 32), 0, 0, 5, parts=3, what="h.0.attn.c_attn.weight")
    piece = split_slice((96, 32), 0, 1, 2, parts=3)
    assert piece.pieces == ((16, 16), (48, 16), (80, 16)) and piece.local_shape == (48, 32)
    full = torch.arange(96 * 32.0).view(96, 32)
    assert torch.equal(piece.take(full)[16:32], full[48:64])
    alone = Comm(None, 0, 1)  # a group of one: no collective runs
    with pytest.raises(ValueError, match=r"patterns \['decoder\.\*'\] match no module"):
        apply_tensor_parallel(GPT(gpt_config()), {**GPT_PLAN, "decoder.*": Column()}, alone)
    with pytest.raises(TypeError, match=r"transformer.ln_f is LayerNorm"):
        apply_tensor_parallel(GPT(gpt_config()), {"transformer.ln_f": Column()}, alone)


def test_split_slices_are_megatrons_layout_and_tile_the_tensor():
    """`split_slice` at 1-4 ranks, 1-3 fused parts, either dimension: rank r's local tensor is, for each part,
    the r-th of `size` equal chunks of that part (Megatron's split of a fused q/k/v per head group), in part
    order; the ranks' slices, placed back, rebuild the whole tensor; a length that does not split is refused."""
    from zerotrain.parallel import split_slice

    for size in (1, 2, 3, 4):
        for parts in (1, 2, 3):
            for dim in (0, 1):
                shape = [5, 7]
                shape[dim] = parts * size * 2
                full = torch.arange(float(shape[0] * shape[1])).view(*shape)
                rebuilt = torch.full_like(full, float("nan"))
                for rank in range(size):
                    piece = split_slice(tuple(shape), dim, rank, size, parts=parts)
                    chunks = [part.chunk(size, dim)[rank] for part in full.chunk(parts, dim)]
                    assert torch.equal(piece.take(full), torch.cat(chunks, dim)), (size, parts, dim, rank)
                    assert piece.full_shape == tuple(shape) and piece.dim == dim
                    piece.place(piece.take(full), rebuilt)
                assert torch.equal(rebuilt, full), (size, parts, dim)
                if size * parts > 1:
                    shape[dim] += 1
                    with pytest.raises(ValueError, match=f"dimension {dim} of size {shape[dim]} does not split"):
                        split_slice(tuple(shape), dim, 0, size, parts=parts)
    assert split_slice((4, 3), 0, 1, 2).pieces == ((2, 2),)  # one part unless told


def test_split_linears_report_the_whole_layers_features_in_both_weight_layouts():
    """A column- or row-parallel layer reports the in/out features of the layer it replaces (as nn.Linear
    does), whether its weight is stored [out, in] (nn.Linear) or [in, out] (transformers' Conv1D), and
    computes x Wᵀ (one rank: the layout alone)."""
    from zerotrain.comm import Comm
    from zerotrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    alone = Comm(None, 0, 1)
    torch.manual_seed(0)
    weight, bias, x = torch.randn(6, 10), torch.randn(6), torch.randn(3, 10)  # 10 inputs, 6 outputs
    for transposed in (False, True):
        stored = weight.t().contiguous() if transposed else weight
        for kind in (ColumnParallelLinear, RowParallelLinear):
            layer = kind(stored, bias, alone, transposed=transposed)
            assert (layer.in_features, layer.out_features) == (10, 6), (kind.__name__, transposed)
            torch.testing.assert_close(layer(x), x @ weight.t() + bias)
