"""comm.blame in-process: which members of a failed collective are named, from the reports on the job's store.

A real one-rank gloo group and a real TCPStore (the job's store at MASTER_ADDR:MASTER_PORT); the other members'
reports are written by the test as their ranks would write them. The spawned failures (a dead or stuck rank, a cut
link) are tests/test_failure_modes.py and tests/multinode/.
"""
from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch.distributed as dist

from distributed import free_port

from zerotrain.comm import blame


@pytest.fixture
def job_store(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("ZEROTRAIN_RANKS_PER_NODE", raising=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def _report(store, group: str, number: int, rank: int, attempt: str = "0") -> None:
    store.set(f"zerotrain/failed/{attempt}/{group}/{number}/{rank}", socket.gethostname())


def test_members_that_never_report_are_named_with_their_nodes(job_store, monkeypatch):
    _report(job_store, "WORLD", 7, 1)
    start = time.monotonic()
    clause = blame.silent_members("WORLD", 7, [0, 1, 2], timeout_seconds=1.0)
    assert clause == "never reached by global rank 2 (node 2) within 1 s: dead, stuck elsewhere or cut off"
    assert time.monotonic() - start >= 1.0  # it waited the grace for rank 2
    assert job_store.check([f"zerotrain/failed/0/WORLD/7/0"])  # and reported its own failure for the others
    # every member reported: nobody to name, and no need to wait out the grace
    _report(job_store, "WORLD", 8, 1)
    _report(job_store, "WORLD", 8, 2)
    start = time.monotonic()
    assert blame.silent_members("WORLD", 8, [0, 1, 2], timeout_seconds=5.0) == \
        "every rank of the group reached it and failed it within 5 s"
    assert time.monotonic() - start < 4.0


def test_a_restarted_job_does_not_count_the_reports_of_its_earlier_attempt(job_store, monkeypatch):
    _report(job_store, "g", 3, 1, attempt="0")  # rank 1 failed collective 3 before the restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert blame.silent_members("g", 3, [0, 1, 2], timeout_seconds=1.0).startswith(
        "never reached by global rank 1 (node 1); global rank 2 (node 2) within 1 s")
    assert job_store.check(["zerotrain/failed/1/g/3/0"])


def test_a_pair_names_its_peer_and_a_missing_or_silent_store_is_said(job_store, monkeypatch):
    assert blame.silent_members("WORLD", 1, [0, 5], timeout_seconds=1.0) == "with its peer global rank 5 (node 5)"
    monkeypatch.delenv("MASTER_PORT")
    assert blame.silent_members("WORLD", 1, [0, 1, 2], 1.0).startswith("no job store (MASTER_ADDR, MASTER_PORT)")
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))  # nothing listens there
    assert blame.silent_members("WORLD", 1, [0, 1, 2], 1.0).startswith(
        f"the job's store at 127.0.0.1:{port} did not answer either")


def test_nodes_follow_the_ranks_per_node_and_collectives_are_numbered_per_group(monkeypatch):
    monkeypatch.setenv("ZEROTRAIN_RANKS_PER_NODE", "2")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert blame._names([1, 2, 3, 6], 8) == "global rank 1 (node 0); global ranks 2, 3 (node 1); global rank 6 (node 3)"
    first = blame.next_number("test-group-a")
    assert blame.next_number("test-group-a") == first + 1 and blame.next_number("test-group-b") == 1
    assert blame.silent_members("g", 1, [0, 1], 1.0) == "torch.distributed is not running"
