"""The run layer's shared pieces: what every training command's ranks do the same way around the `trainer`.

- `resume_after_restart`: an elastic restart (torchrun's agent restarted the workers) or a requeued Slurm job
  (SLURM_RESTART_COUNT, e.g. after a preemption) resumes from the latest
  committed checkpoint of the save directory, as `--resume` would; the restart count is the largest any rank
  read (`job_restarts`), so every rank decides alike.
- `stop_status`: after the Trainer stopped on a signal (a checkpoint saved at the step boundary), the stop line
  said once (by the launcher when there is one, else by rank 0), and the exit status
  (`lifecycle.StopRequest.exit_status`).

`zerotrain train` (language model and pipeline) and `zerotrain train-embedding` use both.
"""
from __future__ import annotations

import os
from typing import Optional

import zerotrain.dist as dist
from zerotrain.command import PROG
from zerotrain.lifecycle import StopRequest
from zerotrain.trainer import TrainSummary

__all__ = ["job_restarts", "resume_after_restart", "stop_status"]


def job_restarts() -> int:
    """How many times torchrun's agents restarted this job's workers, or Slurm requeued the job
    (SLURM_RESTART_COUNT: a preempted job's next run), as every rank agrees (the largest count).

    An agent raises TORCHELASTIC_RESTART_COUNT when its own workers failed, not when it restarts them because
    another node came back for a new round: after one node's restart the other node's ranks read a smaller count.
    Deciding on the local count, those would start afresh while the restarted ones resume, and the two halves of
    the job would run different collectives until the next restart. Needs torch.distributed up (a collective)."""
    import torch

    own = max(int(os.environ.get(name, "0") or 0) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return own
    count = torch.tensor([own], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def resume_after_restart(resume: bool, save_dir: Optional[str], rank: int) -> bool:
    """Whether the run resumes: `resume` asked for it, or this is an elastic restart of a job that saves (it
    continues from the latest committed checkpoint, said once by rank 0). Every rank must call it (a collective)."""
    restarts = job_restarts()
    if restarts > 0 and save_dir is not None and not resume:
        if rank == 0:
            print(f"{PROG}: restart {restarts} of this job: resuming from the latest checkpoint", flush=True)
        return True
    return resume


def stop_status(summary: TrainSummary, stop_request: StopRequest, step: int, rank: int) -> Optional[int]:
    """None when the run was not stopped; else, after rank 0 said where the checkpoint is (and told the
    launcher), the exit status of a stopped run."""
    if summary.stopped_by is None:
        return None
    where = (f"checkpoint {summary.checkpoint}; continue with --resume" if summary.checkpoint
             else "no checkpoint saved (--no-save)")
    # said once: by the launcher (after every rank is gone) when there is one, else here
    told = rank == 0 and stop_request.tell_launcher(summary.stopped_by, f"step {step}; {where}")
    if rank == 0 and not told:
        print(f"{PROG}: stopped by {summary.stopped_by} at step {step}; {where}", flush=True)
    return stop_request.exit_status(summary.stopped_by)
