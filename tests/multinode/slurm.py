"""A Slurm cluster on the network-namespace nodes of tests/multinode/netns.py (issue #46): munged with a key made
for the run (one daemon; its socket is a file every node reaches), slurmctld on node0 and a slurmd per node, all
from one slurm.conf written in the test's directory (`SLURM_CONF` points every daemon and client at it). Each
node's daemon keeps its pid file and spool in the node's private /dev/shm. `slurm_cluster()` stops every daemon
on the way out, whatever happened; `slurm_missing()` says why it cannot run here."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)),
                                      None)


def slurm_missing() -> Optional[str]:
    """Why the Slurm tests cannot run here (a skip reason), or None."""
    absent = [name for name in DAEMONS if _which(name) is None]
    if absent:
        return (f"Slurm/munge are not installed ({', '.join(absent)}: apt-get install -y slurm-wlm munge, or "
                "tests/multinode/install_cluster_software.sh)")
    return None


CONF = """ClusterName=zt
SlurmctldHost=node0({addr0})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={socket},cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}
SlurmdSpoolDir=/dev/shm/slurmd
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile=/dev/shm/slurmd.pid
SlurmctldLogFile={log}/slurmctld.log
SlurmdLogFile=/dev/shm/slurmd.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=10
MessageTimeout=20
InactiveLimit=0
MinJobAge=600
NodeName=node0 NodeAddr={addr0} CPUs=4 State=UNKNOWN
NodeName=node1 NodeAddr={addr1} CPUs=4 State=UNKNOWN
PartitionName=main Nodes=node0,node1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


# slurmd in a node: its spool directory in the node's /dev/shm, and cgroup v1 hierarchies where Slurm's cgroup
# plugin looks for them (`ip netns exec` mounted a fresh /sys without them; slurmd refuses to start without)
_SLURMD = ("mkdir -p /dev/shm/slurmd && "
           "if ! mountpoint -q /sys/fs/cgroup/freezer; then mount -t tmpfs cgroup_root /sys/fs/cgroup && "
           "for c in freezer cpuset memory devices cpu cpuacct pids; do mkdir -p /sys/fs/cgroup/$c && "
           "mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; done; fi && exec {slurmd} -D -N {node}")
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nConstrainCores=no\nConstrainRAMSpace=no\n"


class Slurm:
    """The running cluster: its directory, the environment its clients need, and helpers."""

    def __init__(self, nodes, root: Path, env: dict[str, str]):
        self.nodes, self.root, self.env = nodes, root, env

    def run(self, argv: list[str], node: int = 0, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command inside `node` (node0 by default), with SLURM_CONF set."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.nodes[node].command(argv), env={**self.env, **kwargs.pop("env", {})}, **kwargs)

    def job_state(self, job: str) -> str:
        """The job's state as `scontrol show job` says it (PENDING, RUNNING, COMPLETED, ...)."""
        said = self.run(["scontrol", "show", "job", job]).stdout
        for word in said.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_state(self, job: str, states: tuple[str, ...], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states or time.monotonic() > deadline:
                return state
            time.sleep(1)

    def wait_exit(self, job: str, timeout: float) -> int:
        """The job's exit status once it has ended (COMPLETED: 0; else its ExitCode, at least 1), polled every
        0.3 s: `sbatch --wait` polls at 2, 10, 42 s, so a 12 s job took 42 s there."""
        deadline = time.monotonic() + timeout
        while True:
            said = dict(word.split("=", 1) for word in self.run(["scontrol", "show", "job", job]).stdout.split()
                        if "=" in word)
            state = said.get("JobState", "UNKNOWN")
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                         "DEADLINE", "PREEMPTED"):
                return 0 if state == "COMPLETED" else max(1, int(said.get("ExitCode", "1:0").split(":")[0]))
            assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
            time.sleep(0.3)

    def logs(self) -> str:
        """The controller's log (for a failing assertion's message)."""
        path = self.root / "log" / "slurmctld.log"
        said = path.read_text(errors="replace")[-3000:] if path.exists() else ""
        for node in self.nodes.nodes:
            err = self.root / "log" / f"slurmd-{node.hostname}.err"
            said += f"\n--- slurmd {node.hostname}:\n" + (err.read_text(errors="replace")[-1500:] if err.exists() else "")
        return said


@contextlib.contextmanager
def slurm_cluster(nodes, root: Path, env: dict[str, str], ctld_port: int, slurmd_port: int) -> Iterator[Slurm]:
    """munged, slurmctld on node0 and slurmd on every node of `nodes`; every daemon stopped on exit."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for sub in ("state", "log"):
        (root / sub).mkdir(exist_ok=True)
    key, socket = root / "munge.key", root / "munge.sock"
    subprocess.run([_which("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(addr0=nodes[0].address, addr1=nodes[1].address, ctld_port=ctld_port,
                                slurmd_port=slurmd_port, socket=socket, state=root / "state", log=root / "log"))
    (root / "cgroup.conf").write_text(CGROUP_CONF)
    env = {**env, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []
    try:
        daemons.append(subprocess.Popen([_which("munged"), "-F", "-f", f"--socket={socket}", f"--key-file={key}",
                                         f"--pid-file={root / 'munged.pid'}", f"--seed-file={root / 'munged.seed'}"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while not socket.exists():
            assert time.monotonic() < deadline, "munged did not start"
            time.sleep(0.1)
        daemons.append(subprocess.Popen(nodes[0].command([_which("slurmctld"), "-D", "-c"]), env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for node in nodes.nodes:
            with open(root / "log" / f"slurmd-{node.hostname}.err", "w") as err:
                daemons.append(subprocess.Popen(node.command(["sh", "-c", _SLURMD.format(
                    slurmd=_which("slurmd"), node=node.hostname)]), env=env, stdout=subprocess.DEVNULL, stderr=err))
        slurm = Slurm(nodes, root, env)
        deadline = time.monotonic() + 60
        while True:  # both nodes idle: the controller heard from each slurmd
            said = slurm.run(["sinfo", "-h", "-N", "-o", "%N %T"]).stdout.split()
            if said.count("idle") == 2:
                break
            assert time.monotonic() < deadline, f"Slurm nodes not idle: {said}\n{slurm.logs()}"
            time.sleep(0.5)
        yield slurm
    finally:
        for daemon in reversed(daemons):
            with contextlib.suppress(ProcessLookupError):
                daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
