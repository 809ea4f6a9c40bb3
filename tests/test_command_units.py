"""`zerotrain.command` in the pytest process (issue #48): the node options turned into torchrun's rendezvous
options (static and c10d), the underscore spellings of the training commands (a value is never respelled), and
the exit status of each kind of usage error."""
from __future__ import annotations

import re

import pytest

from zerotrain.cli import build_parser
from zerotrain.command import CLIError, node_rendezvous, usage_error_status


def _train(*argv: str):
    return build_parser().parse_args(["train", *argv])


def test_node_options_become_torchruns_rendezvous():
    assert node_rendezvous(_train("--nproc", "2")) == ["--standalone", "--nproc_per_node", "2"]
    static = _train("--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--master-port", "29600")
    assert node_rendezvous(static) == ["--nnodes", "2", "--node_rank", "1", "--master_addr", "h0", "--master_port",
                                       "29600", "--nproc_per_node", "1"]
    assert node_rendezvous(_train("--nnodes", "2", "--node_rank", "0", "--master_addr", "h0", "--master_port",
                                  "1"))[3] == "0"
    elastic = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400", "--nnodes", "1:3", "--rdzv-id", "job"]
    assert node_rendezvous(_train(*elastic)) == ["--nnodes", "1:3", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                                 "h0:29400", "--rdzv_id", "job", "--nproc_per_node", "1"]
    assert node_rendezvous(_train(*elastic, "--rdzv-conf", "join_timeout=5"))[-4:] == [
        "--rdzv_conf", "join_timeout=5", "--nproc_per_node", "1"]
    for bad, says in ((["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1"],
                       "--node-rank must be in [0, 2), got 2"),
                      (["--nnodes", "2"], "--nnodes > 1 needs --master-addr and --master-port"),
                      (["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint")):
        with pytest.raises(CLIError, match=re.escape(says)):
            node_rendezvous(_train(*bad))


def test_an_unknown_rendezvous_backend_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _train("--rdzv-backend", "etcd")
    assert "invalid choice: 'etcd'" in capsys.readouterr().err


def test_underscore_spellings_respell_options_never_values(capsys):
    """`--a_b[=V]` is `--a-b[=V]`; a value such as `./save_dir` (whose tail spells the option `--save-dir`) or
    `x_y` stays as given; after a bare `--` nothing is an option (argparse's rule kept)."""
    args = _train("--output-dir", "./save_dir", "--learning_rate=3e-4", "--text_field", "x_y", "--seq_len", "16")
    assert (args.save_dir, args.learning_rate, args.text_field, args.seq_len) == ("./save_dir", 3e-4, "x_y", 16)
    with pytest.raises(SystemExit):
        _train("--seq_len", "16", "--", "--seq-len", "8")
    assert "zerotrain train: error: unrecognized arguments: -- --seq-len 8" in capsys.readouterr().err


def test_each_usage_error_has_its_exit_status():
    from zerotrain.checkpoint import CheckpointError
    from zerotrain.cluster import ClusterEnvError
    from zerotrain.config import ConfigError

    assert [usage_error_status(e) for e in (CLIError("x"), ConfigError("x"), ClusterEnvError("x"),
                                            CheckpointError("x"), ValueError("x"))] == [2, 2, 2, 1, None]


def test_only_the_training_commands_take_underscore_spellings(capsys):
    """`zerotrain launch`'s script arguments reach the script as given, even where one spells a launch option with
    underscores (`--stop_timeout`, `--max_restarts`); a command that is no training command refuses an underscore
    spelling it does not declare."""
    parser = build_parser()
    args = parser.parse_args(["launch", "--nproc", "2", "job.py", "--stop_timeout", "5", "--max_restarts=1"])
    assert (args.nproc, args.stop_timeout, args.max_restarts) == (2, 300, 0)
    assert (args.script, args.script_args) == ("job.py", ["--stop_timeout", "5", "--max_restarts=1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--model", "m", "--config", "c", "--prompt", "p", "--max_new_tokens", "4"])
    assert "zerotrain generate: error: unrecognized arguments: --max_new_tokens 4" in capsys.readouterr().err


def test_a_one_node_job_keeps_its_master_address_and_an_elastic_one_is_multi_node(capsys):
    """`--master-addr` on one node (no port): a static rendezvous at that address on torchrun's default port, not
    `--standalone`'s free local port; `--rdzv-backend c10d` is a multi-node job (launched through the agent) even
    with one node; the usage names the node options by their hyphenated spellings."""
    from zerotrain.command import multi_node

    assert node_rendezvous(_train("--master-addr", "h0")) == [
        "--nnodes", "1", "--node_rank", "0", "--master_addr", "h0", "--master_port", "29500", "--nproc_per_node", "1"]
    elastic = _train("--rdzv-backend", "c10d", "--rdzv-endpoint", "h0:29400")
    assert multi_node(elastic) and not multi_node(_train("--nproc", "2"))
    assert multi_node(_train("--nnodes", "2", "--master-addr", "h0", "--master-port", "1"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    for shown in ("[--nnodes N|MIN:MAX]", "[--node-rank R]", "[--master-addr HOST]", "[--master-port P]",
                  "[--rdzv-backend {static,c10d}]", "[--rdzv-endpoint HOST:PORT]", "[--rdzv-id ID]",
                  "[--rdzv-conf K=V,...]"):
        assert shown in usage, (shown, usage)


def test_a_hosts_launch_hands_its_usage_error_to_the_multi_host_launcher(monkeypatch, capsys, tmp_path):
    """`report_error` in one host's launch of a multi-host start (`STOP_ON_EOF_ENV`, not a rank): the line marked
    for `hostfile.run_hosts` with its status (which prints it once for all hosts); elsewhere, or in a rank without
    an agent, the plain line. The error file takes it only in a rank under our agent: not in a rank of plain
    torchrun, nor in a process of our agent's that is no rank."""
    from zerotrain.command import HOST_REPORT, STOP_ON_EOF_ENV, report_error
    from zerotrain.elastic import AGENT_ENV, ERROR_FILE_ENV

    for name in ("RANK", "LOCAL_RANK", AGENT_ENV, STOP_ON_EOF_ENV):
        monkeypatch.delenv(name, raising=False)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    for env in ({"RANK": "1"}, {AGENT_ENV: "1"}):  # plain torchrun's rank; our agent's env outside a rank
        with monkeypatch.context() as scoped:
            for name, value in env.items():
                scoped.setenv(name, value)
            assert report_error("bad key 'x'", 2) == 2
        assert capsys.readouterr().err == "zerotrain: error: bad key 'x'\n" and not error_file.exists(), env
    monkeypatch.delenv(ERROR_FILE_ENV)
    assert report_error("bad key 'x'", 2) == 2
    assert capsys.readouterr().err == "zerotrain: error: bad key 'x'\n"
    monkeypatch.setenv(STOP_ON_EOF_ENV, "1")
    assert report_error("bad checkpoint", 1) == 1
    assert capsys.readouterr().err == HOST_REPORT + "usage 1 bad checkpoint\n"
    monkeypatch.setenv("RANK", "3")  # a rank under that host's launch without an agent's error file: its own line
    assert report_error("bad key 'x'", 2) == 2
    assert capsys.readouterr().err == "zerotrain: error: bad key 'x'\n"
