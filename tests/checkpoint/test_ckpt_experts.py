"""Checkpoints of experts split over expert-parallel groups, in the unified format.

A model with an ExpertParallelMoE trains at world 2 (each rank holds 2 of the 4 experts) and
saves; the files hold whole `(num_experts, ...)` tensors under the model's names (weights and
AdamW states), equal to a plain single-process run's. The checkpoint loads at world 4 (one
expert per rank, or ep_size 2: two per rank, each pair of experts on two ranks) and at world 1
(every expert local), and training goes on exactly like the uninterrupted single-process run.
World 4 with ep_size 2 also saves (each expert once) and loads at worlds 2 and 1. The global batch (16 samples, micro-batches of 4) is the same
at every world size, so the per-micro-batch aux loss sees the same micro-batches everywhere.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import MOE_D_IN as D_IN
from models_for_tests import assert_tensors_close, assert_tolerance_discriminates
from models_for_tests import MOE_D_OUT as D_OUT
from models_for_tests import MOE_EXPERTS as EXPERTS
from models_for_tests import make_moe_model as make_model

MICRO, GLOBAL, STEPS, SAVED_AT, LR, WEIGHT_DECAY, CLIP = 4, 16, 4, 2, 1e-2, 0.01, 0.3


def batches() -> list:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL, D_IN, generator=generator), torch.randn(GLOBAL, D_OUT, generator=generator))
            for _ in range(STEPS)]


def reference():
    """Losses of every step, and weights and AdamW states after SAVED_AT and after STEPS steps."""
    from zerotrain.comm import Comm

    model = make_model(Comm(None, 0, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    losses, at_save = [], None
    for step, (x, y) in enumerate(batches()):
        loss = sum(model(x[i:i + MICRO], y[i:i + MICRO]) for i in range(0, GLOBAL, MICRO)) / (GLOBAL // MICRO)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == SAVED_AT:
            at_save = {name: (p.detach().clone(), {k: v.clone() for k, v in optimizer.state[p].items()})
                       for name, p in model.named_parameters()}
    return losses, at_save, {name: p.detach().clone() for name, p in model.named_parameters()}


def train_segment(directory: str, stage: int, first: int, last: int, precision: str = "fp32", ep_size=None,
                  batches_from: int | None = None):
    """Train steps [first, last) at this world size, the experts split over groups of `ep_size` ranks
    (default: all), loading `directory` when first > 0, saving it when first == 0; returns (losses,
    whole weights on rank 0, whether expert buckets exist). `batches_from` shifts the batches read (a fresh
    run on the batches a resumed one would see)."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    comm = Comm.data_parallel(topology)
    world, rank = comm.size, comm.rank
    ep_comm = comm.subgroup(*topology.expert_parallel_group(ep_size or world))
    accumulation = GLOBAL // (MICRO * world)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": CLIP, "steps_per_print": 0, "bf16": {"enabled": precision == "bf16"},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    engine, *_ = zerotrain.initialize(model=make_model(ep_comm), config=config)
    if first > 0:
        path, _ = engine.load_checkpoint(directory)
        assert path is not None, "nothing loaded"
    losses = []
    shift = 0 if batches_from is None else batches_from - first
    for x, y in batches()[first + shift:last + shift]:
        total = torch.zeros(1)
        for index in range(accumulation):
            start = (index * world + rank) * MICRO
            inputs = (x[start:start + MICRO], y[start:start + MICRO])
            if precision == "bf16":
                inputs = tuple(t.bfloat16() for t in inputs)
            loss = engine(*inputs)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        losses.append(total.item() / (accumulation * world))
    if first == 0 and batches_from is None:
        engine.save_checkpoint(directory, tag="experts")
    split = any(bucket.group.expert for bucket in engine.buckets)
    return losses, engine.full_state_dict(), split


def read_files(directory: str, kind: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(directory, "experts", f"{kind}-*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("save_stage, load_stages, load_ep_size", [(1, (2, 0), 4), (2, (1, 1), 2)])
def test_split_experts_save_at_world_2_and_resume_at_worlds_4_and_1(tmp_path, save_stage, load_stages, load_ep_size):
    ref_losses, at_save, ref_final = reference()
    directory = str(tmp_path)
    saved = run_distributed(train_segment, 2, directory, save_stage, 0, SAVED_AT, timeout=120)
    assert all(split for _, _, split in saved), "experts are not split at world 2"
    losses = saved[0][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[:SAVED_AT])) <= 1e-5, (losses, ref_losses)

    model, optim = read_files(directory, "model"), read_files(directory, "optimizer")
    assert not glob.glob(os.path.join(directory, "experts", "master_weights-*")), "fp32: no separate masters"
    assert model["moe.w_in"].shape[0] == EXPERTS  # whole (num_experts, ...) tensors under the model's names
    assert_tensors_close(model, {name: weight for name, (weight, _) in at_save.items()}, "model file")
    states = {f"{name}/{key}": value for name, (_, state) in at_save.items()
              for key, value in state.items() if key != "step"}
    assert_tensors_close({key: value for key, value in optim.items() if key in states}, states, "optimizer file")

    for world, stage in zip((4, 1), load_stages):
        ep_size = load_ep_size if world == 4 else 1  # world 4: one expert per rank, or two per rank in pairs
        where = f"saved at world 2 stage {save_stage}, loaded at world {world} ep_size {ep_size} stage {stage}"
        results = run_distributed(train_segment, world, directory, stage, SAVED_AT, STEPS, "fp32", ep_size,
                                  timeout=120)
        assert all(split for _, _, split in results) == (world > 1), where
        losses, weights, _ = results[0]
        expected = ref_losses[SAVED_AT:]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) <= 1e-5, (where, losses, expected)
        assert_tensors_close(weights, ref_final, where)


@pytest.mark.parametrize("save_stage, load_stages", [(2, (1, 0)), (0, (2, 1))])
def test_experts_in_groups_of_2_at_world_4_save_once_and_resume_at_worlds_2_and_1(tmp_path, save_stage, load_stages):
    """World 4, ep_size 2: ranks {0, 2} and {1, 3} hold the same experts (partitioned over each pair at
    stages 1-2, replicated at stage 0); the files hold every expert once, whole, and load at world 2
    (ep_size 2: no replicas) and world 1 exactly."""
    ref_losses, at_save, ref_final = reference()
    directory = str(tmp_path)
    saved = run_distributed(train_segment, 4, directory, save_stage, 0, SAVED_AT, "fp32", 2, timeout=120)
    losses = saved[0][0]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses[:SAVED_AT])) <= 1e-5, (losses, ref_losses)
    model, optim = read_files(directory, "model"), read_files(directory, "optimizer")
    assert model["moe.w_in"].shape[0] == EXPERTS
    assert_tensors_close(model, {name: weight for name, (weight, _) in at_save.items()}, "model file")
    states = {f"{name}/{key}": value for name, (_, state) in at_save.items()
              for key, value in state.items() if key != "step"}
    assert_tensors_close({key: value for key, value in optim.items() if key in states}, states, "optimizer file")
    for world, stage in zip((2, 1), load_stages):
        where = f"saved at world 4 ep 2 stage {save_stage}, loaded at world {world} stage {stage}"
        results = run_distributed(train_segment, world, directory, stage, SAVED_AT, STEPS, "fp32", 2 if world > 1 else 1,
                                  timeout=120)
        losses, weights, _ = results[0]
        expected = ref_losses[SAVED_AT:]
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, expected)) <= 1e-5, (where, losses, expected)
        assert_tensors_close(weights, ref_final, where)


def test_bf16_split_experts_write_whole_fp32_masters_and_resume_at_world_1(tmp_path):
    directory = str(tmp_path)
    saved = run_distributed(train_segment, 2, directory, 1, 0, SAVED_AT, "bf16", timeout=120)
    masters, model = read_files(directory, "master_weights"), read_files(directory, "model")
    assert masters["moe.w_in"].dtype == torch.float32 and model["moe.w_in"].dtype == torch.bfloat16
    assert masters["moe.w_in"].shape[0] == EXPERTS == model["moe.w_out"].shape[0]
    assert_tensors_close(masters, saved[0][1], "master file vs full_state_dict at save")
    torch.testing.assert_close(model["moe.w_in"], masters["moe.w_in"].bfloat16(), rtol=0, atol=0)
    continued = run_distributed(train_segment, 2, directory, 1, SAVED_AT, STEPS, "bf16", timeout=120)
    single = run_distributed(train_segment, 1, directory, 1, SAVED_AT, STEPS, "bf16", timeout=120)
    # The do-nothing baseline: the same steps from the initial weights, i.e. a load that restored nothing.
    skipped = run_distributed(train_segment, 1, str(tmp_path / "unused"), 1, 0, STEPS - SAVED_AT, "bf16",
                              batches_from=SAVED_AT, timeout=120)
    assert_tolerance_discriminates("bf16 resume at world 2 vs world 1", (single[0][0], None),
                                   (continued[0][0], None), (skipped[0][0], None), loss_tol=1e-3)


def frozen_experts_segment(directory: str, save: bool) -> bool:
    """World 1 saves with moe.w_in frozen (whole there); a larger world loads its experts of it."""
    import zerotrain
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    comm = Comm.data_parallel(Topology.build(timeout_seconds=60))
    model = make_model(comm)
    model.moe.w_in.requires_grad_(False)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": 1}}
    engine, *_ = zerotrain.initialize(model=model, config=config)
    if save:
        with torch.no_grad():
            engine.module.moe.w_in.mul_(-2.0)  # a value the fresh model at the other world does not have
        engine.save_checkpoint(directory, tag="experts")
        return True
    engine.load_checkpoint(directory)
    whole = read_files(directory, "model")["moe.w_in"]
    return torch.equal(engine.module.moe.w_in.detach(), engine.module.moe.w_in.ep_slice.take(whole))


def test_frozen_experts_saved_whole_load_as_each_ranks_experts(tmp_path):
    run_distributed(frozen_experts_segment, 1, str(tmp_path), True)
    assert run_distributed(frozen_experts_segment, 2, str(tmp_path), False) == [True, True]


def test_plan_refuses_experts_missing_from_a_data_parallel_rank():
    from zerotrain.checkpoint.format import CheckpointError
    from zerotrain.checkpoint.plan import build_plan
    from zerotrain.parallel.slices import split_slice

    def layout(dp_rank: int, holds_expert: bool) -> dict:
        expert_slice = split_slice((2, 3), 0, dp_rank, 2)
        slots = [{"trainable": True, "replicated": True, "numel": 3, "model_dtype": "float32",
                  "records": [("w", (1, 3), 0, 3, 0)], "states": {}, "scalars": {}}] if holds_expert else []
        return {"slots": slots, "extras": [], "order": ["w"], "tp_rank": 0, "dp_rank": dp_rank,
                "experts": ["w"], "slices": {"w": expert_slice} if holds_expert else {}}

    plan = build_plan([layout(0, True), layout(1, True)])
    assert plan.tensors["w"].shape == (2, 3) and [p.tp_rank for p in plan.tensors["w"].pieces] == [0, 1]
    with pytest.raises(CheckpointError, match=r"'w' is split over expert-parallel ranks \(experts\) \[0\] but not"):
        build_plan([layout(0, True), layout(1, False)])


@pytest.mark.parametrize("partitioned", [True, False])
def test_plan_takes_each_expert_once_from_its_expert_data_parallel_replicas(partitioned):
    """World 4, ep_size 2: ranks r and r+2 hold the same expert slice (position r % 2), split in two over
    the pair at stages 1-2 or whole on both at stage 0; the plan covers each slice exactly once."""
    from zerotrain.checkpoint.plan import build_plan
    from zerotrain.parallel.slices import split_slice

    def layout(dp_rank: int) -> dict:
        ep_rank, replica = dp_rank % 2, dp_rank // 2
        start, numel = ((0, 2) if replica == 0 else (2, 1)) if partitioned else (0, 3)
        slot = {"trainable": True, "replicated": not partitioned, "numel": numel, "model_dtype": "float32",
                "records": [("w", (1, 3), start, numel, 0)], "states": {}, "scalars": {}}
        return {"slots": [slot], "extras": [], "order": ["w"], "tp_rank": 0, "dp_rank": dp_rank, "ep_rank": ep_rank,
                "experts": ["w"], "slices": {"w": split_slice((2, 3), 0, ep_rank, 2)}}

    tensor = build_plan([layout(rank) for rank in range(4)]).tensors["w"]
    assert tensor.shape == (2, 3) and sorted(tensor.slices) == [0, 1]
    pieces = [(piece.tp_rank, piece.param_start, piece.numel) for piece in tensor.pieces]
    if partitioned:
        assert pieces == [(0, 0, 2), (0, 2, 1), (1, 0, 2), (1, 2, 1)]
        assert [piece.rank for piece in tensor.pieces] == [0, 2, 1, 3]
    else:
        assert pieces == [(0, 0, 3), (1, 0, 3)]
