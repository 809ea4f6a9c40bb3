"""Stages 0-2 reproduce single-process AdamW: losses and weights, every world size and accumulation."""
from __future__ import annotations

import os

import pytest
import torch

from distributed import run_distributed
from models_for_tests import (OddMLP, assert_same_training, make_batches, micro_slice, reference_training,
                              train_global_step)

from zerotrain.zero.optimizer import COALESCE_BYTES

STEPS, MICRO, LR = 5, 2, 1e-2


def engine_config(stage: int, accumulation: int, world: int, clip: float = 1.0, precision: str = "fp32") -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},  # several buckets, params split across them
        "bf16": {"enabled": precision == "bf16"},
        "steps_per_print": 0,
    }


class GatedMLP(torch.nn.Module):
    """fc1 -> side (a gate, used only when asked) -> fc2 -> head. At reduce_bucket_size 40 the stage-2 buckets, in
    backward order, are [head.bias, head.weight, fc2.bias], [fc2.weight], [side.bias, side.weight, fc1.bias],
    [fc1.weight]: the third takes its staging buffer when its first gradient arrives, after the first bucket was
    reduced, so it reuses the first one's buffer; in a micro-step without the gate, side's slice of it still holds
    head's gradient unless it is zeroed."""

    def __init__(self, rank: int = 0, accumulation: int = 1) -> None:
        super().__init__()
        self.rank, self.accumulation, self.micro_steps = rank, accumulation, 0
        self.fc1 = torch.nn.Linear(6, 7)
        self.side = torch.nn.Linear(7, 1)
        self.fc2 = torch.nn.Linear(7, 7)
        self.head = torch.nn.Linear(7, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor, gate: bool | None = None) -> torch.Tensor:
        if gate is None:  # trained by the engine: micro-step after micro-step, as `gated` says for this rank
            gate = gated(self.micro_steps % self.accumulation, self.rank)
            self.micro_steps += 1
        hidden = torch.tanh(self.fc1(x))
        if gate:
            hidden = hidden + torch.tanh(self.side(hidden))
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.fc2(hidden))), y)


def gated(index: int, rank: int) -> bool:
    """Whether micro-step `index` on `rank` uses the gate: every rank skips it in some micro-step of each step."""
    return (index + rank) % 2 == 0


def train_gated_stage2(accumulation: int) -> tuple:
    """Stage 2, a parameter that gets no gradient in some micro-steps (and on some ranks), reused staging buffers."""
    import torch.distributed as dist

    import zerotrain

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GatedMLP(rank, accumulation), config=engine_config(2, accumulation, world))
    losses, norms = [], []
    for batch in make_batches(STEPS, MICRO * accumulation * world):
        losses.append(train_global_step(engine, batch, MICRO))
        norms.append(engine.get_global_grad_norm())
    assert engine.work_stats()["reduce"]["staging_reused"] > 0, "the premise: staging buffers were reused"
    return losses, engine.full_state_dict(), norms


def reference_gated(world: int, accumulation: int) -> tuple:
    """One process: each step's loss the mean of every (micro-step, rank) slice's, each with its gate."""
    torch.manual_seed(0)
    model = GatedMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, norms = [], []
    for batch in make_batches(STEPS, MICRO * accumulation * world):
        loss = sum(model(*micro_slice(batch, index, rank, world, MICRO), gated(index, rank))
                   for index in range(accumulation) for rank in range(world)) / (accumulation * world)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def train_with_engine(combos: list[tuple[int, int]], clip: float = 1.0, precision: str = "fp32",
                      gated_accumulation: int = 0) -> list:
    """On each rank: train OddMLP for every (stage, accumulation); return per-step mean losses and weights (whole
    weights gather one bucket at a time where the masters are partitioned, nothing at stage 0 or one rank).
    `gated_accumulation` > 0: then GatedMLP at stage 2 with that accumulation (`train_gated_stage2`), last."""
    import zerotrain

    world = int(os.environ["WORLD_SIZE"])
    results = []
    for stage, accumulation in combos:
        torch.manual_seed(0)
        engine, _, _, _ = zerotrain.initialize(model=OddMLP(), config=engine_config(stage, accumulation, world, clip, precision))
        step_losses, norms = [], []
        published = engine.memory_report()["comm"].get("all_gather", {}).get("calls", 0)
        for batch in make_batches(STEPS, MICRO * accumulation * world):
            step_losses.append(train_global_step(engine, batch, MICRO))
            norms.append(engine.get_global_grad_norm())
        # the small buckets' full copies refreshed by one all-gather per step, not one per bucket (fix1)
        published = engine.memory_report()["comm"].get("all_gather", {}).get("calls", 0) - published
        assert len(engine.buckets) > 1 and published == (STEPS if stage and world > 1 else 0), (stage, published)
        assert engine.global_steps == STEPS
        assert engine.global_samples == STEPS * MICRO * accumulation * world
        before = engine.memory_report()["comm"].get("gather", {}).get("calls", 0)
        weights = engine.full_state_dict()
        gathers = engine.memory_report()["comm"].get("gather", {}).get("calls", 0) - before
        assert gathers == (len(engine.buckets) if stage and world > 1 else 0), (stage, gathers, len(engine.buckets))
        assert engine.global_rank == 0 or weights == {}, "whole weights on rank 0 only, an empty dict elsewhere"
        results.append((stage, accumulation, step_losses, weights, norms))
    if gated_accumulation:
        results.append(train_gated_stage2(gated_accumulation))
        results.append(train_wide())
        results.append(coalesced_gathers())
    return results


class WideMLP(torch.nn.Module):
    """fc2's weight alone is over `optimizer.COALESCE_BYTES` (266,240 fp32 elements): its bucket is all-gathered on
    its own, the small ones together."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 512)
        self.fc2 = torch.nn.Linear(512, 520)
        self.head = torch.nn.Linear(520, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def train_wide() -> tuple:
    """Stage 1 at world 2 with one bucket over 1 MiB among small ones: losses, whole weights, all-gathers per step."""
    import zerotrain

    torch.manual_seed(0)
    # SGD: AdamW's update of a near-zero gradient element magnifies the sum order's last bits past 1e-6
    config = {**engine_config(1, 1, 2), "zero_optimization": {"stage": 1, "reduce_bucket_size": 4000},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, *_ = zerotrain.initialize(model=WideMLP(), config=config)
    sizes = sorted(bucket.flat_param.numel() * bucket.flat_param.element_size() for bucket in engine.buckets)
    before = engine.memory_report()["comm"].get("all_gather", {}).get("calls", 0)
    losses = [train_global_step(engine, batch, MICRO) for batch in make_batches(2, MICRO * 2)]
    calls = engine.memory_report()["comm"].get("all_gather", {}).get("calls", 0) - before
    return losses, engine.full_state_dict(), calls / 2, sizes


COALESCED = [(5, torch.float32), (3, torch.bfloat16), (1, torch.float16), (7, torch.float64), (4, torch.int32)]


def rank_piece(index: int, rank: int) -> torch.Tensor:
    """What `rank` contributes to the `index`-th gather of `coalesced_gathers`."""
    numel, dtype = COALESCED[index]
    return (torch.arange(numel, dtype=torch.float64) * (rank + 1) + 100 * index + 0.5 * rank).to(dtype)


def coalesced_gathers() -> tuple:
    """`Comm.all_gather_coalesced` of pieces of several dtypes and sizes (the last one in place, as the optimizer
    gathers its own shard): the outputs, and the calls and bytes the counters counted."""
    import torch.distributed as dist

    from zerotrain.comm import Comm

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None, rank, world)
    pairs = []
    for index, (numel, dtype) in enumerate(COALESCED):
        output = torch.full((world * numel,), -1, dtype=dtype)
        piece = output[rank * numel:(rank + 1) * numel] if index == len(COALESCED) - 1 else torch.empty(numel, dtype=dtype)
        piece.copy_(rank_piece(index, rank))
        pairs.append((output, piece))
    comm.all_gather_coalesced(pairs)
    counted = comm.counters.snapshot()
    return [output for output, _ in pairs], counted


COMBOS = [(stage, accumulation) for stage in (0, 1, 2) for accumulation in (1, 2)]
GATED_ACCUMULATION = 2


def reference_batches_for(world: int, accumulation: int):
    return make_batches(STEPS, MICRO * accumulation * world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_stages_match_single_process(world):
    """At world 2 also: stage 2 with a parameter that gets no gradient in some micro-steps on some ranks, whose
    bucket reuses another bucket's staging buffer (its slice must count as zero, not as what the buffer held)."""
    run_results = run_distributed(train_with_engine, world, COMBOS, gated_accumulation=GATED_ACCUMULATION * (world == 2))
    results = run_results[0]
    if world == 2:
        for rank, (outputs, counted) in enumerate(r.pop() for r in run_results):
            for index, output in enumerate(outputs):
                want = torch.cat([rank_piece(index, peer) for peer in range(world)])
                assert output.dtype == want.dtype and torch.equal(output, want), (rank, index, output, want)
            assert counted == {"all_gather": {"calls": 1, "bytes": sum(o.numel() * o.element_size()
                                                                       for o in outputs) // 2}}, counted
        losses, weights, per_step, sizes = results.pop()  # the wide model: a big bucket on its own, the rest in one
        assert len(sizes) >= 3 and sizes[-1] > COALESCE_BYTES >= sizes[-2] and per_step == 2, (sizes, per_step)
        wide_sgd = reference_training(WideMLP, make_batches(2, MICRO * 2), clip=1.0,  # SGD at lr 0.5, clipping 1.0
                                      make_optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
        assert_same_training(losses, weights, *wide_sgd, "wide")
        losses, weights, norms = results.pop()
        ref_losses, ref_weights, ref_norms = reference_gated(world, GATED_ACCUMULATION)
        what = "world 2, stage 2, a parameter without a gradient in some micro-steps"
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= 1e-5, f"{what}: losses {losses} vs reference {ref_losses} (max rel {rel:.2e})"
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"{what}: gradient norms {norms} vs {ref_norms}"
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")
    for stage, accumulation, losses, weights, norms in results:
        ref_norms: list[float] = []
        ref_losses, ref_weights = reference_training(OddMLP, reference_batches_for(world, accumulation), lr=LR,
                                                     norms=ref_norms)
        what = f"world {world}, stage {stage}, accumulation {accumulation}"
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= 1e-5, f"{what}: losses {losses} vs reference {ref_losses} (max rel {rel:.2e})"
        assert norms == pytest.approx(ref_norms, rel=1e-5), f"{what}: gradient norms (what clipping divides by)"
        assert set(weights) == set(ref_weights), what
        for name, ref in ref_weights.items():
            torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, {name}: {m}")
