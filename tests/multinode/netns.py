"""Two "nodes" on this machine: network namespaces joined by a veth pair, each node in its own UTS and mount
namespace (its own hostname and a private /dev/shm), so zerotrain sees two hosts and moves data between them
over the link, never through shared memory.

`two_nodes()` (a context manager) builds them and tears everything down on the way out, whatever happened:
the node processes are killed and the namespaces (and with them the veth pair and its qdisc) deleted. Names are
unique per run (`ztmn<pid>x<n>`); leftovers of a run whose process is gone (a crashed or killed pytest) are
deleted first. Only root can do this: `skip_reason()` says why a test cannot run here.

A node is a holder process (`sleep`) inside the namespaces; programs join it either as a command
(`Node.command(argv)`: `nsenter` into its network, UTS and mount namespaces, in this directory) or, for a rank
forked by `tests/distributed.py` (single-threaded at that point), in-process with `join_as_rank(pids, per_node)`. Every node's
link interface is called `LINK` (as `eth0` is on every host of a cluster): `GLOO_SOCKET_IFNAME=LINK` makes
gloo use it. Traffic stays inside the namespaces; the kernel has no netem, so a `rate` (tbf) shapes bandwidth
only, no latency.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

LINK = "ztlink"
SUBNET = "10.99.0"
_PREFIX = "ztmn"
_COUNTER = itertools.count()
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18


def skip_reason() -> Optional[str]:
    """Why two nodes cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare --mount, mount tmpfs)"
    for tool in ("ip", "nsenter", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns unavailable: {probe.stderr.strip()}"
    return None


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return libc


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def private_dev_shm(size: str = "256m") -> None:
    """In this (single-threaded) process: a mount namespace of its own with an empty tmpfs over /dev/shm, as a
    container without a shared /dev/shm has (hostname, boot id, pids and network stay those of the host)."""
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    _check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, f"size={size}".encode()), "mount tmpfs /dev/shm")


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose creating process is gone; returns their names."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(rf"{_PREFIX}(\d+)x\d+n\d", name)
        if match and not _alive(int(match.group(1))):
            for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def enter(pid: int) -> None:
    """Move this single-threaded process (a rank forked by tests/distributed.py, first thing) into the node whose
    holder is `pid`: its network, hostname and mount namespace (its /dev/shm); the working directory is kept."""
    cwd = os.getcwd()
    libc = _libc()
    for kind, flag in (("net", _CLONE_NEWNET), ("uts", _CLONE_NEWUTS), ("mnt", _CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            _check(libc.setns(fd, flag), f"setns {kind} of the node held by pid {pid}")
        finally:
            os.close(fd)
    os.chdir(cwd)


def join_as_rank(pids: Sequence[int], ranks_per_node: int) -> int:
    """In a rank of tests/distributed.py's `run_distributed`: enter node RANK // ranks_per_node (of the holders
    `pids`) and set torchrun's per-node variables as a launcher on that node would (LOCAL_RANK, LOCAL_WORLD_SIZE,
    GROUP_RANK, MASTER_ADDR node 0's address, GLOO_SOCKET_IFNAME the link). Returns the node's index."""
    rank = int(os.environ["RANK"])
    node = rank // ranks_per_node
    enter(pids[node])
    os.environ.update(LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node),
                      GROUP_RANK=str(node), MASTER_ADDR=f"{SUBNET}.1", GLOO_SOCKET_IFNAME=LINK)
    return node


@dataclass
class Node:
    """One node: its index, netns name, hostname, address on the link and holder process."""
    index: int
    netns: str
    hostname: str
    address: str
    holder: subprocess.Popen

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node (its network, UTS and mount namespaces), in the current directory."""
        return ["nsenter", f"--target={self.holder.pid}", "--net", "--uts", "--mount", f"--wd={os.getcwd()}",
                "--", *argv]

    @property
    def pid(self) -> int:
        """The holder's pid: what `enter(pid)` takes in a spawned rank."""
        return self.holder.pid

    def exec(self, *argv: str) -> subprocess.CompletedProcess:
        """Run a short command inside the node's network namespace (e.g. `ip link set LINK down`)."""
        return _run(["ip", "netns", "exec", self.netns, *argv])


class Nodes:
    """The nodes and their link (see `two_nodes`)."""

    def __init__(self, nodes: list[Node]):
        self.nodes = nodes

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def cut_link(self) -> None:
        """Take the link down on every node (`ip link set LINK down`): packets stop both ways."""
        for node in self.nodes:
            node.exec("ip", "link", "set", LINK, "down")

    def link_bytes(self) -> list[int]:
        """Bytes each node has sent over the link so far."""
        return [int(node.exec("cat", f"/sys/class/net/{LINK}/statistics/tx_bytes").stdout) for node in self.nodes]


@contextlib.contextmanager
def two_nodes(rate: Optional[str] = None, shm_size: str = "256m") -> Iterator[Nodes]:
    """Two nodes, `SUBNET`.1 and `SUBNET`.2, joined by a veth pair called `LINK` on both sides (shaped by a tbf
    qdisc to `rate`, e.g. "1gbit", when given); hostnames node0 and node1 (each node's own /etc/hosts names both);
    each with loopback up and a private tmpfs of `shm_size` over /dev/shm. Everything is removed on exit, also when the body raised."""
    clean_leftovers()
    run = f"{_PREFIX}{os.getpid()}x{next(_COUNTER)}"
    names = [f"{run}n{i}" for i in range(2)]
    made: list[str] = []
    holders: list[subprocess.Popen] = []
    try:
        for name in names:
            _run(["ip", "netns", "add", name])
            made.append(name)
            _run(["ip", "-n", name, "link", "set", "lo", "up"])
        _run(["ip", "-n", names[0], "link", "add", LINK, "type", "veth", "peer", "name", LINK, "netns", names[1]])
        nodes = []
        # every node resolves every node's name, as on a cluster (torchrun's c10d rendezvous resolves its own)
        hosts = "127.0.0.1 localhost\\n" + "".join(f"{SUBNET}.{i + 1} node{i}\\n" for i in range(len(names)))
        for index, name in enumerate(names):
            address = f"{SUBNET}.{index + 1}"
            _run(["ip", "-n", name, "addr", "add", f"{address}/24", "dev", LINK])
            _run(["ip", "-n", name, "link", "set", LINK, "up"])
            if rate is not None:  # a token bucket: the link's bandwidth (no netem here: no delay)
                _run(["tc", "-n", name, "qdisc", "add", "dev", LINK, "root", "tbf", "rate", rate,
                      "burst", "256kb", "latency", "50ms"])
            hostname = f"node{index}"
            holder = subprocess.Popen(
                ["ip", "netns", "exec", name, "unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                 f"hostname {hostname} && mount -t tmpfs -o size={shm_size} tmpfs /dev/shm "
                 f"&& printf '{hosts}' > /dev/shm/.zerotrain-netns-hosts "
                 f"&& mount --bind /dev/shm/.zerotrain-netns-hosts /etc/hosts && echo ready && exec sleep 100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True)
            holders.append(holder)
            line = holder.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"node {index} did not start: {holder.stderr.read().strip()}")
            nodes.append(Node(index, name, hostname, address, holder))
        yield Nodes(nodes)
    finally:
        for holder in holders:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        for name in made:
            for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():  # anything a test left
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _run(["ip", "netns", "del", name], check=False).returncode != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
