"""When one of gloo's own collectives fails (a silent peer's timeout, a dead peer's closed sockets), the error names
the peer that never reached it, by global rank and node, in one line (`zerotrain.comm.blame`); so does the same-host
transport's setup exchange (a group's first all-gather), which goes through `Comm` too. One 3-rank launch on
this host (nodes of 2 ranks by ZEROTRAIN_RANKS_PER_NODE: rank 2 is node 1), short group timeouts."""
from __future__ import annotations

import datetime
import os
import time

import pytest

from distributed import run_distributed

TIMEOUT = 3  # seconds: the groups' timeout, and the grace the survivors wait for each other's reports


def _wait_for(paths: list[str]) -> None:
    deadline = time.monotonic() + 60
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)


def silent_then_dead(flags: str) -> dict:
    import torch
    import torch.distributed as dist

    from zerotrain.comm import Comm, CollectiveError

    os.environ["ZEROTRAIN_RANKS_PER_NODE"] = "2"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    errors: dict = {}
    # (1) rank 2 stays out of the all-reduce (alive, but silent): ranks 0 and 1 time out; rank 1 waits on a handle
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    comm = Comm(group, rank, 3, timeout_seconds=TIMEOUT)
    if rank == 2:
        _wait_for([f"{flags}.0", f"{flags}.1"])
    else:
        try:
            if rank == 0:
                comm.all_reduce(torch.ones(4))
            else:
                comm.all_reduce(torch.ones(4), async_op=True).wait()
        except CollectiveError as error:
            errors["silent"] = str(error)
        open(f"{flags}.{rank}", "w").close()
    # (2) rank 2 dies (no goodbye): the next all-reduce fails on a closed connection, or times out
    dead = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))
    fresh = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT))  # no collective yet: its transport unset
    Comm(dead, rank, 3, timeout_seconds=TIMEOUT).barrier()
    if rank == 2:
        os._exit(0)
    time.sleep(0.5)
    try:
        Comm(dead, rank, 3, timeout_seconds=TIMEOUT).all_reduce(torch.ones(4))
    except CollectiveError as error:
        errors["dead"] = str(error)
    # (3) the first all-gather of a group sets the same-host transport up (an exchange of who is where): with the
    # dead peer that exchange fails, and names it too
    try:
        Comm(fresh, rank, 3, timeout_seconds=TIMEOUT).all_gather(torch.empty(3), torch.ones(1))
    except CollectiveError as error:
        errors["setup"] = str(error)
    open(f"{flags}.done{rank}", "w").close()  # rank 0 hosts the job's store: it stays until rank 1 is done with it
    _wait_for([f"{flags}.done0", f"{flags}.done1"])
    return errors


@pytest.mark.slow  # a fault case (~13 s); the cheap one in the default suite is test_link_cut.py
def test_a_failed_gloo_collective_names_the_peer_that_never_reached_it(tmp_path):
    results = run_distributed(silent_then_dead, 3, str(tmp_path / "flag"), timeout=90, expect_exit={2})
    assert results[2] is None
    for rank in (0, 1):
        for case, kind in (("silent", "all_reduce"), ("dead", "all_reduce"), ("setup", "same-host transport setup")):
            message = results[rank].get(case)
            assert message is not None, (rank, case, results[rank])  # the collective failed
            assert "\n" not in message, message  # one line
            assert message.startswith(f"{kind} (never reached by global rank 2 (node 1) within {TIMEOUT} s"), message
            assert message.count("global rank") == 1 and f"failed on rank {rank} of 3" in message, message  # once
