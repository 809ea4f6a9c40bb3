"""`zerotrain generate` and `zerotrain train-embedding` take torchrun's node options as `train` and `launch` do
(zerotrain.command.add_node_flags / node_rendezvous), checked before any process starts. In-process, no launch:
tests/embedding/test_export.py runs train-embedding through the elastic (c10d) rendezvous for real."""
from __future__ import annotations

import json

from zerotrain.cli import main


def test_generate_and_train_embedding_take_and_check_the_node_options(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text("{}")
    generate = ["generate", "--model", str(tmp_path / "none"), "--config", str(config), "--prompt", "x"]
    embed = ["train-embedding", "--model", "m", "--data", "d"]
    cases = [
        (generate + ["--nnodes", "2", "--node-rank", "1"], "--nnodes > 1 needs --master-addr and --master-port"),
        (generate + ["--nnodes", "2", "--master_addr", "10.0.0.1", "--master_port", "29500", "--node_rank", "2"],
         "--node-rank must be in [0, 2), got 2"),
        (embed + ["--nnodes", "1:2"], "--nnodes 1:2: a range needs the elastic rendezvous"),
        (embed + ["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint"),
        (embed + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--master-addr", "h"],
         "--master-addr is for the static rendezvous"),
    ]
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (argv, err)  # one line, before anything starts
    # the global batch counts every node's ranks: 2 nodes x 2 ranks x micro 2 x accumulation 1
    assert main(embed + ["--print-config", "--nproc", "2", "--nnodes", "2", "--micro-batch", "2",
                         "--accumulation", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 8
    assert main(embed + ["--print-config", "--nproc", "2", "--micro-batch", "2", "--accumulation", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["train_batch_size"] == 4
