"""DeepSpeed's LR schedules, checked against the formulas written out by hand and against DeepSpeed's own
classes stepped as DeepSpeed's engine steps them (step() only after each optimizer step)."""
import math
import warnings

import pytest
import torch

from zerotrain.config import ConfigError, load_config
from zerotrain.schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler


def make(type_, params, group_lrs=(0.1,)):
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": type_, "params": params}})
    groups = [{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in group_lrs]
    optimizer = torch.optim.SGD(groups, lr=group_lrs[0])
    return optimizer, build_scheduler(cfg.scheduler, optimizer)


def lrs_over(optimizer, scheduler, steps):
    """lr used by optimizer step t, for t = 0 .. steps-1 (step() after each optimizer step)."""
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            seen.append([g["lr"] for g in optimizer.param_groups])
            optimizer.step()
            scheduler.step()
    return seen


def test_none_gives_none():
    assert build_scheduler(None, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)) is None


def test_warmup_lr_log():
    opt, sched = make("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10},
                      group_lrs=(0.5, 0.7))
    assert isinstance(sched, WarmupLR)
    seen = lrs_over(opt, sched, 14)
    for t in range(14):
        i = max(t - 1, 0)  # DeepSpeed's engine: step t uses the schedule's value at index t - 1
        expected = 0.01 + 0.09 * (math.log(i + 1) / math.log(10) if i < 10 else 1.0)
        assert seen[t] == pytest.approx([expected, expected]), t  # absolute lr: same for every group


def test_warmup_lr_linear_and_defaults():
    opt, sched = make("WarmupLR", {"warmup_type": "linear", "warmup_num_steps": 4, "warmup_max_lr": 0.001})
    seen = [lrs[0] for lrs in lrs_over(opt, sched, 7)]
    assert seen == pytest.approx([0.0, 0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001])
    opt, sched = make("WarmupLR", {"warmup_num_steps": 2})  # warmup_max_lr defaults to the group's lr
    assert [lrs[0] for lrs in lrs_over(opt, sched, 4)] == pytest.approx([0.0, 0.0, 0.1 * math.log(2) / math.log(2),
                                                                          0.1])


def test_warmup_lr_per_group_lists():
    opt, sched = make("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.2], "warmup_num_steps": 2,
                                   "warmup_type": "linear"}, group_lrs=(0.3, 0.3))
    assert lrs_over(opt, sched, 4) == [pytest.approx([0.0, 0.1]), pytest.approx([0.0, 0.1]),
                                       pytest.approx([0.5, 0.15]), pytest.approx([1.0, 0.2])]
    with pytest.raises(ConfigError, match="scheduler.params.warmup_max_lr"):
        make("WarmupLR", {"warmup_max_lr": [1.0, 0.2, 0.3]}, group_lrs=(0.3, 0.3))


def test_warmup_decay_lr():
    opt, sched = make("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                        "warmup_num_steps": 5, "warmup_type": "linear"})
    assert isinstance(sched, WarmupDecayLR)
    seen = [lrs[0] for lrs in lrs_over(opt, sched, 24)]
    for t, lr in enumerate(seen):
        i = max(t - 1, 0)
        if i < 5:
            expected = 0.1 * i / 5
        else:
            expected = 0.1 * max(0.0, (20 - i) / 15)
        assert lr == pytest.approx(expected, abs=1e-12), t
    assert seen[6] == pytest.approx(0.1) and seen[21] == 0.0 and seen[23] == 0.0


def test_warmup_cosine_lr_scales_each_group():
    params = {"total_num_steps": 30, "warmup_min_ratio": 0.1, "warmup_num_steps": 10, "cos_min_ratio": 0.01}
    opt, sched = make("WarmupCosineLR", params, group_lrs=(1.0, 0.5))
    assert isinstance(sched, WarmupCosineLR)
    seen = lrs_over(opt, sched, 35)
    assert seen[0] == [0.0, 0.0]  # DeepSpeed's first optimizer step runs at lr 0
    for t, lrs in enumerate(seen[1:], start=1):
        i = t - 1
        if i < 10:
            ratio = 0.1 + 0.9 * math.log(i + 1) / math.log(10)
        else:
            progress = min(1.0, (i - 10 + 1) / 20)
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        assert lrs == pytest.approx([ratio * 1.0, ratio * 0.5]), t
    assert seen[30][0] == pytest.approx(0.01) and seen[34][0] == pytest.approx(0.01)  # stays at the floor


@pytest.mark.parametrize("type_", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_zero_warmup_steps_is_refused_as_deepspeed_refuses_it(type_):
    total = {} if type_ == "WarmupLR" else {"total_num_steps": 4}
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        make(type_, {"warmup_num_steps": 0, **total})
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps"):
        WarmupLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), warmup_num_steps=0)
    opt, sched = make(type_, {"warmup_num_steps": 1, **total})  # raised to 2, as DeepSpeed does
    assert sched.warmup_num_steps == 2


@pytest.mark.parametrize("type_, params", [
    ("WarmupLR", {"warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "decay_step_size": 2,
                  "decay_lr_rate": 0.5}),
])
@pytest.mark.filterwarnings("ignore:scheduler OneCycle. cycle_momentum has no effect")  # `make` builds SGD: no betas
def test_state_dict_round_trips(type_, params):
    opt, sched = make(type_, params, group_lrs=(0.2, 0.4))
    lrs_over(opt, sched, 7)
    state = sched.state_dict()
    opt2, sched2 = make(type_, params, group_lrs=(0.2, 0.4))
    sched2.load_state_dict(state)
    assert sched2.last_epoch == sched.last_epoch == 7
    assert lrs_over(opt2, sched2, 6)[1:] == lrs_over(opt, sched, 6)[1:]


def _adam_groups(count: int = 2) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]} for _ in range(count)], lr=0.1,
                             betas=(0.9, 0.99))


def test_one_cycle_lr_and_momentum_by_hand():
    """Up over 4 steps, down over 2, then min_lr / (1 + rate * (t - 6) / 2); beta1 the mirror image (step 0 at
    cycle_min_mom, as DeepSpeed sets it at construction), beta2 0.99."""
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 4, "cycle_second_step_size": 2,
              "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "OneCycle", "params": params}})
    optimizer = _adam_groups()
    scheduler = build_scheduler(cfg.scheduler, optimizer)
    assert isinstance(scheduler, OneCycle)
    scale = [0, 0.25, 0.5, 0.75, 1.0, 0.5, 0.0]
    expected_lr = [0.01 + 0.04 * x for x in scale] + [0.01 / (1 + 0.5 * (t - 6) / 2) for t in (7, 8, 9)]
    expected_beta1 = [0.85] + [0.95 - 0.1 * x for x in scale[1:]] + [0.95] * 3  # no momentum decay rate
    for t in range(10):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(expected_lr[t]), t
            assert group["betas"] == pytest.approx((expected_beta1[t], 0.99)), t
        optimizer.step()
        scheduler.step()


def test_one_cycle_without_a_decay_step_size_stays_at_min_lr_after_the_cycle():
    """A decay rate with no decay_step_size (0, the default) does not decay: min_lr and max momentum after the
    cycle, as DeepSpeed's OneCycle skips the decay when either is 0."""
    optimizer = _adam_groups(1)
    scheduler = OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.05, cycle_first_step_size=2,
                         decay_lr_rate=0.5, decay_mom_rate=0.5, cycle_min_mom=0.85, cycle_max_mom=0.95)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    assert optimizer.param_groups[0]["betas"] == pytest.approx((0.95, 0.99))


def test_one_cycle_stairs_per_group_and_sgd():
    with pytest.warns(UserWarning, match="scheduler OneCycle: cycle_momentum has no effect: SGD has no betas"):
        opt, sched = make("OneCycle", {"cycle_min_lr": [0.0, 0.1], "cycle_max_lr": [0.8, 0.9],
                                       "cycle_first_step_size": 4, "cycle_first_stair_count": 2}, group_lrs=(0.3, 0.3))
    seen = lrs_over(opt, sched, 9)  # SGD: no betas, cycle_momentum has no effect (warned)
    # stairs of 2 steps up (scale 0, 0, .5, .5, 1), then down over 4 (1, .5, .5, 0)
    scales = [0, 0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert seen == [pytest.approx([0.8 * x, 0.1 + 0.8 * x]) for x in scales]
    assert "betas" not in opt.param_groups[0]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")  # no training
def test_one_cycle_matches_deepspeed_when_installed():
    import deepspeed  # noqa: F401 - in the dev extra: a missing install fails, never skips
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.lr_schedules import OneCycle as DeepSpeedOneCycle

    params = dict(cycle_min_lr=0.004, cycle_max_lr=0.015, cycle_first_step_size=10, cycle_second_step_size=3,
                  cycle_first_stair_count=4, cycle_second_stair_count=2, decay_step_size=5, decay_lr_rate=0.01,
                  decay_mom_rate=0.02)
    ours, theirs = _adam_groups(), _adam_groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours_scheduler, their_scheduler = OneCycle(ours, **params), DeepSpeedOneCycle(theirs, **params)
    for t in range(40):
        for mine, reference in zip(ours.param_groups, theirs.param_groups):
            assert mine["lr"] == pytest.approx(reference["lr"], rel=1e-12), t
            assert mine["betas"] == pytest.approx(reference["betas"], rel=1e-12), t
        ours_scheduler.step()
        their_scheduler.step()


ENGINE_CASES = [
    ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)),
    ("WarmupLR", dict(warmup_num_steps=2)),  # warmup_max_lr: the group's lr
    ("WarmupLR", dict(warmup_min_lr=[0.0, 0.02], warmup_max_lr=[0.3, 0.1], warmup_num_steps=4, warmup_type="linear")),
    ("WarmupDecayLR", dict(total_num_steps=12, warmup_min_lr=0.001, warmup_max_lr=0.05, warmup_num_steps=3)),
    ("WarmupDecayLR", dict(total_num_steps=9, warmup_num_steps=1, warmup_type="linear")),
    ("WarmupCosineLR", dict(total_num_steps=14, warmup_min_ratio=0.1, warmup_num_steps=4, cos_min_ratio=0.05)),
    ("WarmupCosineLR", dict(total_num_steps=3, warmup_num_steps=5, warmup_type="linear")),
    ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, decay_step_size=2,
                      decay_lr_rate=0.3)),
]


def _deepspeed_schedules():
    import deepspeed  # noqa: F401 - in the dev extra: a missing install fails, never skips
    import os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import lr_schedules
    return lr_schedules


@pytest.mark.parametrize("type_, params", ENGINE_CASES)
def test_every_step_uses_deepspeed_engines_lr(type_, params):
    """DeepSpeed's engine builds the scheduler, runs optimizer step 0 at whatever lr construction set, and calls
    scheduler.step() after every optimizer step: ours gives the same lr at every step, and after a resume."""
    lr_schedules = _deepspeed_schedules()
    ours, theirs = _adam_groups(), _adam_groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mine = build_scheduler(load_config({"train_batch_size": 1, "scheduler": {"type": type_, "params": params}})
                               .scheduler, ours)
        reference = getattr(lr_schedules, type_)(theirs, **params)
    seen, expected = lrs_over(ours, mine, 20), lrs_over(theirs, reference, 20)
    assert seen == [pytest.approx(lrs, rel=1e-12, abs=1e-15) for lrs in expected]
    # resume after 7 steps: a fresh scheduler given the saved state continues with the same lrs
    ours, theirs = _adam_groups(), _adam_groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = build_scheduler(load_config({"train_batch_size": 1, "scheduler": {"type": type_, "params": params}})
                                .scheduler, ours)
        lrs_over(ours, first, 7)
        resumed_opt = _adam_groups()
        resumed = build_scheduler(load_config({"train_batch_size": 1, "scheduler": {"type": type_, "params": params}})
                                  .scheduler, resumed_opt)
        resumed.load_state_dict(first.state_dict())
    assert lrs_over(resumed_opt, resumed, 13) == [pytest.approx(lrs, rel=1e-12, abs=1e-15) for lrs in expected[7:]]


def test_state_saved_by_the_old_rule_resumes_under_the_new_one():
    """A state_dict written before the change (torch's full __dict__, with the old `warmup_num_steps` 0 =
    no warmup and the old lrs) resumes from its step count under this run's config and the new rule."""
    old_state = {"min_lrs": [0.0, 0.0], "max_lrs": [0.1, 0.1], "warmup_num_steps": 0, "warmup_type": "log",
                 "base_lrs": [0.1, 0.1], "last_epoch": 3, "verbose": False, "_step_count": 4,
                 "_get_lr_called_within_step": False, "_last_lr": [0.1, 0.1], "total_num_steps": 10}
    opt, sched = make("WarmupDecayLR", {"total_num_steps": 10, "warmup_max_lr": 0.1, "warmup_num_steps": 4,
                                        "warmup_type": "linear"}, group_lrs=(0.2, 0.4))
    sched.load_state_dict(old_state)
    assert sched.last_epoch == 3 and sched.warmup_num_steps == 4
    # step 3 uses index 2 of the linear warmup; then 3/4, then the decay from index 4
    assert [lrs[0] for lrs in lrs_over(opt, sched, 3)] == pytest.approx([0.05, 0.075, 0.1])


# --- HFSchedule: what HF's `lr_scheduler_type` makes (the CLI's flags, config_from_arguments) ------------------------

HF_STEPS, HF_LR = 6, 1e-2


def _hf_lrs(name: str, warmup: int, steps: int, lr: float) -> list[float]:
    """transformers' schedule on a plain torch optimizer, stepped as the HF Trainer steps it: the lr of each step."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule, seen = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps), []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def _engine_lrs(config: dict, batches, overflow_at: int = -1) -> tuple[list[float], object]:
    """In-process (world 1) engine: the lr each optimizer step applies (read before it), over `batches`; with
    `overflow_at`, that batch carries an inf (a skipped step under bf16.check_grad_overflow) and is repeated
    clean after it."""
    import zerotrain
    from models_for_tests import OddMLP

    torch.manual_seed(0)
    engine = zerotrain.initialize(model=OddMLP(), config=config)[0]
    seen = []
    for index, (x, y) in enumerate(batches):
        if index == overflow_at:
            before = engine.get_lr()
            engine.backward(engine(torch.full_like(x, float("inf")).to(engine.dtype), y.to(engine.dtype)))
            engine.step()
            assert engine.skipped_steps == 1 and engine.get_lr() == before  # a skipped step does not advance it
        seen.append(engine.get_lr()[0])
        engine.backward(engine(x.to(engine.dtype), y.to(engine.dtype)))
        engine.step()
    return seen, engine


def _reference_weights(name: str, warmup: int, batches) -> dict:
    """Plain torch AdamW (HF's defaults, clipping at 1.0) under transformers' schedule: the weights after `batches`."""
    from models_for_tests import OddMLP
    from transformers import get_scheduler

    torch.manual_seed(0)
    model = OddMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=HF_LR, weight_decay=0.0)
    schedule = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=HF_STEPS)
    for x, y in batches:
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_lr_scheduler_type_trains_with_transformers_schedule_step_for_step(tmp_path, world_of_one):
    """`lr_scheduler_type` (the CLI's --lr-scheduler-type / --warmup-steps, config_from_arguments) gives the HF Trainer's
    curve in the engine: for linear / cosine / constant_with_warmup, with no warmup and with 2, the lr every optimizer
    step applies is `transformers.get_scheduler`'s (step 1 at the full lr without warmup, where DeepSpeed's
    WarmupDecayLR would raise the warmup to 2 steps at lr 0), the weights are plain torch AdamW's under that schedule,
    an overflow-skipped step does not advance it, and a checkpoint resumes it. A config's DeepSpeed block keeps
    DeepSpeed's rule."""
    from models_for_tests import make_batches

    from zerotrain.config.hf_arguments import config_from_arguments

    batches = make_batches(HF_STEPS, 4)
    for name in ("linear", "cosine", "constant_with_warmup"):
        for warmup in (0, 2):
            arguments = {"lr_scheduler_type": name, "warmup_steps": warmup, "learning_rate": HF_LR,
                         "per_device_train_batch_size": 4, "bf16": name == "cosine"}
            config = config_from_arguments(arguments, world_size=1, num_training_steps=HF_STEPS, zero_stage=1)
            if name == "cosine":  # bf16 with the overflow check: step 3 is once skipped on an inf gradient
                config["bf16"]["check_grad_overflow"] = True
            want = _hf_lrs(name, warmup, HF_STEPS, HF_LR)
            got, engine = _engine_lrs(config, batches, overflow_at=2 if name == "cosine" else -1)
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (name, warmup, got, want)
            assert (got[0] == HF_LR) == (warmup == 0)  # no warmup: step 1 at the full lr, as the HF Trainer
            assert len(set(got)) > 1 or (name, warmup) == ("constant_with_warmup", 0)  # the curve moves
            if name == "linear":  # the lrs applied are the lrs used: torch's AdamW under the same schedule
                weights, reference = engine.full_state_dict(), _reference_weights(name, warmup, batches)
                for key, value in reference.items():
                    torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-7)
    # resume: 3 steps, a checkpoint, a new engine from it: steps 4.. run at the schedule's lrs 4..
    config = config_from_arguments({"lr_scheduler_type": "cosine", "warmup_steps": 2, "learning_rate": HF_LR,
                                    "per_device_train_batch_size": 4}, world_size=1, num_training_steps=HF_STEPS,
                                   zero_stage=1)
    _, first = _engine_lrs(config, batches[:3])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    import zerotrain
    from models_for_tests import OddMLP

    resumed = zerotrain.initialize(model=OddMLP(), config=config)[0]
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    later = []
    for x, y in batches[3:]:
        later.append(resumed.get_lr()[0])
        resumed.backward(resumed(x, y))
        resumed.step()
    assert later == pytest.approx(_hf_lrs("cosine", 2, HF_STEPS, HF_LR)[3:], rel=1e-12)
    # a config file's DeepSpeed WarmupDecayLR keeps DeepSpeed's rule: warmup 1 is raised to 2, steps 1 and 2 at lr 0
    params = {"warmup_min_lr": 0, "warmup_max_lr": HF_LR, "warmup_num_steps": 1, "total_num_steps": HF_STEPS,
              "warmup_type": "linear"}
    got, _ = _engine_lrs(dict(config, scheduler={"type": "WarmupDecayLR", "params": params}), batches)
    want = [lrs[0] for lrs in lrs_over(*make("WarmupDecayLR", params, group_lrs=(HF_LR,)), HF_STEPS)]
    assert got == pytest.approx(want, rel=1e-12) and got[:3] == [0.0, 0.0, HF_LR / 2]
