"""`zerotrain launch --launcher mpich|impi|mvapich` across two network-namespace hosts with the real MPICH
(hydra) (issue #46): an sshd per node (keys made for the run), the launcher on node0 runs DeepSpeed's
MPICHRunner line (`mpirun -n 4 -ppn 2 ... -hosts node0,node1`), hydra starts its proxy on node1 over ssh and the
four ranks read their ranks from PMI_RANK / MPI_LOCALRANKID. ZeRO-3 on 2 hosts x 2 ranks trains a tiny HF Llama
as single-process AdamW does; one host's ranks killed ends the job on both hosts. Intel MPI's and MVAPICH's
lines (DeepSpeed's IMPIRunner / MVAPICHRunner) take hydra's options too: each trains the same job through MPICH's
hydra (MVAPICH is not installable here; Intel MPI's runtime is, from PyPI's `impi-rt`: with
ZEROTRAIN_TEST_IMPI_ROOT set to its root the impi line runs with Intel's own mpirun). Debian's `mpirun` may be Open MPI's: the
test puts a `mpirun` that execs `mpiexec.hydra` first on PATH. Real starts on each host, so `slow`; the default
suite runs the mpich line for real on one host (tests/test_hostfile.py::test_mpich_launch_starts_the_ranks_with_hydra)."""
from __future__ import annotations

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
# An Intel MPI runtime (`pip install --target DIR impi-rt`: DIR/impi_rt-*.data/data is the root, with bin/mpirun):
# the impi line then runs with Intel's own mpirun instead of MPICH's hydra
IMPI_ROOT = os.environ.get("ZEROTRAIN_TEST_IMPI_ROOT", "")
_reason = netns.skip_reason() or sshd_missing() or mpich_missing()
pytestmark = [pytest.mark.skipif(_reason is not None, reason=_reason or ""), pytest.mark.slow]


@pytest.mark.timeout(1500)  # three 4-rank Llama runs and a killed one: minutes on a loaded machine
def test_mpich_launch_trains_a_llama_across_two_hosts_and_one_host_killed_ends_the_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the nodes' commands run in the current directory (netns.Node.command)
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
            for launcher in ("mpich", "impi", "mvapich"):
                out = tmp_path / launcher
                out.mkdir()
                run_env = env
                if launcher == "impi" and IMPI_ROOT:  # the real Intel MPI's mpirun, when one is given
                    run_env = {**env, "I_MPI_ROOT": IMPI_ROOT, "FI_PROVIDER": "tcp",
                               "PATH": f"{IMPI_ROOT}/bin{os.pathsep}{env['PATH']}",
                               "LD_LIBRARY_PATH": f"{IMPI_ROOT}/lib"}
                proc = subprocess.run(nodes[0].command([*launch(launcher), "--out", str(out)]), cwd=tmp_path,
                                      env=run_env, capture_output=True, text=True, timeout=400)
                assert proc.returncode == 0, (launcher, proc.stdout + proc.stderr)
                llama_job.assert_trained_as_one_process(str(out), world=4, hosts=2)
                for rank in range(4):  # two ranks per host: hydra's MPI_LOCALNRANKS, or DeepSpeed's LOCAL_SIZE
                    assert '"local_world": 2' in (out / f"rank{rank}.json").read_text(), launcher

            # node1's ranks killed mid-run: hydra sees them die and ends the ranks on node0 too
            assert_killing_node1s_ranks_ends_the_job(nodes, launch("mpich"), tmp_path, env)
        finally:
            for daemon in daemons:
                daemon.kill()
                daemon.wait()
