"""`zerotrain launch SCRIPT` from the pytest process (issue #48: fast coverage of `command.run_torchrun`,
`zerotrain.elastic` and `zerotrain.launcher`): torchrun's agent started by `run_torchrun`, one worker running a
script as `__main__` with DeepSpeed's `--local_rank` and the environment the agent sets; then two workers, one
stopping on a usage error while its peer waits: the job's status is the error's, its line is printed once, and
the workers are not restarted (run_torchrun's default, `zerotrain generate`'s)."""
from __future__ import annotations

import json
import os
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
