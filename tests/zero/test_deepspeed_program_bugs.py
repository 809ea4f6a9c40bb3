"""What real DeepSpeed programs do at ZeRO-3 (issue 28's bugs), at world 2.

- DeepSpeed-Chat's `save_zero_three_model`: `{k: v.cpu()}` of partitioned parameters (inside
  `GatheredParameters`, and outside it) is a dict of plain tensors that `torch.save` writes (no process group
  pickled) and that holds the values after the gather is released.
- A rank-0-only `engine.module.state_dict()` (DeepSpeed-Chat's `save_hf_format`) returns at once, as
  DeepSpeed's does: partitioned parameters are empty placeholders, no collective is run (a collective here
  would wait for the other rank until `comm_timeout_seconds`); inside `GatheredParameters` it has values.
- The activation_checkpointing block of DeepSpeedExamples' Megatron 10B config (contiguous without
  number_checkpoints) initializes.
- A model built under DeepSpeed's own `deepspeed.zero.Init` is refused by `zerotrain.initialize` at once.
"""
from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, train_global_step

WORLD, MICRO = 2, 2
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 5},  # fc2.bias (3) stays whole
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "comm_timeout_seconds": 15,  # a collective on one rank fails in 15 s, not the 30 min default
    # ds_zero-offload_10B_config.json's block (DeepSpeedExamples Megatron-LM): no number_checkpoints
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True,
                                 "cpu_checkpointing": True},
}


def stage3_saves(save_path: str) -> dict:
    import warnings

    import zerotrain
    from zerotrain.zero import GatheredParameters

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=CONFIG)
    for batch in make_batches(2, WORLD * MICRO):
        train_global_step(engine, batch, MICRO)
    rank = engine.global_rank
    full = engine.full_state_dict()  # collective: rank 0 has the whole fp32 weights
    out: dict = {}

    # A rank-0-only state_dict() (the other rank goes straight on to the barrier).
    if rank == 0:
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alone = engine.module.state_dict()
        out["alone_seconds"] = time.perf_counter() - start
        out["alone"] = {k: (type(v), tuple(v.shape), v.clone()) for k, v in alone.items()}
        out["alone_warning"] = [str(w.message) for w in caught]
    zerotrain.dist.barrier()

    params = dict(engine.module.named_parameters())
    with GatheredParameters(list(params.values())):
        inside = {k: v.cpu() for k, v in params.items()}  # DeepSpeed-Chat's save, verbatim
        gathered_state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    outside = {k: v.cpu() for k, v in params.items()}  # gathered on access, all ranks
    if rank == 0:
        torch.save(inside, save_path)
    zerotrain.dist.barrier()
    out.update(full=full, inside_types={type(v) for v in inside.values()},
               outside_types={type(v) for v in outside.values()},
               inside_after_release={k: v.clone() for k, v in inside.items()},
               outside_values={k: v.detach().clone() for k, v in outside.items()},
               saved=torch.load(save_path), gathered_state=gathered_state,
               partitioned={k for k, p in params.items() if not p._zero.persistent})
    # Training goes on after all that (the one-rank state_dict left nothing half-done).
    out["loss_after"] = train_global_step(engine, make_batches(3, WORLD * MICRO)[2], MICRO)
    return out


def test_stage3_saves_of_real_programs(tmp_path):
    results = run_distributed(stage3_saves, WORLD, str(tmp_path / "pytorch_model.bin"), timeout=120)
    zero = results[0]
    full = zero["full"]
    assert zero["partitioned"] == {"fc1.weight", "fc1.bias", "fc2.weight"}
    # bug 3: no collective (it would have waited comm_timeout_seconds), DeepSpeed's placeholders, one warning
    assert zero["alone_seconds"] < 5
    for name, (kind, shape, value) in zero["alone"].items():
        assert kind is torch.Tensor
        if name in zero["partitioned"]:
            assert shape == (0,), name
        else:
            torch.testing.assert_close(value, full[name], rtol=0, atol=0)
    assert len(zero["alone_warning"]) == 1 and "GatheredParameters" in zero["alone_warning"][0]
    for rank, result in enumerate(results):
        # bug 1: plain tensors, saved and loaded; the values outlive the gather
        assert result["inside_types"] == {torch.Tensor} and result["outside_types"] == {torch.Tensor}, rank
        for name, want in full.items():
            torch.testing.assert_close(result["saved"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(result["inside_after_release"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(result["outside_values"][name], want, rtol=0, atol=0)
            torch.testing.assert_close(result["gathered_state"][name], want, rtol=0, atol=0)
        assert result["loss_after"] == results[0]["loss_after"]


def build_under_deepspeed_init() -> str:
    import deepspeed

    import zerotrain

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        model = OddMLP()
    assert model.fc1.weight.numel() == 0  # DeepSpeed's partitioned parameter
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        zerotrain.initialize(model=model, config=CONFIG)
    assert time.perf_counter() - start < 5
    return str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_model_partitioned_by_deepspeeds_zero_init_is_refused_at_once():
    message = run_distributed(build_under_deepspeed_init, 1, timeout=120)[0]
    assert "fc1.weight" in message and "deepspeed.zero.Init" in message
    assert "zerotrain.zero.Init" in message and "HfDeepSpeedConfig" in message
