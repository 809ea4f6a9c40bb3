"""`zerotrain launch --launcher mpich|impi|mvapich` across two network-namespace hosts with the real MPICH
(hydra) (issue #46): an sshd per node (keys made for the run), the launcher on node0 runs DeepSpeed's
MPICHRunner line (`mpirun -n 4 -ppn 2 ... -hosts node0,node1`), hydra starts its proxy on node1 over ssh and the
four ranks read their ranks from PMI_RANK / MPI_LOCALRANKID. ZeRO-3 on 2 hosts x 2 ranks trains a tiny HF Llama
as single-process AdamW does; one host's ranks killed ends the job on both hosts. Intel MPI's and MVAPICH's
lines (DeepSpeed's IMPIRunner / MVAPICHRunner) take hydra's options too: each trains the same job through MPICH's
hydra (MVAPICH is not installable here: no Debian 12 or PyPI package). Intel MPI's runtime is, from PyPI's
`impi-rt`: with ZEROTRAIN_TEST_IMPI_ROOT naming it, a second test runs the impi line with Intel's own mpirun.
Debian's `mpirun` may be Open MPI's: the tests put a `mpirun` that execs `mpiexec.hydra` first on PATH. Real starts on each host, so `slow`; the default
suite runs the mpich line for real on one host (tests/test_hostfile.py::test_mpich_launch_starts_the_ranks_with_hydra)."""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import sys

import pytest

import llama_job
import netns
from distributed import free_port
from mpi_flavours import hydra_mpiexec, mpich_missing, mpirun_path
from sshd import make_keys, ssh_options, sshd_missing, start_sshd, wait_for_ssh
from test_dropin_api import REPO_ROOT
from test_openmpi_launch import JOB, assert_killing_node1s_ranks_ends_the_job

HYDRA = hydra_mpiexec()  # MPICH's, whichever MPI Debian's `mpirun` alternative is (tests/mpi_flavours.py)
_reason = netns.skip_reason() or sshd_missing() or mpich_missing()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]


def impi_root() -> str | None:
    """The Intel MPI runtime ZEROTRAIN_TEST_IMPI_ROOT names (`pip install --target DIR impi-rt`: DIR itself or its
    `impi_rt-*.data/data`, the root with bin/mpirun), or None."""
    given = os.environ.get("ZEROTRAIN_TEST_IMPI_ROOT", "")
    for root in [given, *sorted(glob.glob(os.path.join(given, "impi_rt-*.data", "data")))] if given else []:
        if os.access(os.path.join(root, "bin", "mpirun"), os.X_OK):
            return root
    return None


IMPI_ROOT = impi_root()


@contextlib.contextmanager
def _hydra_hosts(tmp_path):
    """Two namespace hosts with an sshd each (keys made for the run) and the hostfile: yields (nodes, launch, env),
    `launch(name)` the `zerotrain launch --launcher name` line that hydra starts over ssh on both hosts, `env`
    with MPICH's hydra as `mpirun`; the sshds are stopped and the hosts torn down always."""
    make_keys(tmp_path)
    port = free_port()
    (tmp_path / "hostfile").write_text("node0 slots=2\nnode1 slots=2\n")
    ssh = tmp_path / "hydra-ssh"  # hydra's remote start: ssh with the run's port and key (not on PATH)
    ssh.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -p {port} {ssh_options(tmp_path)} "$@"\n')
    ssh.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_", "HYDRA_"))}
    env.update(PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1",
               PATH=mpirun_path(tmp_path / "bin", HYDRA))
    hydra_args = f"-iface {netns.LINK} -launcher ssh -launcher-exec {ssh}"

    def launch(launcher: str) -> list[str]:
        return [sys.executable, "-m", "zerotrain.cli", "launch", "--launcher", launcher, "--hostfile", "hostfile",
                f"--launcher_args={hydra_args}", "--master_port", str(free_port()), JOB]

    with netns.two_nodes() as nodes:
        daemons = [start_sshd(node, tmp_path, port) for node in nodes.nodes]
        try:
            wait_for_ssh(nodes, tmp_path, port)
            yield nodes, launch, env
        finally:
            for daemon in daemons:
                daemon.kill()
                daemon.wait()


def _trains_as_one_process(nodes, launch: list[str], out, env: dict) -> None:
    """The launch line on node0 trains the tiny Llama on 2 hosts x 2 ranks to single-process AdamW's weights."""
    out.mkdir()
    proc = subprocess.run(nodes[0].command([*launch, "--out", str(out)]), cwd=out.parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (launch, proc.stdout + proc.stderr)
    llama_job.assert_trained_as_one_process(str(out), world=4, hosts=2)
    for rank in range(4):  # two ranks per host: hydra's MPI_LOCALNRANKS, or DeepSpeed's LOCAL_SIZE
        assert '"local_world": 2' in (out / f"rank{rank}.json").read_text(), launch


@pytest.mark.timeout(1500)  # three 4-rank Llama runs and a killed one: minutes on a loaded machine
def test_mpich_launch_trains_a_llama_across_two_hosts_and_one_host_killed_ends_the_job(tmp_path, monkeypatch):
    """DeepSpeed's MPICH, Intel MPI and MVAPICH lines, each through MPICH's hydra (they take hydra's options),
    train as one process; node1's ranks killed end the mpich job on both hosts."""
    monkeypatch.chdir(tmp_path)  # the nodes' commands run in the current directory (netns.Node.command)
    with _hydra_hosts(tmp_path) as (nodes, launch, env):
        for launcher in ("mpich", "impi", "mvapich"):
            _trains_as_one_process(nodes, launch(launcher), tmp_path / launcher, env)
        # node1's ranks killed mid-run: hydra sees them die and ends the ranks on node0 too
        assert_killing_node1s_ranks_ends_the_job(nodes, launch("mpich"), tmp_path, env)


@pytest.mark.skipif(IMPI_ROOT is None, reason="no Intel MPI runtime: pip install --target DIR impi-rt, then "
                                              "ZEROTRAIN_TEST_IMPI_ROOT=DIR")
@pytest.mark.timeout(900)  # one 4-rank Llama run under Intel's hydra: ~4 min at load 40
def test_impi_launch_with_intels_own_mpirun_trains_a_llama_across_two_hosts(tmp_path, monkeypatch):
    """`--launcher impi` with Intel MPI's own `mpirun` (its hydra, over ssh, libfabric's tcp provider) first on
    PATH: DeepSpeed's IMPIRunner line trains as one process on 2 hosts x 2 ranks."""
    monkeypatch.chdir(tmp_path)
    intel_hydra = subprocess.run([os.path.join(IMPI_ROOT, "bin", "mpiexec.hydra"), "--version"],
                                 capture_output=True, text=True, timeout=60)
    assert "Intel(R) MPI Library" in intel_hydra.stdout + intel_hydra.stderr  # Intel's, not MPICH's hydra
    with _hydra_hosts(tmp_path) as (nodes, launch, env):
        intel = {**env, "I_MPI_ROOT": IMPI_ROOT, "FI_PROVIDER": "tcp",
                 "PATH": f"{IMPI_ROOT}/bin{os.pathsep}{env['PATH']}", "LD_LIBRARY_PATH": f"{IMPI_ROOT}/lib"}
        _trains_as_one_process(nodes, launch("impi"), tmp_path / "impi", intel)
