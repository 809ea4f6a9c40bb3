"""NVMe offload failures: an injected failing write (EIO, ENOSPC) or a read failing in the middle of
a step raises in the training process and leaves the training state exactly as before the step (masters,
states and model weights: the slots do not flip and the updated chunks are published again from the
current slot);
retrying the step then continues the run as if nothing had happened. A failure on one rank only
raises on every rank, naming that rank, and every rank rolls back (no hang, no divergence)."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from distributed import run_distributed
from offload_common import assert_same_snapshot, build_engine, snapshot, train_steps, world_batches

FAIL_STEP = 2


def _failing_io(aio, name: str, fail_at: int, code: int, only_fds=None, once: bool = False):
    """Make the `fail_at`-th call of `aio.<name>` (`_pwrite` or `_pread`) from now, and later ones (only that
    one if `once`), fail with `code`, counting only calls on `only_fds` when given; returns a switch-off."""
    real = getattr(aio, name)
    calls = {"n": 0}

    def failing(fd, buffers, offset):
        if only_fds is None or fd in only_fds:
            calls["n"] += 1
            if calls["n"] == fail_at or (calls["n"] > fail_at and not once):
                raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    setattr(aio, name, failing)
    return lambda: setattr(aio, name, real)


def _failing_writes(aio, fail_at: int, code: int):
    """Make the `fail_at`-th write from now (and later ones) fail with `code`; returns a switch-off."""
    return _failing_io(aio, "_pwrite", fail_at, code)


def _failing_state_reads(aio, opt, fail_at: int, code: int):
    """Make the `fail_at`-th read of the slot files from now fail (a transient error); returns a switch-off.

    The reads after it work, so the failed step can publish the stepped chunks' old masters again."""
    return _failing_io(aio, "_pread", fail_at, code, only_fds=opt.records.files, once=True)


def train_with_failure(nvme_path: str, code: int | None, kind: str = "write", ranks=(0, 1)) -> dict:
    """Train 6 steps; at FAIL_STEP, on `ranks`, inject failing `kind` I/O; every rank must raise and roll back."""
    import zerotrain.offload.aio as aio
    from zerotrain.offload import OffloadIOError

    engine = build_engine(2, {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2})
    opt = engine.zero_optimizer
    outcome = {}
    original_step = engine._take_model_step
    failing_here = int(os.environ["RANK"]) in ranks

    def step_with_fault():
        if code is None or engine.global_steps != FAIL_STEP or outcome:
            return original_step()
        before = snapshot(engine)
        slots = (dict(opt.records.location), dict(opt.records.has_state))
        restore = lambda: None  # noqa: E731 - a rank without a fault has nothing to switch off
        if failing_here and kind == "write":
            restore = _failing_writes(aio, fail_at=2, code=code)  # 3 chunks: 3 record writes a step
        elif failing_here:
            # the record kept from the last step and chunk 0 are stepped, chunk 1's read fails
            restore = _failing_state_reads(aio, opt, fail_at=2, code=code)
        try:
            with pytest.raises(OffloadIOError) as raised:
                original_step()
        finally:
            restore()
        outcome["message"] = str(raised.value)
        assert engine.global_steps == FAIL_STEP
        assert (dict(opt.records.location), dict(opt.records.has_state)) == slots
        assert_same_snapshot(before, snapshot(engine), "after the failed step")
        outcome["restored"] = True
        original_step()  # retry: the gradients are untouched, so this is the step that failed

    engine._take_model_step = step_with_fault
    losses, _ = train_steps(engine, world_batches(2))
    outcome.update(losses=losses, weights=engine.full_state_dict(), stats=dict(opt.stats))
    opt.close()
    assert not os.path.exists(opt.records.directory), "the swap directory is removed on close"
    return outcome


def run_all(nvme_path: str) -> list:
    cases = [(None, "write"), (errno.EIO, "write"), (errno.ENOSPC, "write"), (errno.EIO, "read")]
    return [train_with_failure(os.path.join(nvme_path, f"{kind}{code}"), code, kind) for code, kind in cases]


def test_failing_io_raises_and_leaves_state_unchanged(tmp_path):
    clean, eio, enospc, read = run_distributed(run_all, 2, str(tmp_path), timeout=120)[0]
    assert eio["restored"] and enospc["restored"] and read["restored"]
    assert "failed" in eio["message"] and "writing" in eio["message"], eio["message"]
    assert "no space left on device" in enospc["message"], enospc["message"]
    assert "reading" in read["message"] and "states.ring" in read["message"], read["message"]
    for failed in (eio, enospc, read):
        assert "rank(s) [0, 1]" in failed["message"], failed["message"]
        assert failed["stats"]["nvme_failed_steps"] == 1
        assert failed["stats"]["nvme_restored_chunks"] >= 1, "some chunks were updated before the failure"
        assert failed["losses"] == clean["losses"]
        for name, ref in clean["weights"].items():
            assert torch.equal(failed["weights"][name], ref), name
    assert read["stats"]["nvme_restored_chunks"] == 2, "the kept record and chunk 0 were updated, chunk 1's read failed"


def one_rank_fails(nvme_path: str) -> list:
    rank = os.environ["RANK"]
    return [train_with_failure(os.path.join(nvme_path, f"r{rank}-{kind}{code}"), code, kind, ranks=ranks)
            for code, kind, ranks in ((None, "write", ()), (errno.EIO, "read", (1,)), (errno.EIO, "write", (0,)))]


def test_failure_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    per_rank = run_distributed(one_rank_fails, 2, str(tmp_path), timeout=120)
    for rank, (clean, read, write) in enumerate(per_rank):
        for failed, culprit in ((read, 1), (write, 0)):
            assert failed["restored"], (rank, culprit)
            assert f"failed on rank(s) [{culprit}]" in failed["message"], failed["message"]
            if rank != culprit:
                assert "rolled its own step back" in failed["message"], failed["message"]
            assert failed["stats"]["nvme_failed_steps"] == 1
            assert failed["losses"] == clean["losses"], (rank, culprit)
            assert set(failed["weights"]) == set(clean["weights"])  # the full state dict is on rank 0
            for name, ref in clean["weights"].items():
                assert torch.equal(failed["weights"][name], ref), (rank, culprit, name)
    assert per_rank[0][1]["stats"]["nvme_restored_chunks"] == 3, "rank 0 had stepped all 3 chunks"
