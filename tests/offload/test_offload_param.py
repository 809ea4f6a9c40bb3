"""Stage-3 parameter offload (`zero_optimization.offload_param`): cpu and nvme, with and without
offload_optimizer, match single-process AdamW (fp32, 1e-5 relative; world 2, accumulation 2, clipping,
two parameter groups); an NVMe checkpoint round-trips; a failing read raises OffloadIOError; the
device holds only the persistent parameters' shards."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import make_batches, micro_slice, train_global_step
from offload_common import (ACCUMULATION, MICRO, assert_matches_reference, engine_config, param_groups,
                            reference_training, train_steps, world_batches)

PERSISTENCE = 5  # OddMLP: fc2.bias (3 elements) stays whole on the device; the other three are offloaded


def param_config(offload_param: dict, offload_optimizer: dict | None = None) -> dict:
    config = engine_config(3, offload_optimizer)
    config["zero_optimization"].update(stage3_param_persistence_threshold=PERSISTENCE,
                                       offload_param=offload_param)
    config["comm_timeout_seconds"] = 60
    return config


def build(offload_param: dict, offload_optimizer: dict | None = None, seed: int = 0):
    import zerotrain
    from models_for_tests import OddMLP

    torch.manual_seed(seed)
    model = OddMLP()
    engine, *_ = zerotrain.initialize(model=model, model_parameters=param_groups(model),
                                      config=param_config(offload_param, offload_optimizer))
    return engine


def nvme(path: str, **extra) -> dict:
    # max_in_cpu 20: one shard cached at most, so most gathers read the file (through 2 buffers).
    return {"device": "nvme", "nvme_path": path, "buffer_count": 2, "buffer_size": 64, "max_in_cpu": 20, **extra}


def train_modes(nvme_path: str) -> list:
    results = []
    modes = [("cpu", {"device": "cpu"}, None),
             ("cpu + offload_optimizer cpu", {"device": "cpu"}, {"device": "cpu"}),
             ("nvme", nvme(os.path.join(nvme_path, "p1")), None),
             ("nvme + offload_optimizer nvme", nvme(os.path.join(nvme_path, "p2")),
              {"device": "nvme", "nvme_path": os.path.join(nvme_path, "o2"), "buffer_count": 2})]
    for what, params, optimizer in modes:
        engine = build(params, optimizer)
        losses, _ = train_steps(engine, world_batches(2, 3))
        report = engine.memory_report()
        store = engine.param_store
        results.append((what, losses, engine.full_state_dict(), report, dict(getattr(store, "stats", {}))))
        topology = engine.topology
        engine.close()
    return results, budget_checks(topology, nvme_path)


def budget_checks(topology, nvme_path: str) -> dict:
    """The memory budget at world 2 (zerotrain.budget): ranks that see different host memory choose the same
    sizes (the least budget), and a config that cannot fit its set budget is refused by initialize (and by a ZeroTrainEngine built directly), before
    any step, with the numbers."""
    import zerotrain
    from models_for_tests import OddMLP
    from zerotrain.budget import HostMemory, _own_rss, default_budget, plan_sizes, resolve_memory
    from zerotrain.config import ConfigError, load_config
    from zerotrain.estimate import model_shape
    from zerotrain.engine import ZeroTrainEngine

    rank = topology.rank
    unset = {"device": "nvme", "nvme_path": os.path.join(nvme_path, "budget")}  # no size key set
    raw = param_config(unset, dict(unset))
    del raw["zero_optimization"]["reduce_bucket_size"]
    config = load_config(raw)
    model = OddMLP()
    host = HostMemory((rank + 1) * 2**30, "test")  # rank 1 sees twice rank 0's memory (a budget above the runtime)
    local = plan_sizes(default_budget(host.available, 2, _own_rss()), model_shape(model), 2, config, "cpu")
    zero = resolve_memory(model, config, topology, host=host).zero_optimization
    chosen = (zero.reduce_bucket_size, zero.stage3_max_live_parameters, zero.offload_param.max_in_cpu,
              zero.offload_param.buffer_count, zero.offload_param.buffer_size, zero.offload_optimizer.buffer_count)
    # the default budget (half this rank's part) below what the run needs, its whole part above: refused, not
    # run over the printed budget (#43), naming the budget that would let it run
    try:
        resolve_memory(model, config, topology, host=HostMemory(_own_rss(), "test"))
        over = ""
    except ConfigError as error:
        over = str(error)
    raw["zero_optimization"]["memory_budget_bytes"] = 10_000  # less than the model states and buffers need
    refused = []
    for build in (lambda: zerotrain.initialize(model=OddMLP(), model_parameters=None, config=raw),
                  lambda: ZeroTrainEngine(OddMLP(), load_config(raw, dp_world_size=2), topology)):  # built directly
        try:
            build()
            refused.append("")
        except ConfigError as error:
            refused.append(str(error))
    return {"chosen": chosen, "local_max_in_cpu": local.value("offload_param.max_in_cpu"), "refused": refused,
            "over_default_budget": over}


def test_offload_param_matches_single_process(tmp_path):
    ref_losses, ref_weights = reference_training(world_batches(2, 3))
    results = run_distributed(train_modes, 2, str(tmp_path), timeout=150)
    budgets = [budget for _, budget in results]
    # (max_in_cpu, not reduce_bucket_size: a budget-sized stage-3 bucket is capped at the largest parameter, 1M
    # elements at least, which both ranks reach here)
    assert budgets[0]["local_max_in_cpu"] != budgets[1]["local_max_in_cpu"], budgets  # can differ
    assert budgets[0]["chosen"] == budgets[1]["chosen"], budgets  # ... but the ranks agree
    for budget in budgets:
        over = budget["over_default_budget"]
        assert "there are (the memory budget printed: 50% of" in over and "memory_budget_bytes up to" in over, over
    for budget in budgets:  # by initialize and by an engine built directly, the same way
        for refused in budget["refused"]:
            assert "more than the 9.77 KiB there are (zero_optimization.memory_budget_bytes)" in refused, budget
            assert "largest: " in refused and "needs " in refused, budget
    for what, losses, weights, report, stats in results[0][0]:
        assert_matches_reference(f"offload_param {what}", losses, weights, ref_losses, ref_weights)
        # Memory: on the device only fc2.bias remains (its 2-element shard + its 4-element full copy, fp32).
        assert report["parameters"] == (2 + 4) * 4, (what, report["parameters"])
        offloaded_bytes = (21 + 4 + 11) * 4  # shards of fc1.weight (42), fc1.bias (7), fc2.weight (21)
        split = report["offload_param"]
        if what.startswith("cpu"):
            assert split == {"host": offloaded_bytes, "nvme": 0, "host_buffers": 0}, (what, split)
        else:
            assert split["nvme"] == offloaded_bytes and split["host"] <= 20 * 4, (what, split)
            assert split["host_buffers"] == 2 * 4096, (what, split)
            assert stats["param_reads"] > 0 and stats["param_writes"] > 0, stats
    # The files are gone after close().
    assert not [name for _, _, names in os.walk(tmp_path) for name in names], list(os.walk(tmp_path))


# --- checkpoint round trip ------------------------------------------------------------------
FIRST, SECOND = 2, 2


def _train(engine, first: int, count: int) -> list[float]:
    world = int(os.environ["WORLD_SIZE"])
    return [train_global_step(engine, batch, MICRO)
            for batch in make_batches(FIRST + SECOND, MICRO * ACCUMULATION * world)[first:first + count]]


def checkpoint_legs(tmp: str) -> dict:
    save_dir = os.path.join(tmp, "ckpt")
    engine = build(nvme(os.path.join(tmp, "a")), seed=0)
    first = _train(engine, 0, FIRST)
    engine.save_checkpoint(save_dir, tag="first")
    engine.close()
    engine = build(nvme(os.path.join(tmp, "b")), seed=123)  # other initial weights: the load must replace them
    engine.load_checkpoint(save_dir)
    second = _train(engine, FIRST, SECOND)
    weights = engine.full_state_dict()
    engine.close()
    return {"losses": first + second, "weights": weights}


def test_offload_param_nvme_checkpoint_round_trip(tmp_path):
    result = run_distributed(checkpoint_legs, 2, str(tmp_path), timeout=150)[0]
    ref_losses, ref_weights = reference_training(world_batches(2, FIRST + SECOND))
    assert_matches_reference("offload_param nvme, save -> load", result["losses"], result["weights"],
                             ref_losses, ref_weights)


# --- failures -------------------------------------------------------------------------------
def failing_read(nvme_path: str) -> dict:
    import zerotrain.offload.aio as aio
    from zerotrain.offload import OffloadIOError

    engine = build(nvme(nvme_path, max_in_cpu=0))
    batches = world_batches(2, 2)
    train_steps(engine, batches[:1])
    store = engine.param_store
    real = aio._pread

    def pread(fd, buffers, offset):
        if fd == store.fd:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, buffers, offset)

    aio._pread = pread
    try:
        rank = int(os.environ["RANK"])
        x, y = micro_slice(batches[1], 0, rank, 2, MICRO)
        with pytest.raises(OffloadIOError) as caught:
            engine(x, y)
        message = str(caught.value)
    finally:
        aio._pread = real
    engine.close()
    return {"message": message}


def test_offload_param_failed_read_raises(tmp_path):
    for rank, result in enumerate(run_distributed(failing_read, 2, str(tmp_path), timeout=120)):
        assert "reading" in result["message"] and "params.swp" in result["message"], (rank, result)


def test_offload_param_config_no_longer_warns():
    import warnings

    from zerotrain.config import load_config

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = load_config(param_config({"device": "cpu"}))
    assert config.zero_optimization.offload_param.device == "cpu"
