"""The run layer: what every training command's ranks do the same way around the `trainer`.

- `config.RunConfig`: the run's config built once (file + flags + filled "auto"), parsed once, handed down to the
  model, the data wiring and `zerotrain.initialize`; `config.train_config`: `zerotrain train`'s builder.
- `model`: `zerotrain train`'s model (under `zero.Init` at ZeRO-3, LoRA through peft), engine and weights.
- `lm.run_lm`: one rank of `zerotrain train` (language model and pipeline); `zerotrain train-embedding`'s run is
  `embedding.command`'s, on the same skeleton:
- `start_run`: once the engine exists, whether the run resumes (asked, or an elastic restart: torchrun's agent
  restarted the workers, or a requeued Slurm job, SLURM_RESTART_COUNT, e.g. after a
  preemption; `resume_after_restart` on the restart count every rank agrees on, `job_restarts`), the
  effective config recorded by rank 0, the save directory claimed (one job per directory);
- `finish_run`: pending saves committed and the engine closed, then a barrier before any teardown;
- `stop_status`: after the Trainer stopped on a signal (a checkpoint saved at the step boundary), the stop line
  said once (by the launcher when there is one, else by rank 0), and the exit status
  (`lifecycle.StopRequest.exit_status`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable, Optional

from zerotrain.command import PROG

if TYPE_CHECKING:
    from zerotrain.lifecycle import StopRequest
    from zerotrain.run.config import RunConfig
    from zerotrain.trainer import TrainSummary
    from zerotrain.training_engine import TrainingEngine

__all__ = ["job_restarts", "resume_after_restart", "start_run", "finish_run", "stop_status"]


def job_restarts() -> int:
    """How many times torchrun's agents restarted this job's workers, or Slurm requeued the job
    (SLURM_RESTART_COUNT: a preempted job's next run), as every rank agrees (the largest count).

    An agent raises TORCHELASTIC_RESTART_COUNT when its own workers failed, not when it restarts them because
    another node came back for a new round: after one node's restart the other node's ranks read a smaller count.
    Deciding on the local count, those would start afresh while the restarted ones resume, and the two halves of
    the job would run different collectives until the next restart. Needs torch.distributed up (a collective)."""
    import torch

    import zerotrain.dist as dist

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


def start_run(engine: "TrainingEngine", config: "RunConfig", *, resume: bool, save_dir: Optional[str], rank: int,
              record_dirs: Iterable[Optional[str]] = ()) -> bool:
    """What every training command does once its engine exists, before it loads anything: whether the run resumes
    (`resume_after_restart`: asked, or an elastic restart), the run's record of what it trains with written by rank
    0 (`effective_config.json` of `config` in each of `record_dirs` given), `save_dir` claimed (one job per save
    directory: refused before training, not at the first save). Every rank must call it (a collective)."""
    resume = resume_after_restart(resume, save_dir, rank)
    if rank == 0:
        from zerotrain.train.flags import write_effective_config
        for directory in sorted({d for d in record_dirs if d is not None}):
            write_effective_config(config.values, directory)
    if save_dir is not None:
        engine.claim_save_dir(save_dir)
    return resume


def finish_run(engine: "TrainingEngine") -> None:
    """The end of a run on every rank: pending saves committed, offload threads and files released
    (`engine.close`), then a barrier, so that no rank tears its groups down while a peer still talks to it."""
    import zerotrain.dist as dist

    engine.close()
    if dist.is_initialized():
        dist.barrier()


def stop_status(summary: "TrainSummary", stop_request: "StopRequest", step: int, rank: int) -> Optional[int]:
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
