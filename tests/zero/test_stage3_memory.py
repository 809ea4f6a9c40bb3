"""ZeRO-3 memory accounting, gather-buffer peaks, and GatheredParameters write-back."""
from __future__ import annotations

import os

import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, reference_training, train_global_step
from test_precision_and_memory import _measured_gradient_bytes


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 63)
        self.fc2 = torch.nn.Linear(63, 61)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def _config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}, "steps_per_print": 0}


def stage3_memory(zero: dict, accumulation: int = 1) -> dict:
    import zerotrain

    torch.manual_seed(0)
    model = Wide()
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    config = _config(**zero)
    config["gradient_accumulation_steps"] = accumulation
    engine, *_ = zerotrain.initialize(model=model, config=config)
    held_between_micro_steps, between = [], []
    for _ in range(2 * accumulation):  # the second step runs with prefetch
        engine.backward(engine(torch.randn(2, 64), torch.randn(2, 61)))
        if not engine.is_gradient_accumulation_boundary():
            between.append(engine.memory_report())
            between[-1]["measured_gradients"] = _measured_gradient_bytes(engine)
            held_between_micro_steps.append(between[-1]["gradients"])
        engine.step()
    report = engine.memory_report()
    report["held_between_micro_steps"] = held_between_micro_steps
    report["between_micro_steps"] = between
    report["reduce"] = engine.work_stats()["reduce"]
    report["sizes"] = sizes
    report["stats"] = engine.work_stats()["gather"]
    report["tensors"] = len(engine.optimizer.state)
    return report


def test_stage3_holds_a_quarter_at_world_4():
    for rank, report in enumerate(run_distributed(stage3_memory, 4, {})):
        sizes = report["sizes"]
        shard = sum(-(-n // 4) for n in sizes.values())  # ceil(numel / 4) per parameter
        assert report["parameters"] == 4 * shard, f"rank {rank}: only shards are held between steps"
        assert report["gradients"] == 0, "gradient shards are freed after the optimizer step"
        assert report["optimizer_states"] == 8 * shard + 4 * report["tensors"]
        assert report["stats"]["live_bytes"] == 0, "everything released after the step"


def test_persistent_parameters_stay_whole():
    for report in run_distributed(stage3_memory, 4, {"stage3_param_persistence_threshold": 100}):
        sizes = report["sizes"]
        shard = sum(-(-n // 4) for n in sizes.values())
        persistent = sum(-(-n // 4) * 4 for n in sizes.values() if n <= 100)  # the two biases, whole (padded)
        assert report["parameters"] == 4 * (shard + persistent)


def test_sequential_gather_peak_is_one_parameter():
    sequential = run_distributed(stage3_memory, 2, {"stage3_allgather_sequential": True})[0]
    bucketed = run_distributed(stage3_memory, 2, {})[0]
    padded_bytes = {name: -(-n // 2) * 2 * 4 for name, n in sequential["sizes"].items()}
    largest_param = max(padded_bytes.values())
    largest_module = max(padded_bytes["fc1.weight"] + padded_bytes["fc1.bias"],
                         padded_bytes["fc2.weight"] + padded_bytes["fc2.bias"])
    assert sequential["stats"]["peak_gather_bytes"] <= largest_param
    # Bucketed: one module's gather output, its staged input (1/N of it, the copy-in) and the full
    # buffers copied out of it (as large as the output again).
    assert bucketed["stats"]["peak_gather_bytes"] == int(largest_module * (2 + 1 / 2))
    assert sequential["stats"]["prefetch_hits"] > 0 and bucketed["stats"]["prefetch_hits"] > 0
    comm_seq, comm_bucket = sequential["comm"]["all_gather"], bucketed["comm"]["all_gather"]
    assert comm_seq["calls"] > comm_bucket["calls"], "sequential mode trades more, smaller collectives"
    assert comm_seq["bytes"] == comm_bucket["bytes"]


def modify_then_train(modifier_rank: int) -> tuple:
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config())
    weight = engine.module.fc1.weight
    with zerotrain.zero.GatheredParameters([weight], modifier_rank=modifier_rank):
        assert weight.shape == (7, 6)
        if rank == modifier_rank:
            with torch.no_grad():
                weight.fill_(0.25)
    losses = [train_global_step(engine, batch, 2) for batch in make_batches(3, 2 * world)]
    return losses, engine.full_state_dict()


def test_gathered_parameters_modifier_changes_what_every_rank_trains():
    losses, weights = run_distributed(modify_then_train, 2, 1)[0]

    def modified_model():
        model = OddMLP()
        with torch.no_grad():
            model.fc1.weight.fill_(0.25)
        return model

    ref_losses, ref_weights = reference_training(modified_model, make_batches(3, 4), lr=1e-2, weight_decay=0.0)
    for got, ref in zip(losses, ref_losses):
        assert abs(got - ref) <= 1e-5 * abs(ref), (losses, ref_losses)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6)


def test_max_live_parameters_caps_prefetch():
    capped = run_distributed(stage3_memory, 2, {"stage3_max_live_parameters": 0})[0]
    assert capped["stats"]["prefetched"] == 0
    assert capped["stats"]["peak_live_bytes"] <= max(-(-n // 2) * 2 * 4 for n in capped["sizes"].values()) * 2


def test_quarter_of_gradients_held_between_micro_steps_at_world_4():
    for rank, report in enumerate(run_distributed(stage3_memory, 4, {}, 2)):
        shard = sum(-(-n // 4) for n in report["sizes"].values())  # ceil(numel / 4) per parameter
        full = sum(report["sizes"].values())
        assert len(report["between_micro_steps"]) == 2, "two steps of two micro-steps: one gap each"
        for between in report["between_micro_steps"]:
            assert between["gradients"] == 4 * shard, f"rank {rank}: fp32 gradient shards, 1/4 each"
            assert between["measured_gradients"] == between["gradients"], "the reducer's held tensors are what it reports"
            assert between["gradients"] < 4 * full / 4 + 4 * 3 * len(report["sizes"]), \
                "a quarter of the full fp32 gradient, plus at most 3 padding elements per parameter"
            assert between["parameters"] == 4 * shard, f"rank {rank}: parameters released between micro-steps"
        assert report["gradients"] == 0, "gradient shards are freed after the optimizer step"
        assert report["reduce"]["staging_bytes"] == 0


def test_gradient_shards_held_only_while_accumulating():
    for report in run_distributed(stage3_memory, 2, {"reduce_bucket_size": 100}, 2):
        shard = sum(-(-n // 2) for n in report["sizes"].values())
        assert report["held_between_micro_steps"] == [4 * shard, 4 * shard], "fp32 shards while accumulating"
        assert report["gradients"] == 0
        assert report["reduce"]["staging_bytes"] == 0
        # fc2.bias, fc2.weight, fc1.bias, fc1.weight (61, 3843, 63, 4096 elements): every parameter
        # exceeds 100 elements with its neighbour, so each bucket holds one; staging never exceeds
        # the two largest buckets (the one filling and the one in flight).
        padded = sorted((-(-n // 2) * 2 * 4 for n in report["sizes"].values()), reverse=True)
        assert report["reduce"]["peak_staging_bytes"] <= padded[0] + padded[1]
        # nor does what the staging pool holds with its spares: a finished buffer no later bucket of this backward
        # can use is freed (fc1.weight, the last, reduces its own gradient in place), not kept to its end
        assert report["reduce"]["peak_held_bytes"] <= padded[0] + padded[1]
        assert report["reduce"]["reduce_scatters"] == 4 * 4  # 4 buckets, 4 micro-steps
