"""ZeRO-3 prefetch budgets: stage3_prefetch_bucket_size, stage3_max_live_parameters, sequential mode."""
from __future__ import annotations

import os

import torch

from distributed import run_distributed

WIDTHS = [16, 40, 24, 48, 32, 20, 8]  # six Linear modules of different sizes
WORLD, MICRO, STEPS = 2, 2, 3


class Chain(torch.nn.Module):
    """Several modules in a row, each with a weight and a bias: a prefetch window spans a few of them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(self.layers[-1](x), y)


def padded(numel: int) -> int:
    return -(-numel // WORLD) * WORLD


def requests() -> list[int]:
    """Padded elements one module's forward request gathers (weight + bias), per module."""
    return [padded(a * b) + padded(b) for a, b in zip(WIDTHS, WIDTHS[1:])]


def largest_param() -> int:
    return max(padded(a * b) for a, b in zip(WIDTHS, WIDTHS[1:]))


def train_with(zeros: list[dict]) -> list[dict]:
    """Train Chain a few steps per stage-3 override set; return losses and the fetcher's stats."""
    import zerotrain

    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(MICRO * WORLD, WIDTHS[0], generator=generator),
             torch.randn(MICRO * WORLD, WIDTHS[-1], generator=generator)) for _ in range(STEPS)]
    results = []
    for zero in zeros:
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
                  "steps_per_print": 0}
        engine, *_ = zerotrain.initialize(model=Chain(), config=config)
        losses = []
        for x, y in data:
            loss = engine(x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        results.append({"losses": losses, "stats": engine.work_stats()["gather"]})
    return results


def test_prefetch_in_flight_stays_within_bucket_size():
    budget = requests()[1] + requests()[2]  # about two modules ahead
    bounded, unbounded = run_distributed(train_with, WORLD, [{"stage3_prefetch_bucket_size": budget},
                                                             {"stage3_prefetch_bucket_size": 10**9}])[0]
    largest_request = max(requests())
    for run in (bounded, unbounded):
        assert run["stats"]["prefetched"] > 0 and run["stats"]["prefetch_hits"] > 0, run["stats"]
        assert run["stats"]["inflight_numel"] == 0 and run["stats"]["prefetch_inflight_numel"] == 0
    stats = bounded["stats"]
    # The walk stops once the budget is reached, so only the request that crosses it may overshoot.
    assert stats["peak_prefetch_inflight_numel"] < budget + largest_request, stats
    assert stats["peak_inflight_numel"] < budget + largest_request, "a served request never adds to a full window"
    assert unbounded["stats"]["peak_prefetch_inflight_numel"] > budget + largest_request, \
        "without the budget more is in flight: the bound above is the budget's doing"
    assert bounded["losses"] == unbounded["losses"], "the budget changes when, never what, is gathered"


def test_max_live_parameters_caps_live_and_in_flight_and_defaults_keep_one_request_ahead():
    cap = requests()[1] + requests()[3]
    deepspeed = {"stage3_prefetch_bucket_size": 5 * 10**7, "stage3_max_reuse_distance": 10**9}  # its defaults
    capped, uncapped, defaults = run_distributed(train_with, WORLD, [
        {"stage3_max_live_parameters": cap, **deepspeed}, {"stage3_max_live_parameters": 10**9, **deepspeed},
        {}])[0]
    largest_request = max(requests())
    assert capped["stats"]["prefetched"] > 0, "a nonzero cap still lets prefetch run"
    # Prefetch and reuse stop at the cap; only the request being served may go past it.
    assert capped["stats"]["peak_live_inflight_numel"] <= cap + largest_request, capped["stats"]
    assert uncapped["stats"]["peak_live_inflight_numel"] > cap + largest_request, \
        "uncapped, reuse keeps more gathered: the bound above is the cap's doing"
    assert capped["losses"] == uncapped["losses"]
    # No tuning keys: zerotrain's memory-bounded defaults, not DeepSpeed's: prefetch one recorded request
    # ahead, nothing kept for reuse, so at most the request being served plus the one ahead are live.
    stats = defaults["stats"]
    assert stats["prefetched"] > 0 and stats["reuse_kept"] == 0, stats
    assert stats["peak_prefetch_inflight_numel"] <= largest_request, stats
    assert stats["peak_live_inflight_numel"] <= 2 * largest_request < uncapped["stats"]["peak_live_inflight_numel"]
    assert defaults["losses"] == uncapped["losses"], "the defaults change when, never what, is gathered"


def test_sequential_prefetch_stays_one_parameter_ahead():
    sequential, bucketed = run_distributed(train_with, WORLD, [{"stage3_allgather_sequential": True},
                                                               {}])[0]
    stats = sequential["stats"]
    assert stats["prefetched"] > 0 and stats["prefetch_hits"] > 0, stats
    assert stats["peak_prefetch_inflight_params"] == 1, "never more than one parameter prefetched at once"
    assert stats["peak_prefetch_inflight_numel"] <= largest_param()
    assert stats["peak_inflight_numel"] <= max(requests()) + largest_param(), "the request served plus one ahead"
    assert bucketed["stats"]["peak_prefetch_inflight_params"] > 1, "bucketed mode runs further ahead"
    torch.testing.assert_close(sequential["losses"], bucketed["losses"], rtol=1e-6, atol=0)


def test_zero_prefetch_bucket_turns_sequential_prefetch_off():
    off, on = run_distributed(train_with, WORLD, [{"stage3_allgather_sequential": True, "stage3_prefetch_bucket_size": 0},
                                                  {"stage3_allgather_sequential": True}])[0]
    assert off["stats"]["prefetched"] == 0 and off["stats"]["prefetch_hits"] == 0, off["stats"]
    assert off["stats"]["peak_prefetch_inflight_params"] == 0
    assert on["stats"]["prefetched"] > 0
    assert off["stats"]["gathers"] > 0
    assert off["losses"] == on["losses"], "prefetch off gathers the same values, only later"
