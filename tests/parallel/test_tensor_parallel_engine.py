"""ZeRO over the data-parallel axis of a (data, tensor) grid equals single-process training.

`tensor_parallel.autotp_size` splits zerotrain's GPT by its built-in plan; every ZeRO stage
shards the local slices across the data-parallel ranks. Clipping needs the norm over every
distinct piece (split weights summed over the tensor-parallel ranks, replicated ones once).
bf16 (TP2) and fp16 (TP2 x DP2, stage 3) train close to the fp32 reference while the untrained run does not
(assert_tolerance_discriminates); fp16 from a loss scale of 2**24 overflows under TP2 x DP2 and every rank skips
the same steps. A model built under zero.Init (TP2 x DP2, stage 3) trains exactly as one built plainly.
"""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed

STEPS, MICRO, SEQ, LR, CLIP = 3, 2, 16, 1e-3, 0.05  # a clip small enough to fire every step
# Attention's key bias has an exactly-zero gradient (softmax ignores a shift shared by all keys): row-parallel
# layers sum in another order, and Adam with eps=1e-8 would turn that rounding noise into lr-sized steps.
# eps=1e-6 (as tests/zero/test_hf_parity.py) keeps it at rounding level, so every tensor is compared whole.
EPS = 1e-6
PRECISIONS = {(): {}, ("bf16",): {"bf16": {"enabled": True}},
              ("fp16",): {"fp16": {"enabled": True, "initial_scale_power": 8}},
              ("fp16 overflow",): {"fp16": {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}}}
LOW_PRECISION_TOL = 2e-4, 5e-3  # losses (max relative), weights (relative L2); untrained: >= 4.2e-4, 2.1e-2


def gpt():
    from zerotrain.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, n_embd=32, block_size=SEQ, n_inner=64))


def batches(dp: int, accumulation: int):
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 128, (MICRO * accumulation * dp, SEQ + 1), generator=generator) for _ in range(STEPS)]


def train_grid(tp: int, combos: list[tuple[int, int]]) -> list:
    import torch.distributed as dist

    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for stage, accumulation, *precision in combos:
        config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accumulation,
                  "gradient_clipping": CLIP, "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                        "stage3_param_persistence_threshold": 0},
                  "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 0,
                  **PRECISIONS.get(tuple(precision), {})}
        if precision == ["zero.Init"]:  # built partitioned over the data-parallel ranks, gathered layer by layer to split
            precision = []
            with zerotrain.zero.Init(config=config):
                model = gpt()
            assert all(isinstance(p, zerotrain.zero.stage3.ZeroParameter) for p in model.parameters())
        else:
            model = gpt()
        engine, *_ = zerotrain.initialize(model=model, config=config)
        dp, dp_rank = engine.topology.dp_size, engine.topology.dp_rank
        assert dp * tp == world
        losses = []
        for tokens in batches(dp, accumulation):
            total = torch.zeros(1)
            for a in range(accumulation):
                start = (a * dp + dp_rank) * MICRO
                micro = tokens[start:start + MICRO]
                _, loss = engine(micro[:, :-1], micro[:, 1:])
                engine.backward(loss)
                engine.step()
                total += loss.detach()
            dist.all_reduce(total)  # every tensor-parallel rank holds the same loss: divide by world
            losses.append(total.item() / (accumulation * world))
        if precision:  # low precision: (skipped steps, final loss scale) instead of the norm
            results.append((stage, accumulation, losses, engine.full_state_dict(),
                            (engine.skipped_steps, engine.loss_scale), precision[0]))
            continue
        results.append((stage, accumulation, losses, engine.full_state_dict(), engine.get_global_grad_norm()))
    return results


def reference(dp: int, accumulation: int, lr: float = LR):
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=EPS, weight_decay=0.0)
    losses, norms = [], []
    for tokens in batches(dp, accumulation):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms[-1]


def check(results, dp):
    for index, (stage, accumulation, losses, weights, norm, *precision) in enumerate(results[0]):
        if precision:
            states = [rank_results[index][4] for rank_results in results]
            check_low_precision(states, dp, stage, accumulation, losses, weights, precision[0])
            continue
        ref_losses, ref_weights, ref_norm = reference(dp, accumulation)
        where = f"stage {stage}, accumulation {accumulation}"
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-5, where
        assert norm == pytest.approx(ref_norm, rel=1e-5), where
        for name, expected in ref_weights.items():
            torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{where} {name}: {m}")
    for rank_results in results[1:]:
        assert all(not result[3] for result in rank_results)  # full weights only on rank 0


def test_two_way_tensor_parallel_with_two_way_zero():
    results = run_distributed(train_grid, 4, 2, [(0, 1), (1, 2), (2, 1), (3, 2), (3, 1, "zero.Init"),
                                                 (3, 1, "fp16"), (2, 1, "fp16 overflow")], timeout=240)
    check(results, dp=2)


def check_low_precision(states, dp, stage, accumulation, losses, weights, precision):
    """bf16 / fp16 (fp32 masters) under TP against the fp32 reference, the untrained run outside by 2x; fp16 from
    a loss scale of 2**24 overflows first: every rank skips the same steps and lowers the scale."""
    from models_for_tests import assert_tolerance_discriminates

    where = f"TP2 x DP{dp}, stage {stage}, {precision}"
    skipped = states  # (skipped steps, final loss scale) of every rank
    if precision == "fp16 overflow":
        assert skipped[0][0] > 0 and skipped[0][1] < 2.0 ** 24, (where, skipped)
        assert all(s == skipped[0] for s in skipped), (where, skipped)  # every rank skipped the same steps
        assert all(torch.isfinite(w).all() for w in weights.values()), where
        return
    assert all(s == (0, skipped[0][1]) for s in skipped), (where, skipped)
    reference_run = reference(dp, accumulation)
    weights = {name: weights[name] for name in reference_run[1]}  # lm_head.weight is wte.weight (tied)
    assert_tolerance_discriminates(where, reference_run[:2], (losses, weights), reference(dp, accumulation, 0.0)[:2],
                                   loss_tol=LOW_PRECISION_TOL[0], weight_tol=LOW_PRECISION_TOL[1])


def test_tensor_parallel_only():
    results = run_distributed(train_grid, 2, 2, [(2, 1), (3, 1), (2, 1, "bf16")], timeout=180)
    check(results, dp=1)


def initialize_plain_sequential() -> list[str]:
    import zerotrain

    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2},
              "zero_optimization": {"stage": 3}}
    with zerotrain.zero.Init():  # not given the config: partitioned over both ranks, not the grid's one
        model = gpt()
    from torch.distributed.distributed_c10d import _world

    messages = []
    for model in (torch.nn.Sequential(torch.nn.Linear(2, 2)), model):
        groups = _world.group_count
        try:
            zerotrain.initialize(model=model, config=config)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
        # refused before any process group is made: a rank that refused after making them could exit while its
        # peer still connects to them (gloo's "Connection closed by peer" on the peer, seen under load)
        assert _world.group_count == groups, (messages[-1], groups, _world.group_count)
    return messages


def test_bad_tensor_parallel_setups_are_refused_before_training():
    import zerotrain
    from zerotrain.config import ConfigError

    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size: 2 does not divide the world size 1"):
        zerotrain.initialize(model=gpt(), config={"train_micro_batch_size_per_gpu": 1,
                                                  "tensor_parallel": {"autotp_size": 2}})
    for sequential, under_init in run_distributed(initialize_plain_sequential, 2, timeout=60):
        assert "tensor_parallel.autotp_size > 1 needs a plan for Sequential" in sequential
        assert ("transformer.wte.weight was partitioned by zero.Init over 2 ranks" in under_init
                and "zero.Init(config=...)" in under_init), under_init
