"""The HF `TrainingArguments` flags of `zerotrain train` / `train-embedding` (zerotrain.train.flags): each flag sets
its config key, a flag wins over the file's key, a file's "auto" values are filled from the flags, the old names are
aliases, `--print-config` prints the effective config. In-process: the parser and the config, no launch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotrain.cli import build_parser, main
from zerotrain.config import load_config
from zerotrain.run.config import train_config
from zerotrain.train.command import check_train_args

REAL_WORLD = Path(__file__).parent / "config" / "real_world"

# flag, value, config key (dotted), the value the key gets
FLAG_KEYS = [
    ("--learning-rate", "3e-4", "optimizer.params.lr", 3e-4),
    ("--per-device-train-batch-size", "3", "train_micro_batch_size_per_gpu", 3),
    ("--per-device-train-batch-size", "3", "train_batch_size", 3 * 2),
    ("--gradient-accumulation-steps", "4", "gradient_accumulation_steps", 4),
    ("--gradient-accumulation-steps", "4", "train_batch_size", 8 * 4 * 2),
    ("--warmup-steps", "7", "scheduler.params.num_warmup_steps", 7),
    ("--warmup-ratio", "0.25", "scheduler.params.num_warmup_steps", 5),  # of --max-steps 20
    ("--lr-scheduler-type", "cosine", "scheduler.params.name", "cosine"),
    ("--lr-scheduler-type", "constant_with_warmup", "scheduler.type", "HFSchedule"),
    ("--weight-decay", "0.1", "optimizer.params.weight_decay", 0.1),
    ("--adam-beta1", "0.8", "optimizer.params.betas", [0.8, 0.999]),
    ("--adam-beta2", "0.95", "optimizer.params.betas", [0.9, 0.95]),
    ("--adam-epsilon", "1e-6", "optimizer.params.eps", 1e-6),
    ("--max-grad-norm", "0.5", "gradient_clipping", 0.5),
    ("--bf16", None, "bf16.enabled", True),
    ("--fp16", None, "fp16.enabled", True),
    ("--save-total-limit", "2", "checkpoint.keep_last", 2),
    ("--logging-steps", "3", "steps_per_print", 3),
    ("--zero-stage", "1", "zero_optimization.stage", 1),
    ("--stage", "2", "zero_optimization.stage", 2),
]


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        node = node[part]
    return node


def _train_args(*argv: str):
    args = build_parser().parse_args(["train", "--max-steps", "20", "--nproc", "2", *argv])
    check_train_args(args)
    return args


def _file(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("flag,value,key,expected", FLAG_KEYS)
def test_each_flag_sets_its_key_without_a_file_and_over_a_file(tmp_path, flag, value, key, expected):
    argv = [flag] + ([value] if value is not None else [])
    alone = train_config(_train_args(*argv), world_size=2)
    assert _get(alone, key) == pytest.approx(expected) if not isinstance(expected, str) else _get(alone, key) == expected
    load_config(alone, dp_world_size=2)  # a complete, valid config
    if key.startswith("scheduler.") or key == "scheduler.type":
        return  # the file's scheduler: see test_flags_win_over_the_files_keys
    # over a file that sets every key to something else: the flag wins
    other = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1, "train_batch_size": 10,
             "gradient_clipping": 9.0, "steps_per_print": 99, "fp16": {"enabled": False}, "bf16": {"enabled": False},
             "optimizer": {"type": "AdamW", "params": {"lr": 1.0, "betas": [0.5, 0.5], "eps": 1.0,
                                                        "weight_decay": 0.9}},
             "checkpoint": {"keep_last": 9}, "zero_optimization": {"stage": 0}}
    if flag in ("--per-device-train-batch-size", "--gradient-accumulation-steps"):
        # the file's train_batch_size (5 x 1 x 2) contradicts the flag: an error (see the test below), not replaced
        from zerotrain.config import ConfigError
        with pytest.raises(ConfigError, match=r"train_batch_size=10 .* vs train_batch_size \(calculated\)="):
            train_config(_train_args("--config", _file(tmp_path, other), *argv), world_size=2)
        if key == "train_batch_size":
            return
        other.pop("train_batch_size")  # without it the flag sets its key
    over = train_config(_train_args("--config", _file(tmp_path, other), *argv), world_size=2)
    got = _get(over, key)
    if key == "optimizer.params.betas":  # the other beta stays the file's
        expected = [0.8, 0.5] if flag == "--adam-beta1" else [0.5, 0.95]
    assert got == (pytest.approx(expected) if not isinstance(expected, str) else expected)


def test_a_fixed_train_batch_size_the_flags_contradict_is_an_error_naming_both(tmp_path, capsys):
    # transformers' mismatch check: the file's train_batch_size against micro x accumulation x ranks
    from zerotrain.config import ConfigError

    fixed = _file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                             "zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match=r"^train_batch_size: the config disagrees with the flags: "
                                          r"train_batch_size=16 \(.*ds.json\) vs train_batch_size \(calculated\)=12 = "
                                          r"per_device_train_batch_size=3 x gradient_accumulation_steps=2 x 2 "):
        train_config(_train_args("--config", fixed, "--per-device-train-batch-size", "3",
                                 "--gradient-accumulation-steps", "2"), world_size=2)
    # the file's micro-batch with the accumulation flag: 2 x 2 x 2 = 8, not 16
    with pytest.raises(ConfigError, match=r"train_batch_size=16 .* vs train_batch_size \(calculated\)=8 "):
        train_config(_train_args("--config", fixed, "--gradient-accumulation-steps", "2"), world_size=2)
    # flags that agree with it (4 x 2 x 2 = 16), or no batch flag: the file's value stays
    agreed = train_config(_train_args("--config", fixed, "--gradient-accumulation-steps", "4"), world_size=2)
    assert agreed["train_batch_size"] == 16 and agreed["gradient_accumulation_steps"] == 4
    assert train_config(_train_args("--config", fixed), world_size=2)["train_batch_size"] == 16
    # from the command line: one line, exit status 2
    capsys.readouterr()
    assert main(["train", "--config", fixed, "--nproc", "2", "--max-steps", "2", "--per-device-train-batch-size",
                 "3", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train_batch_size=16" in err and "train_batch_size (calculated)=6" in err, err


def test_a_config_without_optimizer_gets_adamw_from_the_flags_as_the_hf_trainer(tmp_path):
    """11 of the 24 real-world configs (LLaMA-Factory's, most of axolotl's) have no optimizer (nor scheduler)
    block: the HF Trainer builds AdamW and its scheduler from its arguments; so does `zerotrain train` (it used to
    build a forward-only engine, which refused the first backward)."""
    real = str(REAL_WORLD / "llamafactory_z2.json")
    assert "optimizer" not in json.loads(Path(real).read_text())
    config = train_config(_train_args("--deepspeed", real, "--learning-rate", "3e-4", "--weight-decay", "0.1"),
                          world_size=2, hidden_size=16)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                               "weight_decay": 0.1}}
    assert config["scheduler"] == {"type": "HFSchedule",
                                   "params": {"name": "linear", "num_warmup_steps": 0, "num_training_steps": 20}}
    assert config["zero_optimization"]["stage"] == 2
    # HF's defaults where no flag is given; the file's own scheduler is kept (the HF optimizer under it)
    config = train_config(_train_args("--deepspeed", _file(tmp_path, {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}),
        "--adam-beta2", "0.95"), world_size=2)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.95], "eps": 1e-8,
                                                               "weight_decay": 0.0}}
    assert config["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    load_config(config, dp_world_size=2)


def test_flags_win_over_the_files_keys_and_fill_its_auto_values(tmp_path):
    auto = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {
                "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                              "warmup_num_steps": "auto", "total_num_steps": "auto"}},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}, "steps_per_print": 7}
    args = _train_args("--deepspeed", _file(tmp_path, auto), "--learning-rate", "2e-4", "--warmup-ratio", "0.1",
                       "--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "3")
    config = train_config(args, world_size=2, hidden_size=16)
    # filled as transformers fills them: flags given, HF's defaults for the rest, the steps for the schedule
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["gradient_accumulation_steps"] == 3
    assert config["train_batch_size"] == 12 and config["gradient_clipping"] == 1.0
    assert config["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert config["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-4, "warmup_num_steps": 2,
                                             "total_num_steps": 20}
    assert config["zero_optimization"]["reduce_bucket_size"] == 16 * 16 and config["steps_per_print"] == 7
    # a flag over a non-auto key, and the scheduler type replaced by --lr-scheduler-type
    fixed = dict(auto, gradient_clipping=0.3, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4}})
    args = _train_args("--config", _file(tmp_path, fixed), "--max-grad-norm", "2.0", "--lr-scheduler-type", "cosine")
    config = train_config(args, world_size=2)
    assert config["gradient_clipping"] == 2.0 and config["scheduler"] == {
        "type": "HFSchedule", "params": {"name": "cosine", "num_warmup_steps": 0, "num_training_steps": 20}}
    # that config as a file again (a saved effective_config.json): the warmup flags set transformers' names
    args = _train_args("--config", _file(tmp_path, config), "--learning-rate", "1e-3", "--warmup-steps", "3")
    again = train_config(args, world_size=2)
    assert again["scheduler"]["params"] == {"name": "cosine", "num_warmup_steps": 3, "num_training_steps": 20}
    assert again["optimizer"]["params"]["lr"] == 1e-3
    # no flag: the file's own value stays
    assert train_config(_train_args("--config", _file(tmp_path, fixed)), world_size=2)["gradient_clipping"] == 0.3


def test_flags_alone_make_a_zero3_config_and_old_names_are_aliases():
    config = train_config(_train_args(), world_size=2)
    assert config["zero_optimization"]["stage"] == 3 and config["optimizer"]["type"] == "AdamW"
    assert config["scheduler"] == {"type": "HFSchedule",
                                   "params": {"name": "linear", "num_warmup_steps": 0, "num_training_steps": 20}}
    parse = build_parser().parse_args
    for new, old, value, dest in (("--max-steps", "--steps", "7", "steps"), ("--save-steps", "--save-every", "3", "save_every"),
                                  ("--eval-steps", "--eval-interval", "4", "eval_interval"),
                                  ("--output-dir", "--save-dir", "d", "save_dir"), ("--deepspeed", "--config", "c.json", "config")):
        assert getattr(parse(["train", new, value]), dest) == getattr(parse(["train", old, value]), dest) != \
            getattr(parse(["train"]), dest)
    embed = ["train-embedding", "--model", "m", "--data", "d"]
    for new, old, value, dest in (("--learning-rate", "--lr", "1e-3", "learning_rate"),
                                  ("--num-train-epochs", "--epochs", "3", "epochs"), ("--zero-stage", "--stage", "2", "zero_stage"),
                                  ("--per-device-train-batch-size", "--micro-batch", "5", "per_device_train_batch_size"),
                                  ("--gradient-accumulation-steps", "--accumulation", "2", "gradient_accumulation_steps"),
                                  ("--max-steps", "--steps", "9", "steps"), ("--save-steps", "--save-every", "4", "save_every"),
                                  ("--output-dir", "--save-dir", "o", "save_dir"), ("--logging-steps", "--log-every", "6", "logging_steps")):
        assert getattr(parse([*embed, new, value]), dest) == getattr(parse([*embed, old, value]), dest) != \
            getattr(parse(embed), dest)


def test_epochs_without_max_steps_lay_the_schedule_out_once_the_data_is_read(capsys):
    """`run_train` reads the data before the engine and lays a decaying schedule over the steps the epochs make (the
    README walkthrough's DeepSpeed run checks it end to end); before the data only `--print-config` cannot say them."""
    args = build_parser().parse_args(["train", "--num-train-epochs", "2"])
    check_train_args(args)  # the check before launching lays it out over a stand-in
    assert args.steps is None and train_config(args, world_size=1, steps=12)["scheduler"]["params"][
        "num_training_steps"] == 12
    with pytest.raises(Exception, match="--print-config with --num-train-epochs and no --max-steps"):
        train_config(args, world_size=1)
    assert main(["train", "--num-train-epochs", "2", "--print-config"]) == 2
    assert "give --max-steps to see them" in capsys.readouterr().err
    args = build_parser().parse_args(["train", "--num-train-epochs", "2", "--lr-scheduler-type", "constant_with_warmup"])
    assert train_config(args, world_size=1)["scheduler"] == {
        "type": "HFSchedule", "params": {"name": "constant_with_warmup", "num_warmup_steps": 0}}


def test_gradient_checkpointing_flag_turns_on_the_models_checkpointing(tiny_llama_dir):
    """--gradient-checkpointing: the config's activation_checkpointing block (printed, saved) and, with it, each
    decoder layer of the Hugging Face model recomputed in backward by zerotrain's checkpoint: the layer runs twice,
    and the loss and gradients are those without checkpointing."""
    import torch

    from zerotrain import checkpointing
    from zerotrain.models.hf import resolve_model
    from zerotrain.run.model import train_model

    config = train_config(_train_args("--gradient-checkpointing", "--zero-stage", "0"), world_size=1)
    assert config["activation_checkpointing"] == {}
    assert "activation_checkpointing" not in train_config(_train_args(), world_size=1)
    assert build_parser().parse_args(["train-embedding", "--model", "m", "--data", "d",
                                      "--gradient-checkpointing"]).gradient_checkpointing
    config = dict(config, train_batch_size=1, train_micro_batch_size_per_gpu=1)
    model = train_model(resolve_model(str(tiny_llama_dir)), config, seed=3)
    layers = list(model.model.layers)  # the decoder layers (transformers' GradientCheckpointingLayer)
    assert len(layers) > 1 and all(m.gradient_checkpointing for m in layers)
    assert all(m._gradient_checkpointing_func.func is checkpointing.checkpoint for m in layers)
    torch.manual_seed(0)
    for p in model.parameters():  # weights are not read here: give them values
        torch.nn.init.normal_(p, std=0.02)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    calls = []
    layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))  # inside the checkpointed layer
    model.train()

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    assert len(calls) == 2  # forward, and the recompute in backward
    # transformers 5.25 renamed it (the old name warns FutureWarning); older releases have the old name only
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    calls.clear()
    want_loss, want_grads = loss_and_grads()
    assert len(calls) == 1
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_per_device_eval_batch_size_sets_the_evaluation_micro_batch(tmp_path):
    """`--per-device-eval-batch-size`: the evaluation loader's micro-batch per rank (default: the training one), on
    `train` and `train-embedding` (whose retrieval evaluation encodes that many texts per forward)."""
    from zerotrain.embedding.command import worker_argv as embedding_argv
    from zerotrain.run.lm import stdlib_data
    from zerotrain.train.command import worker_argv

    def eval_batch(*argv: str) -> int:
        args = build_parser().parse_args(["train", "--max-corpus-bytes", "20000", "--eval-batches", "2", *argv])
        args = build_parser().parse_args(worker_argv(args))  # as each rank gets it
        data = stdlib_data(args, 16)
        _, make_loader, eval_loader, _ = data.loaders(args, micro=2, global_batch=4, dp_rank=1, dp_size=2)
        assert len(next(iter(make_loader(0)))["input_ids"]) == 2
        return len(next(iter(eval_loader))["input_ids"])

    assert eval_batch() == 2 and eval_batch("--per-device-eval-batch-size", "3") == 3
    embed = build_parser().parse_args(["train-embedding", "--model", "m", "--data", "d",
                                       "--per-device-eval-batch-size", "5"])
    assert build_parser().parse_args(embedding_argv(embed)).per_device_eval_batch_size == 5
    assert main(["train", "--per-device-eval-batch-size", "0"]) == 2


def test_print_config_prints_the_effective_config_and_trains_nothing(tmp_path, capsys):
    assert main(["train", "--print-config", "--learning-rate", "1e-4", "--max-steps", "10", "--output-dir",
                 str(tmp_path / "never")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["optimizer"]["params"]["lr"] == 1e-4 and printed["scheduler"] == {"type": "HFSchedule", "params": {
        "name": "linear", "num_warmup_steps": 0, "num_training_steps": 10}}  # the HF default: linear, no warmup
    assert not (tmp_path / "never").exists()
    assert main(["train-embedding", "--model", "m", "--data", "d", "--print-config", "--lr", "1e-3", "--stage", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["optimizer"]["params"]["lr"] == 1e-3 and printed["zero_optimization"]["stage"] == 2
    assert "scheduler" not in printed  # train-embedding's default: constant
    assert main(["train-embedding", "--model", "m", "--data", "d", "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["zero_optimization"]["stage"] == 3  # ZeRO-3 by default, as train


def _readme_blocks() -> list[str]:
    """The fenced bash blocks of the README's "Training your own model" walkthrough: flags only, then DeepSpeed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Training your own model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)[:2]


def test_the_readme_walkthrough_runs_as_written_with_flags_only_and_with_a_deepspeed_config(tmp_path):
    """The README's first-day commands, as written (zerotrain and python are this checkout's), in a fresh directory
    that has the repository's examples/: the flags-only walkthrough, then the DeepSpeed-config variant. bash runs
    each block; its `zerotrain` and `python` are forked from the test forkserver (`serve_commands`: torch,
    zerotrain and transformers imported once, not by each of the six commands), and so are the launches' torchrun
    agents and ranks (`served_python`)."""
    import os
    import subprocess
    from pathlib import Path

    from distributed import serve_commands, served_python

    blocks = _readme_blocks()
    assert len(blocks) == 2 and "--config" not in blocks[0] and "--deepspeed" in blocks[1], blocks
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "examples").symlink_to(root / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the launches' torchrun agents and ranks forked too (served_python as torch's PYTHON_EXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(root),
           "PYTHON_EXEC": served_python()}
    outputs = []
    with serve_commands(bin_dir, {"zerotrain": ["-m", "zerotrain.cli"], "python": []}):
        for block in blocks:
            run = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=900)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            outputs.append(run.stdout)
    flags, deepspeed = outputs
    # flags only: the epochs the steps make, said at the start, in every progress line, the metrics and the summary
    assert "10 steps = " in flags and " epochs of " in flags and "epoch " in flags
    records = [record for record in map(json.loads, (tmp_path / "ft-log" / "metrics.jsonl").read_text().splitlines())
               if "epoch" in record]
    per_epoch = records[-1]["step"] / records[-1]["epoch"]
    assert records[-1]["step"] == 20 and per_epoch == int(per_epoch) > 0
    summary = json.loads((tmp_path / "ft-log" / "summary.json").read_text())
    assert summary["epochs"] == pytest.approx(20 / per_epoch)
    saved = json.loads((tmp_path / "ft" / "effective_config.json").read_text())
    assert saved["optimizer"]["params"]["lr"] == 3e-4 and saved["zero_optimization"]["stage"] == 3
    assert saved["scheduler"] == {"type": "HFSchedule", "params": {"name": "constant_with_warmup", "num_warmup_steps": 5}}
    assert saved["train_micro_batch_size_per_gpu"] == 4
    assert "activation_checkpointing" not in saved
    assert (tmp_path / "ft-log" / "plots" / "loss.png").is_file()
    # the DeepSpeed file: "auto" filled from the flags (and the model's hidden size), printed by `cat`
    printed = json.loads(deepspeed[deepspeed.index("{\n"):])
    assert printed["optimizer"]["params"]["lr"] == 3e-4 and printed["train_batch_size"] == 8
    assert printed["scheduler"]["params"]["warmup_num_steps"] == 2
    assert isinstance(printed["zero_optimization"]["reduce_bucket_size"], int)
    assert "auto" not in json.dumps(printed) and printed["activation_checkpointing"] == {}
    # --num-train-epochs 2 without --max-steps: the data read before the engine, total_num_steps the steps the two
    # epochs make, and the linear decay laid over them: every step's lr is the schedule's, down to its end
    records = [r for r in map(json.loads, (tmp_path / "ft-ds-log" / "metrics.jsonl").read_text().splitlines())
               if "lr" in r]
    steps = printed["scheduler"]["params"]["total_num_steps"]
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and records[-1]["epoch"] == pytest.approx(2)
    assert steps == 2 * (steps // 2) > 2 and f"trained {steps} steps (2.00 epochs)" in deepspeed
    import torch

    from zerotrain.schedules import WarmupDecayLR
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=3e-4)
    schedule = WarmupDecayLR(optimizer, **printed["scheduler"]["params"])
    want = []
    for _ in range(steps):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-6)
    assert want[-1] < want[-2] < 3e-4
    after = 0  # the decay ends with the run: lr 0 at DeepSpeed's index total_num_steps (not 50 default steps later)
    while optimizer.param_groups[0]["lr"] > 0 and after < 10:
        schedule.step()
        after += 1
    assert after <= 2, after


def test_without_max_grad_norm_the_command_clips_at_hfs_one(tmp_path):
    """`zerotrain train` without --max-grad-norm clips at HF's 1.0: flags alone, and over a DeepSpeed file without
    gradient_clipping (DeepSpeed 0.19.8's default is 1.0 too); --max-grad-norm 0 turns it off."""
    bare = _file(tmp_path, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    assert load_config(train_config(_train_args(), world_size=2), dp_world_size=2).gradient_clipping == 1.0
    assert load_config(train_config(_train_args("--config", bare), world_size=2), dp_world_size=2).gradient_clipping == 1.0
    assert load_config(bare, dp_world_size=2).gradient_clipping == 1.0
    off = train_config(_train_args("--config", bare, "--max-grad-norm", "0"), world_size=2)
    assert load_config(off, dp_world_size=2).gradient_clipping == 0.0


def test_a_files_hf_schedule_auto_is_filled_from_the_flags(tmp_path):
    """An HFSchedule block's "auto" values take the flags' (HF's defaults where not given) and the run's steps."""
    hf = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "HFSchedule", "params": {"name": "auto", "num_warmup_steps": "auto",
                                                         "num_training_steps": "auto"}}}
    config = train_config(_train_args("--config", _file(tmp_path, hf), "--warmup-ratio", "0.25"), world_size=2)
    assert config["scheduler"]["params"] == {"name": "linear", "num_warmup_steps": 5, "num_training_steps": 20}
    load_config(config, dp_world_size=2)


# -- issue 47: TrainingArguments' underscore spellings; help defaults = the effective config's ------------------

_REQUIRED = {"train": [], "train-embedding": ["--model", "m", "--data", "d"],
             "estimate": ["--model", "tiny", "--config", "c.json"]}


def _command_parser(command: str):
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command]


def _sample(action) -> list[str]:
    """A value the option takes (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    # by the type's name, as argparse's own error names it (--max-steps' int parser is named "int")
    value = {"int": "3", "float": "0.25"}.get(getattr(action.type, "__name__", None), "x")
    return [value] * (2 if action.nargs in ("+", "*") else 1)


@pytest.mark.parametrize("command", ["train", "train-embedding"])
def test_every_option_takes_both_spellings_and_every_trainingarguments_field_is_among_them(command):
    """Walks the command's option table: each hyphenated option given with underscores parses to the same values;
    and every TrainingArguments field the command mirrors (by its hyphenated name) is one of them."""
    import dataclasses

    from transformers import TrainingArguments

    parser = _command_parser(command)
    options = {option: action for action in parser._actions for option in action.option_strings}
    walked = 0
    for option, action in options.items():
        if not option.startswith("--") or "-" not in option[2:] or action.dest == "help":
            continue
        value = _sample(action)
        argv = [command, *_REQUIRED[command]]
        hyphens = vars(build_parser().parse_args(argv + [option, *value]))
        underscores = vars(build_parser().parse_args(argv + [option.replace("-", "_").replace("__", "--", 1),
                                                             *value]))
        assert underscores == hyphens, option
        if value:  # the --name=value form too
            joined = option.replace("-", "_").replace("__", "--", 1) + "=" + value[0]
            if action.nargs is None:
                assert vars(build_parser().parse_args(argv + [joined])) == hyphens, option
        walked += 1
    mirrored = {f.name for f in dataclasses.fields(TrainingArguments)
                if f"--{f.name.replace('_', '-')}" in options}
    # the fields both commands mirror, by their TrainingArguments names (the walk above covers each of them)
    assert mirrored >= {"learning_rate", "output_dir", "per_device_train_batch_size", "max_steps",
                        "num_train_epochs", "gradient_accumulation_steps", "lr_scheduler_type", "weight_decay",
                        "save_steps", "save_total_limit", "logging_steps", "per_device_eval_batch_size",
                        "max_grad_norm", "warmup_steps", "resume_from_checkpoint"}, mirrored
    assert walked > 30
    # the README's own HF spellings train as they read
    args = build_parser().parse_args(["train", "--learning_rate", "3e-4", "--output_dir", "out",
                                      "--per_device_train_batch_size", "2"])
    assert (args.learning_rate, args.save_dir, args.per_device_train_batch_size) == (3e-4, "out", 2)


def test_an_unknown_argument_shows_the_commands_usage(capsys):
    for command in ("train", "train-embedding", "estimate"):
        with pytest.raises(SystemExit) as stop:
            main([command, *_REQUIRED.get(command, []), "--no-such-flag", "1"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"usage: zerotrain {command} ") and "unrecognized arguments: --no-such-flag 1" in err, err
        assert err.count("error:") == 1


@pytest.mark.parametrize("command", ["train", "train-embedding"])
def test_the_help_states_the_defaults_the_effective_config_is_made_from(command, capsys):
    """For every HF flag whose help states a default: giving that value changes nothing in the effective config
    (train-embedding: constant schedule, weight decay 0.01, lr 2e-5; train: TrainingArguments' own)."""
    import re

    from zerotrain.embedding.command import effective_embedding_config
    from zerotrain.train.flags import HF_FLAGS

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())

    def config(*argv: str) -> dict:
        args = build_parser().parse_args([command, *_REQUIRED[command], "--max-steps", "20", *argv])
        if command == "train":
            check_train_args(args)
            return train_config(args, world_size=1)
        return effective_embedding_config(args)

    plain = config()
    checked = {}
    for name in HF_FLAGS:
        option = f"--{name.replace('_', '-')}"
        stated = re.search(re.escape(option) + r" [A-Z0-9_]+(?:, --[a-z-]+ [A-Z0-9_]+)* (.*?)\(default: ([^)]*)\)", text)
        assert stated is not None, option
        if stated.group(2) == "all":  # save_total_limit: none removed
            assert "keep_last" not in json.dumps(plain.get("checkpoint", {}))
            continue
        checked[name] = stated.group(2)
        assert config(option, stated.group(2)) == plain, (option, stated.group(2))
    if command == "train-embedding":  # the case: the help said linear and 0
        assert checked["lr_scheduler_type"] == "constant" and checked["weight_decay"] == "0.01"
        assert "scheduler" not in plain and plain["optimizer"]["params"]["weight_decay"] == 0.01
    assert len(checked) == len(HF_FLAGS) - 1


def test_the_flag_built_adamw_does_not_decay_biases_and_norm_weights_as_the_hf_trainer(tiny_llama_dir, tmp_path,
                                                                                       world_of_one):
    """Without an `optimizer` block the HF Trainer builds AdamW with weight decay on all but biases and norm weights
    (`Trainer.get_decay_parameter_names`); `zerotrain train` builds that AdamW from the flags, with the same groups
    (it used to decay every parameter). One step at world 1 against plain PyTorch: torch's AdamW over the Trainer's
    groups, clipping 1.0, on the same batch; every weight within 1e-5 (decaying the norm weights moves them by
    lr x wd = 1e-3)."""
    import copy

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from zerotrain.run.model import train_engine
    from zerotrain.train.flags import optimizer_from_flags

    real = str(REAL_WORLD / "llamafactory_z2.json")
    args = _train_args("--deepspeed", real, "--learning-rate", "1e-2", "--weight-decay", "0.1",
                       "--per-device-train-batch-size", "2")
    with_block = _train_args("--deepspeed", _file(tmp_path, {"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-3}}}))
    assert optimizer_from_flags(args) and optimizer_from_flags(_train_args()) and not optimizer_from_flags(with_block)
    config = train_config(args, world_size=1, hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    reference = copy.deepcopy(model)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, reference))
    assert any("norm" in name for name, _ in reference.named_parameters() if name not in decay)
    # the LLaMA-Factory file's DeepSpeed keys zerotrain does not implement: each warned about (the suite stays quiet)
    from zerotrain.config import ConfigWarning
    with pytest.warns(ConfigWarning) as warned:
        engine = train_engine(model, config, decay_groups=optimizer_from_flags(args))
    assert sorted(str(w.message).split(" ", 1)[0] for w in warned) == [
        "comms_config", "monitor_config", "zero_allow_untested_optimizer", "zero_optimization.round_robin_gradients"]
    batch = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    named = list(reference.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                                   {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    ref_loss = reference(input_ids=batch, labels=batch).loss
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    got = engine.full_state_dict()
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
