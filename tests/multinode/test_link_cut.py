"""The cheap link cut that runs in the default suite (the full node faults, real `zerotrain train` launches on two
nodes, are opt-in: test_node_faults.py). 2 nodes x 2 ranks over network namespaces (netns.py) talk through a group
with a 3 s timeout; node 0 takes the link down mid-run. Every rank's next collective fails within the timeout plus
comm.blame's grace, in one line naming what it can: node 0's ranks the ranks of node 1 that never reached it, node
1's ranks that the job's store on node 0 is out of reach too. One 4-rank launch, ~15 s on a quiet machine.

The ranks order the cut through files (the nodes share this machine's file system), never through the link itself:
the link is cut only once every rank has left the barrier before it (a barrier's last message still in flight when
the link went down left a node-1 rank waiting out the 60 s group timeout), no rank starts the collective that sees
the cut before the cut (or node 1's ranks could report on the store first), and rank 0, whose process hosts the
job's store here (no torchrun agent), leaves only after every rank has read its blame from it (a rank that failed
a few seconds after rank 0 found the store gone with rank 0's exit and reported itself cut off from it: the 2 in 8
failures under load)."""
from __future__ import annotations

import datetime
import os
from pathlib import Path
import re
import subprocess
import time

import pytest

import netns
from distributed import run_distributed

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))

TIMEOUT = 3  # seconds: the group's timeout (comm_timeout_seconds), and so the grace the survivors wait


def _wait_for(paths: list, what: str, seconds: float = 90.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still missing {[p.name for p in paths if not p.exists()]}")
        time.sleep(0.05)


def cut_mid_run(pids: list, signals: str) -> dict:
    import torch
    import torch.distributed as dist

    from zerotrain.comm import CollectiveError, Comm

    node = netns.join_as_rank(pids, 2)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    # the group that sees the cut (gloo connects its pairs here, before the cut); the traffic before it goes through
    # the default group's 60 s, so a loaded machine cannot time it out
    short = Comm(dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT)), rank, 4, timeout_seconds=TIMEOUT)
    comm = Comm(None, rank, 4, timeout_seconds=60)
    total = torch.ones(4)
    comm.all_reduce(total)  # the link works: gloo's own all-reduce, and the point-to-point all-gather
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.tensor([float(rank)]))
    comm.barrier()
    folder = Path(signals)
    (folder / f"ready.{rank}").touch()
    if rank == 0:  # in node 0's network namespace: its end of the veth down, and with it the link
        _wait_for([folder / f"ready.{r}" for r in range(4)], "ranks past the barrier")
        subprocess.run(["ip", "link", "set", netns.LINK, "down"], check=True)
        (folder / "cut").touch()
    _wait_for([folder / "cut"], "the cut")
    started = time.monotonic()
    try:
        short.all_reduce(torch.ones(4))
        error = None
    except CollectiveError as failure:
        error = str(failure)
    seconds = time.monotonic() - started
    (folder / f"done.{rank}").touch()
    if rank == 0:  # the store lives in this process: it stays until every rank has asked it
        _wait_for([folder / f"done.{r}" for r in range(4)], "ranks' reports")
    return {"node": node, "before": (total.tolist(), gathered.tolist()), "error": error, "seconds": seconds}


def test_a_cut_link_ends_every_rank_within_the_timeout_naming_the_other_side(tmp_path):
    with netns.two_nodes() as nodes:
        results = run_distributed(cut_mid_run, 4, [node.pid for node in nodes.nodes], str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        assert result["node"] == rank // 2 and result["before"] == ([4.0] * 4, [0.0, 1.0, 2.0, 3.0]), result
        error = result["error"]
        assert error is not None and "\n" not in error, result  # it failed, in one line
        assert error.startswith("all_reduce (") and f"failed on rank {rank} of 4" in error, error
        if rank < 2:  # node 0 still reaches the store (on node 0): node 1's ranks never reported
            assert re.match(rf"all_reduce \(never reached by global ranks 2, 3 \(node 1\) within {TIMEOUT} s", error), error
        else:  # node 1 is cut off from node 0, the store's host
            assert f"the job's store at {netns.SUBNET}.1:" in error and "did not answer either" in error, error
        assert result["seconds"] < 2 * TIMEOUT + 10, result  # the timeout, the grace, slack for a loaded machine
    assert f"ztmn{os.getpid()}x" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
