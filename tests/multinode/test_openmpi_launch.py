"""`zerotrain launch --launcher openmpi` across two network-namespace hosts with the real Open MPI (issue #46):
an sshd per node (keys made for the run), the launcher on node0 runs DeepSpeed's OpenMPIRunner line (`mpirun
-hostfile ...`), Open MPI starts its daemon on node1 over ssh and the four ranks read their ranks from Open MPI's
variables. ZeRO-3 on 2 hosts x 2 ranks trains a tiny HF Llama as single-process AdamW does; one host's ranks
killed ends the job on both hosts. Real starts on each host, so `slow`; the default suite runs mpirun for real on
one host (tests/test_hostfile.py::test_openmpi_launch_starts_the_ranks_with_mpirun)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import llama_job
import netns
from distributed import free_port
from mpi_flavours import mpirun_path, openmpi_missing, openmpi_mpirun
from sshd import make_keys, python_left, ssh_options, sshd_missing, start_sshd, wait_for_ssh
from test_dropin_api import REPO_ROOT

OPENMPI = openmpi_mpirun()  # Open MPI's, whichever MPI Debian's `mpirun` alternative is (tests/mpi_flavours.py)
_reason = netns.skip_reason() or sshd_missing() or openmpi_missing()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_job.py")


def _rank_pids(node) -> list[int]:
    """The job's ranks in `node` (Python processes running llama_job.py; not a `zerotrain launch` or its torchrun
    agent, which name the script too where the ranks start through them: the ssh launch)."""
    found = []
    pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(b"llama_job.py" in part for part in cmdline) and b"python" in cmdline[0] \
                and b"zerotrain.cli" not in cmdline and b"zerotrain.elastic" not in cmdline:
            found.append(int(pid))
    return found


def assert_killing_node1s_ranks_ends_the_job(nodes: list, launch: list[str], tmp_path, env: dict) -> str:
    """Start the launch line `launch` on node0 for a long run, SIGKILL node1's two ranks once every rank runs: the
    launcher must fail, within the job's comm timeout, and leave no rank on any host (shared by the MPI launchers
    and the ssh launch). Returns what the launcher printed (stdout and stderr)."""
    long_out = tmp_path / "long"
    long_out.mkdir()
    launcher = subprocess.Popen(nodes[0].command([*launch, "--out", str(long_out), "--steps", "100000",
                                                  "--sleep", "0.05"]),
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (long_out / "running").exists():
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
            time.sleep(0.2)
        victims = _rank_pids(nodes[1])
        assert len(victims) == 2 and len(_rank_pids(nodes[0])) == 2
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        status = launcher.wait(timeout=llama_job.CONFIG["comm_timeout_seconds"] + 30)
        ended = time.monotonic() - killed_at
        said = launcher.stdout.read()
        assert status != 0, said
        deadline = time.monotonic() + 30
        while python_left(nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert python_left(nodes) == [], said
        assert ended < llama_job.CONFIG["comm_timeout_seconds"], (ended, said)
        return said
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.timeout(1200)  # a 4-rank Llama run and a killed one: 5+ minutes at load 40 (pytest's 300 s cut it)
def test_openmpi_launch_trains_a_llama_across_two_hosts_and_one_host_killed_ends_the_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the nodes' commands run in the current directory (netns.Node.command)
    make_keys(tmp_path)
    port = free_port()
    (tmp_path / "hostfile").write_text("node0 slots=2\nnode1 slots=2\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_"))}
    env.update(PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PATH=mpirun_path(tmp_path / "openmpi-bin", OPENMPI))
    # Open MPI's own traffic over the nodes' link; ssh's key and options for its remote start (--ssh_port adds -p)
    mpi_args = (f"--mca btl_tcp_if_include {netns.LINK} --mca oob_tcp_if_include {netns.LINK} "
                f"--mca plm_rsh_args '{ssh_options(tmp_path)}'")
    launch = [sys.executable, "-m", "zerotrain.cli", "launch", "--launcher", "openmpi", "--hostfile", "hostfile",
              "--ssh_port", str(port), f"--launcher_args={mpi_args}", "--master_port", str(free_port()), JOB]
    with netns.two_nodes() as nodes:
        daemons = [start_sshd(node, tmp_path, port) for node in nodes.nodes]
        try:
            wait_for_ssh(nodes, tmp_path, port)
            out = tmp_path / "out"
            out.mkdir()
            proc = subprocess.run(nodes[0].command([*launch, "--out", str(out)]), cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=400)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            llama_job.assert_trained_as_one_process(str(out), world=4, hosts=2)
            for rank in range(4):  # Open MPI's local ranks: two per host
                assert '"local_world": 2' in (out / f"rank{rank}.json").read_text()

            # node1's ranks killed mid-run: mpirun sees them die and ends the ranks on node0 too
            assert_killing_node1s_ranks_ends_the_job(nodes, launch, tmp_path, env)
        finally:
            for daemon in daemons:
                daemon.kill()
                daemon.wait()
