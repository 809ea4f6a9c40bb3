"""`zerotrain launch SCRIPT` from the pytest process (issue #48: fast coverage of `command.run_torchrun`,
`zerotrain.elastic` and `zerotrain.launcher`): torchrun's agent started by `run_torchrun`, one worker running a
script as `__main__` with DeepSpeed's `--local_rank` and the environment the agent sets; then two workers, one
stopping on a usage error while its peer waits: the job's status is the error's, its line is printed once, and
the workers are not restarted (run_torchrun's default, `zerotrain generate`'s). Then (issue #48, round 7) the
agent's other ends, three agents at once: a worker SIGKILLed and restarted, one raising under torch's `@record`
(its error copied to the agent's own error file), the agent stopped by SIGTERM; and `zerotrain launch` of a
worker that saves on the forwarded stop."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from zerotrain.cli import main
from zerotrain.command import rendezvous, run_torchrun
from zerotrain.launcher import worker_target

SCRIPT = textwrap.dedent('''
    import argparse, json, os, sys, time
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out")
    parser.add_argument("--fail-rank", type=int, default=-1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if rank == args.fail_rank:
        with open(args.out + ".starts", "a") as starts:
            starts.write("started\\n")
        from zerotrain.config import ConfigError
        raise ConfigError("train_batch_size: 7 is not what this script wants")
    if args.fail_rank >= 0:
        time.sleep(120)  # the agent stops this peer once the other rank failed
    json.dump({"name": __name__, "argv0": sys.argv[0], "path0": sys.path[0], "local_rank": args.local_rank,
               "omp": os.environ.get("OMP_NUM_THREADS"), "share": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
               "pythonpath": os.environ["PYTHONPATH"].split(os.pathsep)[0], "agent_sid": os.getsid(os.getppid())},
              open(args.out, "w"))
''')


def test_launch_runs_the_script_as_main_under_the_agent_and_a_usage_error_is_one_line(tmp_path, capfd,
                                                                                     monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    assert main(["launch", "--nproc", "1", str(script), "--out", str(out)]) == 0
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv0"] == str(script) and seen["path0"] == str(tmp_path)
    assert seen["local_rank"] == 0  # the script declares --local_rank: passed as DeepSpeed's launcher does
    assert seen["omp"] == "1" and seen["share"] == "1"
    assert seen["pythonpath"] == str(Path(__file__).resolve().parent.parent)  # the workers import this zerotrain
    assert seen["agent_sid"] != os.getsid(0)  # the agent in its own session: a terminal's Ctrl-C reaches us only
    capfd.readouterr()

    # what each worker runs: --local_rank added only where the script declares it and its arguments lack it
    head = ["-m", "zerotrain.launcher"]
    assert worker_target(str(script), ["--out", "o"]) == [*head, "--pass-local-rank", "--", str(script), "--out", "o"]
    for given in (["--local_rank=3"], ["--local-rank", "3"]):
        assert worker_target(str(script), given) == [*head, "--", str(script), *given]
    assert worker_target(str(script), [], pass_local_rank=False) == [*head, "--", str(script)]
    plain = tmp_path / "plain.py"
    plain.write_text("print(1)\n")
    assert worker_target(str(plain), []) == [*head, "--", str(plain)]
    # run_torchrun's defaults (as `zerotrain generate` calls it): no restart of the failed workers
    # (no --local_rank: torchrun takes the separator off and the worker's first argument is the script)
    assert run_torchrun(rendezvous(2), worker_target(str(script), ["--out", str(out), "--fail-rank", "1"],
                                                     pass_local_rank=False)) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]  # the agent's and workers' too
    assert err == ["zerotrain: error: train_batch_size: 7 is not what this script wants"], err
    assert Path(f"{out}.starts").read_text() == "started\n"

    # a crash in rank 1 of a script that does not use torchrun's @record: the report names the rank and shows
    # the exception with its traceback once (the rank's error file, as @record writes it; was "error_file: <N/A>",
    # no exception in the report, the traceback printed by the rank alone)
    crash = tmp_path / "crash.py"
    crash.write_text("import os, time\nif os.environ['RANK'] == '1':\n    raise KeyError('boom in rank one')\n"
                     "time.sleep(60)\n")
    assert main(["launch", "--nproc", "2", str(crash)]) == 1
    err = capfd.readouterr().err
    assert err.count("KeyError: 'boom in rank one'") == 1 and "  KeyError: 'boom in rank one'" in err.splitlines(), err
    root = err.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1 (pid" in root, err  # as an uncaught one
    assert "error_file: <N/A>" not in root, err
    assert err.count('File "' + str(crash) + '", line 3, in <module>') == 1, err


FAILING = textwrap.dedent('''
    import os, signal, sys, time
    mode, out = sys.argv[1], sys.argv[2]
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(out, "a") as starts:
        starts.write(restart + "\\n")
    if mode == "kill":  # a worker killed by the system (the OOM killer's SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "raise":  # a crash in a script that records its error as torchrun's docs say
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            raise RuntimeError(f"boom at restart {restart}")
        main()
    elif mode in ("term", "stop"):  # the agent told to stop (a scheduler's SIGTERM), the workers after it
        stop = None
        if mode == "stop":  # a worker that saves on the forwarded signal (zerotrain's, imported only here)
            from zerotrain.lifecycle import StopRequest

            stop = StopRequest().install("SIGTERM")
        os.kill(os.getppid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (stop and stop.requested):
            time.sleep(0.05)  # "term": SIGTERM's default action ends it here
        stop.tell_launcher(stop.signal_name, "step 3; checkpoint ck/global_step3")
        sys.exit(StopRequest.exit_status(stop.signal_name))
''')


def test_a_crash_keeps_torchruns_report_a_restart_reruns_and_a_stop_is_128_plus_the_signal(tmp_path, capfd):
    """`python -m zerotrain.elastic` (as `run_torchrun` starts it, here directly, with a scheduler's error file)
    on a worker that is SIGKILLed (restarted once: both attempts' failures and the restart are reported, torchrun's
    failure table last), one that raises (its error copied to the agent's error file, the traceback in the
    table), one whose agent gets SIGTERM (status 143, nothing printed); then `zerotrain launch` of a worker that
    saves on the forwarded SIGTERM: its stop line once, status 143."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("LOGLEVEL", None)
    runs = {}
    for mode, restarts, extra in (("kill", 1, {"LOGLEVEL": "INFO"}),
                                  ("raise", 0, {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "agent-error.json")}),
                                  ("term", 0, {})):
        cmd = [sys.executable, "-m", "zerotrain.elastic", "--standalone", "--nproc_per_node", "1", "--max_restarts",
               str(restarts), "--monitor_interval", "0.1", str(script), mode, str(tmp_path / f"{mode}.starts")]
        runs[mode] = subprocess.Popen(cmd, env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)  # the three agents at once: the test waits for the slowest only

    # `zerotrain launch`: the worker saves on the forwarded stop and says where; the launcher prints it once
    status = main(["launch", "--nproc", "1", str(script), "stop", str(tmp_path / "stop.starts")])
    assert status == 128 + signal.SIGTERM
    assert capfd.readouterr().err.splitlines() == [
        "zerotrain: received SIGTERM: stopping at the next step boundary (a checkpoint is saved where a save "
        "directory is set); send it again to exit at once",
        "zerotrain: stopped by SIGTERM at step 3; checkpoint ck/global_step3"]

    done = {mode: (run.wait(timeout=240), run.communicate()[1]) for mode, run in runs.items()}
    # SIGKILLed twice: one restart (the worker's restart counts), both failures, torchrun's report last
    status, err = done["kill"]
    assert status == 1 and (tmp_path / "kill.starts").read_text() == "0\n1\n", err
    assert "[default] Worker group FAILED. 1/1 attempts left; will restart worker group" in err, err
    assert err.count("failed (exitcode: -9) local_rank: 0") == 2, err
    lines = err.rstrip().splitlines()
    assert "traceback : Signal 9 (SIGKILL) received by PID" in lines[-2] and set(lines[-1]) == {"="}, err
    # a crash: the worker's traceback in the table, its error copied to the agent's own error file
    status, err = done["raise"]
    assert status == 1 and (tmp_path / "raise.starts").read_text() == "0\n", err
    lines = err.rstrip().splitlines()
    assert lines[-3:-1] == ["  RuntimeError: boom at restart 0", "  "], err
    assert set(lines[-1]) == {"="} and "failed (exitcode: 1) local_rank: 0" in err, err
    copied = json.loads((tmp_path / "agent-error.json").read_text())
    assert copied["message"]["message"] == "RuntimeError: boom at restart 0", copied
    # the agent stopped: its status 128 + SIGTERM, nothing printed (the launcher reports a stop)
    assert done["term"] == (128 + signal.SIGTERM, ""), done["term"]
    assert (tmp_path / "term.starts").read_text() == "0\n"


def test_the_agents_filter_holds_torchelastics_worker_lines_and_passes_any_other_record(caplog):
    """What `zerotrain.elastic` holds back until a run's outcome is known (torchelastic's lines about the workers
    it stopped or lost) and what it lets through: every other line, also one whose message is not a string
    (`logger.warning(exc)` is valid logging)."""
    import logging

    from zerotrain.elastic import _HoldBack

    hold = _HoldBack()
    logger = logging.getLogger("tests.launch_units.agent")
    logger.addFilter(hold)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            logger.warning("Sending process %s closing signal %s", 7, "SIGTERM")
            logger.error("failed (exitcode: %s) local_rank: %s", 1, 0)
            logger.warning(RuntimeError("rendezvous closed"))
            logger.info("[%s] Worker group FAILED. %s/%s attempts left", "default", 1, 1)
    finally:
        logger.removeFilter(hold)
    assert [r.getMessage() for r in caplog.records] == ["rendezvous closed",
                                                       "[default] Worker group FAILED. 1/1 attempts left"]
    assert [r.getMessage() for r in hold.held] == ["Sending process 7 closing signal SIGTERM",
                                                   "failed (exitcode: 1) local_rank: 0"]


def test_a_ranks_crash_is_recorded_as_record_does_and_printed_by_the_rank_only_where_no_report_shows_it(
        tmp_path, monkeypatch):
    """`elastic.record_failure` in a rank's except block (in-process, the rank's environment set by hand): the
    error file torchrun's `@record` writes (the exception, its traceback); True (the rank ends quietly: the agent's
    report shows it) only under our agent with no restart left; a restart ahead, or another launcher, False (the
    rank prints it too); no error file: False, nothing written."""
    from zerotrain.elastic import AGENT_ENV, ERROR_FILE_ENV, record_failure

    def crash(**env) -> tuple[bool, dict]:
        for name in (ERROR_FILE_ENV, AGENT_ENV, "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        path = tmp_path / "error.json"
        if path.exists():
            path.unlink()
        try:
            raise KeyError("boom")
        except KeyError as exc:
            quiet = record_failure(exc)
        return quiet, json.loads(path.read_text()) if path.exists() else {}

    ours = {ERROR_FILE_ENV: str(tmp_path / "error.json"), AGENT_ENV: "1"}
    quiet, data = crash(**ours)
    assert quiet and data["message"]["message"] == "KeyError: 'boom'", data
    assert 'raise KeyError("boom")' in data["message"]["extraInfo"]["py_callstack"], data
    assert crash(**ours, TORCHELASTIC_MAX_RESTARTS="2", TORCHELASTIC_RESTART_COUNT="2")[0]  # the last attempt
    for restarts, count in (("2", "1"), ("1", "0"), ("3", "2")):  # a restart ahead: the rank prints it as well
        quiet, data = crash(**ours, TORCHELASTIC_MAX_RESTARTS=restarts, TORCHELASTIC_RESTART_COUNT=count)
        assert not quiet and data["message"]["message"] == "KeyError: 'boom'", (restarts, count)
    quiet, data = crash(**{ERROR_FILE_ENV: str(tmp_path / "error.json")})  # plain torchrun: as @record, re-raised
    assert not quiet and data["message"]["message"] == "KeyError: 'boom'"
    assert crash(**{AGENT_ENV: "1"}) == (False, {})  # no error file: not started by an agent


_LEFT_WORKERS = textwrap.dedent('''
    import json, signal, subprocess, sys, time
    from zerotrain.elastic import stop_left_workers
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
                                start_new_session=True, stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()
    start = time.monotonic()
    signalled, killed = stop_left_workers(signal.SIGTERM, timeout=1.0)
    took = time.monotonic() - start
    alive = [pid for pid in (polite.pid, stubborn.pid) if subprocess.run(["kill", "-0", str(pid)]).returncode == 0]
    print(json.dumps({"signalled": sorted(signalled) == sorted([polite.pid, stubborn.pid]),
                      "killed": killed == [stubborn.pid], "alive": alive, "took": took,
                      "again": stop_left_workers(signal.SIGTERM, timeout=1.0)}))
''')


def test_a_stop_while_the_agent_starts_its_workers_leaves_none_running(tmp_path):
    """`elastic.stop_left_workers`, what the agent does once a stop signal ended torchrun's own agent: torch's
    agent holds its workers' context only once `start_processes` returns, so a stop landing while it starts them
    left them running on without it (seen in the loop: a worker that signals its agent at once outlived it by
    60 s). In a process of its own (it signals every child of the process it runs in): a worker that ends on
    SIGTERM and one that ignores it (SIGKILLed after the timeout), both gone; nothing left the second time."""
    script = tmp_path / "left.py"
    script.write_text(_LEFT_WORKERS)
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["signalled"] and said["killed"] and said["alive"] == [], said
    assert 1.0 <= said["took"] < 30, said  # the polite one ended on SIGTERM, the stubborn one waited out
    assert said["again"] == [[], []], said
