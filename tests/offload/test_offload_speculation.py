"""super_offload and plain CPU offload with zerotrain's CPU Adam kernel end to end, and speculation failures.

- The kernel's copy-back writes the model shards in the update pass (publish copies nothing for them) and the
  runs still equal the device (no offload) run bit for bit, in bf16 and fp32.
- A forward between a boundary backward and `step()` sees the weights of the last step: the speculative
  writes are undone exactly, and the run equals plain offload bit for bit.
- A failing speculative update on rank 1 only ends every rank at once (not through the comm timeout) with an
  error naming rank 1, every rank rolled back; retrying the step continues the run as if nothing happened
  (fp32: agreed in `step()`; fp16: agreed in `has_overflow()`).
World 2, gloo, the OddMLP of the other offload tests.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from distributed import run_distributed
from models_for_tests import micro_slice
from offload_common import (ACCUMULATION, MICRO, STEPS, assert_same_snapshot, engine_config, param_groups, snapshot,
                            world_batches)

COMM_TIMEOUT = 30.0
FAIL_STEP = 1  # clipping does not fire on it: the speculative updates would be committed


def _engine(stage: int, block: dict | None, precision: str):
    import zerotrain
    from models_for_tests import OddMLP

    config = engine_config(stage, block, "fp16" if precision == "fp16" else "fp32")
    config["bf16"] = {"enabled": precision == "bf16"}
    config["comm_timeout_seconds"] = COMM_TIMEOUT
    torch.manual_seed(0)
    model = OddMLP()
    engine, _, _, _ = zerotrain.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, at_boundary=None) -> list[float]:
    """Train STEPS steps; `at_boundary(step)` runs after the boundary backward, before `engine.step()`,
    and returns True when it took the step itself."""
    import torch.distributed as dist

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    losses = []
    for step, batch in enumerate(world_batches(world)):
        total = torch.zeros(1)
        for a in range(ACCUMULATION):
            x, y = micro_slice(batch, a, rank, world, MICRO)
            loss = engine(x.to(engine.dtype), y.to(engine.dtype))
            engine.backward(loss)
            total += loss.detach().float()
            if a == ACCUMULATION - 1 and at_boundary is not None and at_boundary(step):
                continue
            engine.step()
        dist.all_reduce(total)
        losses.append(total.item() / (ACCUMULATION * world))
    return losses


def copy_back_runs(precision: str) -> list:
    """Device, plain offload and super_offload runs; records which model shards each publish skipped."""
    results = []
    for block in (None, {"device": "cpu"}, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}):
        engine = _engine(2, block, precision)
        opt = engine.zero_optimizer
        skipped = []
        publish = opt.publish

        def recording_publish(current=(), publish=publish, skipped=skipped):
            skipped.append(sorted(current))
            return publish(current=current) if current else publish()

        opt.publish = recording_publish
        losses = _train(engine)
        results.append({"losses": losses, "weights": engine.full_state_dict(), "skipped": skipped,
                        "offloaded": list(getattr(opt, "offloaded", [])), "stats": dict(getattr(opt, "stats", {}))})
        engine.close()
    return results


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_kernel_copy_back_equals_the_device_run_bitwise(precision):
    per_rank = run_distributed(copy_back_runs, 2, precision, timeout=120)
    for rank, (device, plain, spec) in enumerate(per_rank):
        everything = [i for i, off in enumerate(plain["offloaded"]) if off]
        assert everything, "the buckets are offloaded"
        assert plain["skipped"] == [everything] * STEPS, (rank, plain["skipped"])  # the kernel wrote every shard
        committed = spec["stats"]["committed"]
        assert committed >= 1 and spec["stats"]["clip_redos"] >= 1, spec["stats"]
        # every offloaded bucket's share of the norm was summed during backward, every step
        assert spec["stats"]["norm_buckets_ahead"] == len(everything) * STEPS, spec["stats"]
        assert all(s == everything for s in spec["skipped"]), (rank, spec["skipped"])  # speculated or redone
        assert spec["losses"] == plain["losses"] == device["losses"], rank
        if rank == 0:
            for name, ref in device["weights"].items():
                assert torch.equal(plain["weights"][name], ref), (precision, name)
                assert torch.equal(spec["weights"][name], ref), (precision, name)


def forward_before_step() -> dict:
    """super_offload with an extra forward between the boundary backward and the step at FAIL_STEP."""
    plain = _engine(2, {"device": "cpu"}, "fp32")
    plain_losses = _train(plain)
    plain_final = snapshot(plain)
    plain.close()

    engine = _engine(2, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}, "fp32")
    opt = engine.zero_optimizer
    seen = {}

    def at_boundary(step: int) -> bool:
        if step != FAIL_STEP:
            return False
        before = seen["before"]
        opt._settle()  # wait for the speculative updates (agreeing, as step() would)
        seen["written"] = sorted(opt._written)
        seen["shards_moved"] = [not torch.equal(b.local_shard(), s) for b, s in zip(engine.buckets, before["model"])]
        with torch.no_grad():
            engine(torch.randn(MICRO, 6), torch.randn(MICRO, 3))  # the model is used again before the step: the speculative weights are undone
        assert_same_snapshot(before, snapshot(engine), "after a forward between backward and step")
        seen["rolled_back"] = opt.stats["other_rollbacks"]
        engine.step()
        return True

    real_backward = engine.backward

    def backward(loss):
        if engine.is_gradient_accumulation_boundary() and engine.global_steps == FAIL_STEP:
            seen["before"] = snapshot(engine)
        return real_backward(loss)

    engine.backward = backward
    losses = _train(engine, at_boundary)
    final = snapshot(engine)
    engine.close()
    assert_same_snapshot(plain_final, final, "super_offload with an extra forward vs plain offload")
    return dict(seen, before=None, losses=losses, plain_losses=plain_losses)


def test_forward_before_step_undoes_speculative_weights():
    for rank, seen in enumerate(run_distributed(forward_before_step, 2, timeout=120)):
        assert seen["written"] and any(seen["shards_moved"]), (rank, seen)  # speculation wrote model shards
        assert seen["rolled_back"] == 1, seen
        assert seen["losses"] == seen["plain_losses"], rank


def failing_speculation(precision: str) -> dict:
    """Train; at FAIL_STEP rank 1's second speculative bucket update raises; the step must fail on every rank
    promptly, naming rank 1, leave the state as before it, and a retry must continue the run."""
    from zerotrain.offload.speculative import SpeculationError

    clean = _engine(2, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}, precision)
    clean_losses = _train(clean)
    clean_final = snapshot(clean)
    clean.close()

    engine = _engine(2, {"device": "cpu", "super_offload": True, "super_offload_speculation": "always"}, precision)
    opt = engine.zero_optimizer
    rank = int(os.environ["RANK"])
    real_step_to = opt.cpu_adam.step_to
    outcome = {}

    def failing_step_to(*args, **kwargs):
        outcome["calls"] = outcome.get("calls", 0) + 1
        if outcome["calls"] == 2:
            raise RuntimeError("injected failure in the speculative update")
        return real_step_to(*args, **kwargs)

    real_backward = engine.backward

    def backward(loss):
        if engine.is_gradient_accumulation_boundary() and engine.global_steps == FAIL_STEP:
            outcome["before"] = snapshot(engine)
            if rank == 1:  # switched off after the failed step (the updates run in the background thread)
                opt.cpu_adam.step_to = failing_step_to
        return real_backward(loss)

    def at_boundary(step: int) -> bool:
        if step != FAIL_STEP:
            return False
        start = time.perf_counter()
        try:
            with pytest.raises(SpeculationError) as raised:
                engine.step()
        finally:
            opt.cpu_adam.step_to = real_step_to
        outcome["seconds"] = time.perf_counter() - start
        outcome["message"] = str(raised.value)
        assert engine.global_steps == FAIL_STEP
        assert_same_snapshot(outcome.pop("before"), snapshot(engine), f"rank {rank}: after the failed step")
        engine.step()  # retry: the reduced gradients are untouched
        return True

    engine.backward = backward
    losses = _train(engine, at_boundary)
    final = snapshot(engine)
    outcome.update(stats=dict(opt.stats), same_losses=losses == clean_losses)
    assert_same_snapshot(clean_final, final, f"rank {rank}: the retried run vs a clean run")
    engine.close()
    return outcome


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_speculation_failure_on_one_rank_ends_every_rank_naming_it(precision):
    for rank, outcome in enumerate(run_distributed(failing_speculation, 2, precision, timeout=120)):
        message = outcome["message"]
        assert "failed on rank(s) [1]" in message, message
        assert ("injected failure" in message) == (rank == 1), message
        assert outcome["seconds"] < COMM_TIMEOUT / 6, f"rank {rank} ended after {outcome['seconds']:.1f} s"
        assert outcome["same_losses"], rank
        assert outcome["stats"]["other_rollbacks"] >= 1, outcome["stats"]
