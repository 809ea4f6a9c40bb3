"""NVMe offload failures: an injected failing write (EIO, ENOSPC) raises in the training process
and leaves the training state exactly as before the step; retrying the step then continues the
run as if nothing had happened."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from distributed import run_distributed
from offload_common import assert_same_snapshot, build_engine, snapshot, train_steps, world_batches

FAIL_STEP = 2


def _failing_writes(aio, fail_at: int, code: int):
    """Make the `fail_at`-th write from now (and later ones) fail with `code`; returns a switch-off."""
    real = aio._pwrite
    calls = {"n": 0}

    def pwrite(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] >= fail_at:
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    aio._pwrite = pwrite
    return lambda: setattr(aio, "_pwrite", real)


def train_with_failure(nvme_path: str, code: int | None) -> dict:
    import zerotrain.offload.aio as aio
    from zerotrain.offload import OffloadIOError

    engine = build_engine(2, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2})
    opt = engine.zero_optimizer
    outcome = {}
    original_step = engine._take_model_step

    def step_with_fault():
        if code is None or engine.global_steps != FAIL_STEP or outcome:
            return original_step()
        before = snapshot(engine)
        slots = (dict(opt.slot), dict(opt.has_state))
        restore = _failing_writes(aio, fail_at=4, code=code)  # 3 chunks: 6 writes a step (backups, states)
        try:
            with pytest.raises(OffloadIOError) as raised:
                original_step()
        finally:
            restore()
        outcome["message"] = str(raised.value)
        assert engine.global_steps == FAIL_STEP
        assert (dict(opt.slot), dict(opt.has_state)) == slots
        assert_same_snapshot(before, snapshot(engine), "after the failed step")
        outcome["restored"] = True
        original_step()  # retry: the gradients are untouched, so this is the step that failed

    engine._take_model_step = step_with_fault
    losses, _ = train_steps(engine, world_batches(2))
    outcome.update(losses=losses, weights=engine.full_state_dict(), stats=dict(opt.stats))
    opt.close()
    assert not os.path.exists(opt.directory), "the swap directory is removed on close"
    return outcome


def run_all(nvme_path: str) -> list:
    return [train_with_failure(os.path.join(nvme_path, str(code)), code) for code in (None, errno.EIO, errno.ENOSPC)]


def test_failing_write_raises_and_leaves_state_unchanged(tmp_path):
    clean, eio, enospc = run_distributed(run_all, 2, str(tmp_path), timeout=120)[0]
    assert eio["restored"] and enospc["restored"]
    assert "failed" in eio["message"] and "writing" in eio["message"], eio["message"]
    assert "no space left on device" in enospc["message"], enospc["message"]
    for failed in (eio, enospc):
        assert failed["stats"]["nvme_failed_steps"] == 1
        assert failed["stats"]["nvme_restored_chunks"] >= 1, "some chunks were updated before the failure"
    for failed in (eio, enospc):
        assert failed["losses"] == clean["losses"]
        for name, ref in clean["weights"].items():
            assert torch.equal(failed["weights"][name], ref), name
