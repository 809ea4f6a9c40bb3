"""The run layer's skeleton (`zerotrain.run`) in the pytest process: the restart count a job agrees on, whether a
run resumes, the run's record written where asked, and what a stopped run says and exits with.

(test_cli.py's world-2 launch checks the count the ranks agree on when they read different ones; test_lifecycle.py
runs real signals through `zerotrain train`.)
"""
from __future__ import annotations

import json
import signal

import pytest
import torch

from zerotrain import lifecycle
from zerotrain.lifecycle import StopRequest, read_stop_file
from zerotrain.run import job_restarts, resume_after_restart, start_run, stop_status
from zerotrain.trainer import TrainSummary

RESTART_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


@pytest.fixture
def no_restarts(monkeypatch):
    for name in RESTART_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_restart_count_is_the_larger_of_torchruns_and_slurms_with_or_without_a_world(no_restarts, world_of_one):
    """Neither variable (or an empty one): 0; either one alone, or the larger of both; before torch.distributed is
    up (the launcher's check) and in a world of one alike."""
    import zerotrain.dist as dist

    assert job_restarts() == 0
    no_restarts.setenv("SLURM_RESTART_COUNT", "")
    assert job_restarts() == 0
    for torchrun, slurm, want in (("2", "", 2), ("", "3", 3), ("4", "1", 4), ("1", "5", 5)):
        no_restarts.setenv("TORCHELASTIC_RESTART_COUNT", torchrun)
        no_restarts.setenv("SLURM_RESTART_COUNT", slurm)
        assert not dist.is_initialized() and job_restarts() == want, (torchrun, slurm)
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    assert job_restarts() == 5


def test_a_run_resumes_when_asked_or_restarted_with_a_save_directory(no_restarts, capsys):
    """Asked: resumes (said by no one); a restart of a job that saves: resumes, said once by rank 0 only; a first
    run, or a restart without a save directory: starts afresh."""
    assert resume_after_restart(True, None, 0) is True and resume_after_restart(False, "/ckpt", 0) is False
    no_restarts.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_after_restart(False, None, 0) is False
    assert resume_after_restart(False, "/ckpt", 1) is True
    assert capsys.readouterr().out == ""
    assert resume_after_restart(True, "/ckpt", 0) is True
    assert capsys.readouterr().out == ""  # asked: nothing to say
    assert resume_after_restart(False, "/ckpt", 0) is True
    assert capsys.readouterr().out == "zerotrain: restart 1 of this job: resuming from the latest checkpoint\n"


def test_start_run_records_the_config_once_in_each_directory_given_and_claims_the_save_dir(no_restarts, tmp_path,
                                                                                          world_of_one):
    import zerotrain
    from zerotrain.checkpoint.lock import LOCK_FILE
    from zerotrain.run.config import RunConfig

    values = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zerotrain.initialize(model=torch.nn.Linear(2, 2), config=values)
    config = RunConfig(values, world_size=1, steps=1)
    save, log = tmp_path / "save", tmp_path / "log"
    try:
        assert start_run(engine, config, resume=False, save_dir=str(save), rank=0,
                         record_dirs=(str(save), None, str(log), str(save))) is False
        for directory in (save, log):
            assert json.loads((directory / "effective_config.json").read_text()) == values, directory
        assert (save / LOCK_FILE).exists()  # claimed before any save
        assert start_run(engine, config, resume=True, save_dir=None, rank=1, record_dirs=(str(tmp_path / "r1"),))
        assert not (tmp_path / "r1").exists()  # rank 0 records it
    finally:
        engine.close()


def _summary(stopped_by, checkpoint):
    return TrainSummary(steps=5, final_loss=1.0, mean_tokens_per_s=1.0, total_time_s=1.0, tokens=10,
                        checkpoint=checkpoint, stopped_by=stopped_by)


def test_a_stopped_run_says_where_its_checkpoint_is_once_and_exits_with_the_signals_status(monkeypatch, tmp_path,
                                                                                         capsys):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(lifecycle.STOP_FILE_ENV, raising=False)
    stop = StopRequest()
    assert stop_status(_summary(None, "ck/global_step5"), stop, 5, 0) is None  # not stopped: nothing said
    assert stop_status(_summary("SIGTERM", "ck/global_step5"), stop, 5, 1) == 128 + signal.SIGTERM
    assert capsys.readouterr().out == ""  # rank 1 says nothing
    assert stop_status(_summary("SIGTERM", "ck/global_step5"), stop, 5, 0) == 128 + signal.SIGTERM
    assert capsys.readouterr().out == ("zerotrain: stopped by SIGTERM at step 5; checkpoint ck/global_step5; "
                                       "continue with --resume\n")
    assert stop_status(_summary("SIGUSR1", None), stop, 3, 0) == 128 + signal.SIGUSR1
    assert capsys.readouterr().out == "zerotrain: stopped by SIGUSR1 at step 3; no checkpoint saved (--no-save)\n"
    # a launcher listening: told through its stop file, and the rank says nothing itself
    path = tmp_path / "stop"
    monkeypatch.setenv(lifecycle.STOP_FILE_ENV, str(path))
    assert stop_status(_summary("SIGTERM", "ck/global_step5"), stop, 5, 1) == 128 + signal.SIGTERM
    assert not path.exists()  # rank 0 tells it
    assert stop_status(_summary("SIGTERM", "ck/global_step5"), stop, 5, 0) == 128 + signal.SIGTERM
    assert capsys.readouterr().out == ""
    assert read_stop_file(str(path)) == (signal.SIGTERM, "step 5; checkpoint ck/global_step5; continue with --resume")


def test_the_restart_line_reaches_a_piped_log_while_the_rank_still_runs(tmp_path):
    """Under a launcher a rank's stdout is a pipe (block-buffered): the restart line must reach the job's log when
    the run resumes, not when the rank exits hours later."""
    import os
    import select
    import subprocess
    import sys

    code = ("import sys; from zerotrain.run import resume_after_restart; "
            "resume_after_restart(False, '/ckpt', 0); sys.stdin.read()")
    env = {**os.environ, "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": ""}
    env.pop("PYTHONUNBUFFERED", None)  # as torchrun and srun start a rank
    rank = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                            cwd=tmp_path)
    try:
        ready, _, _ = select.select([rank.stdout], [], [], 120)
        line = rank.stdout.readline() if ready else b""
    finally:
        rank.stdin.close()
        rank.wait(timeout=60)
        rank.stdout.close()
    assert line == b"zerotrain: restart 1 of this job: resuming from the latest checkpoint\n"
