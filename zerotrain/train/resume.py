"""Where a training command resumes from: `--resume` (the latest checkpoint of the save directory) or
`--resume-from-checkpoint PATH|TAG` (TrainingArguments' resume_from_checkpoint: a checkpoint directory, or a tag
inside the save directory), and what it says about it.

`load_for_resume` loads it into the engine (every rank); when the latest one cannot be loaded, the error names the
newest intact checkpoints and the flag that resumes from one; a resume whose learning-rate schedule now runs over a
different number of steps (another `--max-steps`) is said once, in one line, by rank 0.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Optional

__all__ = ["add_resume_flag", "wants_resume", "load_for_resume", "schedule_change"]

LATEST = "latest"


def add_resume_flag(parser: argparse.ArgumentParser) -> None:
    """`--resume-from-checkpoint PATH|TAG` (TrainingArguments' resume_from_checkpoint)."""
    parser.add_argument(
        "--resume-from-checkpoint", dest="resume_from_checkpoint", default=None, metavar="PATH|TAG",
        help="continue from this checkpoint: a checkpoint directory (e.g. checkpoints/global_step200), or a tag "
             "inside --output-dir (global_step200); 'latest' is --resume. Later saves go to --output-dir")


def wants_resume(args: argparse.Namespace) -> bool:
    """Whether the command line asks to resume (`--resume` or `--resume-from-checkpoint`)."""
    return bool(args.resume or args.resume_from_checkpoint)


def _target(args: argparse.Namespace, save_dir: Optional[str]) -> tuple[str, Optional[str]]:
    """``(load_dir, tag)`` for `engine.load_checkpoint`: the save directory's latest, a checkpoint directory,
    or a tag inside the save directory."""
    from zerotrain.checkpoint import CheckpointError

    given = args.resume_from_checkpoint
    restarted = args.resume and given not in (None, LATEST)  # an elastic restart: its own saves first
    if given in (None, LATEST) or (restarted and save_dir is not None
                                   and os.path.isfile(os.path.join(save_dir, LATEST))):
        if save_dir is None:
            raise CheckpointError("--resume reads the latest checkpoint of --output-dir: give --output-dir")
        return save_dir, None
    if os.path.isdir(given):
        return os.path.abspath(given), None
    if save_dir is not None and os.path.isdir(os.path.join(save_dir, given)):
        return save_dir, given
    where = f" nor a tag in {save_dir}" if save_dir is not None else ""
    raise CheckpointError(f"--resume-from-checkpoint {given}: not a checkpoint directory{where}")


def load_for_resume(engine: Any, args: argparse.Namespace, save_dir: Optional[str],
                    config: dict) -> tuple[Optional[str], dict]:
    """Load the checkpoint `args` ask for into `engine` (collective); ``(path, client_state)``, path None when the
    save directory holds nothing yet (`--resume`: start from scratch). A latest checkpoint that cannot be loaded is
    refused naming the newest intact ones and how to resume from one. Rank 0 warns (stderr, one line) when the
    run's `config` lays the learning-rate schedule over another number of steps than the checkpoint's."""
    import sys

    from zerotrain.checkpoint import CheckpointError, intact_tags
    from zerotrain.command import PROG

    load_dir, tag = _target(args, save_dir)
    try:
        path, client_state = engine.load_checkpoint(load_dir, tag)
    except CheckpointError as error:
        if args.resume_from_checkpoint not in (None, LATEST):
            raise
        intact = intact_tags(load_dir)
        if not intact:
            raise CheckpointError(f"{error}; no intact checkpoint in {load_dir} to resume from") from None
        names = ", ".join(f"{name} (step {step})" for name, step in intact[:3])
        raise CheckpointError(f"{error}; the newest intact checkpoints in {load_dir}: {names}; resume from one with "
                              f"--resume-from-checkpoint {intact[0][0]}") from None
    warning = schedule_change(path, config) if path is not None else None
    if warning is not None and engine.global_rank == 0:
        print(f"{PROG}: {warning}", file=sys.stderr, flush=True)
    return path, client_state


def schedule_change(path: str, config: dict) -> Optional[str]:
    """The warning for a resume from `path` whose learning-rate schedule now spans another number of steps than
    the one it was saved with (another --max-steps), naming both; None when it is the same (or has no length)."""
    from zerotrain.checkpoint import saved_config

    def length(block: Any) -> Optional[int]:
        params = block.get("params", {}) if isinstance(block, dict) else {}
        for key in ("num_training_steps", "total_num_steps"):  # HFSchedule's, DeepSpeed's WarmupDecayLR/CosineLR
            if isinstance(params.get(key), int):
                return params[key]
        return None

    before = length((saved_config(path) or {}).get("scheduler"))
    now = length(config.get("scheduler"))
    if before is None or now is None or before == now:
        return None
    return (f"warning: resuming {path}, saved with a learning-rate schedule over {before} steps (--max-steps "
            f"{before}), with --max-steps {now}: the schedule is now laid out over {now} steps, so the learning "
            f"rate changes at once; give --max-steps {before} to continue the saved schedule")
