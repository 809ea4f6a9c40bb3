"""`zerotrain train`'s command layer in the pytest process (issue #48): what `check_train_args` refuses before
any process starts (one line naming the flag) and what it accepts at the bounds, the options a worker is handed
(`worker_argv`: the worker parses back the launcher's arguments), and the help's metavars."""
from __future__ import annotations

import re

import pytest

from zerotrain.cli import build_parser, main
from zerotrain.train.command import check_train_args, worker_argv

DEFAULT_STEPS = 50  # the command's documented default (its --help: "default 50")


def _parse(*argv: str):
    return build_parser().parse_args(["train", "--no-save", *argv])


@pytest.mark.parametrize("argv, named", [
    (["--lora-r", "2", "--lora-dropout", "1.0"], "--lora-dropout must be in [0, 1), got 1.0"),
    (["--num-proc", "0"], "--num-proc must be >= 1, got 0"),
    (["--val-fraction", "1.0"], "--val-fraction must be in [0, 1), got 1.0"),
    (["--lora-alpha", "16"], "--lora-alpha and --lora-target-modules need --lora-r"),
    (["--model", "no/such/model_dir"], "no/such/model_dir"),
])
def test_a_bad_value_is_one_line_naming_the_flag_before_any_process(argv, named, capsys):
    assert main(["train", "--no-save", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_the_bounds_are_accepted_and_the_steps_given_are_kept():
    """--max-steps 1, --num-proc 1, --seq-len 1, --lora-dropout 0 and LoRA's targets with --lora-r pass the checks; a run given
    --max-steps keeps it (the default of 50 only without --max-steps and --num-train-epochs); --max-steps 0 or -1 is
    not set, as the HF Trainer's max_steps."""
    args = _parse("--max-steps", "1", "--num-proc", "1", "--lora-r", "2", "--lora-dropout", "0.0",
                  "--lora-target-modules", "q_proj,v_proj")
    assert check_train_args(args) is not None
    assert args.steps == 1
    args = _parse("--max-steps", "7", "--pipeline-parallel-size", "1", "--seq-len", "1")
    check_train_args(args)
    assert args.steps == 7
    args = _parse()
    check_train_args(args)
    assert args.steps == DEFAULT_STEPS
    args = _parse("--num-train-epochs", "2")
    check_train_args(args)
    assert args.steps is None
    # the HF Trainer's max_steps: -1 (its default, which scripts pass) or 0 is not set, in either spelling
    for given in (["--max_steps", "-1"], ["--max-steps", "0"]):
        args = _parse(*given)
        check_train_args(args)
        assert args.steps == DEFAULT_STEPS, given
        args = _parse(*given, "--num-train-epochs", "2")
        check_train_args(args)
        assert args.steps is None, given


def test_a_worker_parses_back_the_launchers_options():
    """Each rank re-parses `worker_argv`: every option a worker takes arrives with its value (--resume a flag,
    --eval-steps under its old name too)."""
    args = _parse("--max-steps", "9", "--eval-steps", "3", "--num-proc", "2", "--lora-r", "4", "--resume",
                  "--add-tokens", "<a>", "<b>", "--seq-len", "16")
    assert args.resume is True and args.eval_interval == 3 and args.lora_r == 4
    back = build_parser().parse_args(worker_argv(args))
    for key in ("steps", "eval_interval", "num_proc", "lora_r", "resume", "add_tokens", "seq_len", "no_save"):
        assert getattr(back, key) == getattr(args, key), key
    assert build_parser().parse_args(["train", "--eval-interval", "5"]).eval_interval == 5


def test_the_help_names_each_options_value(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("--num-proc N", "--lora-r R", "--add-tokens TOKEN [TOKEN ...]", "--eval-steps N"):
        assert shown in out, shown
    assert "tokenize with N processes" in out
    # --max-steps: the command's own text, then what 0 or -1 means (as the HF Trainer's max_steps)
    assert "--max-steps N, --steps N optimizer steps to reach" in out
    assert f"default {DEFAULT_STEPS} when neither is given; N <= 0 (the HF Trainer's -1, which scripts pass) is the " \
           "same as not giving it" in out


def test_a_model_directory_whose_tokenizer_cannot_load_is_refused_before_any_process(tmp_path):
    """A --model directory (not a preset) is resolved and its tokenizer loaded in the launching process: a
    directory with config.json and no tokenizer is one CLIError naming it, before any rank is started."""
    import transformers

    from zerotrain.command import CLIError

    model = tmp_path / "no_tokenizer"
    transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(model)
    with pytest.raises(CLIError, match=re.escape(str(model))):
        check_train_args(_parse("--model", str(model), "--max-steps", "1"))


def test_the_configs_warnings_come_from_the_check_for_one_rank_and_from_the_ranks_otherwise(tmp_path):
    """A key zerotrain does not implement (DeepSpeed's `comms_config`) warns once for the job: from this check when
    the launching process is the run's one rank (it hands its config to the run), else from the ranks' rank 0."""
    import warnings

    from zerotrain.config import ConfigWarning

    config = tmp_path / "ds.json"
    config.write_text('{"comms_config": {"verbose": false}, "train_micro_batch_size_per_gpu": 2}')
    with pytest.warns(ConfigWarning, match="comms_config"):
        check_train_args(_parse("--config", str(config), "--max-steps", "1"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        check_train_args(_parse("--config", str(config), "--max-steps", "1", "--nproc", "2"))
