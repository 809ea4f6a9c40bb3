"""`zerotrain train`'s rank (`zerotrain.run.lm.run_lm`) in the pytest process (one rank, the tiny preset): what the
flags not given default to, and what rank 0 says about them.

(test_run.py checks the config built and parsed once; test_cli.py the spawned end-to-end runs.)
"""
from __future__ import annotations

import pytest

from zerotrain.cli import main


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """A single-process run in a fresh directory (no launcher variables)."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_without_seq_len_a_run_takes_the_models_positions_and_lora_trains_the_added_tokens_rows(one_rank, capsys,
                                                                                               monkeypatch):
    """No --seq-len, no --data: the default (128) capped at the model's max_position_embeddings (the tiny preset's
    32), not refused as too long; --lora-r with --add-tokens: rank 0 says the added tokens' rows train too. Run as
    torchrun starts a one-rank worker (RANK 0 of WORLD_SIZE 1)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    status = main(["train", "--model", "tiny", "--max-steps", "1", "--max-corpus-bytes", "20000",
                   "--per-device-train-batch-size", "2", "--zero-stage", "1", "--no-save", "--lora-r", "2",
                   "--add-tokens", "<|x|>", "<|y|>"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "zerotrain: LoRA: the rows of the 2 added tokens train too\n" in out
    assert ", seq 32, " in out, out


def test_chat_data_in_a_models_template_trains_and_says_what_the_template_needs(one_rank, tiny_llama_dir, capsys):
    """--data of chat `messages` with a model directory whose tokenizer has a chat template: the data is built
    (tokenized through the template) and trained on, all of it (no evaluation asked for: nothing held out); rank 0
    never claims the template is missing."""
    from zerotrain.models.tiny_llama import write_chat_jsonl

    chat = write_chat_jsonl(one_rank / "chat.jsonl", n=16)
    status = main(["train", "--model", str(tiny_llama_dir), "--data", str(chat), "--seq-len", "32", "--max-steps", "1",
                   "--per-device-train-batch-size", "2", "--zero-stage", "1", "--no-save"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "no chat template" not in out, out
    # neither --eval-data, --val-fraction nor --eval-interval: nothing held out of --data, no evaluation
    assert "data 18 packed samples, no evaluation (give --eval-data or --val-fraction)" in out, out


def test_a_config_built_for_another_world_size_is_built_again_for_the_ranks_world(one_rank, capsys):
    """The command may hand down a config built for --nproc ranks; the rank builds it again for the world it runs
    in (here one rank: the global batch of one rank's micro-batch x accumulation), or the engine would refuse it."""
    from zerotrain.cli import build_parser
    from zerotrain.run.config import train_run_config
    from zerotrain.run.lm import run_lm

    args = build_parser().parse_args(["train", "--model", "tiny", "--max-steps", "1", "--max-corpus-bytes", "20000",
                                      "--per-device-train-batch-size", "2", "--seq-len", "16", "--no-save"])
    for_two = train_run_config(args, world_size=2)
    assert for_two.global_batch == 4
    assert run_lm(args, for_two) == 0
    assert "batch 2 = 2 micro x 1 accumulation x 1 ranks" in capsys.readouterr().out
