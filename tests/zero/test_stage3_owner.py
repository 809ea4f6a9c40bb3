"""A stage-3 parameter's owner in process: its fp32 master is the master optimizer's, and a write to the
parameter on a running engine (an in-place initializer on the released shard) reaches that master; a frozen
parameter shares the owner, so it is gathered when used outside a module.
bf16 parameters at a world of one: the masters are separate fp32 tensors (in fp32 they are the shards)."""
from __future__ import annotations

import torch

from zerotrain.comm import Comm
from zerotrain.zero.optimizer import ShardedOptimizer
from zerotrain.zero.stage3.setup import partition_module


def test_masters_are_the_optimizers_and_an_initializer_writes_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    model = model.to(torch.bfloat16)
    model[2].requires_grad_(False)  # frozen: a part of the same owner, gathered on access by its fetcher
    frozen_weight = model[2].weight.detach().clone()
    params = [p for p in model.parameters() if p.requires_grad]
    parts = partition_module(model, Comm(None, 0, 1), {id(p): 0 for p in params}, 0, False, 10**6)
    with torch.no_grad():  # used outside its module's forward
        torch.testing.assert_close(torch.nn.functional.linear(torch.eye(2, dtype=torch.bfloat16), model[2].weight),
                                   frozen_weight.t())
    optimizer = ShardedOptimizer(parts.trainable, None, torch.optim.SGD(params, lr=0.1), [params], 0.0)
    parts.use_masters(optimizer)
    for part, master in zip(parts.trainable, optimizer.masters):
        assert part.master is master and master.dtype == torch.float32
    assert parts.owner.master_of(object()) is None  # not one of the optimizer's buckets
    before = {part.names[0]: part.master.clone() for part in parts.trainable}
    torch.nn.init.constant_(model[1].bias, 0.25)  # released: runs on the shard, then the master
    torch.nn.init.constant_(model[0].weight, -0.5)
    by_name = {part.names[0]: part for part in parts.trainable}
    assert torch.equal(by_name["1.bias"].master[:2], torch.full((2,), 0.25))
    assert torch.equal(by_name["0.weight"].master[:12], torch.full((12,), -0.5))
    for name in ("0.bias", "1.weight"):
        assert torch.equal(by_name[name].master, before[name]), name
