"""RNG state resumes exactly: python `random`, numpy and torch CPU continue after a load as if never interrupted."""
from __future__ import annotations

import os
import random

import numpy as np
import torch

from ckpt_common import make_engine, train
from distributed import run_distributed


def draw() -> dict:
    """A few numbers from every generator a training loop uses (dropout draws from torch's CPU generator)."""
    return {"python": [random.random() for _ in range(3)], "numpy": np.random.rand(3).tolist(),
            "torch": torch.rand(3).tolist(),
            "dropout": torch.nn.functional.dropout(torch.ones(16), p=0.5).tolist()}


def save_draw_load_draw(save_dir: str) -> dict:
    rank = int(os.environ["RANK"])
    engine = make_engine(stage=2, async_save=True)
    random.seed(10 + rank), np.random.seed(20 + rank), torch.manual_seed(30 + rank)  # each rank its own streams
    train(engine, 0, 1)
    draw()  # advance every generator past its seed
    engine.save_checkpoint(save_dir, tag="rng")
    uninterrupted = draw()  # drawn while the asynchronous save is still being written
    engine.wait_checkpoint()

    fresh = make_engine(stage=2, seed=5)
    random.seed(99), np.random.seed(99)
    before_load = draw()
    fresh.load_checkpoint(save_dir)
    return {"uninterrupted": uninterrupted, "before_load": before_load, "resumed": draw()}


def test_rng_continues_identically_after_load(tmp_path):
    results = run_distributed(save_draw_load_draw, 2, str(tmp_path / "ckpt"))
    for rank, out in enumerate(results):
        assert out["resumed"] == out["uninterrupted"], f"rank {rank}"
        for kind in out["resumed"]:  # the load changed every generator
            assert out["before_load"][kind] != out["resumed"][kind], (rank, kind)
    for kind in results[0]["resumed"]:  # each rank got its own state back, not rank 0's
        assert results[0]["resumed"][kind] != results[1]["resumed"][kind], kind
