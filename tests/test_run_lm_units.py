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
    from distributed import free_port

    port = free_port()
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


def test_a_lora_run_resumes_from_a_model_directory_and_a_finished_run_leaves_the_save_dir_free(one_rank,
                                                                                               tiny_llama_dir, capsys):
    """LoRA on a model directory, one step saved, then resumed to two: the base weights come from the directory
    (the adapter from the checkpoint); the resumed run's second step equals the uninterrupted two-step run's
    adapter. Resumed again with nothing left to train: it says so, exits 0 and releases the save directory's lock
    (another job may write there)."""
    import json

    import torch
    from safetensors.torch import load_file

    from zerotrain.cli import build_parser
    from zerotrain.run.lm import run_lm

    common = ["train", "--model", str(tiny_llama_dir), "--seq-len", "16", "--max-corpus-bytes", "20000",
              "--per-device-train-batch-size", "2", "--zero-stage", "1", "--lora-r", "2", "--seed", "3"]

    def adapter(save: str) -> dict:
        files = sorted((one_rank / save).rglob("adapter_model.safetensors"))
        assert files, list((one_rank / save).rglob("*"))
        return load_file(files[-1])

    assert main([*common, "--max-steps", "2", "--save-dir", "whole"]) == 0, capsys.readouterr().out
    assert main([*common, "--max-steps", "1", "--save-dir", "split"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main([*common, "--max-steps", "2", "--save-dir", "split", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 1" in out, out
    whole, split = adapter("whole"), adapter("split")
    assert whole.keys() == split.keys() and whole
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-7)
    # the rank itself (the command says so before starting any, an elastic restart after the end reaches the rank)
    args = build_parser().parse_args([*common, "--max-steps", "2", "--save-dir", "split", "--resume"])
    assert run_lm(args) == 0
    out = capsys.readouterr().out
    assert "zerotrain: nothing to train: --steps 2 is the total to reach" in out, out
    assert not (one_rank / "split" / ".zerotrain-lock.json").exists(), "the finished run still holds the lock"
    assert json.loads((one_rank / "split" / "effective_config.json").read_text())


def test_chat_data_with_a_tokenizer_without_a_template_adds_chatmls_tokens_unasked(one_rank, tiny_llama_dir, capsys):
    """Chat `messages` and a tokenizer with no chat template, no --add-tokens: ChatML is used and its special
    tokens are added (the vocabulary grows), said once by rank 0; the run trains."""
    import json
    import shutil

    from zerotrain.models.tiny_llama import write_chat_jsonl

    model = one_rank / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    for template in model.glob("chat_template.*"):
        template.unlink()
    chat = write_chat_jsonl(one_rank / "chat.jsonl", n=16)
    status = main(["train", "--model", str(model), "--data", str(chat), "--seq-len", "32", "--max-steps", "1",
                   "--per-device-train-batch-size", "2", "--zero-stage", "1", "--no-save"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert out.count("the tokenizer has no chat template, using ChatML; adding the template's special tokens "
                     "<|im_start|>, <|im_end|>") == 1, out
    assert "vocabulary grown from" in out, out
