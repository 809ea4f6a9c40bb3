"""The sharded optimizer on one process (`zero.optimizer.ShardedOptimizer` over single-process buckets): the
unscale and clip multiplier, the step against torch's own, and the state it takes over from the user's optimizer."""
import pytest
import torch

from zerotrain.sharding import ShardGroup
from zerotrain.zero.flat import FlatBucket
from zerotrain.zero.optimizer import ShardedOptimizer


@pytest.mark.parametrize("clip", [0.0, 0.5, 100.0])
def test_step_unscales_and_clips_like_torch_and_drops_the_old_state(clip):
    """Plain SGD (a uniform scale shows), loss scale 4; clip 0 means none. An optimizer that already stepped
    hands over no state: its entries belong to the old parameters."""
    torch.manual_seed(0)
    weights = [torch.randn(7), torch.randn(5)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()  # momentum buffers of the old parameters
    with torch.no_grad():
        for param, w in zip(params, weights):
            param.copy_(w)
    buckets = [FlatBucket(i, [(f"p{i}", p)], 0, ShardGroup.local()) for i, p in enumerate(params)]
    sharded = ShardedOptimizer(buckets, None, optimizer, [params], clip)
    assert len(optimizer.state) == 0 and sharded.state_bytes() == 0  # fp32: the shards are their own masters

    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    ref_optimizer = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    for step in range(2):
        grads = [torch.randn(7), torch.randn(5)]
        for ref, grad in zip(reference, grads):
            ref.grad = grad.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(reference, clip if clip > 0 else float("inf")))
        ref_optimizer.step()
        sharded.step([grad * 4.0 for grad in grads], loss_scale=4.0)
        assert sharded.last_grad_norm == pytest.approx(norm, rel=1e-6)
        for param, ref in zip(params, reference):
            torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert sharded.state_bytes() == 4 * (7 + 5)  # one momentum buffer per master


def test_bf16_weights_are_the_cast_fp32_masters_after_each_step():
    """bf16 parameters get separate fp32 masters; after every step the model's weights are those masters cast."""
    torch.manual_seed(0)
    weights = [torch.randn(7), torch.randn(5)]
    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    buckets = [FlatBucket(i, [(f"p{i}", p)], 0, ShardGroup.local()) for i, p in enumerate(params)]
    sharded = ShardedOptimizer(buckets, None, torch.optim.SGD(params, lr=0.1), [params], 0.0)
    reference = [torch.nn.Parameter(w.to(torch.bfloat16).float()) for w in weights]
    ref_optimizer = torch.optim.SGD(reference, lr=0.1)
    assert sharded.state_bytes() == 4 * (7 + 5)  # the fp32 masters
    for _ in range(2):
        grads = [torch.randn(7), torch.randn(5)]
        for ref, grad in zip(reference, grads):
            ref.grad = grad.clone()
        ref_optimizer.step()
        sharded.step([grad.clone() for grad in grads], loss_scale=1.0)
        for param, master, ref in zip(params, sharded.masters, reference):
            torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(param.detach(), ref.detach().to(torch.bfloat16))


def test_the_norm_sums_squares_in_fp64_as_deepspeed():
    """The global norm sums its squares in fp64 (DeepSpeed 0.19's `get_norm_dtype()`): one large bucket beside
    many small ones, where an fp32 running sum drops every small square (1e8 + 1 rounds back to 1e8) and a large
    shard's own fp32 sum drifts. The reference is the fp64 sum of every element's square; fp32 is 3e-5 off it."""
    from zerotrain.zero.gradnorm import GlobalGradients

    torch.manual_seed(0)
    large = torch.full((3 << 20 | 5,), 5.0) + torch.rand(3 << 20 | 5)  # spans several of the norm's fp64 pieces
    grads = [large] + [torch.full((1,), 1.0) for _ in range(2000)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    buckets = [FlatBucket(i, [(f"p{i}", p)], 0, ShardGroup.local()) for i, p in enumerate(params)]
    squared = GlobalGradients(buckets, None).squared_norm(grads)
    exact = sum(float(g.double().square().sum()) for g in grads)
    fp32 = torch.zeros(1)
    for g in grads:
        fp32 += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    assert abs(float(fp32) - exact) / exact > 1e-5  # the case shows the difference
    assert squared == pytest.approx(exact, rel=1e-12), (squared, exact, float(fp32))
