"""`CommCounters` (what `engine.memory_report()["comm"]` shows), the finished and the failed handle, and the package's
pointer from deepspeed.comm's names, in-process; the bytes real collectives count are checked against theory by
tests/test_engine_api.py::test_comm_bytes_match_theory."""
from __future__ import annotations

import torch

from zerotrain.comm.handles import CommCounters, Completed, _nbytes


def test_counters_count_calls_and_bytes_per_kind_and_logical_bytes_only_where_compressed():
    counters = CommCounters()
    counters.add("all_reduce", 96)
    counters.add("all_reduce", 32.0)
    counters.add("reduce_scatter_q4", 10, logical_bytes=80)
    counters.add("reduce_scatter_q4", 6, logical_bytes=48)
    assert counters.snapshot() == {"all_reduce": {"calls": 2, "bytes": 128},
                                   "reduce_scatter_q4": {"calls": 2, "bytes": 16, "logical_bytes": 128}}
    assert list(counters.snapshot()) == sorted(counters.snapshot())
    assert CommCounters().snapshot() == {}


def test_a_finished_handle_waits_at_once_and_tensor_bytes_are_elements_times_size():
    assert Completed().wait() is True
    assert _nbytes(torch.zeros(3, 5, dtype=torch.bfloat16)) == 30 and _nbytes(torch.zeros(7)) == 28


class _PeerGone:
    """A transport's handle whose transfer failed (what a dead peer's socket gives `wait()`)."""

    def wait(self):
        raise RuntimeError("Connection closed by peer")


def test_a_failed_handle_names_the_collective_and_rank_or_says_what_its_explainer_says():
    import pytest

    from zerotrain.comm.handles import CollectiveError, _Named

    with pytest.raises(CollectiveError, match=r"^all_gather failed on rank 1 of 4 .*Connection closed by peer"):
        _Named(_PeerGone(), "all_gather", 1, 4).wait()
    explained = CollectiveError("all_gather (rank(s) [3] never reached it) failed on rank 1 of 4")
    with pytest.raises(CollectiveError) as caught:
        _Named(_PeerGone(), "all_gather", 1, 4, explain=lambda error: explained).wait()
    assert caught.value is explained


def test_a_named_handle_answers_the_transports_own_methods(world_of_one):
    """A real gloo work wrapped: its `is_completed()` and friends still answer through the wrapper."""
    import torch.distributed as dist

    from distributed import free_port
    from zerotrain.comm.handles import _Named

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tensor = torch.ones(3)
    handle = _Named(dist.all_reduce(tensor, async_op=True), "all_reduce", 0, 1)
    handle.wait()
    assert handle.is_completed() is True and tensor.tolist() == [1.0, 1.0, 1.0]


def test_deepspeed_comm_names_on_the_internal_package_point_to_zerotrain_dist():
    """A script ported with `import zerotrain as deepspeed` that calls `deepspeed.comm.get_rank()` is told where
    the name lives; any other missing name is a plain AttributeError."""
    import pytest

    import zerotrain.comm

    with pytest.raises(AttributeError, match=r"deepspeed\.comm's get_rank is zerotrain\.dist\.get_rank"):
        zerotrain.comm.get_rank
    with pytest.raises(AttributeError, match=r"^module 'zerotrain.comm' has no attribute 'no_such_name'$"):
        zerotrain.comm.no_such_name
