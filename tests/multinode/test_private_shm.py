"""Ranks that share hostname, boot id, pids and network but not /dev/shm (containers started with
`--network=host --pid=host`, each with its own /dev/shm): the same-host transport's mailbox is not visible to
every rank, so every rank must fall back to sockets (agreed), not crash at the first all-gather."""
from __future__ import annotations

import os

import pytest
import torch

import netns
from distributed import run_distributed

pytestmark = pytest.mark.skipif(netns.skip_reason() is not None, reason=str(netns.skip_reason()))


def gather_with_private_shm(private_ranks: list) -> list:
    from zerotrain.comm import Comm, CommCounters
    from zerotrain.topology import Topology

    rank = int(os.environ["RANK"])
    if rank in private_ranks:
        netns.private_dev_shm()
    Topology.build()
    world = int(os.environ["WORLD_SIZE"])
    comm = Comm(None, rank, world, CommCounters(), same_host_transport=True, timeout_seconds=60)
    full = torch.empty(world * 3)
    comm.all_gather(full, torch.full((3,), float(rank)))
    half = torch.empty(3)
    comm.reduce_scatter(half, torch.arange(3.0 * world))
    return [comm._same_host() is not None, full.tolist(), half.tolist()]


def test_private_dev_shm_falls_back_to_sockets_on_every_rank():
    # ranks 0 and 1 share /dev/shm (and could map the mailbox), rank 2 has its own: all three take sockets
    for rank, (used, gathered, reduced) in enumerate(run_distributed(gather_with_private_shm, 3, [2], timeout=120)):
        assert not used, rank
        assert gathered == [0.0] * 3 + [1.0] * 3 + [2.0] * 3, rank
        assert reduced == [3.0 * (3 * rank + i) for i in range(3)], rank
