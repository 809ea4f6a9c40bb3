"""The step-for-step comparison of two Trainer runs' logs, shared by tests/hf's Trainer and SFT tests."""
from __future__ import annotations

import pytest


def trainer_log(trainer) -> list:
    """(step, loss, learning rate, gradient norm) of every logged optimizer step of a finished Trainer."""
    return [(h["step"], h["loss"], h["learning_rate"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    """`a` within `tol` of `b`, relative (absolute below 1)."""
    return abs(a - b) <= tol * max(1.0, abs(b))


def assert_same_steps(where: str, log: list, ref_log: list, tol: float = 1e-5, steps: int | None = None) -> None:
    """`log` has the steps 1..`steps` of `ref_log`, each with its loss and gradient norm within `tol` (relative)
    and its learning rate equal (1e-12)."""
    if steps is not None:
        assert [s for s, *_ in log] == list(range(1, steps + 1)), (where, log)
    for (step, loss, lr, norm), (ref_step, ref_loss, ref_lr, ref_norm) in zip(log, ref_log, strict=True):
        assert step == ref_step, (where, step, ref_step)
        assert close(loss, ref_loss, tol), (where, "loss", step, loss, ref_loss)
        assert lr == pytest.approx(ref_lr, rel=1e-12, abs=1e-15), (where, "lr", step, lr, ref_lr)
        assert close(norm, ref_norm, tol), (where, "grad_norm", step, norm, ref_norm)
