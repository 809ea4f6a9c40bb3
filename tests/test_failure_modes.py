"""Failure rule: a dead rank ends the job with an error, and bad configs fail before any process group exists."""
from __future__ import annotations

import os
import time

import pytest
import torch

from distributed import run_distributed
from models_for_tests import OddMLP, make_batches, micro_slice

COMM_TIMEOUT = 10


def _config(stage: int, **extra) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40},
        "comm_timeout_seconds": COMM_TIMEOUT,
        "steps_per_print": 0,
    }
    config.update(extra)
    return config


def train_until_peer_dies(stage: int) -> dict:
    """Rank 1 dies after its first step; rank 0 keeps training and reports the error it gets."""
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(stage))
    for step, batch in enumerate(make_batches(50, 2 * world)):
        if step == 1 and rank == 1:
            os._exit(0)  # a crash: no cleanup, no goodbye to the process group
        x, y = micro_slice(batch, 0, rank, world, 2)
        started = time.monotonic()
        try:
            engine.backward(engine(x, y))
            engine.step()
        except Exception as error:  # noqa: BLE001 - whatever the collective raises is the point
            return {"step": step, "error": f"{type(error).__name__}: {error}",
                    "seconds": time.monotonic() - started}
    return {"step": None, "error": None, "seconds": None}


@pytest.mark.parametrize("stage", [0, 2])
def test_dead_rank_raises_instead_of_hanging(stage):
    started = time.monotonic()
    survivor, dead = run_distributed(train_until_peer_dies, 2, stage, timeout=3 * COMM_TIMEOUT + 30,
                                     expect_exit={1})
    elapsed = time.monotonic() - started
    assert dead is None
    assert survivor["error"] is not None, "rank 0 trained 50 steps alone: the collectives never failed"
    assert survivor["step"] == 1, survivor
    # The error comes from the collective (a closed connection or the group's timeout), within the timeout,
    # and says which collective failed on which rank.
    assert survivor["error"].startswith("CollectiveError: "), survivor
    assert any(kind in survivor["error"] for kind in ("all_reduce", "reduce_scatter", "all_gather")), survivor
    assert "rank 0 of 2" in survivor["error"], survivor
    assert "global rank 1" in survivor["error"], survivor  # the peer: named by our p2p collectives or comm.blame
    assert survivor["seconds"] <= COMM_TIMEOUT + 5, survivor
    assert elapsed < 2 * COMM_TIMEOUT + 20, f"the job took {elapsed:.1f}s to end"


STUCK_TIMEOUT = 4


def train_until_peer_is_stuck(flag_file: str) -> dict:
    """Rank 1 stops calling collectives after its first step (alive, but stuck); rank 0 must time out."""
    import zerotrain

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config=_config(2, comm_timeout_seconds=STUCK_TIMEOUT))
    for step, batch in enumerate(make_batches(50, 2 * world)):
        if step == 1 and rank == 1:
            deadline = time.monotonic() + 60
            while not os.path.exists(flag_file) and time.monotonic() < deadline:
                time.sleep(0.1)
            os._exit(0)
        x, y = micro_slice(batch, 0, rank, world, 2)
        started = time.monotonic()
        try:
            engine.backward(engine(x, y))
            engine.step()
        except Exception as error:  # noqa: BLE001
            result = {"step": step, "error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
            break
    else:
        result = {"step": None, "error": None, "seconds": None}
    with open(flag_file, "w") as handle:
        handle.write("done")
    return result


def test_stuck_rank_hits_the_comm_timeout(tmp_path):
    """comm_timeout_seconds reaches the process group: a silent peer ends the collective after that long."""
    survivor, stuck = run_distributed(train_until_peer_is_stuck, 2, str(tmp_path / "flag"), timeout=60,
                                      expect_exit={1})
    assert stuck is None
    assert survivor["error"] is not None and survivor["step"] == 1, survivor
    assert survivor["error"].startswith("CollectiveError: ") and "rank 0 of 2" in survivor["error"], survivor
    assert "global rank 1" in survivor["error"], survivor
    assert STUCK_TIMEOUT - 0.5 <= survivor["seconds"] <= STUCK_TIMEOUT + 10, survivor


BAD_CONFIGS = [
    ({"zero_optimization": {"stage": 1, "stgae": 2}}, ["zero_optimization.stgae", "stage"]),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["fp16", "bf16"]),
    ({"zero_optimization": {"stage": 7}}, ["zero_optimization.stage"]),
    ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2}, ["train_batch_size"]),  # 6 / (2 x 2 ranks)
    ({"optimizer": {"type": "Adagrad2", "params": {}}}, ["optimizer.type"]),
]


def initialize_with_bad_configs() -> list:
    """Each bad config raises ConfigError naming the key, and torch.distributed is never started."""
    import torch.distributed as dist

    import zerotrain
    from zerotrain.config import ConfigError

    assert os.environ["WORLD_SIZE"] == "2" and "MASTER_PORT" in os.environ
    outcomes = []
    for overrides, _ in BAD_CONFIGS:
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "comm_timeout_seconds": 5}
        config.update(overrides)
        if "train_batch_size" in overrides:
            config.pop("gradient_accumulation_steps")
        try:
            zerotrain.initialize(model=OddMLP(), config=config)
        except ConfigError as error:
            outcomes.append(("ConfigError", str(error), getattr(error, "key", None), dist.is_initialized()))
        except Exception as error:  # noqa: BLE001
            outcomes.append((type(error).__name__, str(error), None, dist.is_initialized()))
        else:
            outcomes.append((None, "accepted", None, dist.is_initialized()))
    return outcomes


def test_bad_config_fails_before_process_group():
    for rank, outcomes in enumerate(run_distributed(initialize_with_bad_configs, 2, timeout=60)):
        for (overrides, names), (kind, message, key, initialized) in zip(BAD_CONFIGS, outcomes):
            what = f"rank {rank}, config {overrides}"
            assert kind == "ConfigError", f"{what}: got {kind}: {message}"
            for name in names:
                assert name in message, f"{what}: {name!r} not named in {message!r}"
            assert not initialized, f"{what}: torch.distributed was initialized before the config was checked"
