"""`zerotrain.train.resume` in the pytest process: which checkpoint a command's resume flags load, on a world-of-one
engine's real saves (issue #48: the fast covering test of its mutation run; the commands' own resumes are
tests/test_cli.py's and, under restarts, tests/test_lifecycle.py's)."""
from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.nn as nn


def _engine(total_steps: int):
    import zerotrain

    torch.manual_seed(0)
    config = {"train_batch_size": 1, "steps_per_print": 0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": total_steps, "warmup_num_steps": 1}}}
    engine, *_ = zerotrain.initialize(model=nn.Linear(2, 1), config=config)
    return engine, config


def _step(engine) -> None:
    engine.backward(engine(torch.ones(1, 2)).sum())
    engine.step()


def _args(resume: bool = False, resume_from_checkpoint=None) -> argparse.Namespace:
    return argparse.Namespace(resume=resume, resume_from_checkpoint=resume_from_checkpoint)


def test_each_resume_flag_loads_its_checkpoint_and_another_schedule_length_is_said_once(tmp_path, world_of_one,
                                                                                         capsys):
    """--resume: the save directory's latest (nothing saved yet: none); --resume-from-checkpoint TAG: that tag of the
    save directory, PATH: that directory, `latest`: as --resume; both (an elastic restart of a job started from
    PATH): its own latest once it saved one, PATH before; a name that is neither, or --resume without a save
    directory: refused naming it. A resume whose schedule now spans other steps is warned once on stderr, naming
    both counts; the same length, or no scheduler, says nothing."""
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.train.resume import load_for_resume, schedule_change, wants_resume

    engine, config = _engine(10)
    save, other, empty = tmp_path / "save", tmp_path / "other", tmp_path / "empty"
    empty.mkdir()
    _step(engine)
    engine.save_checkpoint(str(save), tag="global_step1")
    engine.save_checkpoint(str(other), tag="start")
    _step(engine)
    engine.save_checkpoint(str(save), tag="global_step2")  # save's latest
    start = str(other / "start")

    def loaded(args, save_dir, run_config=config) -> tuple:
        path, _ = load_for_resume(engine, args, save_dir, run_config)
        return (os.path.relpath(path, tmp_path) if path is not None else None), engine.global_steps

    assert not wants_resume(_args()) and wants_resume(_args(True)) and wants_resume(_args(False, "x"))
    assert loaded(_args(True), str(save)) == ("save/global_step2", 2)
    assert loaded(_args(False, "global_step1"), str(save)) == ("save/global_step1", 1)
    assert loaded(_args(False, "latest"), str(save)) == ("save/global_step2", 2)
    assert loaded(_args(False, start), str(save)) == ("other/start", 1)
    assert loaded(_args(False, start), None) == ("other/start", 1)
    assert loaded(_args(True, start), str(save)) == ("save/global_step2", 2)  # restarted: its own saves first
    assert loaded(_args(True, start), str(empty)) == ("other/start", 1)  # restarted before its first save
    assert loaded(_args(True, start), None) == ("other/start", 1)  # no save directory: nothing of its own
    assert loaded(_args(True), str(empty)) == (None, 1)  # --resume with nothing saved: from scratch
    assert capsys.readouterr().err == ""  # the same schedule length each time: nothing said
    with pytest.raises(CheckpointError, match=r"^--resume-from-checkpoint nope: not a checkpoint directory nor a "
                                              rf"tag in {save}$"):
        load_for_resume(engine, _args(False, "nope"), str(save), config)
    with pytest.raises(CheckpointError, match=r"^--resume-from-checkpoint nope: not a checkpoint directory$"):
        load_for_resume(engine, _args(False, "nope"), None, config)
    with pytest.raises(CheckpointError, match="give --output-dir"):
        load_for_resume(engine, _args(True), None, config)
    # another --max-steps: said once, one line, both lengths; no scheduler now: nothing
    longer = dict(config, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 20}})
    assert loaded(_args(False, "global_step1"), str(save), longer) == ("save/global_step1", 1)
    err = capsys.readouterr().err
    assert err == (f"zerotrain: warning: resuming {save / 'global_step1'}, saved with a learning-rate schedule over 10 "
                   "steps (--max-steps 10), with --max-steps 20: the schedule is now laid out over 20 steps, so the "
                   "learning rate changes at once; give --max-steps 10 to continue the saved schedule\n"), err
    hf = dict(config, scheduler={"type": "HFSchedule", "params": {"num_training_steps": 10}})
    assert loaded(_args(False, "global_step1"), str(save), hf) == ("save/global_step1", 1)
    plain = {k: v for k, v in config.items() if k != "scheduler"}
    assert loaded(_args(False, "global_step1"), str(save), plain) == ("save/global_step1", 1)
    assert capsys.readouterr().err == ""
    # a checkpoint that records no config (no trainer state: another tool's directory) has no schedule to compare
    assert schedule_change(str(empty), longer) is None
    engine.close()
