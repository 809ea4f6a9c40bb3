"""`zerotrain generate`'s command layer (`zerotrain.inference`) in the pytest process (issue #48): the required
options, the workers' arguments parsed back, the help's metavars, --max-new-tokens' bound (one line, before the
model is read). The generation itself is tests/test_inference.py's."""
from __future__ import annotations

import pytest

from zerotrain.cli import build_parser, main
from zerotrain.inference import worker_argv


def test_model_config_and_prompt_are_required(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate"])
    assert "the following arguments are required: --model, --config, --prompt" in capsys.readouterr().err


def test_each_worker_parses_back_the_launchers_arguments():
    argv = ["generate", "--model", "m dir", "--config", "ds.json", "--prompt", "def f(a, b):", "--prompt",
            "--not an option", "--max-new-tokens", "7", "--nproc", "2"]
    args = build_parser().parse_args(argv)
    assert (args.model, args.config, args.prompt, args.max_new_tokens, args.nproc) == (
        "m dir", "ds.json", ["def f(a, b):", "--not an option"], 7, 2)
    back = build_parser().parse_args(worker_argv(args))
    assert (back.model, back.config, back.prompt, back.max_new_tokens, back.nproc) == (
        "m dir", "ds.json", ["def f(a, b):", "--not an option"], 7, 1)  # a worker is one rank


def test_the_help_names_each_options_value(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("--model DIR", "--config CFG", "--prompt TEXT", "--max-new-tokens N", "--nproc N"):
        assert shown in out, shown


def test_max_new_tokens_below_one_is_one_line_before_the_model_is_read(tmp_path, capsys):
    base = ["generate", "--model", str(tmp_path / "no_model"), "--config", str(tmp_path / "no.json"), "--prompt", "a"]
    assert main([*base, "--max-new-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip() == "zerotrain: error: --max-new-tokens must be >= 1, got 0"
    assert main([*base, "--max-new-tokens", "1"]) == 2  # past the bound: the missing files are what is refused
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "max-new-tokens" not in err and ("no_model" in err or "no.json" in err), err
