"""In-process units of the offload package: the NVMe swapper streams chunks through two buffers bit for bit
like fused AdamW, states round-trip through `resident_states()` (and are adopted when a load bypasses it), a
disk too small fails at start-up, no O_DIRECT falls back with a warning, a user's torch AdamW is switched to
the fused kernel, and the `ratio` split is by elements."""
from __future__ import annotations

import os

import pytest
import torch


def _bucket_optimizer(tmp_path, **kwargs):
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(2500))]
    buckets = [FlatBucket(0, [("a", params[0])], 0, ShardGroup.local()),
               FlatBucket(1, [("b", params[1])], 1, ShardGroup.local())]
    torch_opt = torch.optim.AdamW([{"params": [params[0]], "lr": 1e-2},
                                   {"params": [params[1]], "lr": 5e-3, "weight_decay": 0.1}], fused=True)
    opt = NvmeOffloadOptimizer(buckets, None, torch_opt, [[params[0]], [params[1]]], 0.0, nvme_path=str(tmp_path),
                               **kwargs)
    return params, opt


def test_streamed_chunks_equal_fused_adamw_bitwise(tmp_path):
    params, opt = _bucket_optimizer(tmp_path, buffer_count=2, chunk_numel=1024)
    assert len(opt.records.chunks) == 6  # 3 + 3 chunks streamed through 2 buffers
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(2500))]
    ref_opt = torch.optim.AdamW([{"params": [ref[0]], "lr": 1e-2},
                                 {"params": [ref[1]], "lr": 5e-3, "weight_decay": 0.1}], fused=True)
    def step_both():
        grads = [torch.randn(3000), torch.randn(2500)]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        ref_opt.step()
        opt.step([g.clone() for g in grads], 1.0)
        for p, q in zip(ref, params):
            assert torch.equal(p.detach(), q.detach())

    for _ in range(3):
        step_both()
    assert set(opt.optimizer.state[opt.masters[0]]) == {"step"}  # per-element states live on disk
    with opt.resident_states():
        for master, p in zip(opt.masters, ref):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.optimizer.state[master][key], ref_opt.state[p][key]), key
            opt.optimizer.state[master]["exp_avg"].mul_(2)  # as a checkpoint load would write
            ref_opt.state[p]["exp_avg"].mul_(2)
    step_both()
    # A load that writes states straight into optimizer.state (no resident_states) is adopted by the next step.
    for master, p in zip(opt.masters, ref):
        ref_opt.state[p]["exp_avg_sq"].mul_(0.5)
        opt.optimizer.state[master]["exp_avg_sq"] = ref_opt.state[p]["exp_avg_sq"].clone()
        opt.optimizer.state[master]["exp_avg"] = ref_opt.state[p]["exp_avg"].clone()
    step_both()
    assert set(opt.optimizer.state[opt.masters[1]]) == {"step"}
    assert opt.memory_split()["nvme"] == (4 + 8) * 5500  # masters and both Adam states on disk
    opt.close()


def test_disk_too_small_is_a_clear_error_at_start(tmp_path, monkeypatch):
    import shutil

    from zerotrain.offload import OffloadIOError

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("zerotrain.offload.nvme_records.shutil.disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(OffloadIOError, match=r"needs .* MiB under .*only 0.0 MiB are free"):
        _bucket_optimizer(tmp_path)
    assert not os.listdir(tmp_path)


def test_a_failed_first_write_of_the_masters_leaves_no_swap_files(tmp_path, monkeypatch):
    """The disk fills while the initial masters are written: the error names it, and the swap directory (and
    its I/O threads) are gone at once, even while the error, and so the half-built optimizer, is still held."""
    import errno

    from zerotrain.offload import OffloadIOError, aio

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio, "_pwrite", full)
    with pytest.raises(OffloadIOError, match="no space left on device while writing") as caught:
        _bucket_optimizer(tmp_path, chunk_numel=1024)
    assert caught.value is not None and not os.listdir(tmp_path)


def test_no_direct_io_warns_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr("zerotrain.offload.aio.direct_io_supported", lambda directory: False)
    with pytest.warns(UserWarning, match="O_DIRECT"):
        _, opt = _bucket_optimizer(tmp_path, chunk_numel=1024)
    assert not opt.records.io.direct and opt.stats["direct_io"] == 0
    opt.close()


@pytest.mark.parametrize("ratio,expected", [(1.0, [True] * 3), (0.5, [True, True, False]),
                                            (0.1, [False, True, False]), (0.01, [False] * 3)])
def test_choose_offloaded_by_elements(ratio, expected):
    from zerotrain.offload import choose_offloaded

    class Bucket:
        def __init__(self, n):
            self.shard_numel = n

    assert choose_offloaded([Bucket(12), Bucket(4), Bucket(21)], ratio) == expected


def test_user_adamw_is_switched_to_the_fused_kernel():
    from zerotrain.offload import OffloadOptimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    param = torch.nn.Parameter(torch.randn(100))
    user = torch.optim.AdamW([param], lr=1e-2)  # fused and foreach left to torch
    opt = OffloadOptimizer([FlatBucket(0, [("w", param)], 0, ShardGroup.local())], None, user, [[param]], 0.0)
    assert user.param_groups[0]["fused"] is True and user.param_groups[0]["params"] == opt.masters
    opt.step([torch.randn(100)], 1.0)
    assert opt.optimizer.state[opt.masters[0]]["step"].item() == 1
    assert torch.equal(param.detach(), opt.masters[0])  # published back into the model


def test_partial_offload_accounts_each_master_where_it_lives_and_clips_as_torch():
    """ratio 0.5 over two bf16 buckets: the first one's fp32 master on the host, the second one's on the device
    (apart from its bf16 model shard, so it counts there); a gradient norm near clip_grad_norm_'s 1e-6 epsilon
    is clipped by torch's factor (plain SGD, lr 1: the update is the clipped gradient)."""
    from zerotrain.offload import OffloadOptimizer
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    torch.manual_seed(0)
    sizes = (300, 200)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in sizes]  # the update is exact
    buckets = [FlatBucket(i, [(f"p{i}", p)], 0, ShardGroup.local()) for i, p in enumerate(params)]
    sgd = torch.optim.SGD(params, lr=1.0)
    opt = OffloadOptimizer(buckets, None, sgd, [params], clip_norm=1e-6, ratio=0.5)
    assert opt.offloaded == [True, False]
    grads = [torch.randn(n) for n in sizes]
    scale = 2e-6 / torch.cat(grads).norm().item()  # a total norm of 2e-6: torch's factor 1e-6 / (2e-6 + 1e-6)
    grads = [g * scale for g in grads]
    ref = [torch.nn.Parameter(g.clone()) for g in grads]
    for r in ref:
        r.grad = r.detach().clone()
    torch.nn.utils.clip_grad_norm_(ref, 1e-6)
    opt.step([g.clone() for g in grads], 1.0)
    for master, r in zip(opt.masters, ref):
        assert master.dtype == torch.float32
        torch.testing.assert_close(-master, r.grad, rtol=1e-5, atol=0)
    split = opt.memory_split()
    assert split["host"] == 4 * sizes[0] and split["device"] == 4 * sizes[1] and split["nvme"] == 0, split
    assert opt.offloaded_bytes() == split["host"] and opt.state_bytes() == split["device"]


def test_io_errors_name_the_file_and_say_disk_full(tmp_path, monkeypatch):
    import errno

    from zerotrain.offload import OffloadIOError, aio

    io = aio.AsyncFileIO(threads=1, direct=False)
    fd = io.open(str(tmp_path / "f"), aio.ALIGN)
    buffer = aio.aligned_empty(aio.ALIGN)
    assert io.write(fd, 0, buffer).result() == aio.ALIGN and io.read(fd, 0, buffer).result() == aio.ALIGN

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio, "_pwrite", full)
    with pytest.raises(OffloadIOError, match=r"no space left on device while writing 4096 bytes at offset 0 of .*f"):
        io.write(fd, 0, buffer).result()
    with pytest.raises(OffloadIOError, match="reading 4096 bytes at offset 4096"):
        io.read(fd, aio.ALIGN, buffer).result()  # past the end of the file
    io.shutdown()


def test_direct_io_probe_agrees_with_an_o_direct_write_of_its_own_and_leaves_nothing(tmp_path):
    from zerotrain.offload import aio

    flag, mine = getattr(os, "O_DIRECT", 0), str(tmp_path / "mine")
    try:
        fd = os.open(mine, os.O_CREAT | os.O_RDWR | flag, 0o600)
        try:
            expected = bool(flag) and os.pwritev(fd, [aio.aligned_empty(aio.ALIGN).numpy()], 0) == aio.ALIGN
        finally:
            os.close(fd)
    except OSError:
        expected = False
    os.remove(mine)
    assert aio.direct_io_supported(str(tmp_path)) == expected
    assert os.listdir(tmp_path) == []


def test_io_cuts_requests_into_blocks_in_flight_together(tmp_path, monkeypatch):
    """aio.block_size: one system call per block; a failing block fails its request, naming its offset."""
    from zerotrain.offload import OffloadIOError, aio

    io = aio.AsyncFileIO(threads=1, queue_depth=3, block_size=aio.ALIGN, direct=False)
    assert io.in_flight == 3 and io.block_size == aio.ALIGN
    fd = io.open(str(tmp_path / "f"), 5 * aio.ALIGN)
    data = aio.aligned_empty(5 * aio.ALIGN)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8))
    offsets = []
    real = aio._pwrite

    def counting(fd, buffers, offset):
        offsets.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(aio, "_pwrite", counting)
    assert io.write(fd, 0, data, before=lambda: None).result() == 5 * aio.ALIGN
    assert sorted(offsets) == [k * aio.ALIGN for k in range(5)]
    back = aio.aligned_empty(5 * aio.ALIGN)
    assert io.read(fd, 0, back).result() == 5 * aio.ALIGN and torch.equal(back, data)
    assert io.bytes_written == io.bytes_read == 5 * aio.ALIGN
    assert os.stat(tmp_path / "f").st_mode & 0o777 == 0o600  # optimizer states: the owner's only
    real_read = aio._pread

    def short(call):  # a system call that moves 1000 bytes at most: the rest follows from where it ended
        return lambda fd, buffers, offset: call(fd, [buffers[0][:1000]], offset)

    monkeypatch.setattr(aio, "_pwrite", short(real))
    monkeypatch.setattr(aio, "_pread", short(real_read))
    assert io.write(fd, 0, data.flip(0).contiguous()).result() == 5 * aio.ALIGN
    assert io.read(fd, 0, back).result() == 5 * aio.ALIGN and torch.equal(back, data.flip(0))
    monkeypatch.setattr(aio, "_pread", real_read)

    def fail_third(fd, buffers, offset):
        if offset == 2 * aio.ALIGN:
            raise OSError(5, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(aio, "_pwrite", fail_third)
    released = []
    with pytest.raises(OffloadIOError, match="writing 4096 bytes at offset 8192"):
        io.write(fd, 0, data, done=lambda: released.append(True)).result()
    assert released == [True]  # the buffer is handed back once, after every block finished
    io.shutdown()


def test_param_store_grows_one_shard_at_a_time_as_zero_init_hands_them_in(tmp_path):
    """NvmeParamStore.add (zero.Init's path): each shard leaves host memory for a new extent of the file, the
    pool grows to a larger shard, the values read back are the ones written; remove gives them back."""
    from zerotrain.offload.param_store import NvmeParamStore
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.stage3.owner import ParamOwner
    from zerotrain.zero.stage3.partition import partition_parameter

    store = NvmeParamStore([], str(tmp_path), rank=0, buffer_count=2, buffer_size=10_000, max_in_cpu=0)
    owner = ParamOwner(store=store)  # what zero.Init hands the parameters it partitions
    try:
        values = [torch.randn(10), torch.randn(5000), torch.randn(7, 3)]
        parts = [partition_parameter(f"p{i}", torch.nn.Parameter(v.clone()), ShardGroup.local(), owner=owner)
                 for i, v in enumerate(values)]
        for part in parts:
            store.add(part)
            assert part.store is store and part._shard is None  # on disk now, not in host memory
        store.flush()
        assert store.pool.nbytes == 20480 and store.size == 4096 + 20480 + 4096  # aligned extents, in order
        assert os.path.getsize(os.path.join(store.directory, "params.swp")) == store.size
        assert store.memory_split()["host"] == 0 and store.cached_numel == 0
        store.read_ahead(parts)  # as far as one largest shard's bytes: p0 (4 KiB), not p1 (20 KiB) on top
        assert list(store.reads) == [id(parts[0])] and store.read_ahead_bytes == 20480
        for part, value in zip(parts, values):
            assert torch.equal(part.shard, value.reshape(-1)), part.names
        assert store.stats["read_ahead_hits"] == store.stats["read_ahead"] == 1 and not store.reads
        with store.resident():  # a checkpoint load writes into the resident shards; on exit they go to the file
            for part in parts:
                store.host_shard(part).mul_(2)
        assert not store.writes  # written and flushed
        for part, value in zip(parts, values):
            assert torch.equal(part.shard, 2 * value.reshape(-1)), part.names
        values = [2 * v for v in values]
        store.remove(parts[1])
        assert parts[1].store is None and torch.equal(parts[1]._shard, values[1])
        assert [p.names[0] for p in store.parts] == ["p0", "p2"]
        # a shard larger than buffer_size (10_000 elements): written in pieces, the pool's buffers stay at
        # buffer_size (40_000 bytes, aligned up), and every piece lands where the read finds it
        big_values = torch.randn(25_003)
        big = partition_parameter("big", torch.nn.Parameter(big_values.clone()), ShardGroup.local(), owner=owner)
        store.add(big)
        store.flush()
        assert store.pool.nbytes == 40960 and store.pool.count == 2, store.pool.nbytes
        assert torch.equal(big.shard, big_values)
        store.resize_pool(3, 1000)  # what initialize does with the budget's sizes: 1000 fp32 elements -> 4 KiB
        assert store.pool.nbytes == 4096 and store.pool.count == 3
        big.write_shard(big_values * 2)
        store.flush()
        assert not store.cache and torch.equal(big.shard, big_values * 2) and store.stats["param_writes"] >= 2
    finally:
        store.close()


def test_param_store_holds_back_cache_for_memory_held_elsewhere(tmp_path):
    """NvmeParamStore.hold_back_cache (the first pass's activations, budget.FirstPassReserve): the cache keeps
    `max_in_cpu` less the bytes held back (rounded up to whole elements), evicting the least recently used shards
    at once and caching later reads under the lower bound; the latest call counts, not the sum; values read after
    an eviction are the ones written."""
    from zerotrain.offload.param_store import NvmeParamStore
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.stage3.owner import ParamOwner
    from zerotrain.zero.stage3.partition import partition_parameter

    store = NvmeParamStore([], str(tmp_path), rank=0, buffer_count=2, buffer_size=10_000, max_in_cpu=300)
    owner = ParamOwner(store=store)
    try:
        values = [torch.randn(100) for _ in range(3)]
        parts = [partition_parameter(f"p{i}", torch.nn.Parameter(v.clone()), ShardGroup.local(), owner=owner)
                 for i, v in enumerate(values)]
        for part in parts:
            store.add(part)
        store.flush()
        for part in parts:  # read in order: all three cached (300 elements), p0 least recently used
            part.shard
        assert list(store.cache) == [id(p) for p in parts] and store.cached_numel == 300
        assert store.hold_back_cache(4 * 99 + 1) == 4 * 200  # 100 elements held back (99.25 rounded up)
        assert list(store.cache) == [id(parts[1]), id(parts[2])] and store.cached_numel == 200
        assert store.hold_back_cache(4 * 101) == 4 * 199  # the latest call, not the sum: 101 elements
        assert list(store.cache) == [id(parts[2])] and store.cached_numel == 100
        reads = store.stats["param_reads"]
        assert torch.equal(parts[0].shard, values[0])  # from the file again, cached under the bound: p2 goes
        assert store.stats["param_reads"] == reads + 1 and list(store.cache) == [id(parts[0])]
        assert store.hold_back_cache(4 * 100) == 4 * 200
        assert torch.equal(parts[1].shard, values[1]) and list(store.cache) == [id(parts[0]), id(parts[1])]
        assert store.cached_numel == 200
        assert store.hold_back_cache(4 * 200) == 4 * 100  # a shard of exactly the bound still fits
        assert list(store.cache) == [id(parts[1])] and torch.equal(parts[2].shard, values[2])
        assert list(store.cache) == [id(parts[2])] and store.cached_numel == 100
        assert store.hold_back_cache(4 * 1000) == 0 and not store.cache  # more than the cache: none of it
        assert torch.equal(parts[2].shard, values[2]) and not store.cache
        assert store.hold_back_cache(0) == 4 * 300
        assert torch.equal(parts[2].shard, values[2]) and store.cached_numel == 100
    finally:
        store.close()


def test_param_store_reuses_freed_extents_and_compacts_to_the_live_shards(tmp_path):
    """A shard dropped from the NVMe parameter store (the tied head zero.Init wrote before the model tied it)
    leaves no orphan: a later add reuses its extent, freed space at the file's end goes back to the disk, and
    `compact` moves the last shard into a hole below it. Accounting: the file's allocated bytes == the live
    shards' extents + the free list, and after compact the free list holds no extent the last shard fits."""
    from zerotrain.offload.param_store import NvmeParamStore, _extent
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.stage3.owner import ParamOwner
    from zerotrain.zero.stage3.partition import partition_parameter

    def allocated() -> int:
        path = os.path.join(store.directory, "params.swp")
        assert os.path.getsize(path) == store.size
        return os.stat(path).st_blocks * 512

    def live() -> int:
        return sum(_extent(part) for part in store.parts)

    store = NvmeParamStore([], str(tmp_path), rank=0, buffer_count=2, buffer_size=10_000, max_in_cpu=0)
    try:
        values = {name: torch.randn(n) for name, n in [("a", 3000), ("b", 5000), ("c", 100), ("d", 2000)]}
        parts = {name: partition_parameter(name, torch.nn.Parameter(v.clone()), ShardGroup.local(),
                                           owner=ParamOwner(store=store)) for name, v in values.items()}
        for name in "abc":
            store.add(parts[name])
        store.flush()
        assert allocated() == live() == 12288 + 20480 + 4096
        store.remove(parts["b"])  # a hole in the middle: kept for reuse (b's values back in host memory)
        assert store.free == [(12288, 20480)] and store.size == live() + 20480
        store.add(parts["d"])  # 8 KiB: into the hole, not at the end
        store.flush()
        assert store.offsets[id(parts["d"])] == 12288 and store.free == [(20480, 12288)]
        assert store.size == live() + 12288 and allocated() <= store.size
        store.remove(parts["c"])  # the last extent: the file shrinks at once
        assert store.size == 12288 + 8192 and store.free == [] and allocated() == live()
        store.add(parts["b"])  # larger than any hole: at the end again
        store.remove(parts["a"], keep_values=False)  # 12 KiB hole at the start, too small for b
        store.compact()
        assert store.size == live() + 12288  # b (20 KiB) fits no hole below it: nothing moves
        store.add(parts["c"])  # 4 KiB: into the hole at 0
        store.remove(parts["b"], keep_values=False)
        store.compact()  # the tail is cut; d (at 12 KiB) then moves into the 8 KiB hole after c
        assert store.size == allocated() == live() == 4096 + 8192 and store.free == []
        for name in "cd":
            assert torch.equal(parts[name].shard, values[name]), name
    finally:
        store.close()


def test_param_store_merges_a_freed_extent_with_the_hole_before_it_not_the_first(tmp_path):
    """Freed extents next to each other become one hole (the one they touch, wherever it is in the free list), so
    a shard as large as both goes there instead of growing the file."""
    from zerotrain.offload.param_store import NvmeParamStore
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.stage3.owner import ParamOwner
    from zerotrain.zero.stage3.partition import partition_parameter

    store = NvmeParamStore([], str(tmp_path), rank=0, buffer_count=2, buffer_size=10_000, max_in_cpu=0)
    try:
        values = {name: torch.randn(1000) for name in "bcde"}  # 4000 bytes: one 4 KiB extent each
        values.update(a=torch.randn(3000), f=torch.randn(2000))  # 12 KiB, 8 KiB
        parts = {name: partition_parameter(name, torch.nn.Parameter(v.clone()), ShardGroup.local(),
                                           owner=ParamOwner(store=store)) for name, v in values.items()}
        for name in "abcde":
            store.add(parts[name])
        store.flush()
        store.remove(parts["a"])  # a 12 KiB hole at 0
        store.remove(parts["c"])  # a second one at 16 KiB
        store.remove(parts["d"])  # next to c's: merged with it, not with a's
        assert store.free == [(0, 12288), (16384, 8192)] and store.size == 12288 + 4 * 4096, store.free
        store.add(parts["f"])  # 8 KiB: into c's and d's hole (the smallest that holds it), the file does not grow
        store.flush()
        assert store.offsets[id(parts["f"])] == 16384 and store.free == [(0, 12288)] and store.size == 12288 + 4 * 4096
        for name in "bef":
            assert torch.equal(store.host_shard(parts[name]), values[name]), name
    finally:
        store.close()


def test_build_param_store_builds_what_offload_param_asks_for(tmp_path):
    """No offload_param, or `device: none`: no store (the shards stay on the device); `cpu`: a host store;
    `nvme`: a store with its file under nvme_path."""
    from zerotrain.config import load_config
    from zerotrain.offload.param_store import HostParamStore, NvmeParamStore, build_param_store

    def offload(device: str):
        block = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
        return load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
            "stage": 3, "offload_param": block}}).zero_optimization.offload_param

    assert build_param_store([], None, None, 0) is None
    assert build_param_store([], offload("none"), None, 0) is None
    assert isinstance(build_param_store([], offload("cpu"), None, 0), HostParamStore)
    store = build_param_store([], offload("nvme"), None, 0)
    try:
        assert isinstance(store, NvmeParamStore) and store.directory.startswith(str(tmp_path))
    finally:
        store.close()


def test_the_norm_from_a_first_pass_is_chosen_by_its_rule_and_a_true_that_cannot_apply_is_refused(tmp_path,
                                                                                                   world_of_one):
    """`offload_optimizer.norm_first_pass`: "auto" (unset) takes the norm from a first backward where clipping
    would spill and the parameters are on NVMe too; true also where they are not; false spills; where the spill
    itself would not apply (no clipping, accumulation) nothing changes, and a true there is refused at
    initialize, naming the key (as is a true with the optimizer off NVMe, by the config)."""
    import zerotrain
    from zerotrain.config import ConfigError, load_config
    from zerotrain.offload.nvme import FirstPass, takes_norm_first

    def config(key=None, params="nvme", clip=1.0, accumulation=1, device="nvme"):
        optimizer = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
        if key is not None:
            optimizer["norm_first_pass"] = key
        return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
                "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {
                    "stage": 3, "offload_optimizer": optimizer,
                    "offload_param": {"device": params, "nvme_path": str(tmp_path)}}}

    def rule(**kwargs):
        parsed = load_config(config(**kwargs))
        return takes_norm_first(parsed, True, parsed.zero_optimization.offload_param.device == "nvme")

    assert rule() and rule(key="auto") and not rule(params="cpu") and rule(params="cpu", key=True)
    assert not rule(key=False) and not rule(clip=0.0) and not rule(accumulation=2)
    assert not rule(key=True, accumulation=2)  # (the engine refuses this one, below)
    with pytest.raises(ConfigError, match=r"offload_optimizer.norm_first_pass: true needs device 'nvme'"):
        load_config(config(key=True, device="cpu"))
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_optimizer.norm_first_pass: true needs .*"
                                          r"gradient_accumulation_steps 2\)$"):
        zerotrain.initialize(model=model, model_parameters=model.parameters(),
                             config=config(key=True, accumulation=2, params="none"))
    # the second pass's terms are compared with the first's, bit for bit (a difference is counted)
    terms = {0: [torch.tensor(2.0, dtype=torch.float64)], 1: []}
    first = FirstPass(1.0, 0.5, terms)
    assert first.same_terms({0: [torch.tensor(2.0, dtype=torch.float64)], 1: []})
    assert not first.same_terms({0: [torch.tensor(2.0 + 1e-15, dtype=torch.float64)], 1: []})
    assert not first.same_terms({0: terms[0]}) and not first.same_terms({0: terms[0] * 2, 1: []})


class _OnceOnly(torch.autograd.Function):
    """Doubles its input; like a node whose saved buffers are freed by its first backward, the second raises
    torch's own error."""

    calls = 0
    error = ("Trying to backward through the graph a second time (or directly access saved tensors after they "
             "have already been freed).")

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _OnceOnly.calls += 1
        if _OnceOnly.calls > 1:
            raise RuntimeError(_OnceOnly.error)
        return grad * 2


def test_a_graph_that_cannot_be_backpropagated_twice_names_the_key_that_spills_instead(tmp_path, world_of_one):
    import zerotrain

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "o")},
                                    "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p")}}}
    engine, *_ = zerotrain.initialize(model=model, model_parameters=model.parameters(), config=config)
    try:
        assert engine.zero_optimizer.takes_norm_first_pass()
        stats = engine.offload_stats()  # nothing counted before a step
        assert stats["norm_first_passes"] == stats["norm_pass_mismatches"] == stats["grad_host_peak_bytes"] == 0
        _OnceOnly.calls = 0
        loss = _OnceOnly.apply(engine(torch.randn(2, 8))).square().sum()
        with pytest.raises(RuntimeError, match=r"^the model's backward cannot run twice over one graph .*second time"
                                               r".*set zero_optimization.offload_optimizer.norm_first_pass: false"):
            engine.backward(loss)
        assert _OnceOnly.calls == 2
        # any other error of the second pass is the model's own: raised as it is
        _OnceOnly.calls, _OnceOnly.error = 0, "the model's own error"
        loss = _OnceOnly.apply(engine(torch.randn(2, 8))).square().sum()
        with pytest.raises(RuntimeError, match=r"^the model's own error$"):
            engine.backward(loss)
    finally:
        engine.close()


def test_an_nvme_path_that_is_a_file_names_the_key_at_construction(tmp_path):
    """Where no config checked the path first (zero.Init's store takes the raw block), the optimizer's records and
    the parameter store refuse a file at nvme_path naming their key, not with a bare FileExistsError."""
    from zerotrain.offload import OffloadIOError
    from zerotrain.offload.param_store import NvmeParamStore

    blocker = tmp_path / "swapfile"
    blocker.write_text("")
    says = r"nvme_path: .*{} or a parent of it is a file"
    with pytest.raises(OffloadIOError, match=r"^zero_optimization\.offload_optimizer\." + says.format("swapfile")):
        _bucket_optimizer(blocker)
    with pytest.raises(OffloadIOError, match=r"^zero_optimization\.offload_param\." + says.format("swapfile/sub")):
        NvmeParamStore([], str(blocker / "sub"), rank=0, buffer_count=2, buffer_size=10_000, max_in_cpu=0)
    assert blocker.read_text() == ""
