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


def test_without_seq_len_a_run_takes_the_models_positions_and_lora_trains_the_added_tokens_rows(one_rank, capsys):
    """No --seq-len, no --data: the default (128) capped at the model's max_position_embeddings (the tiny preset's
    32), not refused as too long; --lora-r with --add-tokens: rank 0 says the added tokens' rows train too."""
    status = main(["train", "--model", "tiny", "--max-steps", "1", "--max-corpus-bytes", "20000",
                   "--per-device-train-batch-size", "2", "--zero-stage", "1", "--no-save", "--lora-r", "2",
                   "--add-tokens", "<|x|>", "<|y|>"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "zerotrain: LoRA: the rows of the 2 added tokens train too\n" in out
    assert ", seq 32, " in out, out
