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


class _MegatronMpu:
    """Megatron-LM's mpu module as DeepSpeed's `configure(mpu_)` takes it: getters of the tensor-parallel group."""

    def __init__(self, prefix: str) -> None:
        setattr(self, prefix + "group", lambda: None)  # one rank: no group to pass
        setattr(self, prefix + "rank", lambda: 0)
        setattr(self, prefix + "world_size", lambda: 1)


@pytest.mark.parametrize("prefix", ["get_tensor_model_parallel_", "get_model_parallel_"])
def test_a_megatron_mpu_of_one_rank_configures_without_tensor_parallelism(unconfigured, prefix):
    ckpt.configure(_MegatronMpu(prefix), partition_activations=True)
    assert ckpt.is_configured() and ckpt._state.tp is None and ckpt._state.tp_rank() == 0
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    ckpt.reset()
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), x).sum().backward()  # partitioning over one rank keeps it whole
    torch.testing.assert_close(weight.grad, torch.autograd.grad((x.detach() @ weight).tanh().sum(), weight)[0])
    assert ckpt.stats()["input_bytes"] == 0  # nothing to partition over: the inputs are saved as they are
    with pytest.raises(TypeError, match="mpu_ must be a Topology, a Comm or an object with "
                                        "get_model_parallel_group/rank/world_size, not object"):
        ckpt.configure(object())


def test_configure_logs_what_it_set_and_profile_logs_each_forward_and_recompute(unconfigured, monkeypatch, caplog):
    """The log line names each setting by its key; `profile` times every forward and recompute (one clock tick of
    0.25 s each here) into the log in milliseconds and into `stats()` in seconds."""
    import logging
    from types import SimpleNamespace

    caplog.set_level(logging.INFO, logger="zerotrain")
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3, profile=True)
    assert caplog.messages[-1] == ("activation checkpointing: partition_activations=True cpu_checkpointing=False "
                                   "contiguous=True (number_checkpoints=3) synchronize=False profile=True tp=1")
    clock = iter(0.25 * i for i in range(1000))
    monkeypatch.setattr(ckpt, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    ckpt.reset()
    caplog.clear()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    ckpt.checkpoint(lambda t: (t @ weight).tanh(), torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert caplog.messages == ["activation checkpoint forward: 250.000 ms", "activation checkpoint recompute: 250.000 ms"]
    stats = ckpt.stats()
    assert (stats["forwards"], stats["recomputes"], stats["forward_seconds"], stats["recompute_seconds"]) == (
        1, 1, 0.25, 0.25)


def test_torchs_checkpoint_options_are_taken_and_early_stop_is_always_off(unconfigured):
    """Hugging Face passes use_reentrant=False (and may pass early_stop, preserve_rng_state): accepted; the recompute
    runs to the end whatever early_stop says (every hooked module of a ZeRO-3 recompute must finish)."""
    seen = []
    weight = torch.nn.Parameter(torch.randn(4, 4))

    def body(t):
        seen.append("first")
        hidden = (t @ weight).tanh()
        seen.append("second")  # after the last saved tensor: early stopping would skip this in the recompute
        return hidden * 2

    x = torch.randn(3, 4, requires_grad=True)
    ckpt.checkpoint(body, x, use_reentrant=False, early_stop=True, preserve_rng_state=False).sum().backward()
    assert seen == ["first", "second"] * 2
    torch.testing.assert_close(weight.grad, torch.autograd.grad(((x.detach() @ weight).tanh() * 2).sum(), weight)[0])
    with pytest.raises(ValueError, match="context_fn is not supported"):
        ckpt.checkpoint(body, x, context_fn=lambda: (None, None))


def test_the_contiguous_arena_hands_out_slots_of_one_buffer_and_takes_them_back():
    """`contiguous_memory_optimization`: up to `number_checkpoints` kept slices share one buffer per size, in slot
    order; one more is kept in its own tensor (counted); a slot is free again once its owner is collected."""
    import gc

    from zerotrain.checkpointing.saved import ContiguousArena

    class Owner:
        pass

    arena = ContiguousArena(2)
    owners = [Owner() for _ in range(3)]
    sources = [torch.full((5,), float(i)) for i in range(3)]
    views = [arena.take(source, owner) for source, owner in zip(sources, owners)]
    (buffer,) = arena.buffers.values()
    assert buffer.numel() == 10
    assert views[0].data_ptr() == buffer.data_ptr() and views[1].data_ptr() == buffer.data_ptr() + 5 * 4
    assert torch.equal(buffer, torch.cat(sources[:2])) and views[2] is sources[2] and arena.overflows == 1
    del owners[0]
    gc.collect()
    again = arena.take(torch.full((5,), 7.0), Owner())
    assert again.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:5], torch.full((5,), 7.0))
    assert torch.equal(views[1], sources[1])  # the slot still owned keeps its data
    other = arena.take(torch.ones(3, dtype=torch.float64), Owner())  # another size and dtype: its own buffer
    assert len(arena.buffers) == 2 and other.dtype == torch.float64 and arena.overflows == 1
    arena.reset()
    assert arena.buffers == {} and arena.free == {}
    assert ContiguousArena(0).slots == 1  # number_checkpoints 0 still keeps one
