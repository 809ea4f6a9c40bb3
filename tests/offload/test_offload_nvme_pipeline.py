"""The NVMe step's pipeline: records kept in the buffers after a committed step are updated by the next
step without being read (fewer bytes read, same bits as torch's fused AdamW), and are dropped whenever the
current records change outside a step (a master written from outside, states written back by a load) or
a step fails; the async I/O starts waiting reads before waiting writes."""
from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

NUMEL, CHUNK, BUFFERS = 5000, 1024, 3  # 5 chunks (4 whole, 1 of 904) through 3 buffers: 2 records kept


def _pair(tmp_path, spare=None):
    """An NVMe optimizer over one fp32 bucket and torch's fused AdamW on an identical parameter."""
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(NUMEL))
    ref = torch.nn.Parameter(param.detach().clone())
    make = lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
    bucket = FlatBucket(0, [("w", param)], 0, ShardGroup.local())
    opt = NvmeOffloadOptimizer([bucket], None, make(param), [[param]], 0.0,
                               nvme_path=str(tmp_path), buffer_count=BUFFERS, chunk_numel=CHUNK, spare=spare)
    return param, opt, ref, make(ref)


def _step_both(param, opt, ref, ref_opt) -> int:
    """One step of both on the same gradient; asserts equal weights; returns the bytes the NVMe step read."""
    grad = torch.randn(NUMEL)
    ref.grad = grad.clone()
    ref_opt.step()
    before = opt.records.io.bytes_read
    opt.step([grad.clone()], 1.0)
    assert torch.equal(param.detach(), ref.detach())
    return opt.records.io.bytes_read - before


def test_kept_records_are_not_read_and_the_step_stays_bitwise_adamw(tmp_path):
    param, opt, ref, ref_opt = _pair(tmp_path)
    record = opt.records.record_bytes[0]
    assert len(opt.records.chunks) == 5 and opt.records.pool.count == BUFFERS
    assert _step_both(param, opt, ref, ref_opt) == 5 * record  # nothing kept before the first step
    for _ in range(3):
        assert _step_both(param, opt, ref, ref_opt) == 3 * record, "the 2 kept records are not read"
        assert len(opt.records.kept) == BUFFERS - 1
    with opt.resident_states(write_back=False):  # read only: the kept records stay valid
        assert torch.equal(opt.optimizer.state[opt.masters[0]]["exp_avg"], ref_opt.state[ref]["exp_avg"])
        assert torch.equal(opt.optimizer.state[opt.masters[0]]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])
    assert _step_both(param, opt, ref, ref_opt) == 3 * record
    opt.close()


def test_records_changed_outside_a_step_are_read_again(tmp_path):
    param, opt, ref, ref_opt = _pair(tmp_path)
    record = opt.records.record_bytes[0]
    _step_both(param, opt, ref, ref_opt)
    _step_both(param, opt, ref, ref_opt)
    # A master written from outside (stage 3's GatheredParameters) replaces the kept records' masters.
    new = torch.randn(NUMEL)
    opt.write_master(0, new)
    with torch.no_grad():
        ref.copy_(new)
    assert not opt.records.kept
    assert _step_both(param, opt, ref, ref_opt) == 5 * record
    # States written back by a checkpoint load through resident_states() replace the kept records' states.
    with opt.resident_states():
        opt.optimizer.state[opt.masters[0]]["exp_avg"].mul_(2)
        ref_opt.state[ref]["exp_avg"].mul_(2)
    assert not opt.records.kept
    assert _step_both(param, opt, ref, ref_opt) == 5 * record
    assert _step_both(param, opt, ref, ref_opt) == 3 * record
    opt.close()


def _failing_step(opt, nth: int) -> None:
    """A step whose `nth` record write fails with EIO: it raises OffloadIOError."""
    from zerotrain.offload import OffloadIOError, aio

    real = aio._pwrite
    calls = {"n": 0}

    def failing(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == nth:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    aio._pwrite = failing
    try:
        with pytest.raises(OffloadIOError, match="writing"):
            opt.step([torch.randn(NUMEL)], 1.0)
    finally:
        aio._pwrite = real


def test_a_failed_step_drops_the_kept_records(tmp_path):
    param, opt, ref, ref_opt = _pair(tmp_path, spare=5)  # a ring that holds the step: it rolls back whole
    record = opt.records.record_bytes[0]
    _step_both(param, opt, ref, ref_opt)
    before = param.detach().clone()
    _failing_step(opt, 3)  # the step's third record write fails
    assert torch.equal(param.detach(), before), "the failed step's weights were put back"
    assert not opt.records.kept and opt.records.pool.free_count() == BUFFERS, "every buffer is back in the pool"
    assert _step_both(param, opt, ref, ref_opt) == 5 * record, "after a failure every record is read"
    assert _step_both(param, opt, ref, ref_opt) == 3 * record
    opt.close()


def test_a_failed_write_of_a_record_committed_early_is_not_committed_and_the_ring_keeps_its_spare(tmp_path):
    """One spare extent: every chunk but the last is committed early, once its write is done. The step's first
    record write fails: that record is not committed, the step rolls back whole, its extent goes back to the
    ring, and the retried steps are still fused AdamW bit for bit."""
    param, opt, ref, ref_opt = _pair(tmp_path, spare=1)
    _step_both(param, opt, ref, ref_opt)
    assert opt.stats["nvme_early_commits"] == 4
    before = param.detach().clone()
    with opt.resident_states(write_back=False):
        masters = opt.masters[0].clone()
    _failing_step(opt, 1)  # the step's first record write: the one the second chunk commits early
    assert torch.equal(param.detach(), before) and opt.stats["nvme_early_commits"] == 4
    with opt.resident_states(write_back=False):
        assert torch.equal(opt.masters[0], masters), "a record whose write failed was committed"
    assert sum(map(len, opt.records.free.values())) == 1, "the failed record's extent is back in the ring"
    assert opt.records.pool.free_count() == BUFFERS
    for _ in range(2):
        _step_both(param, opt, ref, ref_opt)
    opt.close()


def test_streamed_buckets_read_the_next_ones_ahead_and_give_every_buffer_back(tmp_path):
    """Gradients streamed bucket by bucket (`stream_gradients`, stage 3 without clipping): each bucket's records
    are stepped as its gradient arrives and the records of the buckets backward makes final next are read
    ahead into free buffers (`NvmeStream.prefetch`); fused AdamW bit for bit, and after every step each
    buffer is back in the pool (a record read ahead twice would hold one buffer forever)."""
    from types import SimpleNamespace

    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    sizes, buffers = (900, 700, 500), 4  # a chunk each: a bucket's read-ahead reaches past the next bucket
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
    reducer = SimpleNamespace(grad_shards=[None] * 3, shard_ready_callbacks=[], free_final_shards=lambda: None)
    buckets = [FlatBucket(i, [(f"p{i}", p)], 0, ShardGroup.local()) for i, p in enumerate(params)]
    opt = NvmeOffloadOptimizer(buckets, None, make(params), [params], 0.0, reducer=reducer, nvme_path=str(tmp_path),
                               buffer_count=buffers, chunk_numel=CHUNK, stream_gradients=True)
    ref_opt = make(refs)
    read_ahead = []
    real = opt.stream.prefetch

    def prefetch(chunks):
        real(chunks)
        read_ahead.append(len(opt.records.prefetched))

    opt.stream.prefetch = prefetch
    for step in range(3):
        grads = [torch.randn(n) for n in sizes]
        for ref, grad in zip(refs, grads):
            ref.grad = grad.clone()
        ref_opt.step()
        reducer.grad_shards = [g.clone() for g in grads]
        for index in (2, 1, 0):  # backward's order; the reducer frees a shard once it is handed over
            for callback in reducer.shard_ready_callbacks:
                callback(index)
            reducer.grad_shards[index] = None
        opt.step(list(reducer.grad_shards), 1.0)
        for param, ref in zip(params, refs):
            assert torch.equal(param.detach(), ref.detach()), step
        assert opt.records.pool.free_count() == buffers and not opt.records.prefetched, step
    assert any(read_ahead), "no record was read ahead"
    opt.close()


def test_waiting_reads_start_before_waiting_writes(tmp_path, monkeypatch):
    from zerotrain.offload import aio

    io = aio.AsyncFileIO(threads=1, queue_depth=1, block_size=aio.ALIGN, direct=False)
    fd = io.open(str(tmp_path / "f"), 4 * aio.ALIGN)
    order = []
    real_read, real_write = aio._pread, aio._pwrite
    monkeypatch.setattr(aio, "_pread", lambda f, b, o: order.append(("read", o)) or real_read(f, b, o))
    monkeypatch.setattr(aio, "_pwrite", lambda f, b, o: order.append(("write", o)) or real_write(f, b, o))
    gate = threading.Event()
    first = io.write(fd, 0, aio.aligned_empty(aio.ALIGN), before=gate.wait)  # holds the only worker
    second = io.write(fd, aio.ALIGN, aio.aligned_empty(2 * aio.ALIGN))
    read = io.read(fd, 3 * aio.ALIGN, aio.aligned_empty(aio.ALIGN))
    gate.set()
    for future in (first, second, read):
        future.result()
    assert order[0] == ("read", 3 * aio.ALIGN), order
    assert sorted(order[1:]) == [("write", 0), ("write", aio.ALIGN), ("write", 2 * aio.ALIGN)], order
    io.shutdown()
