"""`CommCounters` (what `engine.memory_report()["comm"]` shows) and the finished handle of a world of one, in-process;
the bytes real collectives count are checked against theory by tests/test_engine_api.py::test_comm_bytes_match_theory."""
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
