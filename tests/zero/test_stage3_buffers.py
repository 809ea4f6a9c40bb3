"""The stage-3 gather buffer pool in process: what it keeps, hands out again and drops (largest first)."""
from __future__ import annotations

import torch

from zerotrain.zero.stage3.buffers import BufferPool

CPU = torch.device("cpu")


def test_pool_keeps_only_unreferenced_buffers_within_its_limit_and_drops_the_largest_first():
    pool = BufferPool(64)
    assert (pool.limit_bytes, pool.idle_bytes, pool.stats) == (64, 0, {"reused": 0, "allocated": 0})
    a = pool.take(4, torch.float32, CPU)  # 16 bytes
    pool.give(a)
    assert pool.idle_bytes == 16 and pool.stats == {"reused": 0, "allocated": 1}
    assert pool.take(4, torch.float32, CPU) is a and pool.idle_bytes == 0
    assert pool.stats == {"reused": 1, "allocated": 1}
    c = pool.take(8, torch.float32, CPU)  # 32 bytes
    view = c[:4]
    pool.give(c)  # a view of it is alive: not kept
    pool.give(c[2:])  # a view itself: never kept
    assert pool.idle_bytes == 0 and not any(pool.idle.values())
    del view
    pool.give(c)
    assert pool.idle_bytes == 32
    d = torch.empty(16)  # 64 bytes, exactly the limit: kept after dropping c
    pool.give(d)
    assert pool.idle_bytes == 64 and pool.idle[(16, torch.float32, CPU)] == [d] and not pool.idle[(8, torch.float32, CPU)]
    pool.give(torch.empty(17))  # over the limit alone: not kept, nothing dropped
    assert pool.idle_bytes == 64
    e, f = torch.empty(4), torch.empty(2, dtype=torch.float64)  # 16 bytes each: d (the largest) goes
    pool.give(e)
    pool.give(f)
    assert pool.idle_bytes == 32 and not pool.idle[(16, torch.float32, CPU)]
    assert pool.take(2, torch.float64, CPU) is f and pool.take(4, torch.float16, CPU) is not e
    assert pool.stats == {"reused": 2, "allocated": 3} and pool.idle_bytes == 16
    pool.clear()
    assert pool.idle == {} and pool.idle_bytes == 0
    assert BufferPool(-5).limit_bytes == 0
