"""The checkpoint's non-tensor state and its tensor-parallel pieces, in-process (`checkpoint/state.py`,
`checkpoint/split.py`): the JSON codec keeps every type and dtype it tags, the RNG streams continue exactly
after a capture and restore (numpy's cached Gaussian too), the trainer state records counters, scheduler,
loss scaler, config and tied names and is applied under this run's accumulation; a split tensor's pieces
join into the whole tensor, and a slice's records give the whole shape or a one-line error."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zerotrain.checkpoint import split
from zerotrain.checkpoint.format import FORMAT_NAME, CheckpointError
from zerotrain.checkpoint.state import (apply_trainer_state, capture_rng, capture_trainer_state, decode, encode,
                                        module_names, restore_rng)
from zerotrain.parallel.slices import split_slice


def _through_json(value):
    return decode(json.loads(json.dumps(encode(value))))


def test_codec_keeps_dtypes_shapes_and_plain_values():
    values = {"bf16": torch.tensor([[1.5, -2.25, 3.0]], dtype=torch.bfloat16),
              "f16": torch.tensor([0.5, 65504.0], dtype=torch.float16),
              "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3, 1),
              "scalar": torch.tensor(7.0), "u8": np.arange(4, dtype=np.uint8).reshape(2, 2)}
    back = _through_json(values)
    for key, value in values.items():
        got = back[key]
        assert type(got) is type(value) and got.dtype == value.dtype and tuple(got.shape) == tuple(value.shape), key
        assert (torch.equal(got, value) if torch.is_tensor(value) else np.array_equal(got, value)), key
    assert _through_json(np.float32(1.5)) == 1.5 and isinstance(_through_json(np.int64(3)), int)
    assert _through_json(bytearray(b"\x00\xff")) == b"\x00\xff"
    assert _through_json({"one": 1}) == {"one": 1} and _through_json({"a": 1, "b": (2,)}) == {"a": 1, "b": (2,)}
    assert _through_json({(1, 2): "t", 2: [None, True]}) == {(1, 2): "t", 2: [None, True]}
    with pytest.raises(CheckpointError, match=r"client_state\['x'\]\[1\]: a set cannot be stored"):
        encode({"x": (1, {2})}, "client_state")


def test_rng_streams_continue_exactly_after_restore():
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    random.gauss(0, 1)  # python's and numpy's Gaussians cache the second value of a pair
    np.random.standard_normal()
    saved = json.loads(json.dumps(capture_rng()))

    def draw():
        return (random.random(), random.gauss(0, 1), np.random.standard_normal(), np.random.randint(1 << 30),
                torch.rand(3).tolist())

    first = draw()
    draw()
    restore_rng(saved)
    assert draw() == first


class _Counters:
    def __init__(self, **values):
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state: dict) -> None:
        self.values = dict(state)


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.head = torch.nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.BatchNorm1d(3)  # persistent buffers: running_mean, running_var, num_batches_tracked
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _state(gas: int, scheduler, raw=None, adapters_only=False):
    from zerotrain.precision import LossScaler

    config = SimpleNamespace(gradient_accumulation_steps=gas, train_batch_size=8 * gas,
                             raw={"train_batch_size": 8 * gas} if raw is None else raw,
                             checkpoint=SimpleNamespace(adapters_only=adapters_only))
    return SimpleNamespace(
        config=config, scheduler=scheduler, module=_Tied(), stage=2, dtype=torch.bfloat16,
        counters=_Counters(global_steps=5, global_samples=40, skipped_steps=2, micro_steps=19),
        topology=SimpleNamespace(describe=lambda: {"world_size": 2, "dp_size": 2}),
        loss_scaler=LossScaler(scale=1024.0, dynamic=True, iteration=5, last_overflow_iteration=2,
                               hysteresis_left=1))


def _scheduler(lr: float = 1.0):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def test_trainer_state_records_and_restores_under_this_runs_accumulation():
    scheduler = _scheduler()
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
    saved = json.loads(json.dumps(capture_trainer_state(_state(4, scheduler), "step5", {"epoch": (1, 2)})))
    assert saved["format"] == FORMAT_NAME and saved["tag"] == "step5"
    assert (saved["global_steps"], saved["global_samples"], saved["skipped_steps"], saved["micro_steps"]) == \
        (5, 40, 2, 19)
    assert saved["topology"] == {"world_size": 2, "dp_size": 2, "stage": 2, "dtype": "bfloat16",
                                 "gradient_accumulation_steps": 4, "train_batch_size": 32}
    assert decode(saved["client_state"]) == {"epoch": (1, 2)} and saved["adapters_only"] is False
    assert decode(saved["config"]) == {"train_batch_size": 32}
    assert saved["buffer_names"] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert saved["shared_params"] == {"head.weight": "embed.weight"}
    assert decode(saved["lr_scheduler"])["last_epoch"] == 3

    # loaded under accumulation 3: micro_steps is this run's boundary, the scheduler and the scale come back
    target = _state(3, _scheduler())
    target.loss_scaler.scale = 1.0
    apply_trainer_state(target, saved, load_lr_scheduler_states=True)
    assert target.counters.values == {"global_steps": 5, "global_samples": 40, "skipped_steps": 2,
                                      "micro_steps": 15}
    assert target.loss_scaler.state_dict() == {"scale": 1024.0, "iteration": 5, "last_overflow_iteration": 2,
                                               "hysteresis_left": 1}
    assert target.scheduler.last_epoch == 3 and target.scheduler.get_last_lr() == scheduler.get_last_lr()

    # the scheduler left alone when asked, or when the checkpoint has none; an old state without skipped_steps
    for load, stored in ((False, saved["lr_scheduler"]), (True, None)):
        target = _state(3, _scheduler())
        old = dict(saved, lr_scheduler=stored)
        del old["skipped_steps"]
        apply_trainer_state(target, old, load_lr_scheduler_states=load)
        assert target.scheduler.last_epoch == 0 and target.counters.values["skipped_steps"] == 0
    none = capture_trainer_state(_state(1, None, raw={"fn": object()}, adapters_only=True), "t", {})
    assert none["lr_scheduler"] is None and none["adapters_only"] is True
    assert isinstance(none["config"], str) and none["config"].startswith("{'fn': <object")  # not JSON: its repr


def test_module_names_list_buffers_and_tied_aliases():
    names = module_names(_Tied())
    assert names == {"buffer_names": ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"],
                     "shared_params": {"head.weight": "embed.weight"}}
    assert module_names(torch.nn.Linear(2, 2)) == {"buffer_names": [], "shared_params": {}}


class _Split(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.col = torch.nn.Parameter(torch.zeros(4, 3))
        self.col.tp_slice = split_slice((4, 6), 1, 1, 2)
        self.alias = self.col  # a tied name of the same split parameter
        self.experts = torch.nn.Parameter(torch.zeros(2, 5))
        self.experts.ep_slice = split_slice((4, 5), 0, 0, 2)
        self.experts_alias = self.experts  # a tied name of the split expert weight
        self.all_experts = torch.nn.Parameter(torch.zeros(4, 5))  # every expert here: not split
        self.all_experts.ep_slice = split_slice((4, 5), 0, 0, 1)
        self.plain = torch.nn.Parameter(torch.zeros(3))


def test_tensor_slices_find_split_parameters_and_experts():
    module = _Split()
    slices = split.tensor_slices(module)
    assert set(slices) == {"col", "alias", "experts", "experts_alias"}
    assert slices["col"] == slices["alias"] == module.col.tp_slice and slices["experts"] == module.experts.ep_slice
    assert [name for name, _ in split.expert_params(module)] == ["experts", "experts_alias"]


def test_refusals_of_frozen_split_parameters_name_them():
    split.refuse_split_extras([])
    split.refuse_split_extras([], {"e"})
    with pytest.raises(CheckpointError, match=r"frozen expert-parallel parameters \['e'\]"):
        split.refuse_split_extras(["w", "e"], {"e"})
    with pytest.raises(CheckpointError, match=r"frozen tensor-parallel parameters \['w', 'v'\]"):
        split.refuse_split_extras(["w", "v"], {"e"})


def test_expected_shape_is_the_whole_tensor_of_a_matching_slice():
    tensor_slice = split_slice((6, 8), 1, 0, 4)
    assert split.expected_shape((6, 2), None, "w") == (6, 2)
    assert split.expected_shape([6, 2], tensor_slice, "w") == (6, 8)
    with pytest.raises(CheckpointError, match=r"parameter 'w': its tensor-parallel slice has shape \[6, 2\], "
                                              r"its shard records say \[6, 4\]"):
        split.expected_shape((6, 4), tensor_slice, "w")


@pytest.mark.parametrize("dim, parts, size", [(0, 1, 2), (1, 2, 3), (1, 1, 4)])
def test_assemble_whole_joins_each_ranks_pieces_into_the_whole_tensor(dim, parts, size):
    whole = torch.randn(6, 12, dtype=torch.float64)
    slices = {r: split_slice(tuple(whole.shape), dim, r, size, parts) for r in range(size)}
    pieces, chunks = [], []
    for rank in range(size):  # each rank's local tensor in pieces of unequal size, in order
        local = slices[rank].take(whole).reshape(-1)
        for lo, hi in ((0, 5), (5, 6), (6, local.numel())):
            pieces.append(SimpleNamespace(tp_rank=rank))
            chunks.append(local[lo:hi].contiguous().view(torch.uint8))
    got = split.assemble_whole(tuple(whole.shape), slices, pieces, chunks, torch.float64)
    assert got.dtype == torch.uint8 and torch.equal(got.view(torch.float64).reshape(whole.shape), whole)
