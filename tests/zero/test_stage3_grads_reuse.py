"""ZeRO-3 bucketed gradient reduce-scatter and stage3_max_reuse_distance: exact, and fewer collectives."""
from __future__ import annotations

import os

import torch

from distributed import run_distributed
from test_stage3 import compute_loss, make_data, reference, stage3_config, TiedModel


def train_counting(combos: list) -> list:
    """Train TiedModel per (accumulation, zero overrides); losses, weights, comm calls and fetcher stats."""
    import torch.distributed as dist

    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    results = []
    for accumulation, zero in combos:
        torch.manual_seed(0)
        engine, *_ = zerotrain.initialize(model=TiedModel(), config=stage3_config(accumulation, **zero))
        losses, micro_steps = [], 0
        for ids, targets in make_data(world, accumulation):
            total = torch.zeros(1)
            for a in range(accumulation):
                start = (a * world + rank) * 2
                loss = compute_loss(engine, engine.module, ids[start:start + 2], targets[start:start + 2], False)
                engine.backward(loss)
                engine.step()
                micro_steps += 1
                total += loss.detach()
            dist.all_reduce(total)
            losses.append(total.item() / (accumulation * world))
        comm = engine.memory_report()["comm"]
        results.append({"combo": (accumulation, zero), "losses": losses, "weights": engine.full_state_dict(),
                        "micro_steps": micro_steps, "comm": comm, "fetch": engine.work_stats()["gather"],
                        "reduce": engine.work_stats()["reduce"]})
    return results


def assert_matches_reference(result: dict, world: int) -> None:
    accumulation, zero = result["combo"]
    ref_losses, ref_weights, _ = reference(world, accumulation, False)
    rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses))
    assert rel <= 1e-5, f"{result['combo']}: losses {result['losses']} vs {ref_losses}"
    for name, ref in ref_weights.items():
        torch.testing.assert_close(result["weights"][name], ref, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{result['combo']} {name}: {m}")


# TiedModel's trainable parameters, in backward order: frozen.bias (6), mid.bias (6), mid.weight (36),
# emb.weight (66, tied with the head). Bucket limits of 1, 50 and 10**9 elements give 4, 2 and 1 buckets.
BUCKET_COMBOS = [(1, {"reduce_bucket_size": 1}), (1, {"reduce_bucket_size": 50}), (1, {"reduce_bucket_size": 10**9}),
                 (2, {"reduce_bucket_size": 50})]


def test_bucketed_reduce_scatter_is_exact_and_launches_one_collective_per_bucket():
    results = run_distributed(train_counting, 2, BUCKET_COMBOS)[0]
    calls_per_micro_step = []
    for result in results:
        assert_matches_reference(result, 2)
        calls = result["comm"]["reduce_scatter"]["calls"]
        assert calls == result["reduce"]["reduce_scatters"]
        calls_per_micro_step.append(calls / result["micro_steps"])
        assert result["reduce"]["staging_bytes"] == 0, "every staging buffer is freed after backward"
    assert calls_per_micro_step[:3] == [4, 2, 1], calls_per_micro_step
    assert calls_per_micro_step[3] == 2, "accumulation reduces every micro-step, in the same buckets"
    bytes_per_step = [r["comm"]["reduce_scatter"]["bytes"] / r["micro_steps"] for r in results[:3]]
    assert bytes_per_step[0] == bytes_per_step[1] == bytes_per_step[2], "bucketing changes calls, not bytes"


REUSE_COMBOS = [(1, {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}),
                (1, {"stage3_max_reuse_distance": 60, "stage3_prefetch_bucket_size": 0}),
                (1, {"stage3_max_reuse_distance": 10**9, "stage3_prefetch_bucket_size": 0}),
                (2, {"stage3_max_reuse_distance": 10**9}),
                (2, {"stage3_max_reuse_distance": 0, "stage3_allgather_sequential": True})]


def test_max_reuse_distance_keeps_parameters_and_saves_gathers():
    results = run_distributed(train_counting, 2, REUSE_COMBOS)[0]
    for result in results:
        assert_matches_reference(result, 2)
        assert result["fetch"]["live_bytes"] == 0 and result["fetch"]["inflight_bytes"] == 0, \
            "everything is released at the end of the micro-step"
    gathers = [r["comm"]["all_gather"]["calls"] for r in results[:3]]
    assert gathers[0] > gathers[1] > gathers[2], gathers
    assert results[0]["fetch"]["reuse_kept"] == 0 and results[2]["fetch"]["reuse_kept"] > 0
    kept_live = [r["fetch"]["peak_live_bytes"] for r in results[:3]]
    assert kept_live[0] < kept_live[2], "keeping parameters for reuse costs live memory"


def evaluate_after_training(zero: dict) -> tuple:
    """Train two steps, then run forward without grad."""
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=TiedModel(), config=stage3_config(1, **zero))
    data = make_data(world, 1)
    for ids, targets in data[:2]:
        engine.backward(compute_loss(engine, engine.module, ids[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2], False))
        engine.step()
    ids, targets = data[2]
    gathers_before = engine.work_stats()["gather"]["gathers"]
    with torch.no_grad():
        compute_loss(engine, engine.module, ids[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2], False)
    return gathers_before, engine.work_stats()["gather"]


def evaluate_with_and_without_reuse() -> list:
    return [evaluate_after_training(zero) for zero in ({}, {"stage3_max_reuse_distance": 10**9})]


def test_forward_without_grad_keeps_nothing_for_reuse():
    """The defaults (nothing kept for reuse), and reuse on: the no-grad forward must release what it keeps."""
    for gathers_before, stats in sum(run_distributed(evaluate_with_and_without_reuse, 2), []):
        assert stats["gathers"] > gathers_before, "the no-grad forward gathered its parameters"
        assert stats["live_bytes"] == 0 and stats["inflight_bytes"] == 0, "no backward follows: all released"
