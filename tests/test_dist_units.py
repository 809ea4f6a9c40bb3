"""`zerotrain.dist` (DeepSpeed's `deepspeed.comm` names) in the pytest process (issue #48: the fast covering test of
`zerotrain/dist.py`'s mutation run): before torch.distributed starts, `init_distributed`'s warnings and timeout,
and each collective at a world of one over the world, a torch group and a `Comm`. What only two ranks show (the
reduce op, the source rank) is in tests/test_dropin_api.py's world-2 launch."""
from __future__ import annotations

import datetime
import warnings

import pytest
import torch


def _timeout() -> datetime.timedelta:
    import torch.distributed as torch_dist

    return torch_dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def _warned(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught]


def test_before_start_the_world_is_one_and_collectives_say_how_to_start(monkeypatch):
    from zerotrain import dist
    from zerotrain.comm import Comm

    assert not dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
    dist.destroy_process_group()  # nothing to tear down: no error
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_local_rank() == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert dist.get_local_rank() == 0
    # a Comm answers for itself (no process group needed)
    assert (dist.get_rank(Comm(None, 2, 4)), dist.get_world_size(Comm(None, 2, 4))) == (2, 4)
    for call in (lambda: dist.all_reduce(torch.ones(1)), lambda: dist.broadcast(torch.ones(1)),
                 lambda: dist.all_gather([torch.ones(1)], torch.ones(1)), dist.barrier):
        with pytest.raises(RuntimeError, match=r"^zerotrain.dist: torch.distributed is not started; call "
                                               r"zerotrain.init_distributed\(\) or zerotrain.initialize\(\) first$"):
            call()


def test_init_distributed_warns_about_what_it_ignores_and_takes_the_timeout_in_either_form(world_of_one):
    """DeepSpeed's `init_distributed` arguments: another backend than this machine's (gloo on a CPU) and the
    rendezvous keywords are named in a warning (None values, `verbose` and `dist_init_required` are not); the
    timeout, seconds or a timedelta, is the process group's (DeepSpeed's default 30 minutes)."""
    from zerotrain import dist

    assert _warned(lambda: dist.init_distributed(dist_backend="nccl", timeout=datetime.timedelta(seconds=90))) == [
        "init_distributed(dist_backend='nccl') has no effect: zerotrain uses gloo here"]
    assert dist.is_initialized() and _timeout() == datetime.timedelta(seconds=90)
    dist.destroy_process_group()
    assert not dist.is_initialized()
    assert _warned(lambda: dist.init_distributed("gloo", 45, auto_mpi_discovery=True, distributed_port=29500,
                                                 verbose=True, dist_init_required=False, rank=None)) == [
        "init_distributed: ['auto_mpi_discovery', 'distributed_port'] have no effect in zerotrain (the launcher's "
        "environment variables set the rendezvous)"]
    assert _timeout() == datetime.timedelta(seconds=45)
    dist.destroy_process_group()
    assert _warned(dist.init_distributed) == [] and _timeout() == datetime.timedelta(minutes=30)
    dist.destroy_process_group()


def test_collectives_at_a_world_of_one_over_the_world_a_group_and_a_comm(world_of_one):
    import torch.distributed as torch_dist

    from zerotrain import dist
    from zerotrain.comm import Comm

    dist.init_distributed()
    for group in (None, torch_dist.group.WORLD, Comm(torch_dist.group.WORLD, 0, 1)):
        assert (dist.get_rank(group), dist.get_world_size(group)) == (0, 1)
        value = torch.tensor([1.5, -2.0])
        assert dist.all_reduce(value, group=group) is None and value.tolist() == [1.5, -2.0]
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group, async_op=True).wait()
        assert value.tolist() == [1.5, -2.0]
        dist.broadcast(value, group=group)
        assert value.tolist() == [1.5, -2.0]
        mine = torch.arange(6.0).reshape(2, 3)
        into = [torch.zeros(2, 3)]
        assert dist.all_gather(into, mine, group=group) is into and torch.equal(into[0], mine)
        with pytest.raises(ValueError, match=r"^all_gather needs a list of 1 tensors, got 2$"):
            dist.all_gather([torch.zeros(2, 3), torch.zeros(2, 3)], mine, group=group)
        dist.barrier(group)
