"""NVMe offload keeps its fp32 masters in the slot files beside the states, not in host memory.

Between steps every offloaded master is a placeholder holding no memory, `optimizer.state` holds only
scalars and `memory_split()` counts masters and states under `nvme`; the published model weights and
the masters paged in by `resident_masters()` / `resident_states()` are bit for bit torch's own
optimizer on whole tensors (our CPU Adam kernel for fused AdamW, bf16 model weights cast in its pass;
the torch step for an optimizer the kernel does not take). A load through `resident_states()` that
writes new masters makes them current for the next step.
"""
from __future__ import annotations

import os

import pytest
import torch

SIZES = (12000, 10000)  # 22 chunks of 1024 through 2 buffers: the pool is smaller than the masters


def _build(tmp_path, make_optimizer, dtype=torch.float32):
    from zerotrain.offload import NvmeOffloadOptimizer
    from zerotrain.zero.flat import FlatBucket
    from zerotrain.sharding import ShardGroup

    torch.manual_seed(0)
    values = [torch.randn(n) for n in SIZES]
    params = [torch.nn.Parameter(v.to(dtype)) for v in values]
    buckets = [FlatBucket(i, [(f"p{i}", p)], i, ShardGroup.local()) for i, p in enumerate(params)]
    opt = NvmeOffloadOptimizer(buckets, None, make_optimizer(params), [[p] for p in params], 0.0,
                               nvme_path=str(tmp_path), buffer_count=2, chunk_numel=1024)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in params]  # fp32 masters, as the offload's
    return params, opt, ref, make_optimizer(ref)


def _adamw(params):
    return torch.optim.AdamW([{"params": [params[0]], "lr": 1e-2},
                              {"params": [params[1]], "lr": 5e-3, "weight_decay": 0.1}], fused=True)


def _amsgrad_adam(params):  # not taken by the CPU Adam kernel: the torch step runs per chunk
    return torch.optim.Adam([{"params": [params[0]], "lr": 1e-2, "amsgrad": True},
                             {"params": [params[1]], "lr": 5e-3, "weight_decay": 0.1}], fused=True)


def _step_both(opt, ref, ref_opt, multiplier: float = 0.5) -> None:
    grads = [torch.randn(n) for n in SIZES]
    for p, g in zip(ref, grads):
        p.grad = g * multiplier
    ref_opt.step()
    opt.update([g.clone() for g in grads], multiplier, range(len(grads)))
    opt.publish()


def _assert_no_masters_in_host_memory(opt, stepped: bool = True) -> None:
    for master in opt.masters:
        assert master.untyped_storage().nbytes() <= 4, "an offloaded master holds memory between steps"
        assert all(not torch.is_tensor(v) or v.numel() == 1 for v in opt.optimizer.state.get(master, {}).values())
    split = opt.memory_split()
    per_element = [4 + (sum(d.itemsize for _, d, *_ in opt.records.layouts[group]) if stepped else 0)  # master, states
                   for group in range(len(SIZES))]
    assert split["nvme"] == sum(k * n for k, n in zip(per_element, SIZES)), split
    assert split["host"] <= 4 * len(SIZES), split  # the step counts only
    assert split["host_buffers"] == opt.records.pool.total_bytes() < 4 * sum(SIZES), split


@pytest.mark.parametrize("make_optimizer,dtype", [(_adamw, torch.float32), (_adamw, torch.bfloat16),
                                                  (_amsgrad_adam, torch.float32)])
def test_masters_live_in_the_files_and_match_torch_bitwise(tmp_path, make_optimizer, dtype):
    params, opt, ref, ref_opt = _build(tmp_path, make_optimizer, dtype)
    _assert_no_masters_in_host_memory(opt, stepped=False)  # from the start: built, written to slot 0, freed
    for _ in range(3):
        _step_both(opt, ref, ref_opt)
        _assert_no_masters_in_host_memory(opt)
        for p, r in zip(params, ref):  # published: the masters cast into the model, chunk by chunk
            assert torch.equal(p.detach(), r.detach().to(dtype))
    with opt.resident_masters():
        for master, r in zip(opt.masters, ref):
            assert torch.equal(master, r.detach())
    _assert_no_masters_in_host_memory(opt)
    with opt.resident_states(write_back=False):
        for master, r in zip(opt.masters, ref):
            assert torch.equal(master, r.detach())
            for key, value in ref_opt.state[r].items():
                assert torch.equal(opt.optimizer.state[master][key], value), key
    _assert_no_masters_in_host_memory(opt)
    opt.close()


def test_masters_written_in_resident_states_become_current(tmp_path):
    params, opt, ref, ref_opt = _build(tmp_path, _adamw)
    _step_both(opt, ref, ref_opt)
    with opt.resident_states():  # as a checkpoint load writes masters
        for master, r in zip(opt.masters, ref):
            master.mul_(0.5)
            with torch.no_grad():
                r.mul_(0.5)
    opt.publish()  # what the load does after writing: the new masters reach the model
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r.detach())
    _step_both(opt, ref, ref_opt)
    for p, r in zip(params, ref):
        assert torch.equal(p.detach(), r.detach())
    _assert_no_masters_in_host_memory(opt)
    opt.close()


def test_step_inside_resident_states_is_refused(tmp_path):
    _, opt, *_ = _build(tmp_path, _adamw)
    with opt.resident_states(write_back=False), pytest.raises(RuntimeError, match="inside resident_states"):
        opt.update([torch.randn(n) for n in SIZES], 1.0, range(len(SIZES)))
    opt.close()


def _gathered_write_then_train(nvme_path: str) -> list:
    """Stage 3, world 2: 2 steps, set fc1.weight to 0.25 under GatheredParameters(modifier_rank=0), 2 more steps;
    with cpu offload (masters in host memory) and nvme offload (masters in the files)."""
    import zerotrain
    from offload_common import build_engine, train_steps, world_batches

    results = []
    for block in ({"device": "cpu"}, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}):
        engine = build_engine(3, block)
        batches = world_batches(2, steps=4)
        losses, _ = train_steps(engine, batches[:2])
        weight = engine.module.fc1.weight
        with zerotrain.zero.GatheredParameters([weight], modifier_rank=0):
            if int(os.environ["RANK"]) == 0:
                with torch.no_grad():
                    weight.fill_(0.25)
        modified = engine.full_state_dict()
        more, _ = train_steps(engine, batches[2:])
        results.append((block["device"], losses + more, modified, engine.full_state_dict()))
        engine.close()
    return results


def test_stage3_gathered_write_reaches_the_masters_in_the_files(tmp_path):
    from distributed import run_distributed

    (_, cpu_losses, cpu_modified, cpu_weights), (_, losses, modified, weights) = \
        run_distributed(_gathered_write_then_train, 2, str(tmp_path), timeout=120)[0]
    assert (modified["fc1.weight"] == 0.25).all() and (cpu_modified["fc1.weight"] == 0.25).all()
    assert losses == cpu_losses
    for name, ref in cpu_weights.items():
        assert torch.equal(weights[name], ref), name


_BUILD_PEAK = r"""
import resource, sys, torch
from zerotrain.offload import NvmeOffloadOptimizer
from zerotrain.offload.nvme_records import master_placeholder
from zerotrain.zero.flat import FlatBucket
from zerotrain.sharding import ShardGroup
numel = 32 * 2**20  # 128 MiB of fp32 masters
param = torch.nn.Parameter(torch.ones(numel, dtype=torch.bfloat16))
bucket = FlatBucket(0, [("w", param)], 0, ShardGroup.local())
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
opt = NvmeOffloadOptimizer([bucket], None, torch.optim.AdamW([param], fused=True), [[param]], 0.0,
                           nvme_path=sys.argv[1], buffer_count=2, chunk_numel=2**20)
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
with opt.resident_masters():
    assert torch.equal(opt.masters[0], torch.ones(numel)), "slot 0 holds the model's weights as fp32 masters"
opt.close()
print(f"PEAK_GROWTH_MIB {grew:.1f}")
"""


def test_building_never_holds_every_master_in_host_memory(tmp_path):
    """Slot 0 is filled from the model shards chunk by chunk: the build's peak host memory grows by about the
    buffer pool (2 records of 1M elements here), not by the 128 MiB of fp32 masters."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BUILD_PEAK, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    grew = float(done.stdout.split("PEAK_GROWTH_MIB")[1])
    assert grew < 64, f"building the NVMe optimizer grew peak host memory by {grew:.1f} MiB (masters: 128 MiB)"
