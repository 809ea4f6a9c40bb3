"""ZeRO++ with experts split over expert-parallel groups: qgZ (stages 1-3, with and without LoCo), qwZ, hpZ.

Through the engine, world 4 as 2 pretend nodes of 2 ranks (ZEROTRAIN_RANKS_PER_NODE=2), ep_size 2: the
dense buckets take qgZ's two hops over all 4 ranks, the expert buckets one quantized hop over their
expert-data-parallel pair ({0, 2} or {1, 3}); no gradient is reduced exactly. World 2 with ep_size 2:
each expert bucket is this rank's alone, so it is not reduced (no quantized reducer, no LoCo buffer)
while the dense buckets are quantized. Losses stay within 0.5% of the exact single-process run, weights within
6.5% (relative L2; the expert tensors alone within 6%), and the untrained run / the run with frozen experts
fall outside by 2x (TOLERANCES, assert_tolerance_discriminates).

Stage 3 qwZ gathers split experts as int8 over their expert-data-parallel pair (dense parameters over
all ranks; losses within 0.2%, weights 2%); hpZ keeps secondary shards of dense parameters only (the
hpZ pair {0, 1} holds different experts), so hpZ alone stays exact (1e-5).

The reducer test pins what the expert reduction computes: gradients that int4 represents exactly
(values in {-7, 0, 7} divided by the data-parallel size) reduce to exactly the sum over the ranks that
hold the same experts, and the dense bucket's to the sum over all ranks.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import pytest
import torch

from distributed import run_distributed
from models_for_tests import assert_tolerance_discriminates, train_global_step
from moe_common import EXPERT_PARAMETERS, MICRO, assert_matches, batches, build_engine, do_nothing, reference

QGZ = {"zero_quantized_gradients": True}
QWZ = {"zero_quantized_weights": True, "stage3_param_persistence_threshold": 0}
HPZ = {"zero_hpz_partition_size": 2, "stage3_param_persistence_threshold": 0}
STAGE3_MODES = [("qwZ", QWZ), ("hpZ", HPZ), ("qwZ+hpZ", {**QWZ, **HPZ})]
LOCO = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
# Lossy tolerances (losses: max relative; weights: relative L2, all tensors / the expert tensors alone), each
# checked to reject its do-nothing baseline by 2x: no update at all / the experts frozen (measured: 1.15e-2 /
# 1.31e-1 / 1.35e-1). Adam turns int4 gradient noise into lr-sized steps: qgZ's weights sit 4-5e-2 from the
# reference after these 4 steps, so its weight bounds are the loose ones (the losses discriminate 9x).
TOLERANCES = {"qgZ": (5e-3, 6.5e-2, 6e-2), "qwZ": (2e-3, 2e-2, 2e-2)}


def assert_lossy_close(where: str, losses, weights, ref_losses, ref_weights, baselines) -> None:
    """Losses and weights against the untrained run; the expert tensors against the run with frozen experts."""
    untrained, frozen_experts = baselines
    loss_tol, weight_tol, expert_tol = TOLERANCES["qgZ" if "qgZ" in where else "qwZ"]
    assert_tolerance_discriminates(where, (ref_losses, ref_weights), (losses, weights), untrained,
                                   loss_tol=loss_tol, weight_tol=weight_tol)
    experts = lambda w: {name: w[name] for name in EXPERT_PARAMETERS}  # noqa: E731
    assert_tolerance_discriminates(f"{where}, experts", (None, experts(ref_weights)), (None, experts(weights)),
                                   (None, experts(frozen_experts[1])), loss_tol=None, weight_tol=expert_tol)


MODES = [("stage 2 qgZ+LoCo", 2, LOCO), ("stage 1 qgZ", 1, QGZ),
         ("stage 3 qgZ", 3, {**QGZ, "stage3_param_persistence_threshold": 0})]


def train_quantized(ep_size: int) -> list:
    """Each mode from scratch: (mode, losses, full weights, comm byte counters of training, expert reducer
    group sizes, LoCo bytes, whether the LoCo state loads back)."""
    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "2"
    results = []
    for what, stage, zero in MODES:
        engine = build_engine(stage, ep_size, **zero)
        reducer = engine.reducer
        expert_groups = [None if reducer.reduce.per_bucket[i] is None else reducer.reduce.per_bucket[i].comm.size
                         for i, bucket in enumerate(engine.buckets) if bucket.group.expert]
        before = engine.memory_report()["comm"]
        losses = [train_global_step(engine, batch, MICRO) for batch in batches()]
        after = engine.memory_report()["comm"]
        comm = {kind: entry["calls"] - before.get(kind, {}).get("calls", 0) for kind, entry in after.items()}
        state, loco_bytes = reducer.loco_state(), reducer.loco_bytes()
        reloaded = reducer.load_loco_state(state)
        if reloaded:  # LoCo buffers saved with other expert groups (another ep_size) restart from zero
            layout = state["layout"]
            other = [dict(layout, expert_partitions=[p + 1 for p in layout["expert_partitions"]]),
                     {k: v for k, v in layout.items() if k != "expert_partitions"}]  # older files had no experts
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                reloaded = not any(reducer.load_loco_state(dict(state, layout=o)) for o in other) and \
                    sum("another layout" in str(w.message) for w in caught) == 2
        results.append((what, losses, engine.full_state_dict(), comm, expert_groups, loco_bytes, reloaded))
        engine.close()
    return results


@pytest.mark.parametrize("world, ep_size", [(4, 2), (2, 2)])
def test_qgz_quantizes_expert_gradients_over_their_expert_data_parallel_group(world, ep_size):
    ref_losses, _, _, ref_weights = reference()
    baselines = do_nothing(), do_nothing(EXPERT_PARAMETERS)
    results = run_distributed(train_quantized, world, ep_size, timeout=120)
    for what, losses, weights, comm, expert_groups, loco_bytes, reloaded in results[0]:
        where = f"world {world}, ep_size {ep_size}, {what}"
        assert all(weights[name].shape == ref.shape for name, ref in ref_weights.items()), where
        assert_lossy_close(where, losses, weights, ref_losses, ref_weights, baselines)
        kinds = {kind for kind, calls in comm.items() if kind.startswith("reduce_scatter") and calls}
        replicas = world // ep_size  # ranks holding the same experts
        if replicas > 1:  # dense buckets in two hops, expert buckets in one over their pair; nothing exact
            assert expert_groups and all(size == replicas for size in expert_groups), (where, expert_groups)
            assert kinds == {"reduce_scatter_q4_intra", "reduce_scatter_q4_inter", "reduce_scatter_q4"}, (where, comm)
        else:  # experts not reduced at all; the dense buckets in one hop (one pretend node)
            assert expert_groups and all(size is None for size in expert_groups), (where, expert_groups)
            assert kinds == {"reduce_scatter_q4"}, (where, comm)
        assert (loco_bytes > 0) == ("LoCo" in what) and reloaded == ("LoCo" in what), (where, loco_bytes, reloaded)


def train_stage3_zeropp(ep_size: int) -> list:
    """Each stage-3 qwZ/hpZ mode from scratch: (mode, losses, full weights, comm calls of training, fetcher
    stats, the group sizes of the experts' qwZ gathers)."""
    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "2"
    results = []
    for what, zero in STAGE3_MODES:
        engine = build_engine(3, ep_size, **zero)
        fetcher = engine.stage3.fetcher
        before = engine.memory_report()["comm"]
        losses = [train_global_step(engine, batch, MICRO) for batch in batches()]
        after = engine.memory_report()["comm"]
        comm = {kind: entry["calls"] - before.get(kind, {}).get("calls", 0) for kind, entry in after.items()}
        expert_gathers = sorted(quantizer.comm.size for quantizer in fetcher._expert_quantizers.values())
        results.append((what, losses, engine.full_state_dict(), comm, engine.work_stats()["gather"], expert_gathers))
        engine.close()
    return results


@pytest.mark.parametrize("world, ep_size", [(4, 2), (2, 2)])
def test_stage3_qwz_and_hpz_with_split_experts(world, ep_size):
    ref_losses, _, _, ref_weights = reference()
    baselines = do_nothing(), do_nothing(EXPERT_PARAMETERS)
    for what, losses, weights, comm, stats, expert_gathers in run_distributed(train_stage3_zeropp, world, ep_size,
                                                                             timeout=120)[0]:
        where = f"world {world}, ep_size {ep_size}, stage 3 {what}"
        if "qwZ" in what:  # int8 weights: lossy
            assert_lossy_close(where, losses, weights, ref_losses, ref_weights, baselines)
            assert comm.get("all_gather_q8", 0) > 0 and stats["quantized_gathers"] > 0, (where, comm)
            assert expert_gathers == ([2] if world == 4 else []), (where, expert_gathers)  # a pair, or none
        else:  # hpZ moves exact values
            assert_matches(where, losses, weights, ref_losses, ref_weights)
        if "hpZ" in what and world == 4:
            assert comm.get("all_gather_hpz", 0) > 0 and stats["hpz_gathers"] > 0, (where, comm, stats)


def exact_int4_gradients(rank: int, shape) -> torch.Tensor:
    """Rank `rank`'s gradient: values in {-7, 0, 7}, so every int4 block holds +-7 or nothing (exact scales)."""
    generator = torch.Generator().manual_seed(100 + rank)
    return 7.0 * torch.randint(-1, 2, shape, generator=generator).float()


def reduce_known_gradients(ep_size: int) -> list[tuple[int, str, Optional[int], float]]:
    """At stages 1 and 2, one backward of (dense·G_dense + expert·G_expert).sum() through a qgZ reducer (stage 1's full buffer, stage 2's partitioned one)
    (one hop, LoCo); returns (stage, bucket kind, the size of its quantized reducer's group, max error against the
    exact sums)."""
    from zerotrain.comm import Comm
    from zerotrain.topology import Topology

    topology = Topology.build(timeout_seconds=60)
    comm = Comm.data_parallel(topology)
    _, ep_rank, _ = topology.expert_parallel_group(ep_size)
    return [result for stage in (1, 2) for result in _reduce_at_stage(stage, topology, comm, ep_rank, ep_size)]


def _reduce_at_stage(stage: int, topology, comm, ep_rank: int,
                     ep_size: int) -> list[tuple[int, str, Optional[int], float]]:
    from zerotrain.parallel.experts import build_expert_groups
    from zerotrain.parallel.slices import split_slice
    from zerotrain.zero.flat import build_sharded_buckets
    from zerotrain.zero.grads import FullBufferReducer, PartitionedReducer
    from zerotrain.zero.reduce import GradQuantization, QuantizedReduce

    model = torch.nn.Module()
    model.dense = torch.nn.Parameter(torch.zeros(37))
    model.expert = torch.nn.Parameter(torch.zeros(4 // ep_size, 30))
    model.expert.ep_slice = split_slice((4, 30), 0, ep_rank, ep_size)
    groups = build_expert_groups(model, topology, comm)
    named = list(model.named_parameters())
    buckets = build_sharded_buckets(named, {id(p): 0 for _, p in named}, 1000, comm, True, groups)
    reduce = QuantizedReduce(GradQuantization(bits=4, loco_beta=0.8), comm)
    reducer = (FullBufferReducer(buckets, comm, reduce, sharded=True) if stage == 1
               else PartitionedReducer(buckets, comm, reduce))
    grads = {rank: {name: exact_int4_gradients(rank * 10 + i, p.shape) for i, (name, p) in enumerate(named)}
             for rank in range(comm.size)}
    reducer.begin_backward(True)
    sum((p * grads[comm.rank][name]).sum() for name, p in named).backward()
    reducer.end_backward()
    results = []
    for index, bucket in enumerate(buckets):
        expert = bucket.group.expert
        holders = [r for r in range(comm.size) if r % ep_size == comm.rank % ep_size] if expert else range(comm.size)
        expected = torch.zeros(bucket.padded_numel)
        for position, name in enumerate(bucket.names):
            bucket.param_view(position, expected).copy_(sum(grads[r][name] for r in holders) / comm.size)
        error = (reducer.grad_shards[index] - bucket.shard_of(expected)).abs().max().item()
        quantized = reducer.reduce.per_bucket[index]
        results.append((stage, "expert" if expert else "dense", quantized.comm.size if quantized else None, error))
    return results


def test_quantized_expert_reduction_sums_exactly_over_the_ranks_holding_the_same_experts():
    for rank, results in enumerate(run_distributed(reduce_known_gradients, 4, 2)):
        assert sorted((stage, kind) for stage, kind, _, _ in results) == \
            [(1, "dense"), (1, "expert"), (2, "dense"), (2, "expert")], results
        for stage, kind, group_size, error in results:  # int4 reducers over the pair / over all 4 ranks
            assert group_size == (2 if kind == "expert" else 4), (rank, stage, kind, group_size)
            assert error <= 1e-6, (rank, stage, kind, error)
