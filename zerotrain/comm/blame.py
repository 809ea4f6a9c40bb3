"""Which peer did not answer, when one of gloo's own collectives fails.

gloo's errors name no rank: a timeout says only "Timed out waiting 10000ms for recv operation to complete", a dead
peer's closed socket at most an address (and only on the ranks that were reading from that peer); the same-host
transport's timeout names none either. So when a collective that gloo runs itself (all-reduce, barrier, broadcast,
all-to-all, ...) or the same-host transport fails, every failing rank reports
the failure on the job's store (the TCPStore at MASTER_ADDR:MASTER_PORT: torchrun's agent's, or rank 0's) under
the collective's sequence number in its group, and waits a short grace (the group's timeout, at most 30 s) for the
group's other ranks to report the same. The members that never do are the ones that did not reach the collective:
dead, stuck elsewhere, or cut off by the network; the error names them, with their node (global rank //
ranks per node). A rank that cannot reach the store either is itself cut off from it, and says so.

Nothing of this runs until a collective has failed: the happy path costs a counter increment per collective.
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from collections import defaultdict
from typing import Optional

import torch.distributed as dist

from ..topology import _ranks_per_node  # the layout's one reading of ZEROTRAIN_RANKS_PER_NODE / LOCAL_WORLD_SIZE

_GRACE_CAP_SECONDS = 30.0

# Gloo collectives issued so far per process group (by name): every rank of a group issues the same ones in the
# same order, so (group, number) names one collective on every rank.
_ISSUED: dict[str, int] = defaultdict(int)


def next_number(group_name: str) -> int:
    """The number of the collective about to be issued on `group_name` (counted per process)."""
    _ISSUED[group_name] += 1
    return _ISSUED[group_name]


def _names(ranks: list[int], world: int) -> str:
    per_node = _ranks_per_node(world)
    by_node: dict[int, list[int]] = defaultdict(list)
    for rank in ranks:
        by_node[rank // per_node].append(rank)
    parts = []
    for node, members in sorted(by_node.items()):
        listed = ", ".join(map(str, members))
        parts.append(f"global rank{'s' if len(members) > 1 else ''} {listed} (node {node})")
    return "; ".join(parts)


def silent_members(group_name: str, number: int, members: list[int], timeout_seconds: float) -> str:
    """Report this rank's failure of collective `number` of `group_name` (whose global ranks are `members`) on
    the job's store, wait for the other members' reports, and say in a clause who did not report (or why
    nobody can be named)."""
    if not dist.is_initialized():
        return "torch.distributed is not running"
    me, world = dist.get_rank(), dist.get_world_size()
    others = [r for r in members if r != me]
    if len(others) == 1:  # a pair: the peer is the one
        return f"with its peer {_names(others, world)}"
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return "no job store (MASTER_ADDR, MASTER_PORT) to ask which peer did not answer"
    grace = max(1.0, min(timeout_seconds, _GRACE_CAP_SECONDS))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"zerotrain/failed/{attempt}/{group_name}/{number}/"
    try:
        store = dist.TCPStore(address, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=grace))
        store.set(prefix + str(me), socket.gethostname())
        deadline = time.monotonic() + grace
        while True:
            missing = [r for r in others if not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except (RuntimeError, OSError, ValueError) as error:  # the store is out of reach too (or gone with rank 0)
        return (f"the job's store at {address}:{port} did not answer either ({type(error).__name__}): this "
                f"rank is cut off from it, or its host is down")
    if not missing:
        return f"every rank of the group reached it and failed it within {grace:.0f} s"
    return f"never reached by {_names(missing, world)} within {grace:.0f} s: dead, stuck elsewhere or cut off"
