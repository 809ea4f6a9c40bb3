"""Slurm across two network-namespace hosts (issue #46), the real slurmctld / slurmd / munge
(tests/multinode/slurm.py): `sbatch` scripts that set no rendezvous (no MASTER_ADDR, MASTER_PORT, RANK: the
ranks read SLURM_* through `zerotrain.cluster`).

- default suite (seconds): an sbatch script runs `zerotrain launch --launcher slurm --hostfile` (DeepSpeed's
  SlurmRunner line, srun inside the allocation), two hosts x one rank meet and all-reduce.
- `slow`: `srun python llama_job.py` trains ZeRO-3 on 2 hosts x 2 ranks to single-process AdamW's weights
  within 1e-5; `srun zerotrain train` preempted (SIGUSR1 to the steps, as `--signal=USR1@60` sends it) saves at
  a step boundary, the script requeues itself (`scontrol requeue`) and the requeued job resumes to the end; one
  host's ranks killed ends the job on both hosts."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import llama_job
import netns
from distributed import free_port
from slurm import slurm_cluster, slurm_missing
from test_dropin_api import REPO_ROOT

_reason = netns.skip_reason() or slurm_missing()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_job.py")
MEET = '''
import json, os, sys
import torch
import zerotrain
zerotrain.init_distributed()
rank = torch.distributed.get_rank()
total = torch.tensor([float(rank + 1)])
zerotrain.dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"world": torch.distributed.get_world_size(), "sum": total.item(), "host": os.uname().nodename,
               "master": os.environ["MASTER_ADDR"], "slurm_rank": os.environ["SLURM_PROCID"]}, f)
'''


def _env() -> dict:
    """The submitting shell's environment: no rendezvous variable of any launcher."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=REPO_ROOT, GLOO_SOCKET_IFNAME=netns.LINK, OMP_NUM_THREADS="1")
    return env


def _sbatch(slurm, tmp_path, name: str, body: str, *options: str, wait: bool = True,
            timeout: float = 600) -> tuple[str, subprocess.CompletedProcess]:
    script = tmp_path / f"{name}.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/{name}-%j.out\n{body}")
    proc = slurm.run(["sbatch", "--parsable", *options, str(script)], cwd=tmp_path, timeout=60)
    job = proc.stdout.strip().split(";")[0]
    if wait and proc.returncode == 0:  # as `sbatch --wait` ends: with the job's exit status
        proc.returncode = slurm.wait_exit(job, timeout)
    return job, proc


def _output(tmp_path, name: str, job: str) -> str:
    path = tmp_path / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_sbatch_runs_zerotrain_launch_with_launcher_slurm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "meet.py").write_text(MEET)
    (tmp_path / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    out = tmp_path / "out"
    out.mkdir()
    with netns.two_nodes() as nodes, slurm_cluster(nodes, tmp_path / "slurm", _env(), free_port(),
                                                   free_port()) as slurm:
        job, proc = _sbatch(slurm, tmp_path, "meet", f"#SBATCH --nodes=2 --ntasks-per-node=1\n"
                            f"{sys.executable} -m zerotrain.cli launch --launcher slurm --hostfile hostfile "
                            f"meet.py {out}\n", timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr + _output(tmp_path, "meet", job) + slurm.logs()
    infos = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert infos == [{"world": 2, "sum": 3.0, "host": f"node{rank}", "master": "node0", "slurm_rank": str(rank)}
                     for rank in (0, 1)]


def _rank_pids(node, marker: bytes) -> list[int]:
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split():
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"python" in cmdline[0] and any(marker in part for part in cmdline):
            found.append(int(pid))
    return found


PREEMPT_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1,
                  "comm_timeout_seconds": 60, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  "zero_optimization": {"stage": 3}}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sbatch_srun_trains_a_llama_as_one_process(tmp_path, monkeypatch):
    """The 2 x 2 job from SLURM_* alone equals one process."""
    monkeypatch.chdir(tmp_path)
    with netns.two_nodes() as nodes, slurm_cluster(nodes, tmp_path / "slurm", _env(), free_port(),
                                                   free_port()) as slurm:
        out = tmp_path / "llama"
        out.mkdir()
        job, proc = _sbatch(slurm, tmp_path, "llama", "#SBATCH --nodes=2 --ntasks-per-node=2\n"
                            f"srun {sys.executable} {JOB} --out {out}\n")
        assert proc.returncode == 0, proc.stdout + proc.stderr + _output(tmp_path, "llama", job) + slurm.logs()
        llama_job.assert_trained_as_one_process(str(out), world=4, hosts=2)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sbatch_preempted_by_usr1_saves_requeues_and_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(PREEMPT_CONFIG))
    with netns.two_nodes() as nodes, slurm_cluster(nodes, tmp_path / "slurm", _env(), free_port(),
                                                   free_port()) as slurm:
        # (b) preemption: SIGUSR1 to every step's task (what --signal=USR1@60 sends 60 s before the time limit);
        # zerotrain train saves at the step boundary and exits 128 + 10; the script requeues the job, which
        # Slurm runs again with SLURM_RESTART_COUNT=1: zerotrain train resumes from the checkpoint (no --resume)
        steps = 200  # ~0.2 s a step here: the signal lands well before the end
        train = (f"srun {sys.executable} -m zerotrain.cli train --config ds.json --model tiny "
                 f"--steps {steps} --max-corpus-bytes 300000 --val-fraction 0 --save-dir {tmp_path / 'ckpt'}")
        job, proc = _sbatch(slurm, tmp_path, "preempt",
                            "#SBATCH --nodes=2 --ntasks-per-node=2 --requeue --open-mode=append "
                            "--signal=USR1@60\n"
                            f"echo run $SLURM_RESTART_COUNT\n{train}\nstatus=$?\n"
                            "if [ $status -eq 138 ]; then scontrol requeue $SLURM_JOB_ID; fi\nexit $status\n",
                            wait=False)
        assert proc.returncode == 0, proc.stderr
        deadline = time.monotonic() + 300
        while "step 1/" not in _output(tmp_path, "preempt", job):
            assert time.monotonic() < deadline, _output(tmp_path, "preempt", job) + slurm.logs()
            time.sleep(0.5)
        signalled = slurm.run(["scancel", "--signal=USR1", job])
        assert signalled.returncode == 0, signalled.stderr
        deadline = time.monotonic() + 700
        while True:
            printed = _output(tmp_path, "preempt", job)
            if f"step {steps}/{steps} " in printed and slurm.job_state(job) == "COMPLETED":
                break
            assert time.monotonic() < deadline, printed[-4000:] + slurm.logs()
            time.sleep(1)
        stopped = re.search(r"stopped by SIGUSR1 at step (\d+)", printed)
        assert stopped is not None, printed[-4000:]
        at = int(stopped.group(1))
        assert 1 <= at < steps, printed[-4000:]
        first, second = printed.split("run 1\n", 1)
        assert first.startswith("run\n") and "resuming" not in first, printed[-4000:]  # the first run: no count
        assert "resuming from the latest checkpoint" in second and f"at step {at}" in second, second[-4000:]
        assert f"step {at + 1}/{steps} " in second and f"step {at}/{steps} " not in second, second[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_hosts_ranks_killed_end_the_slurm_job_everywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with netns.two_nodes() as nodes, slurm_cluster(nodes, tmp_path / "slurm", _env(), free_port(),
                                                   free_port()) as slurm:
        # (c) one host's ranks killed: srun ends the step on the other host too (--kill-on-bad-exit)
        long_out = tmp_path / "long"
        long_out.mkdir()
        job, proc = _sbatch(slurm, tmp_path, "long", "#SBATCH --nodes=2 --ntasks-per-node=2\n"
                            f"srun --kill-on-bad-exit=1 {sys.executable} {JOB} --out {long_out} --steps 100000 "
                            "--sleep 0.05\n", wait=False)
        deadline = time.monotonic() + 300
        while not (long_out / "running").exists():
            assert time.monotonic() < deadline, _output(tmp_path, "long", job) + slurm.logs()
            time.sleep(0.2)
        victims = _rank_pids(nodes[1], b"llama_job.py")
        assert len(victims) == 2 and len(_rank_pids(nodes[0], b"llama_job.py")) == 2
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        state = slurm.wait_state(job, ("FAILED", "CANCELLED", "COMPLETED"), llama_job.CONFIG["comm_timeout_seconds"])
        assert state == "FAILED", (state, _output(tmp_path, "long", job))
        assert time.monotonic() - killed_at < llama_job.CONFIG["comm_timeout_seconds"]
        assert _rank_pids(nodes[0], b"llama_job.py") == [] and _rank_pids(nodes[1], b"llama_job.py") == []
