"""`zerotrain.initialize` in the pytest process (issue #48, round 7): the world checked against the sequence- and
tensor-parallel sizes and the data-parallel size the batch triple counts (world / (tp x sp): refused before any
process group, so a world larger than this process is only named), `args.local_rank` set only where `args` has one
(as DeepSpeed's engine does), the trainable-parameter check for an optimizer from the config, the
die-with-parent switch under torchrun, and DeepSpeed's keywords that do nothing here (a warning for each given a
value that would change something)."""
from __future__ import annotations

import json
import threading
import types

import pytest
import torch

from models_for_tests import OddMLP

import zerotrain
from zerotrain.config import ConfigError

ADAMW = {"type": "AdamW", "params": {"lr": 1e-2}}


def test_the_world_must_hold_sequence_times_tensor_parallel_ranks_and_the_batch_counts_the_rest(monkeypatch):
    with pytest.raises(ConfigError) as refused:  # a world of one cannot hold 2 sequence-parallel ranks
        zerotrain.initialize(model=OddMLP(), config={"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2})
    assert (str(refused.value), refused.value.key) == (
        "sequence_parallel_size: 2 x tensor_parallel.autotp_size: 1 does not divide the world size 1",
        "sequence_parallel_size")
    # a launcher's world of 4 (refused before its process group is started): 2 x 2 model-parallel ranks leave one
    # data-parallel rank, which the batch triple counts
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = {"train_batch_size": 3, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(ConfigError, match=r"with dp_world_size=1\b"):
        zerotrain.initialize(model=OddMLP(), config=config)
    # at a world of 2 with tensor_parallel 2, a model that cannot be split is refused before the process group
    # (which would wait for the absent peer: the short comm timeout ends a run that got that far)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="fc1 has 7 output features, which do not split into 1 part"):
        zerotrain.initialize(model=OddMLP(), config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
                                                     "comm_timeout_seconds": 10, "tensor_parallel": {"autotp_size": 2}})


def test_args_local_rank_is_set_only_where_args_has_one(tmp_path, world_of_one):
    """DeepSpeed's engine sets `args.local_rank` when `args` has the attribute (a script's parser declared
    `--local_rank`) and leaves an args without it as it is."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW}))
    declared = types.SimpleNamespace(deepspeed_config=str(path), local_rank=-1)
    plain = types.SimpleNamespace(deepspeed_config=str(path))
    for args in (declared, plain):
        zerotrain.initialize(model=OddMLP(), args=args)
        torch.distributed.destroy_process_group()
    assert declared.local_rank == 0 and not hasattr(plain, "local_rank")


def test_an_optimizer_from_the_config_refuses_parameters_that_are_not_the_models(world_of_one):
    """The config's optimizer over `model_parameters` that hold none of the model's trainable parameters would train
    nothing: refused naming the key (the check does not depend on an optimizer object being passed)."""
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"model_parameters holds 1 tensors, none of them the model's 4 parameters "
                                          r"that require grad \(fc1.weight, fc1.bias, fc2.weight, \.\.\.\)") as refused:
        zerotrain.initialize(model=OddMLP(), model_parameters=[stray],
                             config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW})
    assert refused.value.key == "model_parameters"


def test_a_rank_under_torchrun_told_not_to_die_with_its_parent_starts_no_watch(monkeypatch, world_of_one):
    """`ZEROTRAIN_DIE_WITH_PARENT=0` under torchrun (its run id in the environment): no parent-death hook (the
    kernel's PR_SET_PDEATHSIG stays as it was) and no watcher thread in this process."""
    import ctypes

    def parent_death_signal() -> int:
        value = ctypes.c_int(-1)
        assert ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
        return value.value

    before = parent_death_signal()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "units")
    monkeypatch.setenv("ZEROTRAIN_DIE_WITH_PARENT", "0")
    zerotrain.initialize(model=OddMLP(), config={"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW})
    assert parent_death_signal() == before
    assert "zerotrain-parent-watch" not in [thread.name for thread in threading.enumerate()]


def test_deepspeeds_keywords_without_effect_warn_once_each_and_only_when_they_would_change_something(world_of_one):
    """`distributed_port`, `mpu`, `mesh_param`, `dist_init_required` are DeepSpeed's `initialize` keywords that do
    nothing here: accepted, with a warning naming the one given a value that would change DeepSpeed's behaviour
    (not for None, nor for dist_init_required=True, which is what zerotrain does anyway)."""
    import warnings

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": ADAMW}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zerotrain.initialize(model=OddMLP(), config=config, distributed_port=1234, mpu=None, mesh_param=None,
                             dist_init_required=True)
        torch.distributed.destroy_process_group()
        zerotrain.initialize(model=OddMLP(), config=config, dist_init_required=False, mesh_param=(1, 1))
    assert [str(w.message) for w in caught if "has no effect" in str(w.message)] == [
        "zerotrain.initialize(distributed_port=...) has no effect: the rendezvous port comes from the launcher "
        "(MASTER_PORT)",
        "zerotrain.initialize(dist_init_required=...) has no effect: zerotrain starts torch.distributed when it is "
        "not running yet",
        "zerotrain.initialize(mesh_param=...) has no effect: the data/sequence/tensor grid comes from the config "
        "(sequence_parallel_size, tensor_parallel)"]
