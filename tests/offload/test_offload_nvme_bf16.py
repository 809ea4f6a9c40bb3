"""bf16 records of NVMe offload (`bf16.bf16_master_weights_and_grads`, `bf16.bf16_optimizer_states`): masters and
Adam states stored in bf16, stepped in fp32, stored back rounded stochastically (`offload/stochastic_round.py`).

Exact where it can be: each step is bit for bit torch's fused AdamW on the fp32 values of the stored bf16 records
followed by `round_bf16_` with the chunk's seed (kernel path and torch-step path); the files hold 6 bytes per
Adam parameter (10 with bf16 masters and fp32 states); checkpoints page fp32 values in. The world-2 engine run against fp32 masters
(the lossy rule) is in tests/offload/test_offload_stage3.py's launch.
"""
from __future__ import annotations

import pytest
import torch

from test_offload_nvme_masters import _adamw, _amsgrad_adam  # two groups; amsgrad: the torch step per chunk
from zerotrain.offload.aio import round_up
from zerotrain.offload.stochastic_round import round_bf16_, rounding_seed

SIZES = (12000, 10000)
CHUNK = 1024


def _build(tmp_path, make_optimizer, state_dtype=torch.bfloat16):
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n) * 0.05) for n in SIZES]
    buckets = [FlatBucket(i, [(f"p{i}", p)], i, ShardGroup.local()) for i, p in enumerate(params)]
    opt = NvmeOffloadOptimizer(buckets, None, make_optimizer(params), [[p] for p in params], 0.0,
                               nvme_path=str(tmp_path), buffer_count=2, chunk_numel=CHUNK,
                               master_dtype=torch.bfloat16, state_dtype=state_dtype)
    # the reference: fp32 masters holding the stored bf16 values (the first records: the shards rounded to nearest)
    ref = [torch.nn.Parameter(p.detach().to(torch.bfloat16).float()) for p in params]
    return params, opt, ref, make_optimizer(ref)


def _store_like_the_records(opt, ref, ref_opt, narrow_states: bool, chunk: int = CHUNK) -> None:
    """Round the reference's masters (and states) per chunk with the records' seeds, as `NvmeRecords.store`
    (and `Bf16HostStates.step`: the same seeds, its own chunk size)."""
    with torch.no_grad():
        for bucket, r in enumerate(ref):
            state = ref_opt.state[r]
            keys = sorted(key for key, value in state.items() if torch.is_tensor(value) and value.numel() == r.numel())
            tensors = [r.data] + [state[key] for key in keys]
            step = int(state["step"])
            for index, start in enumerate(range(0, r.numel(), chunk)):
                for which, tensor in enumerate(tensors):
                    if which and not narrow_states:
                        continue
                    piece = tensor[start:start + chunk]
                    out = torch.empty_like(piece, dtype=torch.bfloat16)
                    round_bf16_(piece.contiguous(), out, rounding_seed(0, bucket, index, step, which))
                    piece.copy_(out)


@pytest.mark.parametrize("make_optimizer,narrow_states", [(_adamw, True), (_amsgrad_adam, True), (_adamw, False)])
def test_bf16_records_step_as_torch_then_round_and_take_six_bytes(tmp_path, make_optimizer, narrow_states):
    params, opt, ref, ref_opt = _build(tmp_path, make_optimizer, torch.bfloat16 if narrow_states else None)
    per_state = 2 if narrow_states else 4
    states = [len(opt.records.layouts[group]) for group in range(len(SIZES))]  # amsgrad: 3 in group 0
    # the file: every chunk's record (bf16 master + states), each region 4 KiB-aligned, plus 2 spares per class
    per_chunk = [round_up(CHUNK * 2) + k * round_up(CHUNK * per_state) for k in states]
    assert opt.records.disk_bytes() == sum((-(-n // CHUNK) + 2) * c for n, c in zip(SIZES, per_chunk))
    for step in range(4):
        grads = [torch.randn(n) for n in SIZES]
        for r, g in zip(ref, grads):
            r.grad = g * 0.5
        ref_opt.step()
        _store_like_the_records(opt, ref, ref_opt, narrow_states)
        opt.update([g.clone() for g in grads], 0.5, range(len(grads)))
        opt.publish()
        for p, r in zip(params, ref):  # the model gets the stored bf16 master
            assert torch.equal(p.detach(), r.detach()), step
    split = opt.memory_split()
    assert split["nvme"] == sum((2 + k * per_state) * n for k, n in zip(states, SIZES)), split
    assert opt.offloaded_bytes() == split["host"] + split["nvme"]
    with opt.resident_states(write_back=False):  # checkpoints see fp32 masters and states holding the bf16 values
        for master, r in zip(opt.masters, ref):
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            for key, value in ref_opt.state[r].items():
                got = opt.optimizer.state[master][key]
                assert got.dtype == value.dtype and torch.equal(got, value), key
    opt.close()


@pytest.mark.parametrize("make_optimizer,narrow_states", [(_adamw, True), (_amsgrad_adam, True), (_adamw, False)])
def test_cpu_offload_bf16_masters_step_as_torch_then_round_and_take_six_bytes(make_optimizer, narrow_states):
    """Plain CPU offload with bf16 masters (and states): in host memory, stepped and rounded as the NVMe records;
    checkpoints see fp32 copies, and a write back of what they saw leaves every stored bit as it was."""
    from zerotrain.offload import OffloadOptimizer
    from zerotrain.offload.bf16_host import CHUNK_NUMEL
    from zerotrain.sharding import ShardGroup
    from zerotrain.zero.flat import FlatBucket

    torch.manual_seed(0)
    sizes = (CHUNK_NUMEL + 3000, 10000)  # two chunks in the first bucket (kernel path)
    params = [torch.nn.Parameter(torch.randn(n) * 0.05) for n in sizes]
    buckets = [FlatBucket(i, [(f"p{i}", p)], i, ShardGroup.local()) for i, p in enumerate(params)]
    opt = OffloadOptimizer(buckets, None, make_optimizer(params), [[p] for p in params], 0.0,
                           master_dtype=torch.bfloat16, state_dtype=torch.bfloat16 if narrow_states else None)
    ref = [torch.nn.Parameter(p.detach().to(torch.bfloat16).float()) for p in params]
    ref_opt = make_optimizer(ref)
    for step in range(3):
        grads = [torch.randn(n) for n in sizes]
        for r, g in zip(ref, grads):
            r.grad = g * 0.5
        ref_opt.step()
        _store_like_the_records(opt, ref, ref_opt, narrow_states, chunk=CHUNK_NUMEL)
        opt.step([g.clone() for g in grads], 2.0)  # loss scale 2: the multiplier 0.5
        for p, r in zip(params, ref):  # the model gets the stored bf16 master
            assert torch.equal(p.detach(), r.detach()), step
    if make_optimizer is _adamw:  # the kernel path's fp32 working copies: one chunk per tensor, not the bucket
        assert opt.bf16_host._scratch.numel() == 4 * CHUNK_NUMEL
    per_state = 2 if narrow_states else 4
    states = [sum(1 for v in ref_opt.state[r].values() if torch.is_tensor(v) and v.numel() == r.numel()) for r in ref]
    assert opt.memory_split()["host"] == sum((2 + k * per_state) * n + 4 for k, n in zip(states, sizes))
    stored = [(m.clone(), {k: v.clone() for k, v in opt.optimizer.state[m].items()}) for m in opt.masters]
    with opt.resident_states(write_back=True):  # a checkpoint: fp32 copies holding the bf16 values
        for master, r in zip(opt.masters, ref):
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            for key, value in ref_opt.state[r].items():
                got = opt.optimizer.state[master][key]
                assert got.dtype == value.dtype and torch.equal(got, value), key
    for master, (was, state) in zip(opt.masters, stored):  # narrowed back exactly
        assert master.dtype == torch.bfloat16 and torch.equal(master, was)
        for key, value in state.items():
            now = opt.optimizer.state[master][key]
            assert now.dtype == value.dtype and torch.equal(now, value), key


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_stochastic_rounding_is_unbiased_deterministic_and_keeps_specials(path, monkeypatch):
    """Both ways of rounding (the C kernel's hash, torch's generator without it): the same properties."""
    from zerotrain.offload import stochastic_round
    from zerotrain.offload.cpu_adam import kernel

    lib = kernel()
    assert lib is not None, "the C kernel builds here (the fallback is torch's generator)"
    if path == "torch":
        monkeypatch.setattr(stochastic_round, "kernel", lambda: None)
    value = 1.0 + 2 ** -10  # a quarter of the way from bf16's 1.0 to the next value (1 + 2**-7 ... 2**-8 apart)
    source = torch.full((1 << 16,), value)
    out, again = torch.empty(1 << 16, dtype=torch.bfloat16), torch.empty(1 << 16, dtype=torch.bfloat16)
    round_bf16_(source, out, 7)
    round_bf16_(source, again, 7)
    assert torch.equal(out, again)
    direct = torch.empty(1 << 16, dtype=torch.bfloat16)
    lib.zt_round_bf16(source.data_ptr(), direct.data_ptr(), source.numel(), 7)
    assert torch.equal(out, direct) == (path == "kernel")  # the kernel runs wherever it exists
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}  # only the two neighbours
    assert abs(out.float().mean().item() - value) < 2e-5  # in expectation the value (nearest would give 1.0)
    assert source.to(torch.bfloat16).float().mean().item() == 1.0
    round_bf16_(source, again, 8)
    assert not torch.equal(out, again)  # another seed, other noise
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, -value] + [0.0] * 10)
    got = round_bf16_(specials, torch.empty(16, dtype=torch.bfloat16), 1).float()
    assert got[0] == float("inf") and got[1] == -float("inf") and got[2].isnan() and got[3] == 0 and got[4] == 0
    assert got[5].item() in (-1.0, -1.0 - 2 ** -7)
    top = torch.full((64,), torch.finfo(torch.float32).max)  # above bf16's largest value: that or inf, never nan
    got = round_bf16_(top, torch.empty(64, dtype=torch.bfloat16), 3)
    assert set(got.float().tolist()) <= {torch.finfo(torch.bfloat16).max, float("inf")}, got


def test_rounding_seeds_are_64_bit_and_distinct_for_distinct_tuples():
    """(rank, bucket, chunk, step, which): every tuple its own seed, order counts, and each fits the kernel's
    uint64 (a seed shared by two chunks would round them with the same noise)."""
    import itertools

    tuples = list(itertools.product(range(3), range(3), range(4), range(1, 5), range(3)))
    seeds = [rounding_seed(*t) for t in tuples]
    assert len(set(seeds)) == len(tuples)
    assert all(0 <= seed < 1 << 64 for seed in seeds)
    assert {seed & 1 for seed in seeds} == {0, 1} and {seed >> 63 for seed in seeds} == {0, 1}  # all 64 bits vary
    assert rounding_seed(0, 1) != rounding_seed(1, 0) and rounding_seed(0) != rounding_seed()
    assert rounding_seed(2, 5, 1, 3, 0) == rounding_seed(2, 5, 1, 3, 0)


def test_the_keys_need_each_other_and_an_offloaded_optimizer():
    from zerotrain.config import ConfigError, load_config
    from zerotrain.offload.nvme import record_dtypes

    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    both = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    with pytest.raises(ConfigError, match="bf16.bf16_optimizer_states: requires bf16.bf16_master_weights_and_grads"):
        load_config({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": nvme})
    config = load_config({"bf16": both, "zero_optimization": nvme})
    assert record_dtypes(config) == {"master_dtype": torch.bfloat16, "state_dtype": torch.bfloat16}
    masters_only = load_config({"bf16": dict(both, bf16_optimizer_states=False), "zero_optimization": nvme})
    assert record_dtypes(masters_only) == {"master_dtype": torch.bfloat16, "state_dtype": None}
    on_cpu = load_config({"bf16": both, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}})
    assert on_cpu.bf16_records  # plain CPU offload stores them in bf16 too (offload/bf16_host.py)
    with pytest.warns(UserWarning, match="bf16.bf16_master_weights_and_grads: .* keeps them in fp32"):
        speculative = load_config({"bf16": both, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}})
    assert not speculative.bf16_records
