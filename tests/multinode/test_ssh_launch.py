"""`zerotrain launch --hostfile` over ssh across two network-namespace hosts (issue #46): an sshd per node (keys
made for this run, torn down with the nodes), the launcher on node0 starts one `zerotrain launch` per host
through ssh (DeepSpeed's pdsh launcher's job) and the 2-host job trains as one process does; the launcher killed
mid-run ends every rank on both hosts. A real start on each host, so `slow`; the default suite has the
unreachable-host error (tests/test_hostfile.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from distributed import free_port
import netns
from test_dropin_api import (DEEPSPEED_SCRIPT, DEEPSPEED_SCRIPT_CONFIG, REPO_ROOT, STOPPABLE_SCRIPT,
                             _assert_trained_as_one_process)

_reason = netns.skip_reason() or (None if shutil.which("sshd") or os.path.exists("/usr/sbin/sshd") else
                                  "openssh-server is not installed (apt-get install -y openssh-server)")
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _keys(tmp_path):
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    shutil.copy(tmp_path / "id.pub", tmp_path / "authorized_keys")
    os.chmod(tmp_path / "authorized_keys", 0o600)


def _start_sshd(node, tmp_path, port: int) -> subprocess.Popen:
    config = tmp_path / f"sshd_{node.hostname}"
    config.write_text(f"Port {port}\nHostKey {tmp_path / 'host_key'}\n"
                      f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\n"
                      "PermitRootLogin yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                      "StrictModes no\nPidFile none\n")
    os.makedirs("/run/sshd", exist_ok=True)  # its privilege-separation directory
    return subprocess.Popen(node.command([SSHD, "-D", "-e", "-f", str(config)]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _launcher_args(tmp_path) -> str:
    return (f"-i {tmp_path / 'id'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
            "-o ConnectTimeout=10")


def _wait_for_ssh(nodes, tmp_path, port: int) -> None:
    deadline = time.monotonic() + 30
    for node in nodes.nodes:
        while True:
            probe = subprocess.run(nodes[0].command(["ssh", "-o", "BatchMode=yes", "-p", str(port),
                                                     *_launcher_args(tmp_path).split(), node.hostname, "hostname"]),
                                   capture_output=True, text=True, stdin=subprocess.DEVNULL)
            if probe.returncode == 0 and probe.stdout.strip() == node.hostname:
                break
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(0.3)


def _python_left(nodes) -> list[str]:
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


def test_hostfile_launch_over_ssh_trains_across_two_hosts_and_stops_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the nodes' commands run in the current directory (netns.Node.command)
    _keys(tmp_path)
    port = free_port()
    (tmp_path / "hostfile").write_text("# two hosts, one rank each\nnode0 slots=1\nnode1 slots=1\n")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DEEPSPEED_SCRIPT_CONFIG))
    (tmp_path / "train.py").write_text(DEEPSPEED_SCRIPT)
    (tmp_path / "stoppable.py").write_text(STOPPABLE_SCRIPT)
    (tmp_path / ".deepspeed_env").write_text("ZT_FROM_DEEPSPEED_ENV=forwarded\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1")
    with netns.two_nodes() as nodes:
        daemons = [_start_sshd(node, tmp_path, port) for node in nodes.nodes]
        try:
            _wait_for_ssh(nodes, tmp_path, port)
            launch = [sys.executable, "-m", "zerotrain.cli", "launch", "--hostfile", "hostfile", "--ssh_port",
                      str(port), f"--launcher_args={_launcher_args(tmp_path)}", "--master_port", str(free_port())]
            out = tmp_path / "out"
            out.mkdir()
            proc = subprocess.run(nodes[0].command([*launch, "train.py", "--deepspeed_config", str(config),
                                                    "--out", str(out)]),
                                  cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            for rank in (0, 1):
                info = json.loads((out / f"rank{rank}.json").read_text())
                assert (info["world"], info["env_local_rank"], info["visible"], info["steps"]) == (2, 0, "0", 4)
            _assert_trained_as_one_process(out)

            # the launcher killed (SIGKILL: no handler runs) mid-run: its ssh clients die with it, each host's
            # launch sees its channel close and stops its ranks: nothing is left on either host
            stop_out = tmp_path / "stop"
            stop_out.mkdir()
            launcher = subprocess.Popen(nodes[0].command([*launch, "stoppable.py", "--out", str(stop_out),
                                                          "--nproc", "2", "--deepspeed_config", str(config)]),
                                        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
            deadline = time.monotonic() + 300
            while not (stop_out / "running").exists():
                assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
                time.sleep(0.2)
            launcher.kill()
            launcher.wait()
            deadline = time.monotonic() + 120
            while _python_left(nodes) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _python_left(nodes) == [], launcher.stdout.read()
            # stopped, not killed: every rank on both hosts got the stop, saved at a step boundary and ended
            assert sorted(p.name for p in stop_out.glob("stopped*.json")) == ["stopped0.json", "stopped1.json"]
        finally:
            for daemon in daemons:
                daemon.kill()
                daemon.wait()
