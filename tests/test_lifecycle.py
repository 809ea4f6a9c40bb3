"""How jobs end: stop signals, orphaned ranks, elastic restarts (zerotrain.lifecycle, the CLI launcher).

Every test runs the real `zerotrain train` command (torchrun agent, 2 ranks, gloo) and sends real
signals. The launcher is forked from the test forkserver (`start_python`/`run_cli`: torch, zerotrain and
transformers already imported), and so are its agent and ranks (`served_python` as torch's PYTHON_EXEC: real
signals forwarded, the same exit statuses) except in the tests of who dies with whom, where they are the
launcher's own fresh interpreters, as a user's are. The stop step is only
known once it happened, so each comparison run is launched after the interrupted one, for the same number of
steps.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import ForkedProcess, run_cli, run_distributed, run_python, served_python, start_python

REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT = 180


def _env(served: bool = True) -> dict:
    """The launch's environment; `served`: its torchrun agent and ranks are forked from the test forkserver as well
    (served_python as torch's PYTHON_EXEC), for the tests that do not look at the process tree."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    if served:
        env["PYTHON_EXEC"] = served_python()
    return env


def _train_cmd(save_dir: Path, log_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zerotrain.cli", "train", "--config", str(REPO / "examples/zero3.json"),
            "--nproc", "2", "--model", "tiny", "--steps", str(steps), "--max-corpus-bytes", "300000",
            "--val-fraction", "0", "--save-dir", str(save_dir), "--log-dir", str(log_dir), *extra]


def _losses(log_dir: Path) -> dict[int, float]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records}


def _wait_for_step(proc: ForkedProcess, log_dir: Path, step: int, timeout: float = LAUNCH_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training ended (status {proc.returncode}) before step {step}:\n{out}\n{err}")
        if len(_losses(log_dir)) >= step:
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout}s")


def _communicate(proc: ForkedProcess) -> tuple[str, str]:
    """The launch's output once it ends; past LAUNCH_TIMEOUT its whole process tree is killed (a hung run
    must not outlive the test) and the test fails with what it printed."""
    try:
        return proc.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        for pid in _descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = proc.communicate()
        pytest.fail(f"the launch did not end within {LAUNCH_TIMEOUT}s:\n{out}\n{err[-4000:]}")


def _start(cmd: list[str], served: bool = True) -> ForkedProcess:
    """The launch the test signals or kills: the launcher forked from the test forkserver (`start_python`, a Popen
    stand-in), not a fresh interpreter; `served=False`: its agent and ranks are fresh interpreters, its children."""
    assert cmd[:3] == [sys.executable, "-m", "zerotrain.cli"], cmd
    return start_python(cmd[1:], cwd=os.getcwd(), env=_env(served))


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A launch nothing signals: the launcher forked from the test forkserver (`run_cli`), not a fresh interpreter."""
    assert cmd[:3] == [sys.executable, "-m", "zerotrain.cli"], cmd
    done = run_cli(cmd[3:], cwd=os.getcwd(), env=_env(), timeout=LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _children() -> dict[int, list[int]]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = (int(v) for v in line.split())
        children.setdefault(parent, []).append(child)
    return children


def _descendants(pid: int) -> list[int]:
    children = _children()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_a_rank_and_wait(proc: ForkedProcess) -> tuple[str, str]:
    """SIGKILL one rank of a `zerotrain train` launch (not the agent) and wait for the job: it must end with 0."""
    ranks = [pid for pid in _descendants(proc.pid) if "zerotrain.cli" in Path(f"/proc/{pid}/cmdline").read_text()
             and "torch.distributed.run" not in Path(f"/proc/{pid}/cmdline").read_text()]
    assert ranks
    os.kill(max(ranks), signal.SIGKILL)
    out, err = _communicate(proc)
    assert proc.returncode == 0, out + err
    return out, err


def _assert_the_restart_continued(out: str, log_dir: Path, total: int) -> None:
    """The restarted attempt resumed from the latest checkpoint and continued the run: a restart from step 1 would
    end with the same weights, and log step 1 twice."""
    assert "resuming from the latest checkpoint" in out, out
    logged = [json.loads(line)["step"] for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert logged.count(1) == 1 and logged[-1] == total, logged


def _assert_same_weights(run: Path, other: Path, step: int) -> None:
    """The two runs' saved weights at `step` are equal bit for bit."""
    from safetensors.torch import load_file

    def weights(directory: Path) -> dict:
        found = {}
        for path in sorted((directory / "ckpt" / f"global_step{step}").glob("model*.safetensors")):
            found.update(load_file(str(path)))
        return found

    a, b = weights(run), weights(other)
    assert a and a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


# One uninterrupted run both interruption tests compare with (the schedule does not depend on --steps, so a
# run stopped early and resumed to UNINTERRUPTED_STEPS must match it step for step).
UNINTERRUPTED_STEPS = 16


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted")
    _run(_train_cmd(run / "ckpt", run / "log", UNINTERRUPTED_STEPS, "--save-every", "4"))
    return run


def test_sigterm_saves_exits_143_and_resume_continues_exactly(tmp_path, uninterrupted):
    stopped = tmp_path / "stopped"
    proc = _start(_train_cmd(stopped / "ckpt", stopped / "log", 100000))
    _wait_for_step(proc, stopped / "log", 3)
    proc.send_signal(signal.SIGTERM)
    out, err = _communicate(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    stop_step = max(_losses(stopped / "log"))
    tag = f"global_step{stop_step}"
    assert (stopped / "ckpt" / "latest").read_text().strip() == tag
    line = f"stopped by SIGTERM at step {stop_step}; checkpoint {stopped / 'ckpt' / tag}; continue with --resume"
    # said once (issue 47), by the launcher's closing line: not by rank 0 as well
    assert f"zerotrain: {line}" in err and (out + err).count(line) == 1, out + err
    # a stop is no error: no "error:", no agent traceback, no torchelastic lines about the workers it stopped
    assert "zerotrain: error" not in err and "Traceback" not in err and "closing signal" not in err, err
    assert err.count("received SIGTERM") == 1, err  # every rank got it, rank 0 says so
    assert stop_step < UNINTERRUPTED_STEPS, f"the stop came only at step {stop_step}: nothing left to resume"

    _run(_train_cmd(stopped / "ckpt", stopped / "log", UNINTERRUPTED_STEPS, "--resume"))
    resumed, whole = _losses(stopped / "log"), _losses(uninterrupted / "log")
    for step in range(1, UNINTERRUPTED_STEPS + 1):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-6), step


def _pipeline_cmd(run: Path, steps: int, *extra: str) -> list[str]:
    """`zerotrain train --pipeline-parallel-size 2` (2 ranks = 2 stages) of the tiny preset on the built-in corpus (a
    DistributedSampler: a resumed run must skip the consumed batches itself); a constant rate, so a run stopped
    early and resumed to `steps` follows the schedule of a run of `steps`."""
    return [sys.executable, "-m", "zerotrain.cli", "train", "--nproc", "2", "--model", "tiny",
            "--pipeline-parallel-size", "2", "--steps", str(steps), "--max-corpus-bytes", "300000",
            "--val-fraction", "0", "--per-device-train-batch-size", "4", "--gradient-accumulation-steps", "2",
            "--learning-rate", "1e-3", "--lr-scheduler-type", "constant", "--save-dir", str(run / "ckpt"),
            "--log-dir", str(run / "log"), *extra]


def test_pipeline_run_stops_at_a_step_boundary_on_sigterm_and_resume_continues_exactly(tmp_path):
    """The pipeline step carries the stop flag like the language-model step (the Trainer's one reduction): a SIGTERM
    stops it after the step under way with a checkpoint, and `--resume` seeks to the next batch: every loss equals
    an uninterrupted run's (launched afterwards, for as many steps)."""
    stopped = tmp_path / "stopped"
    proc = _start(_pipeline_cmd(stopped, 400))
    _wait_for_step(proc, stopped / "log", 3)
    proc.send_signal(signal.SIGTERM)
    out, err = _communicate(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    stop_step = max(_losses(stopped / "log"))
    assert stop_step < 400, out
    tag = f"global_step{stop_step}"
    latest = stopped / "ckpt" / "latest"
    assert latest.exists() and latest.read_text().strip() == tag, out + err
    line = f"zerotrain: stopped by SIGTERM at step {stop_step}; checkpoint {stopped / 'ckpt' / tag}"
    assert line in err and (out + err).count(line) == 1, out + err  # said once, by the launcher
    total = stop_step + 3
    _run(_pipeline_cmd(stopped, total, "--resume"))
    whole = tmp_path / "whole"
    _run(_pipeline_cmd(whole, total))
    resumed, expected = _losses(stopped / "log"), _losses(whole / "log")
    assert sorted(resumed) == list(range(1, total + 1)), resumed
    for step in range(1, total + 1):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), step
    # the tokens: the first stage's count (4 x 2 micro-batches of 32 a step), once over the ranks
    assert json.loads((whole / "log" / "summary.json").read_text())["tokens"] == total * 4 * 2 * 32
    # the step's one reduction gathers every rank's memory (the pipeline's records had none)
    record = json.loads((whole / "log" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["memory_bytes"]) == 2 and min(record["memory_bytes"]) > 0, record


@pytest.mark.slow  # a fault case: `pytest -m slow` after touching the elastic restart or the pipeline's resume
def test_a_killed_pipeline_rank_restarts_from_the_latest_checkpoint_and_finishes_like_an_uninterrupted_run(tmp_path):
    """An elastic restart resumes a pipeline run as it does a language-model run (the run layer's one resume path):
    a stage's rank is killed, the agent restarts the pair, the run resumes from `latest`, seeks past the consumed
    batches and ends with the losses and weights of an uninterrupted run of as many steps."""
    crashed, whole, total = tmp_path / "crashed", tmp_path / "whole", 8
    proc = _start(_pipeline_cmd(crashed, total, "--save-every", "1", "--max-restarts", "3", "--stop-timeout", "15"),
                  served=False)  # a rank of its own process tree is killed
    _wait_for_step(proc, crashed / "log", 3)
    out, err = _kill_a_rank_and_wait(proc)
    _assert_the_restart_continued(out, crashed / "log", total)
    _run(_pipeline_cmd(whole, total, "--save-every", "4"))
    resumed, expected = _losses(crashed / "log"), _losses(whole / "log")
    assert sorted(resumed) == list(range(1, total + 1)), resumed
    for step in range(1, total + 1):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), step
    _assert_same_weights(crashed, whole, total)


# killing the torchrun agent itself is the rarer case and the one the multi-node fault tests repeat: `slow`
@pytest.mark.parametrize("victim", ["launcher", pytest.param("agent", marks=pytest.mark.slow)])
def test_killed_launcher_takes_every_rank_with_it(tmp_path, victim):
    proc = _start(_train_cmd(tmp_path / "ckpt", tmp_path / "log", 100000, "--save-every", "1"), served=False)
    _wait_for_step(proc, tmp_path / "log", 2)
    family = _descendants(proc.pid)
    assert len(family) >= 3, family  # the agent and two ranks
    if victim == "launcher":
        proc.kill()
    else:  # the torchrun agent, the launcher's only child: the ranks' own parent-death hook ends them
        (agent,) = _children()[proc.pid]
        os.kill(agent, signal.SIGKILL)
        family.append(proc.pid)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in family):
        time.sleep(0.1)
    assert not [pid for pid in family if _alive(pid)], "ranks outlived their launcher by 10 s"
    committed = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    time.sleep(1.5)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == committed  # nothing written afterwards


@pytest.mark.slow  # a fault case (~20 s): `pytest -m slow` after touching the elastic restart or resume path
def test_killed_rank_restarts_from_the_latest_checkpoint_and_finishes_like_an_uninterrupted_run(tmp_path, uninterrupted):
    crashed, whole = tmp_path / "crashed", uninterrupted
    total = 12  # the uninterrupted run saved here too (every 4 steps)
    # The agent stops the surviving rank with SIGTERM, which that rank takes as a stop request; should it be
    # stuck in a collective with its dead peer, --stop-timeout bounds the wait before the agent kills it.
    # Spare restarts absorb a gloo connect that fails on a loaded machine.
    proc = _start(_train_cmd(crashed / "ckpt", crashed / "log", total, "--save-every", "1",
                             "--max-restarts", "3", "--stop-timeout", "15"), served=False)
    _wait_for_step(proc, crashed / "log", 4)
    out, err = _kill_a_rank_and_wait(proc)
    # the crashed run's metrics file holds the steps before the crash and, appended, those after the restart
    _assert_the_restart_continued(out, crashed / "log", total)
    assert _losses(crashed / "log")[total] == pytest.approx(_losses(whole / "log")[total], rel=1e-6)
    _assert_same_weights(crashed, whole, total)


# --- in-process pieces -----------------------------------------------------------------------------

def _should_stop_on_one_rank(requesting_rank: int, save_dir: str) -> dict:
    import io

    from rich.console import Console

    import zerotrain
    from tests.models_for_tests import OddMLP
    from zerotrain.data import TokenBlockDataset, load_stdlib_corpus
    from zerotrain.models import GPT, GPTConfig
    from zerotrain.trainer import Trainer

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=OddMLP(), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    rank = engine.topology.rank
    answers = [engine.should_stop()]
    if rank == requesting_rank:
        engine.stop_request.request(signal.SIGUSR1)
    answers.append(engine.should_stop())
    engine.close()

    # A rank that learns of the stop from its peer's flag (the step's one reduction) before its own signal reaches
    # it (another node's scheduler, a slower chain of forwarders) gets that signal while the stop's checkpoint is
    # saved: the Trainer's handlers stay until the save is committed, so it is a first request there, not
    # SIGTERM's default action (the rank killed mid-save, its peer's collective reset, no checkpoint).
    class SignalDuringSave(Trainer):
        def save_checkpoint(self, step, console):
            if self.rank != requesting_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().save_checkpoint(step, console)

    torch.manual_seed(0)
    engine, *_ = zerotrain.initialize(model=GPT(GPTConfig.preset("tiny")), config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "comm_timeout_seconds": 60})
    dataset = TokenBlockDataset(load_stdlib_corpus(max_bytes=16 * 16 + 1), 16)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2,
                                         sampler=torch.utils.data.DistributedSampler(dataset, shuffle=False))
    trainer = SignalDuringSave(engine, loader, total_steps=4, save_dir=save_dir, stop_signals="SIGTERM,SIGUSR1",
                               console=Console(file=io.StringIO()))
    if rank == requesting_rank:
        trainer.stop_request.request(signal.SIGUSR1)
    before = signal.getsignal(signal.SIGTERM)
    summary = trainer.train()
    given_back = signal.getsignal(signal.SIGTERM) is before  # once the save is committed
    engine.close()
    return {"should_stop": answers, "stopped_by": summary.stopped_by, "steps": summary.steps,
            "late": trainer.stop_request.signal_name, "latest": open(os.path.join(save_dir, "latest")).read(),
            "given_back": given_back}


def test_should_stop_agrees_across_ranks(tmp_path):
    results = run_distributed(_should_stop_on_one_rank, 2, 1, str(tmp_path))
    assert [r["should_stop"] for r in results] == [[False, True], [False, True]]
    # the stop after step 1 on both ranks, its checkpoint committed; rank 0's own signal (SIGTERM, during the
    # save) taken as a request, as the handlers were still there
    assert [(r["stopped_by"], r["steps"], r["latest"]) for r in results] == [("SIGUSR1", 1, "global_step1")] * 2
    assert [r["late"] for r in results] == ["SIGTERM", "SIGUSR1"]
    assert [r["given_back"] for r in results] == [True, True]


def test_parse_signals_names_a_bad_one():
    from zerotrain.lifecycle import parse_signals

    assert parse_signals("TERM, SIGUSR1") == (signal.SIGTERM, signal.SIGUSR1)
    with pytest.raises(ValueError, match="SIGBOGUS"):
        parse_signals("SIGTERM,SIGBOGUS")
    with pytest.raises(ValueError, match="KILL"):
        parse_signals("KILL")


_SECOND_SIGNAL = """
import os, signal, sys, time
from zerotrain.lifecycle import StopRequest, REPEAT_WINDOW_S
stop = StopRequest().install("SIGTERM")
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # within the window: the same stop, delivered twice
time.sleep(0.05)
assert stop.signal_name == "SIGTERM"
print("still running", flush=True)
time.sleep(REPEAT_WINDOW_S + 0.2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("not reached", flush=True)
"""


def test_a_second_signal_exits_at_once():
    done = run_python(["-c", _SECOND_SIGNAL], env=_env(served=False), timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert "still running" in done.stdout and "not reached" not in done.stdout
    assert "again: exiting now" in done.stderr
