"""DeepSpeed's LR schedules, checked against the formulas written out by hand."""
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
        expected = 0.01 + 0.09 * (math.log(t + 1) / math.log(10) if t < 10 else 1.0)
        assert seen[t] == pytest.approx([expected, expected]), t  # absolute lr: same for every group


def test_warmup_lr_linear_and_defaults():
    opt, sched = make("WarmupLR", {"warmup_type": "linear", "warmup_num_steps": 4})
    seen = [lrs[0] for lrs in lrs_over(opt, sched, 6)]
    assert seen == pytest.approx([0.0, 0.00025, 0.0005, 0.00075, 0.001, 0.001])


def test_warmup_lr_per_group_lists():
    opt, sched = make("WarmupLR", {"warmup_min_lr": [0.0, 0.1], "warmup_max_lr": [1.0, 0.2], "warmup_num_steps": 2,
                                   "warmup_type": "linear"}, group_lrs=(0.3, 0.3))
    assert lrs_over(opt, sched, 3) == [pytest.approx([0.0, 0.1]), pytest.approx([0.5, 0.15]),
                                       pytest.approx([1.0, 0.2])]
    with pytest.raises(ConfigError, match="scheduler.params.warmup_max_lr"):
        make("WarmupLR", {"warmup_max_lr": [1.0, 0.2, 0.3]}, group_lrs=(0.3, 0.3))


def test_warmup_decay_lr():
    opt, sched = make("WarmupDecayLR", {"total_num_steps": 20, "warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                        "warmup_num_steps": 5, "warmup_type": "linear"})
    assert isinstance(sched, WarmupDecayLR)
    seen = [lrs[0] for lrs in lrs_over(opt, sched, 24)]
    for t, lr in enumerate(seen):
        if t < 5:
            expected = 0.1 * t / 5
        else:
            expected = 0.1 * max(0.0, (20 - t) / 15)
        assert lr == pytest.approx(expected, abs=1e-12), t
    assert seen[5] == pytest.approx(0.1) and seen[20] == 0.0 and seen[23] == 0.0


def test_warmup_cosine_lr_scales_each_group():
    params = {"total_num_steps": 30, "warmup_min_ratio": 0.1, "warmup_num_steps": 10, "cos_min_ratio": 0.01}
    opt, sched = make("WarmupCosineLR", params, group_lrs=(1.0, 0.5))
    assert isinstance(sched, WarmupCosineLR)
    seen = lrs_over(opt, sched, 35)
    for t, lrs in enumerate(seen):
        if t < 10:
            ratio = 0.1 + 0.9 * math.log(t + 1) / math.log(10)
        else:
            progress = min(1.0, (t - 10 + 1) / 20)
            ratio = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        assert lrs == pytest.approx([ratio * 1.0, ratio * 0.5]), t
    assert seen[29][0] == pytest.approx(0.01) and seen[34][0] == pytest.approx(0.01)  # stays at the floor


def test_zero_warmup_steps_means_no_warmup():
    opt, sched = make("WarmupLR", {"warmup_num_steps": 0, "warmup_max_lr": 0.3})
    assert [lrs[0] for lrs in lrs_over(opt, sched, 2)] == pytest.approx([0.3, 0.3])
    opt, sched = make("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 0, "cos_min_ratio": 0.0})
    assert [lrs[0] for lrs in lrs_over(opt, sched, 4)] == pytest.approx([0.1 * 0.5 * (1 + math.cos(math.pi * k / 4))
                                                                        for k in range(1, 5)])


@pytest.mark.parametrize("type_, params", [
    ("WarmupLR", {"warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 12, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 4}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4, "decay_step_size": 2,
                  "decay_lr_rate": 0.5}),
])
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


def test_one_cycle_stairs_per_group_and_sgd():
    opt, sched = make("OneCycle", {"cycle_min_lr": [0.0, 0.1], "cycle_max_lr": [0.8, 0.9], "cycle_first_step_size": 4,
                                   "cycle_first_stair_count": 2}, group_lrs=(0.3, 0.3))
    seen = lrs_over(opt, sched, 9)  # SGD: no betas, cycle_momentum has no effect (warned)
    # stairs of 2 steps up (scale 0, 0, .5, .5, 1), then down over 4 (1, .5, .5, 0)
    scales = [0, 0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert seen == [pytest.approx([0.8 * x, 0.1 + 0.8 * x]) for x in scales]
    assert "betas" not in opt.param_groups[0]


def test_one_cycle_matches_deepspeed_when_installed():
    pytest.importorskip("deepspeed")
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
