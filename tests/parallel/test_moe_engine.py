"""The ZeRO engine (stages 0-2) trains experts split over expert-parallel groups like one process.

Each rank holds EXPERTS/ep_size experts of an ExpertParallelMoE built over its expert-parallel
group (ep_size consecutive ranks; all of them when ep_size == world). The engine must sum expert
gradients only over the ranks holding the same experts (none when ep_size == world), count each
expert element once in the clipping norm, and join the experts into whole `(num_experts, ...)`
tensors in full_state_dict. The reference is the same
model with every expert local (a world-1 Comm), trained on the whole global batch with the loss
= the mean of every (micro-step, rank) micro-batch's loss (the aux loss is per micro-batch).
"""
from __future__ import annotations

import os
import types

import pytest
import torch

from distributed import run_distributed
from models_for_tests import MOE_D_IN as D_IN
from models_for_tests import MOE_D_OUT as D_OUT
from models_for_tests import make_moe_model as make_model
from models_for_tests import micro_slice, train_global_step

STEPS, MICRO, ACCUMULATION, LR, WEIGHT_DECAY, CLIP = 3, 4, 2, 1e-2, 0.01, 0.3
# With every other parameter frozen the experts are the whole clipping norm: an expert replica counted on each
# of its 2 ranks makes it sqrt(2) times too large, not a 1e-5 nudge hidden under the dense layers' gradients
EXPERTS = frozenset({"moe.w_in", "moe.b_in", "moe.w_out", "moe.b_out"})


def global_batches(world: int):
    generator = torch.Generator().manual_seed(3)
    size = MICRO * ACCUMULATION * world
    return [(torch.randn(size, D_IN, generator=generator), torch.randn(size, D_OUT, generator=generator))
            for _ in range(STEPS)]


def engine_config(stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": CLIP, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, **zero}}


def expert_parallel_comm(ep_size=None):
    """(data-parallel Comm, the Comm of this rank's expert-parallel group of ep_size consecutive ranks)."""
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    comm = Comm.data_parallel(topology)
    return comm, comm.subgroup(*topology.expert_parallel_group(ep_size or comm.size))


def train_stages(stages: list[int], ep_size=None, experts_only: bool = False) -> list:
    """For each stage (and with `experts_only` also stage 0 with only the experts trainable, as stage
    "0 experts only"): (stage, losses, pre-clip norms, full weights)."""
    import zerotrain

    comm, ep_comm = expert_parallel_comm(ep_size)
    world = comm.size
    results = []
    for label in stages + (["0 experts only"] if experts_only else []):
        stage = 0 if label == "0 experts only" else label
        model = make_model(ep_comm)
        if label == "0 experts only":
            for name, param in model.named_parameters():
                param.requires_grad_(name in EXPERTS)
        # the model's generate (a recorder): between training steps it must keep the ranks in step (split experts
        # hold collectives in every forward), i.e. get transformers' synced_gpus=True, at every stage
        model.generate = lambda *args, **kwargs: kwargs
        engine, *_ = zerotrain.initialize(model=model, config=engine_config(stage))
        synced = engine.module.generate(max_new_tokens=1).get("synced_gpus")
        expert_buckets = [bucket for bucket in engine.buckets if bucket.group.expert]
        assert expert_buckets, "experts not in buckets of their own"
        replicas = world // ep_comm.size  # ranks holding the same experts: expert states partitioned over them
        assert all(b.partitions == (replicas if stage else 1) for b in expert_buckets), (stage, replicas)
        losses, norms = [], []
        for batch in global_batches(world):
            losses.append(train_global_step(engine, batch, MICRO))
            norms.append(engine.get_global_grad_norm())
        before = engine.memory_report()["comm"].get("gather", {}).get("calls", 0)
        weights = engine.full_state_dict()
        gathers = engine.memory_report()["comm"].get("gather", {}).get("calls", 0) - before
        results.append((label, losses, norms, weights, gathers, synced))
    return results


def reference(world: int, experts_only: bool = False):
    from zerotrain.comm import Comm

    model = make_model(Comm(None, 0, 1))
    if experts_only:
        for name, param in model.named_parameters():
            param.requires_grad_(name in EXPERTS)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR,
                                  weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for batch in global_batches(world):
        loss = sum(model(*micro_slice(batch, index, rank, world, MICRO))
                   for index in range(ACCUMULATION) for rank in range(world)) / (ACCUMULATION * world)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 4), (4, 2)])
def test_engine_trains_split_experts_like_one_process(world, ep_size):
    # expert replicas (ep_size < world) at stage 0, where they are not partitioned: also with only experts training
    experts_only = ep_size < world
    results = run_distributed(train_stages, world, [0, 1, 2], ep_size, experts_only, timeout=120)
    assert all(weights == {} for rank in results[1:] for _, _, _, weights, _, _ in rank)  # full weights on rank 0 only
    assert all(synced is True for rank in results for *_, synced in rank), results  # generate kept in step
    # stage 0 partitions nothing (experts neither): a rank outside the first expert-parallel group holds replicas of
    # experts that group has whole, so full_state_dict gathers nothing from it (its group joins the experts)
    for rank in results[ep_size:]:
        assert all(gathers == 0 for stage, _, _, _, gathers, _ in rank if stage in (0, "0 experts only")), rank
    for stage, losses, norms, weights, _, _ in results[0]:
        where = f"world {world}, ep_size {ep_size}, stage {stage}"
        ref_losses, ref_norms, ref_weights = reference(world, experts_only=stage == "0 experts only")
        # (the experts' own norm stays under CLIP: there the norm itself is what is checked)
        assert stage == "0 experts only" or any(norm > CLIP for norm in ref_norms), f"clipping never fires: {ref_norms}"
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5, (where, losses, ref_losses)
        assert norms == pytest.approx(ref_norms, rel=1e-5), (where, norms, ref_norms)
        assert sorted(weights) == sorted(ref_weights), where
        for name, expected in ref_weights.items():
            assert weights[name].shape == expected.shape, (where, name)  # whole (num_experts, ...) tensors
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{where}, {name}: {m}")


def overflow_in_one_ranks_experts(stage: int, ep_size=None) -> tuple[int, int]:
    import zerotrain

    comm, ep_comm = expert_parallel_comm(ep_size)
    config = dict(engine_config(stage), fp16={"enabled": True, "initial_scale_power": 4})
    engine, *_ = zerotrain.initialize(model=make_model(ep_comm), config=config)
    before = engine.full_state_dict()
    batch = global_batches(comm.size)[0]
    for index in range(ACCUMULATION):
        x, y = micro_slice(batch, index, comm.rank, comm.size, MICRO)
        engine.backward(engine(x.half(), y.half()))
        if index == ACCUMULATION - 1 and comm.rank == 1:  # only rank 1's experts overflow
            expert_bucket = next(i for i, bucket in enumerate(engine.buckets) if bucket.group.expert)
            engine.reducer.grad_shards[expert_bucket][0] = float("inf")
        engine.step()
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    return engine.skipped_steps, int(unchanged) if comm.rank == 0 else -1


@pytest.mark.parametrize("stage, world, ep_size", [(0, 2, 2), (2, 2, 2), (1, 4, 2)])
def test_overflow_in_one_ranks_experts_skips_the_step_everywhere(stage, world, ep_size):
    skipped, unchanged = zip(*run_distributed(overflow_in_one_ranks_experts, world, stage, ep_size))
    assert skipped == (1,) * world and unchanged[0] == 1, (skipped, unchanged)


def checkpoint_of_frozen_experts(directory: str) -> str:
    import zerotrain
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    comm = Comm.data_parallel(Topology.build(timeout_seconds=60))
    model = make_model(comm)
    model.moe.w_in.requires_grad_(False)  # outside every slot at stages 0-2: only this rank's experts at hand
    engine, *_ = zerotrain.initialize(model=model, config=engine_config(1))
    try:
        engine.save_checkpoint(directory, tag="t1")
    except CheckpointError as error:
        return str(error)
    return "accepted"


def test_checkpoints_of_frozen_split_experts_are_refused_before_writing(tmp_path):
    """Trainable split experts are saved whole (tests/checkpoint/test_ckpt_experts.py); frozen ones are not."""
    for message in run_distributed(checkpoint_of_frozen_experts, 2, str(tmp_path)):
        assert "frozen expert-parallel parameters" in message and "moe.w_in" in message, message
    assert os.listdir(tmp_path) == []


def split_expert_model(ep_size: int) -> torch.nn.Module:
    """A module with one expert weight of which this rank holds 1/ep_size (no process group needed)."""
    from zerotrain.parallel.slices import split_slice

    model = torch.nn.Module()
    model.w_in = torch.nn.Parameter(torch.zeros(4 // ep_size, 3))
    model.w_in.ep_slice = split_slice((4, 3), 0, 0, ep_size)
    return model


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 3}])
def test_split_experts_with_tensor_parallelism_pass_the_up_front_check(zero):
    """TP+EP trains (tests/parallel/test_tensor_expert_parallel.py); only a bad ep_size is refused up front."""
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.parallel.experts import check_expert_parallel

    config = ZeroTrainConfig(train_micro_batch_size_per_gpu=1, zero_optimization=zero)
    topology = types.SimpleNamespace(dp_size=2, tp_size=2)
    assert check_expert_parallel(split_expert_model(2), config, topology) is True
    assert check_expert_parallel(split_expert_model(1), config, topology) is False  # whole experts: plain DP
    with pytest.raises(ValueError, match=r"\['w_in'\].*ep_size=4 ranks, which does not divide the 2 data-parallel"):
        check_expert_parallel(split_expert_model(4), config, topology)


def test_bad_ep_sizes_are_refused_naming_them():
    from zerotrain.comm import Comm
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.parallel.experts import check_expert_parallel
    from zerotrain.parallel.moe import ExpertParallelMoE
    from zerotrain.topology import Topology

    topology = Topology(rank=0, world_size=6, dp_group=None, dp_rank=0, dp_size=6, device=torch.device("cpu"))
    for ep_size in (4, 0):
        with pytest.raises(ValueError, match=f"ep_size={ep_size} does not divide the 6 data-parallel ranks"):
            topology.expert_parallel_group(ep_size)
        with pytest.raises(ValueError, match=f"ep_size={ep_size} does not divide"):
            topology.expert_data_parallel_group(ep_size)
    with pytest.raises(ValueError, match="4 experts do not split over ep_size=3"):
        ExpertParallelMoE(8, 16, 4, Comm(None, 0, 3))  # no collective before the check
    config = ZeroTrainConfig(train_micro_batch_size_per_gpu=1, zero_optimization={"stage": 1})
    with pytest.raises(ValueError, match=r"\['w_in'\].*ep_size=4 ranks, which does not divide the 6 data-parallel"):
        check_expert_parallel(split_expert_model(4), config, types.SimpleNamespace(dp_size=6, tp_size=1))
    assert check_expert_parallel(split_expert_model(2), config, types.SimpleNamespace(dp_size=6, tp_size=1))


def experts_in_the_wrong_position() -> str:
    import zerotrain
    from zerotrain.comm import Comm

    rank = int(os.environ["RANK"])  # the process group starts inside initialize
    swapped = Comm(None, 1 - rank, 2)  # rank 0 builds rank 1's experts and the other way round
    try:
        zerotrain.initialize(model=make_model(swapped), config=engine_config(1))
    except ValueError as error:
        return str(error)
    return "accepted"


def test_experts_not_in_their_expert_parallel_position_are_refused():
    for rank, message in enumerate(run_distributed(experts_in_the_wrong_position, 2)):
        assert f"on data-parallel rank {rank} holds experts" in message and "moe.w_in" in message, message
        assert "topology.expert_parallel_group(2)" in message, message


def test_expert_groups_of_each_rank_and_a_misplaced_or_uneven_expert_in_process():
    """build_expert_groups at ep_size == dp_size (no group to create: the expert-parallel group is the data-parallel
    one, each expert-data-parallel group a single rank): each rank's groups, a layer built for another position
    refused by name on the rank that holds it, experts split two ways refused, no split experts: no groups; an
    ep_size that does not divide the data-parallel ranks names the first four split experts."""
    from zerotrain.comm import Comm
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.parallel.experts import build_expert_groups, check_expert_parallel, expert_parallel_size
    from zerotrain.parallel.slices import split_slice
    from zerotrain.topology import Topology

    def experts_at(position: int, ways: int = 2, name: str = "w_in") -> torch.nn.Module:
        model = torch.nn.Module()
        setattr(model, name, torch.nn.Parameter(torch.zeros(4 // ways, 3)))
        getattr(model, name).ep_slice = split_slice((4, 3), 0, position, ways)
        return model

    for rank in range(2):
        topology = Topology(rank=rank, world_size=2, dp_group=None, dp_rank=rank, dp_size=2,
                            device=torch.device("cpu"))
        comm = Comm(None, rank, 2)
        groups = build_expert_groups(experts_at(rank), topology, comm)
        assert groups.ep_size == 2 and groups.ep is comm, "every data-parallel rank is in the one expert group"
        assert (groups.data.rank, groups.data.size) == (0, 1) and groups.data.counters is comm.counters
        with pytest.raises(ValueError, match=rf"'w_in' on data-parallel rank {rank} holds experts "
                                             rf"\(\({2 * (1 - rank)}, 2\),\), but .* position {rank}: build the "
                                             r"layer over topology.expert_parallel_group\(2\)"):
            build_expert_groups(experts_at(1 - rank), topology, comm)
        assert build_expert_groups(torch.nn.Module(), topology, comm) is None
    uneven = experts_at(0)
    uneven.w_out = experts_at(0, ways=4, name="w_out").w_out
    with pytest.raises(ValueError, match=r"split over different numbers of ranks: \{'w_in': 2, 'w_out': 4\}"):
        expert_parallel_size(uneven)
    assert expert_parallel_size(experts_at(1)) == 2 and expert_parallel_size(torch.nn.Linear(2, 2)) == 1
    many = torch.nn.Module()  # five split experts at a bad ep_size: the error names the first four
    for index in range(5):
        setattr(many, f"e{index}", experts_at(0, ways=4, name=f"e{index}").get_parameter(f"e{index}"))
    with pytest.raises(ValueError, match=r"parameters \['e0', 'e1', 'e2', 'e3'\] \(experts split over ranks\) are "
                                         r"split over ep_size=4 ranks, which does not divide the 6"):
        check_expert_parallel(many, ZeroTrainConfig(train_micro_batch_size_per_gpu=1),
                              types.SimpleNamespace(dp_size=6, tp_size=1))
