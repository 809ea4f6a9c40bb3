"""An sshd per network-namespace node (tests/multinode/netns.py) for the launchers that start ranks over ssh
(`zerotrain launch --hostfile`, Open MPI's mpirun): keys made for the run in the test's directory, a daemon per
node on one port, root's login by key only; the test kills the daemons in a finally block."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional


def sshd_missing() -> Optional[str]:
    """Why sshd cannot run here (a skip reason), or None."""
    if shutil.which("sshd") or os.path.exists("/usr/sbin/sshd"):
        return None
    return ("openssh-server is not installed (apt-get install -y openssh-server, or "
            "tests/multinode/install_cluster_software.sh)")


SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def make_keys(tmp_path):
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    shutil.copy(tmp_path / "id.pub", tmp_path / "authorized_keys")
    os.chmod(tmp_path / "authorized_keys", 0o600)


def start_sshd(node, tmp_path, port: int) -> subprocess.Popen:
    config = tmp_path / f"sshd_{node.hostname}"
    config.write_text(f"Port {port}\nHostKey {tmp_path / 'host_key'}\n"
                      f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\n"
                      "PermitRootLogin yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                      "StrictModes no\nPidFile none\n")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
    return subprocess.Popen(node.command([SSHD, "-D", "-e", "-f", str(config)]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def ssh_options(tmp_path) -> str:
    return (f"-i {tmp_path / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
            "-o ConnectTimeout=10")


def wait_for_ssh(nodes, tmp_path, port: int) -> None:
    deadline = time.monotonic() + 30
    for node in nodes.nodes:
        while True:
            probe = subprocess.run(nodes[0].command(["ssh", "-o", "BatchMode=yes", "-p", str(port),
                                                     *ssh_options(tmp_path).split(), node.hostname, "hostname"]),
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if probe.returncode == 0 and probe.stdout.strip() == node.hostname:
                break
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(0.3)


def python_left(nodes) -> list[str]:
    """The Python processes still in either node's network namespace (ranks, agents, launches)."""
    left = []
    for node in nodes.nodes:
        pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "python" in cmdline:
                left.append(f"{node.hostname}: {cmdline[:120]}")
    return left
