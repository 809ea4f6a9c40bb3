"""kaiming_* / xavier_* on partitioned parameters of a running engine give torch's exact values."""
from __future__ import annotations

import torch

from distributed import run_distributed
from models_for_tests import OddMLP
from test_stage3_init import is_released

# (parameter, initializer, keyword arguments): every rank seeds its own generator alike.
INITS = [("fc1.weight", "kaiming_uniform_", {"a": 1.0, "mode": "fan_out"}), ("fc2.weight", "kaiming_normal_", {}),
         ("fc1.bias", "uniform_", {"a": -0.3, "b": 0.3}), ("fc2.bias", "normal_", {"std": 2.0})]
XAVIER = [("fc1.weight", "xavier_uniform_", {}), ("fc2.weight", "xavier_normal_", {"gain": 2.0})]


def init_after_initialize(inits: list, persistence_threshold: int = 0) -> dict:
    import zerotrain

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence_threshold}, "steps_per_print": 0}
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config)
    params = dict(engine.module.named_parameters())
    returned_self = []  # torch.nn.init returns the tensor it filled, as on a plain tensor
    for seed, (name, init, kwargs) in enumerate(inits):
        returned = getattr(torch.nn.init, init)(params[name], generator=torch.Generator().manual_seed(seed), **kwargs)
        returned_self.append(returned is params[name])
    parts = {name: params[name]._zero for name, _, _ in inits}
    out = {"released": all(is_released(p) for p in params.values()), "returned_self": returned_self,
           "persistent": all(part.persistent for part in parts.values()), "full": {key.removeprefix("module."): value for key, value in engine.full_state_dict().items()},
           "shards": {name: part.shard.clone() for name, part in parts.items()},
           "masters": {name: part.master.clone() for name, part in parts.items()}}
    if not persistence_threshold:  # element-wise ops on a released parameter: a full-shaped operand cut to the chunk
        bias = params["fc2.bias"]
        with torch.no_grad():
            bias.fill_(0.5)  # the last rank's padding stays zero
            bias.add_(torch.arange(bias.numel(), dtype=bias.dtype).reshape(bias.shape))
        out["bias_shard"], out["bias_master"] = bias._zero.shard.clone(), bias._zero.master.clone()
    return out


def expected(inits: list) -> dict:
    torch.manual_seed(0)
    model = OddMLP()
    params = dict(model.named_parameters())
    for seed, (name, init, kwargs) in enumerate(inits):
        getattr(torch.nn.init, init)(params[name].data, generator=torch.Generator().manual_seed(seed), **kwargs)
    return {name: p.detach().clone() for name, p in params.items()}


def test_kaiming_xavier_and_random_inits_match_torch_on_every_rank():
    check_inits_match_torch(persistence_threshold=0)


def test_inits_on_persistent_parameters_reach_the_shard_and_master():
    """A persistent (always whole) parameter: the write goes to the full copy, the shard and the master,
    so the next optimizer step starts from it instead of overwriting it."""
    check_inits_match_torch(persistence_threshold=10**6)


def check_inits_match_torch(persistence_threshold: int) -> None:
    world = 2
    for inits in (INITS, XAVIER):
        want = expected(inits)
        for rank, result in enumerate(run_distributed(init_after_initialize, world, inits, persistence_threshold)):
            assert all(result["returned_self"]), f"rank {rank}: {result['returned_self']}"
            if persistence_threshold:
                assert result["persistent"], f"rank {rank}: the parameters were meant to stay whole"
            else:
                assert result["released"], f"rank {rank}: the initializers ran without gathering"
            for name, ref in want.items() if rank == 0 else ():  # full_state_dict: on rank 0 only
                torch.testing.assert_close(result["full"][name], ref, rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank} {name}: {m}")
            if not persistence_threshold:
                numel = want["fc2.bias"].numel()
                shard = result["bias_shard"]
                flat = torch.zeros(shard.numel() * world)
                flat[:numel] = 0.5 + torch.arange(numel, dtype=torch.float32)
                chunk = flat[rank * shard.numel():(rank + 1) * shard.numel()]
                assert torch.equal(shard, chunk) and torch.equal(result["bias_master"], chunk), (rank, shard, chunk)
            for name in result["shards"]:
                shard = result["shards"][name]
                flat = torch.zeros(shard.numel() * world)
                flat[:want[name].numel()] = want[name].reshape(-1)
                chunk = flat[rank * shard.numel():(rank + 1) * shard.numel()]
                assert torch.equal(shard, chunk), f"rank {rank} {name}: shard is torch's chunk, padding zero"
                assert torch.equal(result["masters"][name], chunk), f"rank {rank} {name}: fp32 master too"
    # Not the same values as before (the write is not lost): not the default init.
    assert not torch.equal(expected(INITS)["fc1.weight"], expected([])["fc1.weight"])


def test_an_init_time_slice_answers_metadata_and_fp32_stage3_keeps_no_master_copy(world_of_one):
    """World of one, in-process. A `param[index]` slice of a parameter zero.Init partitioned answers metadata as a
    plain tensor's slice does (shape, size, dim, numel, dtype: what initializer code reads) while printing it is
    refused with the one line (its values are not there to show). An fp32 stage-3 engine's shards are their own
    fp32 masters: after a step the optimizer holds AdamW's two moments and a step count per bucket, no copy."""
    import pytest

    import zerotrain
    from models_for_tests import make_batches
    from test_stage3_init import PaddedEmbedding

    with zerotrain.zero.Init():
        padded = PaddedEmbedding()
    row, plain = padded.embed.weight[3], torch.nn.Embedding(7, 6).weight[3]
    assert (row.shape, row.size(), row.size(0), row.dim(), row.numel(), row.dtype, row.is_floating_point()) == \
        (plain.shape, plain.size(), plain.size(0), plain.dim(), plain.numel(), plain.dtype, True)
    with pytest.raises(RuntimeError, match=r"__repr__ on a slice of parameter weight, which zero.Init partitioned"):
        repr(row)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 0}
    torch.manual_seed(0)
    model = OddMLP()
    engine, *_ = zerotrain.initialize(model=model, config=config)
    engine.backward(engine(*make_batches(1, 2)[0]))
    engine.step()
    numel, buckets = sum(p.numel() for p in model.parameters()), len(engine.zero_optimizer.buckets)
    assert engine.memory_report()["optimizer_states"] == 2 * 4 * numel + 4 * buckets, engine.memory_report()


def test_a_bf16_weight_written_in_gathered_parameters_is_what_the_next_step_starts_from(world_of_one):
    """World of one, in-process. A bf16 stage-3 engine keeps an fp32 master of each shard apart from the bf16
    shard: a weight written inside `GatheredParameters(modifier_rank=0)` reaches both, so the next step starts from
    the written values (one AdamW step of lr 1e-2 moves each by about 1e-2), not from the old master's (torch's
    init: |0.5 - w| >= 0.09 for every fc1 weight)."""
    import zerotrain
    from models_for_tests import make_batches

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 0}
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=config)
    weight = engine.module.fc1.weight
    assert is_released(weight) and weight._zero.master.dtype == torch.float32
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=0):
        with torch.no_grad():
            weight.fill_(0.5)
    x, y = make_batches(1, 2)[0]
    engine.backward(engine(x.bfloat16(), y.bfloat16()))
    engine.step()
    with zerotrain.zero.GatheredParameters([weight]):
        moved = (weight.detach().float() - 0.5).abs()
    assert 0 < moved.max() <= 0.02, moved.max()


def test_the_placeholder_warning_points_at_the_users_state_dict_call(world_of_one, monkeypatch):
    """World of one, in-process. `state_dict()` of a stage-3 model warns once that partitioned parameters are
    placeholders; the warning names the line that called `state_dict()` (here), not a line of torch's module
    recursion, at any depth of the module tree."""
    import inspect
    import warnings

    import zerotrain
    from zerotrain.zero.stage3 import partition

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 0}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Sequential(OddMLP()))
    engine, *_ = zerotrain.initialize(model=model, config=config)
    for module in (model, model[0][0]):  # the whole tree, a leaf's parent alone
        monkeypatch.setattr(partition, "_warned_placeholders", [])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            saved = module.state_dict()
        placeholders = [w for w in caught if "empty placeholders" in str(w.message)]
        assert [(w.filename, w.lineno) for w in placeholders] == [(__file__, line)], \
            [(w.filename, w.lineno) for w in caught]
        assert saved[next(key for key in saved if key.endswith("fc1.weight"))].shape == (0,)


def test_parameter_status_names_and_values_are_deepspeeds():
    """`param.ds_status` answers with DeepSpeed's `ZeroParamStatus`: the same three members and values (code written
    for DeepSpeed compares against each, e.g. `ds_status == ZeroParamStatus.NOT_AVAILABLE` before a gather)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as DeepSpeeds

    from zerotrain.runtime.zero.partition_parameters import ZeroParamStatus

    assert {status.name: status.value for status in ZeroParamStatus} == \
        {status.name: status.value for status in DeepSpeeds}


def test_writes_to_a_released_parameter_wait_for_a_pending_snapshot_copy_first():
    """World of one, in-process. An async checkpoint's snapshot may still be copying the shards when user code writes
    a released parameter in place (an element-wise op on the shard, or an initializer on a transient full tensor):
    the write first waits on the engine's fence, so the copy made by then holds the values from before the write."""
    from zerotrain.comm import Comm
    from zerotrain.zero.stage3.setup import partition_module

    class CopyAtWait:  # a snapshot copy that completes when a writer waits for it
        def __init__(self) -> None:
            self.copies = []

        def wait(self) -> None:
            self.copies.append(weight._zero.shard.clone())

    torch.manual_seed(0)
    model, fence = torch.nn.Linear(6, 8), CopyAtWait()
    partition_module(model, Comm(None, 0, 1), {id(p): 0 for p in model.parameters()}, 0, False, 10**6, fence=fence)
    weight = model.weight
    assert is_released(weight)
    for write in (lambda: weight.add_(1.0), lambda: torch.nn.init.kaiming_uniform_(weight)):
        before = weight._zero.shard.clone()
        with torch.no_grad():
            write()
        assert len(fence.copies) == 1 and torch.equal(fence.copies.pop(), before)
        assert not torch.equal(weight._zero.shard, before)
