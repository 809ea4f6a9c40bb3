"""zerotrain.checkpointing's RNG tracker and settings in-process (issue #48, round 4): the tensor-parallel seed is
DeepSpeed's (seed + 2718 + tp rank) and a fork leaves the default generator where it was; the tracker's refusals;
what `configure` starts from and the counters `stats()` reports for a checkpoint's forward and recompute."""
from __future__ import annotations

import pytest
import torch

from zerotrain import checkpointing as ckpt
from zerotrain.checkpointing.rng import MODEL_PARALLEL_RNG, RNGStatesTracker, rng_device_type
from zerotrain.checkpointing.settings import Settings


def _draws(seed: int, count: int = 2, size: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(size, generator=generator) for _ in range(count)]


@pytest.fixture
def unconfigured():
    """checkpointing as a process starts: no tensor-parallel group; put back afterwards."""
    ckpt.configure(None)
    yield
    ckpt.configure(None)


def test_the_device_is_the_accelerators_else_the_cpu():
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    assert rng_device_type() == (accelerator.type if accelerator is not None else "cpu")
    assert ckpt.get_rng_tracker().device_type == rng_device_type()


def test_a_torch_without_torch_accelerator_draws_on_the_cpu(monkeypatch):
    """torch 2.4 and 2.5 (pyproject's floor) have no `torch.accelerator`: the CPU generator, not an AttributeError."""
    monkeypatch.delattr(torch, "accelerator")
    assert rng_device_type() == "cpu"


@pytest.mark.parametrize("tp_rank, tracked_seed", [(None, 7 + 2718), (0, 7 + 2718), (3, 7 + 2718 + 3)])
def test_model_parallel_seed_is_deepspeeds_and_a_fork_leaves_the_default_generator(unconfigured, tp_rank,
                                                                                 tracked_seed):
    before = torch.get_rng_state()
    try:
        ckpt.model_parallel_manual_seed(7, tp_rank=tp_rank)
        tracker = ckpt.get_rng_tracker()
        default, tracked = _draws(7), _draws(tracked_seed)
        assert torch.equal(torch.rand(5), default[0])  # the default generator: seed itself, on every tp rank
        with tracker.fork():
            assert torch.equal(torch.rand(5), tracked[0])
        assert torch.equal(torch.rand(5), default[1])  # untouched by the fork
        with tracker.fork(MODEL_PARALLEL_RNG):
            assert torch.equal(torch.rand(5), tracked[1])  # the tracked state advanced
        ckpt.model_parallel_manual_seed(7, tp_rank=tp_rank)  # seeding again starts both over
        with tracker.fork():
            assert torch.equal(torch.rand(5), tracked[0])
    finally:
        torch.set_rng_state(before)


def test_the_tracker_refuses_a_seed_or_name_twice_and_an_unknown_fork():
    tracker = RNGStatesTracker("cpu")
    before = torch.get_rng_state()
    tracker.add("a", 11)
    assert torch.equal(torch.get_rng_state(), before)  # adding a state leaves the default generator alone
    with pytest.raises(ValueError, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(ValueError, match="state 'a' already exists"):
        tracker.add("a", 12)
    with pytest.raises(KeyError, match="state 'c' is not added"):
        with tracker.fork("c"):
            pass
    states = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(3)
    assert not torch.equal(tracker.get_states()["a"], states["a"])
    tracker.set_states(states)  # back to the snapshot: the same draws again
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), _draws(11, 1, 3)[0])
    tracker.reset()
    tracker.add("a", 11)  # forgotten: both may be used again


def test_before_configure_nothing_is_set():
    fresh = Settings()
    assert (fresh.configured, fresh.partition, fresh.cpu, fresh.contiguous, fresh.synchronize, fresh.profile) == (
        False, False, False, False, False, False)
    assert fresh.tp_rank() == 0 and fresh.number_checkpoints is None and fresh.arena is None


def test_stats_count_each_forward_and_recompute_and_the_inputs_a_saver_keeps(unconfigured):
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    ckpt.reset()
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()
    assert ckpt.stats() == {"forwards": 1, "recomputes": 1, "forward_seconds": 0.0, "recompute_seconds": 0.0,
                            "input_bytes": 0, "kept_device_bytes": 0, "kept_host_bytes": 0}
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()
    assert (ckpt.stats()["forwards"], ckpt.stats()["recomputes"]) == (2, 2)
    ckpt.configure(None, checkpoint_in_cpu=True, profile=True)  # counters carry over a configure
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()
    stats = ckpt.stats()
    assert (stats["forwards"], stats["recomputes"]) == (3, 3)
    assert stats["forward_seconds"] > 0 and stats["recompute_seconds"] > 0
    assert stats["input_bytes"] == stats["kept_host_bytes"] == 0  # CPU tensors: cpu_checkpointing keeps nothing
    ckpt.reset()
    assert ckpt.stats() == {"forwards": 0, "recomputes": 0, "forward_seconds": 0.0, "recompute_seconds": 0.0,
                            "input_bytes": 0, "kept_device_bytes": 0, "kept_host_bytes": 0}
