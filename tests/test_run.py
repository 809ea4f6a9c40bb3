"""The run layer (`zerotrain.run`, issue 42): a command builds its run's config once and hands the one parsed object
down; the skeleton both training commands share. In-process runs of the tiny preset (world 1, seconds)."""
from __future__ import annotations

import pytest

from zerotrain.cli import main


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    """A single-process run in a fresh directory (no launcher variables)."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("epochs", [False, True], ids=["max-steps", "num-train-epochs"])
def test_a_train_run_builds_and_parses_its_config_once_and_hands_the_parsed_object_to_initialize(one_rank,
                                                                                                monkeypatch, epochs):
    """`zerotrain train` builds the effective config (file + flags + "auto") once and parses it once: the check
    before launching builds it for the run (one rank: this process), the model, the data wiring and
    `zerotrain.initialize` take that object (initialize neither parses it again nor re-resolves its batch). It was
    built 3 times and parsed 6 times (issue 42). With --num-train-epochs and no --max-steps too (it was built and
    parsed a second time once the data was read): the schedule's step counts stay open until then and are filled in
    place, and every step's lr is DeepSpeed's WarmupDecayLR's over the steps the epochs make (warmup a share of
    them), as before."""
    import json
    import math

    import zerotrain
    import zerotrain.config.loader as loader
    import zerotrain.train.flags as flags
    from zerotrain.config import ZeroTrainConfig

    builds, parses, handed = [], [], []
    effective_config, build, initialize = flags.effective_config, loader._build, zerotrain.initialize
    monkeypatch.setattr(flags, "effective_config", lambda *a, **k: builds.append(k) or effective_config(*a, **k))
    monkeypatch.setattr(loader, "_build", lambda *a, **k: parses.append(a[0]) or build(*a, **k))

    def recording_initialize(**kwargs):
        handed.append(kwargs["config"])
        return initialize(**kwargs)

    monkeypatch.setattr(zerotrain, "initialize", recording_initialize)
    config = one_rank / "c.json"
    file = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2}}
    length = ["--max-steps", "1"]
    if epochs:  # a DeepSpeed schedule whose steps and warmup the run's steps decide
        file.update(optimizer={"type": "AdamW", "params": {"lr": "auto"}},
                    scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                                                   "warmup_max_lr": "auto", "warmup_min_lr": "auto"}})
        length = ["--num-train-epochs", "0.02", "--warmup-ratio", "0.4", "--learning-rate", "1e-3",
                  "--logging-steps", "1"]
    config.write_text(json.dumps(file))
    status = main(["train", "--config", str(config), "--model", "tiny", *length, "--max-corpus-bytes",
                   "20000", "--per-device-train-batch-size", "2", "--seq-len", "16", "--eval-batches", "1",
                   "--output-dir", "ck", "--log-dir", "log"])
    assert status == 0
    assert len(builds) == 1, builds
    assert len(parses) == 1, [sorted(p) for p in parses]
    assert len(handed) == 1 and isinstance(handed[0], ZeroTrainConfig)
    # the batch resolved for the run's one data-parallel rank, the schedule over --max-steps
    assert (handed[0].train_batch_size, handed[0].train_micro_batch_size_per_gpu,
            handed[0].gradient_accumulation_steps) == (4, 2, 2)
    recorded = json.loads((one_rank / "ck" / "effective_config.json").read_text())
    assert recorded == json.loads((one_rank / "log" / "effective_config.json").read_text())
    assert recorded["gradient_accumulation_steps"] == 2 and recorded["zero_optimization"]["stage"] == 2
    if not epochs:
        assert handed[0].scheduler.params["num_training_steps"] == 1
        return
    records = [r for r in map(json.loads, (one_rank / "log" / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    per_epoch = records[-1]["step"] / records[-1]["epoch"]  # full global batches in one pass over the corpus
    steps = math.ceil(0.02 * round(per_epoch))
    warmup = math.ceil(0.4 * steps)
    assert steps > warmup > 1 and [r["step"] for r in records] == list(range(1, steps + 1))
    want_params = {"total_num_steps": steps, "warmup_num_steps": warmup, "warmup_max_lr": 1e-3, "warmup_min_lr": 0}
    assert recorded["scheduler"] == {"type": "WarmupDecayLR", "params": want_params}
    assert handed[0].scheduler.params == want_params and handed[0].raw["scheduler"]["params"] == want_params
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR  # DeepSpeed's own, the reference

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule, want = WarmupDecayLR(optimizer, **want_params), []
    for _ in range(steps):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-6)
    # warmed up over the first `warmup` steps (DeepSpeed's index `warmup` is the peak), then decaying to the run's end
    assert want.index(max(want)) == warmup and max(want) == pytest.approx(1e-3) and want[-1] < want[-2] < 1e-3


def test_run_config_is_parsed_once_for_the_data_parallel_ranks_and_fills_its_open_schedule_in_place():
    """`RunConfig` (no engine): the built dict parsed once; the batch triple is resolved for world / (tensor x
    sequence x pipeline) ranks; `initialize`'s second resolution returns the same object (and refuses another rank
    count). Built with its steps open ("auto" at the schedule's step counts), `schedule_over` fills them in the same
    dict and parsed object (raw included) with what `fill` gives, nothing else; a world the split does not divide,
    or a batch it cannot make, is a ConfigError naming the key (the latter the world size)."""
    from zerotrain.config import ConfigError
    from zerotrain.run.config import RunConfig

    filled = []

    def values(steps, **extra) -> dict:
        return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                "tensor_parallel": {"autotp_size": 2}, "sequence_parallel_size": 3, "pipeline_parallel_size": 5,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": steps, "warmup_num_steps": 4}},
                **extra}

    def fill(steps: int) -> dict:
        filled.append(steps)
        return {"scheduler.params.total_num_steps": steps, "scheduler.params.warmup_num_steps": 99,
                "scheduler.params.num_training_steps": steps, "scheduler.params.num_warmup_steps": 98}

    config = RunConfig(values(5), world_size=2 * 3 * 5 * 4, steps=5, fill=fill)
    assert config.dp_world_size == 4 and config.world_size == 120 and config.scheduled
    assert (config.global_batch, config.parsed.train_micro_batch_size_per_gpu,
            config.parsed.gradient_accumulation_steps) == (24, 2, 3)
    assert config.parsed.resolve_batch(4) is config.parsed  # what initialize does with it: no copy
    with pytest.raises(ConfigError, match="dp_world_size=8"):
        config.parsed.resolve_batch(8)
    parsed = config.parsed
    config.schedule_over(5)  # built for those steps: nothing to do
    assert filled == [] and config.parsed is parsed
    with pytest.raises(ValueError, match="built for 5 steps"):
        config.schedule_over(7)

    late = RunConfig(values("auto"), world_size=120, steps=None, fill=fill)
    assert not late.scheduled and late.values["scheduler"]["params"]["total_num_steps"] == "auto"
    parsed, built = late.parsed, late.values
    late.schedule_over(7)
    assert filled == [7] and late.scheduled and late.steps == 7 and late.parsed is parsed and late.values is built
    # only the open key is filled: the warmup the config gives stays
    assert late.values["scheduler"]["params"] == {"total_num_steps": 7, "warmup_num_steps": 4}
    assert late.parsed.scheduler.params["total_num_steps"] == 7 and late.parsed.scheduler.params[
        "warmup_num_steps"] == 4
    assert late.parsed.raw["scheduler"]["params"] == {"total_num_steps": 7, "warmup_num_steps": 4}
    assert late.global_batch == 24
    with pytest.raises(ValueError, match="nothing is given to fill them"):
        RunConfig(values("auto"), world_size=120, steps=None)
    # built for known steps, an "auto" left at a step count is the parse's error (nothing fills it later)
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps"):
        RunConfig(values("auto"), world_size=120, steps=5, fill=fill)
    # no scheduler (generate's forward-only config): nothing open, nothing to fill
    bare = values(5)
    del bare["scheduler"], bare["optimizer"]
    plain = RunConfig(bare, world_size=120, steps=None)
    assert plain.scheduled and plain.parsed.scheduler is None
    plain.schedule_over(9)
    assert plain.steps == 9 and "scheduler" not in plain.values
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps: the run makes 0 optimizer steps"):
        RunConfig(values("auto"), world_size=120, steps=None, fill=fill).schedule_over(0)
    with pytest.raises(ConfigError, match="does not divide the world size 100") as refused:
        RunConfig(values(5), world_size=100, steps=5)
    assert refused.value.key == "pipeline_parallel_size"
    with pytest.raises(ConfigError, match="this job has world size 120") as refused:
        RunConfig(values(5, train_batch_size=12), world_size=120, steps=5)
    assert refused.value.key == "train_batch_size"


def test_train_config_splits_the_world_over_the_pipeline_stages(tmp_path):
    """`train_config` with --pipeline-parallel-size 2 at 8 ranks (no engine): the batch counts the 4 data-parallel
    ranks of a stage; flags alone default to ZeRO-1 (ZeRO-2/3 are refused with a pipeline), a --config file's stage
    is kept; the RunConfig over it resolves for those 4 ranks."""
    import json

    from zerotrain.cli import build_parser
    from zerotrain.run.config import RunConfig, train_config

    def args(*argv: str):
        return build_parser().parse_args(["train", "--pipeline-parallel-size", "2", "--per-device-train-batch-size",
                                          "2", "--gradient-accumulation-steps", "3", "--max-steps", "5", *argv])

    config = train_config(args(), world_size=8)
    assert (config["pipeline_parallel_size"], config["zero_optimization"]["stage"], config["train_batch_size"]) == \
        (2, 1, 24)
    assert RunConfig(train_config(args(), world_size=8), world_size=8, steps=5).dp_world_size == 4
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    assert train_config(args("--config", str(file)), world_size=8)["zero_optimization"]["stage"] == 0
    assert train_config(args("--zero-stage", "0"), world_size=8)["zero_optimization"]["stage"] == 0
    assert "pipeline_parallel_size" not in train_config(build_parser().parse_args(["train", "--max-steps", "5"]),
                                                        world_size=8)


def test_train_config_fills_a_files_auto_bucket_sizes_from_the_models_hidden_size(tmp_path):
    """`train_config` with a --config file whose bucket sizes are "auto" (no engine): the model's hidden size h
    fills them (reduce h*h, ZeRO-3 prefetch 0.9*h*h, as transformers), looked up from --model when the caller gives
    none; a hidden size given wins (the worker passes the one it resolved)."""
    import json

    from zerotrain.cli import build_parser
    from zerotrain.models.hf import resolve_model
    from zerotrain.run.config import train_config

    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                      "stage3_prefetch_bucket_size": "auto"}}))
    args = build_parser().parse_args(["train", "--config", str(file), "--model", "tiny", "--max-steps", "2"])
    hidden = resolve_model("tiny").config.hidden_size
    zero = train_config(args, world_size=1)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (hidden * hidden,
                                                                                int(0.9 * hidden * hidden))
    assert hidden != 7 and train_config(args, world_size=1, hidden_size=7)["zero_optimization"][
        "reduce_bucket_size"] == 49
