"""DeepSpeed's launcher options in `zerotrain launch` (issue #46): the hostfile, --include/--exclude, the
--num_nodes/--num_gpus caps and .deepspeed_env give DeepSpeed's own results (its runner's functions on the same
inputs), bad input is one line naming the file and line or the flag; MPI's and Slurm's rank variables map onto
torchrun's, the compressed Slurm node list expands as `scontrol show hostnames` does."""
from __future__ import annotations

import json
import os
import re
import socket

import pytest

from zerotrain.cli import main
from zerotrain.cluster import ClusterEnvError, adopt_cluster_ranks, expand_nodelist
from zerotrain.command import CLIError
from zerotrain.hostfile import is_this_host, parse_hostfile, read_deepspeed_env, select_resources

from mpi_flavours import (MPICH_HINT, OPENMPI_HINT, hydra_mpiexec, mpich_missing, mpirun_path, openmpi_missing,
                          openmpi_mpirun)

runner = pytest.importorskip("deepspeed.launcher.runner")

HOSTFILE = """# two workers
worker-0 slots=4

   worker-1    slots=2   # trailing text is ignored, as DeepSpeed's pattern does
worker-2 slots=8
"""

SELECTIONS = [  # (include, exclude, num_nodes, num_gpus)
    ("", "", -1, -1), ("worker-0", "", -1, -1), ("worker-1@worker-0:0,2", "", -1, -1),
    ("worker-0:3,1,1@worker-0:2", "", -1, -1), ("worker-2:7@worker-1", "", -1, -1), ("", "worker-1", -1, -1),
    ("", "worker-0:0,3@worker-2:1", -1, -1), ("", "worker-1:0,1", -1, -1), ("", "", 2, -1), ("", "", 1, 1),
    ("", "", -1, 3), ("", "", 0, -1), ("", "", 5, 16), ("", "", -1, 0), ("", "", 1, 0),
]


def _deepspeed(pool, include, exclude, num_nodes, num_gpus):
    active = runner.parse_inclusion_exclusion(pool, include, exclude)
    return dict(runner.apply_num_nodes_and_gpus(active, num_nodes, num_gpus))


def test_hostfile_and_selection_equal_deepspeeds(tmp_path):
    path = tmp_path / "hosts"
    path.write_text(HOSTFILE)
    pool = parse_hostfile(str(path))
    assert list(pool.items()) == list(runner.fetch_hostfile(str(path)).items()) == [
        ("worker-0", 4), ("worker-1", 2), ("worker-2", 8)]
    for include, exclude, num_nodes, num_gpus in SELECTIONS:
        ours = select_resources(pool, include, exclude, num_nodes, num_gpus)
        theirs = _deepspeed(pool, include, exclude, num_nodes, num_gpus)
        assert list(ours.items()) == list(theirs.items()), (include, exclude, num_nodes, num_gpus)


@pytest.mark.parametrize("text, says", [
    ("worker-0 slots=4\nworker-1 slot=2\n", ":2: bad hostfile line 'worker-1 slot=2'"),
    ("worker-0 slots=4\n\nworker-0 slots=2\n", ":3: host 'worker-0' is listed twice (first at line 1)"),
    ("worker-0\n", ":1: bad hostfile line 'worker-0'"),
    ("# nothing\n\n", ": no hosts in the hostfile"),
])
def test_a_bad_hostfile_is_one_line_naming_file_and_line(tmp_path, capsys, text, says):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(ValueError):  # DeepSpeed refuses it too
        runner.fetch_hostfile(str(path))
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    assert main(["launch", "--hostfile", str(path), str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"zerotrain: error: {path}{says}"), err


@pytest.mark.parametrize("include, exclude, num_nodes, num_gpus, says", [
    ("worker-9", "", -1, -1, "--include: host 'worker-9' is not in the hostfile"),
    ("worker-1:2", "", -1, -1, "--include: host 'worker-1' has no slot 2"),
    ("", "worker-1:5", -1, -1, "--exclude: host 'worker-1' has no slot 5"),
    ("worker-0", "worker-1", -1, -1, "--include and --exclude are mutually exclusive"),
    ("worker-0", "", 1, -1, "--num_nodes/--num_gpus cannot be combined with --include/--exclude"),
    ("", "worker-0", -1, 2, "--num_nodes/--num_gpus cannot be combined with --include/--exclude"),
])
def test_a_bad_selection_is_refused_as_deepspeed_refuses_it(include, exclude, num_nodes, num_gpus, says):
    pool = {"worker-0": 4, "worker-1": 2}
    with pytest.raises(CLIError, match=says.replace("(", r"\(").replace("[", r"\[")):
        select_resources(pool, include, exclude, num_nodes, num_gpus)
    if num_nodes < 0 and num_gpus < 0:  # main() checks the caps' exclusion before parse_inclusion_exclusion
        with pytest.raises(ValueError):
            runner.parse_inclusion_exclusion(pool, include, exclude)
    with pytest.raises(CLIError, match="slots of 'worker-0' must be integers"):
        select_resources(pool, "worker-0:a", "")
    with pytest.raises(CLIError, match="no slots left"):
        select_resources(pool, "", "worker-0@worker-1")


def test_launch_refuses_other_hosts_and_mixed_flags_in_one_line(tmp_path, capsys):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    script = tmp_path / "train.py"
    script.write_text("print('never')\n")
    for argv, says in ((["--hostfile", str(hosts), "--launcher_args", "-o ConnectTimeout=5"],
                        "host 'worker-0' is not reachable by passwordless ssh: ssh: Could not resolve hostname"),
                       (["--hostfile", str(hosts), "--include", "worker-1", "--launcher", "MPICH"],
                        "--launcher mpich runs every slot of the hostfile (as DeepSpeed's): it does not take "
                        "--include"),
                       (["--hostfile", str(hosts), "--nproc", "2"], "--nproc cannot be combined with --hostfile"),
                       (["--num_nodes", "2"], "--num_nodes > 1 needs a --hostfile"),
                       (["--hostfile", str(tmp_path / "missing")], f"--hostfile {tmp_path / 'missing'}: cannot read")):
        assert main(["launch", *argv, str(script)]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):  # an unknown launcher name: argparse's one line
        main(["launch", "--launcher", "mpirun", str(script)])
    assert "invalid choice: 'mpirun'" in capsys.readouterr().err


def test_this_host_is_recognised():
    for name in ("localhost", "127.0.0.1", socket.gethostname()):
        assert is_this_host(name), name
    assert not is_this_host("worker-that-is-not-here")


def test_deepspeed_env_is_read_where_deepspeed_reads_it(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nSHARED=home\n")
    (cwd / ".deepspeed_env").write_text("SHARED=cwd\n\nPATHS=a=b:c d\n# a comment\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    found = read_deepspeed_env()
    assert found == {"NCCL_IB_DISABLE": "1", "SHARED": "cwd", "PATHS": "a=b:c d"}
    # DeepSpeed's reading of the same lines (runner.main: split at the first '=', add_export strips and quotes)
    exports = runner.PDSHRunner.__new__(runner.PDSHRunner)
    exports.exports = {}
    for directory in (home, cwd):
        for line in (directory / ".deepspeed_env").read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                exports.add_export(*line.split("=", maxsplit=1))
    assert {k: v.strip('"') for k, v in exports.exports.items()} == found
    monkeypatch.setenv("DS_ENV_FILE", "other_env")
    (cwd / "other_env").write_text("ONLY=1\nbroken line\n")
    with pytest.raises(CLIError, match=r"other_env:2: bad line 'broken line': expected NAME=VALUE"):
        read_deepspeed_env()


def test_slurm_nodelist_expands_as_scontrol_does():
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_nodelist("a[8-11]") == ["a8", "a9", "a10", "a11"]
    assert expand_nodelist("r[1-2]n[3,5]") == ["r1n3", "r1n5", "r2n3", "r2n5"]
    assert expand_nodelist("single") == ["single"]
    for bad in ("node[1-3", "node1-3]", "node[a-c]", "node[1-c]"):
        with pytest.raises(ClusterEnvError, match="bad Slurm node list"):
            expand_nodelist(bad)


def test_mpi_and_slurm_variables_become_torchruns():
    env = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0"}
    assert adopt_cluster_ranks(env) is not None
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT")} == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                                    "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0",
                                                    "MASTER_PORT": "29500"}
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "1234"}
    adopt_cluster_ranks(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "1", "2", "1", "127.0.0.1", "1234")  # one host: loopback
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_TASKS_PER_NODE": "1(x2),4", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    adopt_cluster_ranks(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == (
        "3", "6", "1", "4", "gpu07")
    # DeepSpeed's MPICH line: hydra's PMI_RANK (or PMIX_RANK), the world and ranks per host from its -genv
    env = {"PMIX_RANK": "3", "PMI_RANK": "3", "WORLD_SIZE": "4", "PALS_LOCAL_RANKID": "1", "LOCAL_SIZE": "2",
           "MASTER_ADDR": "node0"}
    assert adopt_cluster_ranks(env) == "MPI (PMI_RANK/PMI_SIZE)"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    with pytest.raises(ClusterEnvError, match="the rank of PMIX_RANK=1 and PMI_RANK=2 disagree"):
        adopt_cluster_ranks({"PMIX_RANK": "1", "PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"})
    with pytest.raises(ClusterEnvError, match="the local rank of PALS_LOCAL_RANKID=0 and MPI_LOCALRANKID=1"):
        adopt_cluster_ranks({"PMI_RANK": "1", "PMI_SIZE": "2", "PALS_LOCAL_RANKID": "0", "MPI_LOCALRANKID": "1"})
    # DeepSpeed's Intel MPI line sets RANK, LOCAL_RANK (-env), WORLD_SIZE, LOCAL_SIZE (-genv): the ranks per host
    impi = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "PMI_RANK": "1"}
    assert adopt_cluster_ranks(impi) is None and impi["LOCAL_WORLD_SIZE"] == "2" and impi["RANK"] == "1"
    assert adopt_cluster_ranks({"OMPI_COMM_WORLD_RANK": "0"}) is None  # no size: not Open MPI's complete set
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert adopt_cluster_ranks(torchrun) is None and torchrun["RANK"] == "0"  # torchrun's own win
    with pytest.raises(ClusterEnvError, match="MASTER_ADDR is unset and the ranks may span several hosts"):
        adopt_cluster_ranks({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    with pytest.raises(ClusterEnvError, match="rank 4 is not below the world size 4"):
        adopt_cluster_ranks({"PMI_RANK": "4", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "h"})
    with pytest.raises(ClusterEnvError, match="SLURM_NTASKS must be an integer"):
        adopt_cluster_ranks({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"})


def test_ssh_commands_start_one_launch_per_host_with_the_forwarded_environment(tmp_path, monkeypatch):
    """What `zerotrain launch --hostfile` runs on each host over ssh: `zerotrain launch` with the host's node rank
    (its place in the hostfile), its slot count and the static rendezvous, DeepSpeed's forwarded variables and
    .deepspeed_env's lines (run for real across two hosts in tests/multinode/test_ssh_launch.py)."""
    import shlex

    from zerotrain.hostfile import STOP_ON_EOF_ENV, ssh_commands

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=a b\n")
    commands = ssh_commands({"w0": [0, 1], "w1": [0, 1, 2]}, "10.0.0.1", 29600, ["train.py", "--x", "1"],
                            ssh_port=2222, launcher_args="-i key", cwd=str(tmp_path),
                            environ={"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth1", "SECRET": "no",
                                     "PYTHONPATH": "/lib"})
    for rank, (cmd, host, slots) in enumerate(zip(commands, ("w0", "w1"), ("0,1", "0,1,2"))):
        assert cmd[:7] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", "key"] and cmd[7] == host
        remote = shlex.split(cmd[8])
        assert remote[:3] == ["cd", str(tmp_path), "&&"]
        assert {"NCCL_DEBUG=INFO", "GLOO_SOCKET_IFNAME=eth1", "FROM_FILE=a b", f"{STOP_ON_EOF_ENV}=1",
                f"PYTHONPATH={tmp_path}:/lib", f"CUDA_VISIBLE_DEVICES={slots}"} <= set(remote)
        assert "SECRET=no" not in remote
        launch = remote[remote.index("launch"):]
        assert launch == ["launch", "--nproc", str(len(slots.split(","))), "--nnodes", "2", "--node-rank", str(rank),
                          "--master-addr", "10.0.0.1", "--master-port", "29600", "train.py", "--x", "1"]


def test_one_host_failing_stops_the_others(tmp_path, capfd):
    """`run_hosts` with real processes standing in for the hosts' ssh clients: one ends with status 3, the other
    runs until its stdin (its ssh channel) closes. The job ends with 3, promptly, the other saw its channel
    close (the stop a host's launch turns into SIGTERM), and one line names the failed host, its node rank and
    ranks; ssh's own failure (255: connection lost) is said as such; a job that succeeds says nothing, nor does
    one the launcher's SIGTERM stopped (status 143)."""
    import signal
    import sys
    import threading
    import time

    from zerotrain.hostfile import run_hosts

    closed = tmp_path / "closed"
    from zerotrain.command import HOST_REPORT

    # a host's launch: its channel closing stops it, and it reports its stop marked for the launcher (which drops
    # it when it stopped the host for another's failure, and prints it when the launcher itself was stopped)
    waiter = [sys.executable, "-c", "import select, sys\n"  # gives up after 30 s: a missed stop fails, not hangs
              f"if select.select([sys.stdin], [], [], 30)[0] and not sys.stdin.read(): open({str(closed)!r}, 'w')\n"
              f"print({HOST_REPORT!r} + 'stopped zerotrain: stopped by SIGTERM', file=sys.stderr)"]
    failer = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"]
    start = time.monotonic()
    assert run_hosts([waiter, failer], {"worker-0": [0, 1], "worker-1": [0, 1, 2]}) == 3
    assert closed.exists() and time.monotonic() - start < 60
    assert capfd.readouterr().err.splitlines() == [
        "zerotrain: error: host 'worker-1' (node rank 1, ranks 2-4 of 5) failed: exit status 3; the job was "
        "stopped on every other host"]
    lost = [sys.executable, "-c", "import sys; sys.exit(255)"]
    assert run_hosts([lost, [sys.executable, "-c", "pass"]], {"worker-0": [1], "worker-1": [0]}) == 255
    assert capfd.readouterr().err.splitlines() == [
        "zerotrain: error: host 'worker-0' (node rank 0, rank 0 of 2) failed: ssh's own failure (status 255: the "
        "connection lost, or the host down); the job was stopped on every other host"]
    assert run_hosts([[sys.executable, "-c", "pass"], [sys.executable, "-c", "pass"]], {"a": [0], "b": [0]}) == 0
    assert capfd.readouterr().err == ""
    # the launcher stopped (SIGTERM to it): every host's channel closes, the job's status is 128 + SIGTERM and
    # no host is blamed
    closed.unlink()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert run_hosts([waiter, [sys.executable, "-c", "import sys; sys.stdin.read()"]],
                         {"a": [0], "b": [0]}) == 128 + signal.SIGTERM
    finally:
        timer.cancel()
    assert closed.exists() and capfd.readouterr().err == "zerotrain: stopped by SIGTERM\n"


def test_the_hosts_reports_are_taken_out_of_their_output_and_the_first_usage_error_wins(capfd):
    """`run_hosts`' relay of the hosts' stderr, with stand-ins for the hosts' launches: ordinary lines pass as they
    come (a partial line too), a report (`command.HOST_REPORT`) is taken out, even one without its newline at the
    end of the output; of two hosts' usage errors the first reported is printed, once, and its status is the job's
    (the other's line and status are dropped, and no host is blamed)."""
    import sys

    from zerotrain.command import HOST_REPORT
    from zerotrain.hostfile import run_hosts

    # the first host's report arrives in two reads, split inside the mark, after a long partial line
    first = [sys.executable, "-c", "import sys, time\n"
             f"sys.stderr.write('rank 0 says hi\\n' + 'x' * 40 + {HOST_REPORT[:10]!r})\nsys.stderr.flush()\n"
             f"time.sleep(0.5)\nsys.stderr.write({HOST_REPORT[10:]!r} + 'usage 2 bad key x')\nsys.exit(2)"]
    second = [sys.executable, "-c", "import sys, time\ntime.sleep(2.5)\n"
              f"sys.stderr.write('waiting 50%\\r' + {HOST_REPORT!r} + 'usage 1 bad checkpoint y\\n')\nsys.exit(1)"]
    assert run_hosts([first, second], {"a": [0], "b": [0]}) == 2
    assert capfd.readouterr().err == "rank 0 says hi\n" + "x" * 40 + "waiting 50%\rzerotrain: error: bad key x\n"


BAD_KEY_SCRIPT = """
import json, sys
import torch
import zerotrain
zerotrain.initialize(model=torch.nn.Linear(2, 2), config=json.load(open(sys.argv[1])))
"""


def test_a_usage_error_on_every_host_is_one_line_from_the_launcher(tmp_path, capfd):
    """A multi-host start whose script gets a bad config (an unknown key, every rank on every host refuses it): the
    launcher prints the usage line once, not once per host, with no host-failure line after it, and ends with the
    usage status (2). Each host is the real host launch `ssh_commands` makes, run through `bash -c` in place of
    ssh (two hosts of one rank each, a static rendezvous on this machine), under `run_hosts`; the two-host ssh run
    is tests/multinode/test_ssh_launch.py. Before the fix: two `zerotrain: error: unknown key ...` lines and the
    host line."""
    import shlex
    import sys

    from distributed import free_port, served_python

    from zerotrain.hostfile import run_hosts, ssh_commands

    (tmp_path / "bad.py").write_text(BAD_KEY_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                                   "zero_optimization": {"stage": 2, "no_such_key": 1}}))
    served = served_python()
    environ = {"PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "PYTHON_EXEC": served}
    active = {"host-a": [0], "host-b": [0]}
    commands = ssh_commands(active, "127.0.0.1", free_port(), [str(tmp_path / "bad.py"), str(tmp_path / "ds.json")],
                            environ=environ, cwd=str(tmp_path))
    hosts = [["bash", "-c", cmd[-1].replace(shlex.quote(sys.executable), shlex.quote(served))] for cmd in commands]
    assert run_hosts(hosts, active) == 2
    err = capfd.readouterr().err
    # libraries' own warnings are not errors (torch's "[rank0]:W1205 ...", torchao's "Failed to load ...")
    warning = re.compile(r"^(\[rank\d+\]:)?W\d{4} ")
    said = [line for line in err.splitlines() if ("error" in line.lower() or "host" in line.lower())
            and not warning.match(line)]
    assert len(said) == 1 and said[0].startswith(
        "zerotrain: error: unknown key 'zero_optimization.no_such_key'; valid keys here: stage, "), err
    assert "Traceback" not in err and "zerotrain-host-report" not in err and "stopped by" not in err, err


def test_a_hosts_launch_stops_its_printing_ranks_when_its_ssh_channel_closes(tmp_path):
    """A host's launch as `run_hosts` starts it over ssh (STOP_ON_EOF_ENV), with pipes standing in for the ssh
    channel; the ranks print every step (steps_per_print 1). The channel closes as a dead launcher's does, its
    stdout first (then stdin, a second later: under load the stop reaches the ranks that late): every rank still
    gets the stop, saves at the same step boundary and writes its file, instead of rank 0 dying of the broken
    pipe at its next progress line (tests/multinode/test_ssh_launch.py failed so under load)."""
    import subprocess
    import time

    from distributed import free_port, served_python
    from test_dropin_api import REPO_ROOT, STOPPABLE_SCRIPT

    from zerotrain.hostfile import STOP_ON_EOF_ENV

    (tmp_path / "train.py").write_text(STOPPABLE_SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    # the launch, its torchrun agent and ranks forked from the test forkserver with these pipes (served_python,
    # also torch's PYTHON_EXEC), not fresh interpreters
    served = served_python()
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", PYTHON_EXEC=served, **{STOP_ON_EOF_ENV: "1"})
    proc = subprocess.Popen([served, "-m", "zerotrain.cli", "launch", "--nproc", "2", "--nnodes", "1",
                             "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                             "train.py", "--deepspeed_config", "ds.json", "--out", str(tmp_path), "--nproc", "2"],
                            cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "running").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert proc.stdout.read(1)  # rank 0's progress lines come through
        proc.stdout.close()  # the channel gone: its output end first...
        proc.stderr.close()
        time.sleep(1.5)  # ...rank 0 prints every step meanwhile...
        proc.stdin.close()  # ...then the end of its input, which the launch turns into SIGTERM
        status = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stopped = [json.loads((tmp_path / f"stopped{rank}.json").read_text()) if (tmp_path / f"stopped{rank}.json")
               .exists() else None for rank in (0, 1)]
    assert stopped[0] is not None and stopped[0] == stopped[1] and stopped[0]["step"] > 2, stopped
    assert (tmp_path / "ckpt" / f"global_step{stopped[0]['step']}").is_dir()
    assert status == 143, status  # stopped by SIGTERM (128 + 15), as a launch told to stop


def test_bad_cluster_variables_are_one_line_from_train(tmp_path, monkeypatch, capsys):
    """A rank started by srun/mpirun with a bad variable gets the one usage line, exit 2, not a traceback."""
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "two")
    assert main(["train", "--model", "tiny", "--steps", "1", "--no-save", "--max-corpus-bytes", "20000"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert err == ["zerotrain: error: environment variable SLURM_NTASKS must be an integer, got 'two'"]


def test_mpirun_line_is_deepspeeds_openmpi_runner(tmp_path, monkeypatch):
    """`--launcher openmpi`'s line is the one DeepSpeed's OpenMPIRunner builds for the same hostfile, launcher
    args and exports (its runner adds the forwarded variables, PYTHONPATH and .deepspeed_env's lines as exports
    too), plus MASTER_ADDR/MASTER_PORT (DeepSpeed's ranks find them by mpi4py) and --ssh_port as ssh's -p."""
    import argparse
    import sys

    from deepspeed.launcher.multinode_runner import OpenMPIRunner

    from zerotrain.hostfile import mpirun_command

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=1\n")
    pool = {"w0": 2, "w1": 3}
    environ = {"NCCL_DEBUG": "INFO", "SECRET": "no", "PYTHONPATH": "/lib"}
    for launcher_args in ("", "--mca btl_tcp_if_include ib0 --bind-to none"):
        ours = mpirun_command("hosts", pool, "w0", 29600, ["train.py", "--x", "1"], launcher_args,
                              environ=environ, cwd=str(tmp_path))
        args = argparse.Namespace(launcher_args=launcher_args, include="", exclude="", num_nodes=-1, num_gpus=-1,
                                  hostfile="hosts", user_script="train.py", user_args=["--x", "1"],
                                  no_python=False, module=False)
        theirs = OpenMPIRunner(args, "", pool)
        for key, value in (("NCCL_DEBUG", "INFO"), ("PYTHONPATH", f"{tmp_path}:/lib"), ("FROM_FILE", "1"),
                           ("MASTER_ADDR", "w0"), ("MASTER_PORT", "29600")):
            theirs.add_export(key, value)
        assert ours == theirs.get_cmd({}, {h: list(range(n)) for h, n in pool.items()}), launcher_args
        assert ours[-5:] == [sys.executable, "-u", "train.py", "--x", "1"] and "SECRET=no" not in " ".join(ours)
    with_port = mpirun_command("hosts", pool, "w0", 29600, ["t.py"], "--mca plm_rsh_args '-i key'", ssh_port=2222,
                               environ={}, cwd=str(tmp_path))
    assert with_port[with_port.index("plm_rsh_args") + 1] == "-p 2222 -i key"
    alone = mpirun_command("hosts", pool, "w0", 29600, ["t.py"], "", ssh_port=2222, environ={}, cwd=str(tmp_path))
    assert alone[alone.index("plm_rsh_args") + 1] == "-p 2222"
    last = mpirun_command("hosts", pool, "w0", 29600, ["t.py"], "--mca plm_rsh_args", ssh_port=2222, environ={},
                          cwd=str(tmp_path))  # the launcher args end at the name: ours is added, theirs left
    assert last[last.index("-p 2222") - 2:last.index("-p 2222") + 1] == ["--mca", "plm_rsh_args", "-p 2222"]


def test_hydra_lines_are_deepspeeds_mpich_impi_and_mvapich_runners(tmp_path, monkeypatch):
    """`--launcher mpich|impi|mvapich`: the line DeepSpeed's MPICHRunner / IMPIRunner / MVAPICHRunner builds for
    the same hostfile, launcher args and exports, word for word, but for the program each rank runs: zerotrain's
    worker module (`target`) where DeepSpeed runs its launcher_helper.py (mpich) or the bare script (impi,
    mvapich); MVAPICH's line also exports MASTER_ADDR/MASTER_PORT (DeepSpeed's ranks ask mpi4py)."""
    import argparse
    import sys

    from deepspeed.launcher import multinode_runner as ds

    from zerotrain.hostfile import MVAPICH_HOSTFILE, hydra_command

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=1\n")
    pool = {"w0": 2, "w1": 2, "w2": 2}
    environ = {"NCCL_DEBUG": "INFO", "SECRET": "no", "PYTHONPATH": "/lib", "MV2_SUPPORT_DL": "0"}
    target = ["-m", "zerotrain.launcher", "--", "train.py", "--x", "1"]
    ds_program = [sys.executable, "-u", "train.py", "--x", "1"]
    ours_program = [sys.executable, "-u", *target]
    for name, cls in (("mpich", ds.MPICHRunner), ("impi", ds.IMPIRunner), ("mvapich", ds.MVAPICHRunner)):
        for launcher_args in ("", "-iface eth1 -launcher ssh"):
            ours = hydra_command(name, pool, "w0", 29600, target, launcher_args, environ=environ,
                                 cwd=str(tmp_path))
            args = argparse.Namespace(launcher_args=launcher_args, include="", exclude="", num_nodes=-1,
                                      num_gpus=-1, user_script="train.py", user_args=["--x", "1"],
                                      no_python=False, module=False, launcher=name, bind_cores_to_rank=False,
                                      master_addr="w0", master_port=29600)
            theirs = cls(args, "", pool)
            for key, value in (("NCCL_DEBUG", "INFO"), ("PYTHONPATH", f"{tmp_path}:/lib"), ("MV2_SUPPORT_DL", "0"),
                               ("FROM_FILE", "1")):
                theirs.add_export(key, value)
            if name == "mvapich":  # zerotrain's ranks need the master on the line (DeepSpeed's: mpi4py)
                theirs.add_export("MASTER_ADDR", "w0")
                theirs.add_export("MASTER_PORT", "29600")
            line = theirs.get_cmd({}, {h: list(range(n)) for h, n in pool.items()})
            if name == "mpich":  # DeepSpeed's helper maps PMI_RANK to RANK; zerotrain.cluster does it in the rank
                helper = line.index(sys.executable) + 2
                assert line[helper].endswith("launcher_helper.py") and line[helper + 1:helper + 3] == [
                    "--launcher", "mpich"]
                line = [*line[:helper], *line[helper + 3:]]
            expected, start = [], 0
            while True:  # every rank's program: DeepSpeed's, then ours in its place
                try:
                    at = next(i for i in range(start, len(line)) if line[i:i + len(ds_program)] == ds_program)
                except StopIteration:
                    break
                expected += [*line[start:at], *ours_program]
                start = at + len(ds_program)
            expected += line[start:]
            assert ours == expected, (name, launcher_args)
            assert ours.count(sys.executable) == (6 if name == "impi" else 1) and "SECRET" not in " ".join(ours)
    write = tmp_path / "hosts"
    monkeypatch.setattr("zerotrain.hostfile.MVAPICH_HOSTFILE", str(write))
    from zerotrain.hostfile import write_mvapich_hostfile
    write_mvapich_hostfile(pool)
    assert write.read_text() == "w0\nw1\nw2\n" and MVAPICH_HOSTFILE == ds.MVAPICH_TMP_HOSTFILE
    with pytest.raises(CLIError, match=r"--launcher impi needs the same slot count on every host \(its -ppn\), "
                                       r"got \{'w0': 2, 'w1': 1\}"):
        hydra_command("impi", {"w0": 2, "w1": 1}, "w0", 1, target)


MPI_SCRIPT = '''
import json, os, sys
import torch
import zerotrain
zerotrain.init_distributed()
rank = torch.distributed.get_rank()
total = torch.tensor([float(rank + 1)])
zerotrain.dist.all_reduce(total)
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"world": torch.distributed.get_world_size(), "local": int(os.environ["LOCAL_RANK"]),
               "sum": total.item(), "ompi": os.environ["OMPI_COMM_WORLD_RANK"],
               "master": os.environ["MASTER_ADDR"], "from_env_file": os.environ.get("FROM_FILE")}, f)
'''


OPENMPI = openmpi_mpirun()  # Open MPI's mpirun, whichever MPI Debian's `mpirun` is (tests/mpi_flavours.py)
HYDRA = hydra_mpiexec()


@pytest.mark.skipif(OPENMPI is None, reason=OPENMPI_HINT)
def test_openmpi_launch_starts_the_ranks_with_mpirun(tmp_path):
    """The fast real case of `--launcher openmpi` (two hosts: tests/multinode/test_openmpi_launch.py, slow):
    `zerotrain launch --launcher openmpi --force_multi` on one host runs the real mpirun, whose two ranks take
    their ranks from Open MPI's variables, the master from the line and .deepspeed_env's variables, and meet."""
    from distributed import free_port, run_cli, served_python
    from test_dropin_api import REPO_ROOT

    env = _one_host_mpi_job(tmp_path, MPI_SCRIPT)
    # the launcher and the ranks mpirun starts (with the launcher's sys.executable) forked from the test forkserver
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", PYTHON_EXEC=served_python(), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               OMPI_MCA_oob_tcp_if_include="lo", PATH=mpirun_path(tmp_path / "openmpi-bin", OPENMPI))
    proc = run_cli(["launch", "--launcher", "openmpi", "--force_multi", "--hostfile", "hosts", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), "--launcher_args=--mca btl_tcp_if_include lo",
                    "job.py", str(tmp_path)], cwd=tmp_path, env=env, timeout=120)
    _assert_the_two_ranks_met(tmp_path, proc)


def _one_host_mpi_job(tmp_path, script: str) -> dict:
    """The fast MPI cases' job directory (a one-host hostfile of 2 slots, the job, a .deepspeed_env line) and the
    test's environment without any launcher's rank variables."""
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "job.py").write_text(script)
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=forwarded\n")
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI", "SLURM_"))}


def _assert_the_two_ranks_met(tmp_path, proc) -> None:
    """Both ranks ran with the launcher's world, local rank, master and .deepspeed_env, and their all-reduce met."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert info == {"world": 2, "local": rank, "sum": 3.0, "ompi": str(rank), "master": "127.0.0.1",
                        "from_env_file": "forwarded"}


def hydra_path(tmp_path) -> str:
    """A PATH whose `mpirun` is MPICH's hydra (Debian's `mpirun` alternative may be Open MPI's)."""
    return mpirun_path(tmp_path / "mpich-bin", HYDRA)


@pytest.mark.skipif(HYDRA is None, reason=MPICH_HINT)
def test_mpich_launch_starts_the_ranks_with_hydra(tmp_path):
    """The fast real case of `--launcher mpich` (two hosts: tests/multinode/test_mpich_launch.py, slow): the
    real MPICH mpirun (hydra) on one host starts two ranks that take their ranks from PMI_RANK /
    MPI_LOCALRANKID, the world from the line, the master and .deepspeed_env's variables, and meet."""
    from distributed import free_port, run_cli, served_python
    from test_dropin_api import REPO_ROOT

    env = _one_host_mpi_job(tmp_path, MPI_SCRIPT.replace('os.environ["OMPI_COMM_WORLD_RANK"]',
                                                         'os.environ["PMI_RANK"]'))
    # the launcher and the ranks hydra starts (with the launcher's sys.executable) forked from the test forkserver
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1", PATH=hydra_path(tmp_path), PYTHON_EXEC=served_python())
    proc = run_cli(["launch", "--launcher", "mpich", "--force_multi", "--hostfile", "hosts", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), "--launcher_args=-iface lo",
                    "job.py", str(tmp_path)], cwd=tmp_path, env=env, timeout=120)
    _assert_the_two_ranks_met(tmp_path, proc)


@pytest.mark.skipif(HYDRA is None, reason=MPICH_HINT)
def test_hydra_launcher_refusals_are_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    """`--launcher mpich|impi|mvapich`: DeepSpeed's refusals (a selection, unequal slots per host), --ssh_port
    (their lines have no ssh option) and no mpirun at all: one line each, exit 2, no rank started."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    (tmp_path / "even").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    (tmp_path / "odd").write_text("worker-0 slots=2\nworker-1 slots=1\n")
    monkeypatch.setenv("PATH", hydra_path(tmp_path))
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail(f"started {a}"))  # a refusal missed: not this process
    for argv, says in ((["--launcher", "mpich", "--hostfile", "even", "--include", "worker-1"],
                        "--launcher mpich runs every slot of the hostfile (as DeepSpeed's): it does not take "
                        "--include"),
                       (["--launcher", "impi", "--hostfile", "even", "--num_nodes", "1"],
                        "--launcher impi runs every slot of the hostfile"),
                       (["--launcher", "mvapich", "--hostfile", "odd"],
                        "--launcher mvapich needs the same slot count on every host (its -ppn), got "
                        "{'worker-0': 2, 'worker-1': 1}"),
                       (["--launcher", "mpich", "--hostfile", "even", "--ssh_port", "2222"],
                        "--launcher mpich does not take --ssh_port")):
        assert main(["launch", *argv, "train.py"]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun here
    assert main(["launch", "--launcher", "impi", "--hostfile", "even", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "--launcher impi: mpirun is not on PATH" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "started").exists()


@pytest.mark.skipif(OPENMPI is None or HYDRA is None, reason=OPENMPI_HINT if OPENMPI is None else MPICH_HINT)
def test_each_mpi_launcher_refuses_the_other_mpis_mpirun_in_one_line(tmp_path, capsys, monkeypatch):
    """Debian's `mpirun` is Open MPI's or MPICH's: `--launcher mpich|impi|mvapich` with Open MPI's first on PATH,
    and `--launcher openmpi` with MPICH's (hydra), are one line naming the mpirun, exit 2, no rank started."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    (tmp_path / "hosts").write_text("worker-0 slots=2\nworker-1 slots=2\n")
    monkeypatch.setattr(os, "execvp", lambda *a: pytest.fail(f"started {a}"))  # a refusal missed: not this process
    for launcher, target, says in (("mpich", OPENMPI, "is Open MPI's, which does not take this launcher's line"),
                                   ("impi", OPENMPI, "is Open MPI's"),
                                   ("openmpi", HYDRA, "is MPICH's (hydra), which does not take Open MPI's line")):
        monkeypatch.setenv("PATH", mpirun_path(tmp_path / launcher, target))
        assert main(["launch", "--launcher", launcher, "--hostfile", "hosts", "train.py"]) == 2, launcher
        err = capsys.readouterr().err
        assert f"--launcher {launcher}: mpirun on PATH ({tmp_path / launcher / 'mpirun'}) {says}" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "started").exists()


def test_mpirun_kind_tells_open_mpi_from_hydra_by_what_it_says(tmp_path):
    """`mpirun_kind` reads `mpirun --version`: Open MPI's (4.x, 5.x) and hydra's (MPICH's, Intel MPI's) words,
    anything else or a mpirun that does not run is unknown; the tests' finders take Open MPI's `mpirun` or
    `mpirun.openmpi` and hydra's `mpiexec.hydra` or `mpirun`, whichever the `mpirun` alternative points to."""
    from zerotrain.hostfile import mpirun_kind

    said = {"ompi4": "mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/",
            "ompi5": "mpirun (Open MPI) 5.0.3", "orterun": "mpirun.openmpi (OpenRTE) 4.1.4",
            "mpich": "HYDRA build details:\n    Version: 4.0.2",
            "impi": "Intel(R) MPI Library for Linux* OS, Version 2021.19.0", "other": "mpirun from elsewhere 1.0"}
    kinds = {"ompi4": "openmpi", "ompi5": "openmpi", "orterun": "openmpi", "mpich": "hydra", "impi": "hydra",
             "other": "unknown"}
    for name, text in said.items():
        fake = tmp_path / name / "mpirun"
        fake.parent.mkdir()
        fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}\nEOF\n")
        fake.chmod(0o755)
        assert mpirun_kind(str(fake)) == kinds[name], name
    (tmp_path / "broken").write_text("not a program")
    assert mpirun_kind(str(tmp_path / "broken")) == "unknown"  # not executable: no exception

    # Debian's alternative points to one or the other: each finder finds its MPI whatever `mpirun` is
    def bin_dir(name: str, **links: str) -> str:
        path = tmp_path / name
        path.mkdir()
        for link, target in links.items():
            (path / link.replace("_", ".")).symlink_to(tmp_path / target / "mpirun")
        return str(path)

    only_mpich = bin_dir("only-mpich", mpirun="mpich", mpiexec_hydra="mpich")
    assert openmpi_missing(only_mpich) == OPENMPI_HINT and mpich_missing(only_mpich) is None
    assert hydra_mpiexec(only_mpich) == os.path.join(only_mpich, "mpiexec.hydra")
    only_openmpi = bin_dir("only-openmpi", mpirun="ompi4", mpirun_openmpi="ompi4")
    assert mpich_missing(only_openmpi) == MPICH_HINT and openmpi_mpirun(only_openmpi) == os.path.join(
        only_openmpi, "mpirun")
    both_mpich_first = bin_dir("both", mpirun="mpich", mpirun_openmpi="ompi5", mpiexec_hydra="mpich")
    assert openmpi_mpirun(both_mpich_first) == os.path.join(both_mpich_first, "mpirun.openmpi")
    assert hydra_mpiexec(both_mpich_first) == os.path.join(both_mpich_first, "mpiexec.hydra")
    assert openmpi_missing(bin_dir("none")) == OPENMPI_HINT and mpich_missing(str(tmp_path / "none")) == MPICH_HINT


def test_openmpi_and_slot_count_refusals_are_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    """Slots that do not fit the script's config's batch sizes, DeepSpeed's openmpi refusals and a missing mpirun:
    one line each, exit 2, and no rank started (the script would write a file)."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("open('started', 'w').close()\n")
    (tmp_path / "one").write_text("localhost slots=3\n")
    (tmp_path / "two").write_text("worker-0 slots=2\nworker-1 slots=1\n")
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}))
    (tmp_path / "tp.json").write_text(json.dumps({"train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}}))
    (tmp_path / "auto.json").write_text(json.dumps({"train_batch_size": "auto",
                                                     "train_micro_batch_size_per_gpu": "auto"}))
    for argv, says in (
            (["--hostfile", "one", "train.py", "--deepspeed_config", "ds.json"],
             "3 slots (localhost: 3) do not fit ds.json's batch sizes: cannot derive gradient_accumulation_steps"),
            (["--hostfile", "two", "--launcher", "openmpi", "train.py", "--deepspeed", "--deepspeed_config=ds.json"],
             "3 slots (worker-0: 2, worker-1: 1) do not fit ds.json's batch sizes"),
            (["--hostfile", "one", "train.py", "--deepspeed", "tp.json"],
             "3 slots (localhost: 3) do not fit tp.json: the world must be a multiple of tensor x sequence x "
             "pipeline parallel sizes = 2"),
            (["--hostfile", "two", "--launcher", "openmpi", "--include", "worker-1", "train.py"],
             "--launcher openmpi runs every slot of the hostfile (as DeepSpeed's): it does not take --include"),
            (["--hostfile", "two", "--launcher", "openmpi", "--num_gpus", "1", "train.py"],
             "--launcher openmpi runs every slot of the hostfile")):
        assert main(["launch", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun here
    assert main(["launch", "--hostfile", "two", "--launcher", "openmpi", "train.py", "--deepspeed_config",
                 "auto.json"]) == 2  # "auto" batch sizes fit any slots: the next check speaks
    err = capsys.readouterr().err
    assert "--launcher openmpi: mpirun is not on PATH" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "started").exists()


def test_slots_fit_the_batch_over_the_data_parallel_ranks(tmp_path):
    """The check counts data-parallel ranks (the world over tensor x sequence x pipeline parallel sizes) and finds
    the config where DeepSpeed's and the HF Trainer's scripts take it; fitting slots pass."""
    from zerotrain.hostfile import check_slots_fit_batch

    (tmp_path / "tp.json").write_text(json.dumps({"train_batch_size": 6, "tensor_parallel": {"autotp_size": 2},
                                                   "sequence_parallel_size": 1}))
    (tmp_path / "sp.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 2,
                                                   "sequence_parallel_size": 2, "pipeline_parallel_size": 1}))
    four = {"a": [0, 1], "b": [0, 1]}
    for args in (["--deepspeed_config", str(tmp_path / "tp.json")], [f"--zerotrain_config={tmp_path / 'sp.json'}"],
                 ["--deepspeed", str(tmp_path / "sp.json")],
                 ["--deepspeed", "--deepspeed_config", str(tmp_path / "tp.json")]):
        check_slots_fit_batch(four, args)  # 4 ranks / 2 = 2 data-parallel ranks: 6 = 3 x 2, 2 = 1 x 2
    with pytest.raises(CLIError, match=r"6 slots \(a: 6\) do not fit .*sp.json's batch sizes"):
        check_slots_fit_batch({"a": list(range(6))}, ["--deepspeed_config", str(tmp_path / "sp.json")])  # 3 data
    (tmp_path / "pp.json").write_text(json.dumps({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
                                                   "gradient_accumulation_steps": 2, "pipeline_parallel_size": 2}))
    check_slots_fit_batch(four, ["--deepspeed_config", str(tmp_path / "pp.json")])  # 4 = 1 x 2 x (4 / 2)
    with pytest.raises(CLIError, match=r"6 slots \(a: 3, b: 3\) do not fit .*pp.json's batch sizes"):
        check_slots_fit_batch({"a": [0, 1, 2], "b": [0, 1, 2]}, ["--deepspeed_config", str(tmp_path / "pp.json")])
    check_slots_fit_batch(four, ["--deepspeed", "--other", "x.json"])  # a switch, then no config: nothing to check
    with pytest.raises(CLIError, match=r"6 slots \(a: 6\) do not fit .*sp.json's batch sizes"):  # no value: next
        check_slots_fit_batch({"a": list(range(6))}, ["--deepspeed_config", "--deepspeed", str(tmp_path / "sp.json")])
    with pytest.raises(CLIError, match=r"sp.json's batch sizes"):  # DeepSpeed's --deepspeed switch, then a word
        check_slots_fit_batch({"a": list(range(6))}, ["--deepspeed", "notes", "--deepspeed_config",
                                                      str(tmp_path / "sp.json")])
    check_slots_fit_batch(four, ["--x", "1", "--deepspeed_config"])  # no value after the flag: the script's error


def test_srun_line_is_deepspeeds_slurm_runner(tmp_path, monkeypatch):
    """`--launcher slurm`'s line is the one DeepSpeed's SlurmRunner builds for the same selection and exports
    (plus MASTER_PORT when --master_port is given); a value with a comma travels in srun's environment only."""
    import argparse
    import sys

    from deepspeed.launcher.multinode_runner import SlurmRunner

    from zerotrain.hostfile import srun_command

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".deepspeed_env").write_text("FROM_FILE=1\nLIST=a,b\n")
    pool = {"w0": 2, "w1": 2, "w2": 2}
    environ = {"NCCL_DEBUG": "INFO", "SECRET": "no", "PYTHONPATH": "/lib"}
    for include, exclude, num_nodes, num_gpus in (("", "", -1, -1), ("w0@w2", "", -1, -1), ("", "w1", -1, -1),
                                                 ("", "", 2, -1), ("", "", -1, 1), ("w1:0", "", -1, -1),
                                                 ("", "", 0, 0)):
        active = select_resources(pool, include, exclude, num_nodes, num_gpus)
        ours, exports = srun_command(active, ["train.py", "--x", "1"], "-p main", include, exclude, num_nodes,
                                     num_gpus, master_port=29600, environ=environ, cwd=str(tmp_path))
        args = argparse.Namespace(launcher_args="-p main", include=include, exclude=exclude, num_nodes=num_nodes,
                                  num_gpus=num_gpus, user_script="train.py", user_args=["--x", "1"])
        theirs = SlurmRunner(args, "", pool)
        for key, value in (("NCCL_DEBUG", "INFO"), ("PYTHONPATH", f"{tmp_path}:/lib"), ("FROM_FILE", "1"),
                           ("MASTER_PORT", "29600")):
            theirs.add_export(key, value)
        assert ours == theirs.get_cmd({}, active), (include, exclude, num_nodes, num_gpus)
        assert ours[-5:] == [sys.executable, "-u", "train.py", "--x", "1"] and "SECRET" not in " ".join(ours)
        assert exports["LIST"] == "a,b" and exports["MASTER_PORT"] == "29600" and "SECRET" not in exports


def test_slurm_refusals_are_one_line_before_any_rank(tmp_path, capsys, monkeypatch):
    """What srun cannot place (DeepSpeed's refusals) and a missing srun: one line each, exit 2, nothing run."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    (tmp_path / "hosts").write_text("worker-0 slots=2\nworker-1 slots=1\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun here
    for argv, says in ((["--hostfile", "hosts"], "--launcher slurm needs the same slot count on every host, got "
                                                 "{'worker-0': 2, 'worker-1': 1}"),
                       (["--hostfile", "hosts", "--include", "worker-0:1@worker-1"],
                        "--launcher slurm cannot select specific slots, got [1] on 'worker-0'"),
                       (["--hostfile", "hosts", "--num_gpus", "1"], "--launcher slurm: srun is not on PATH")):
        assert main(["launch", "--launcher", "slurm", *argv, "train.py"]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "started").exists()


def test_a_requeued_slurm_job_resumes(monkeypatch, capsys):
    """A Slurm job requeued after a preemption runs again with SLURM_RESTART_COUNT >= 1: `zerotrain train` resumes
    from the save directory as after an elastic restart (the full requeue runs in tests/multinode/test_slurm.py);
    a first run, or one without a save directory, does not."""
    from zerotrain.run import job_restarts, resume_after_restart

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert job_restarts() == 0 and resume_after_restart(False, "/ckpt", 0) is False
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert job_restarts() == 2 and resume_after_restart(False, "/ckpt", 0) is True
    assert "restart 2 of this job: resuming from the latest checkpoint" in capsys.readouterr().out
    assert resume_after_restart(False, None, 0) is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert job_restarts() == 3


def test_without_a_hostfile_the_slots_are_the_gpus_else_nproc():
    """DeepSpeed's pool without a hostfile: this machine with a slot per GPU; on a CPU machine, --nproc ranks."""
    import torch

    from zerotrain.hostfile import local_slots

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert local_slots(3) == (gpus or 3) and local_slots(1) == (gpus or 1)
