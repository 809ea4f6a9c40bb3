"""checkpoint/optim_state.py in-process (issue #48, round 4): which optimizer state is per-element and which is a
scalar (torch's own Adam, SGD and Adagrad), the template a load rebuilds scalars from, and the param groups'
hyperparameters saved as JSON and put back (tensors filled in place, betas a tuple again, implementation flags
kept)."""
from __future__ import annotations

import json

import pytest
import torch

from zerotrain.checkpoint.format import CheckpointError
from zerotrain.checkpoint.optim_state import (check_groups, group_hyperparameters, make_scalar, probe_template,
                                              restore_hyperparameters, scalar_value, split_state)


def _stepped(optimizer_type, numel: int = 5, **hyper):
    master = torch.nn.Parameter(torch.randn(numel))
    optimizer = optimizer_type([master], **hyper)
    master.grad = torch.randn(numel)
    optimizer.step()
    return optimizer, master


@pytest.mark.parametrize("numel", [5, 1])  # a master of one element: its moments are per-element all the same
def test_torch_adam_state_splits_into_its_moments_and_its_step(numel):
    optimizer, master = _stepped(torch.optim.Adam, numel, amsgrad=True)
    elementwise, scalars = split_state(optimizer.state[master], master)
    assert set(elementwise) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"} and set(scalars) == {"step"}
    assert elementwise["exp_avg"] is optimizer.state[master]["exp_avg"]
    assert scalar_value(scalars["step"]) == 1.0 and scalar_value(3) == 3.0


def test_python_numbers_are_scalars_none_is_skipped_and_anything_else_is_refused_by_name():
    master = torch.zeros(4)
    elementwise, scalars = split_state({"step": 7, "rate": 0.5, "gone": None, "m": torch.ones(4),
                                        "s": torch.tensor([2.0])}, master)
    assert set(elementwise) == {"m"} and scalars == {"step": 7, "rate": 0.5, "s": scalars["s"]}
    for bad, shown in ((torch.ones(2, 2), "(Tensor(2, 2))"), (torch.ones(3), "(Tensor(3,))"), (True, "(bool)"),
                       ("adam", "(str)")):
        with pytest.raises(CheckpointError, match=f"optimizer state 'odd' {shown.replace('(', '[(]').replace(')', '[)]')}"):
            split_state({"odd": bad}, master)


def test_the_template_comes_from_an_existing_state_or_a_trial_step_and_rebuilds_scalars():
    optimizer, master = _stepped(torch.optim.Adam)
    template = probe_template(optimizer, 0, master)
    assert template.elementwise == {"exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    assert template.scalars == {"step": (torch.float32, torch.device("cpu"))}
    fresh_master = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    fresh = torch.optim.Adagrad([fresh_master], lr=0.1)
    probed = probe_template(fresh, 0, fresh_master)  # no state yet: a throwaway step of the same optimizer
    assert probed.elementwise == {"sum": torch.float64} and fresh.state.get(fresh_master, {}).keys() <= {"sum", "step"}
    assert set(probed.scalars) == {"step"}
    step = make_scalar(template, "step", 4.0)
    assert torch.is_tensor(step) and step.dtype == torch.float32 and step.item() == 4.0
    as_python = probe_template(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), 0, torch.zeros(2))
    assert as_python.elementwise == {} and as_python.scalars == {}
    numbers = type(template)({}, {"n": (None, None)})
    assert make_scalar(numbers, "n", 3.0) == 3 and isinstance(make_scalar(numbers, "n", 3.0), int)
    assert make_scalar(numbers, "n", 2.5) == 2.5
    unknown = make_scalar(numbers, "other", 1.5)  # a key the template does not know: a float32 tensor
    assert torch.is_tensor(unknown) and unknown.dtype == torch.float32 and unknown.item() == 1.5


def test_a_trial_step_that_fails_is_one_error_naming_the_optimizer():
    class Picky(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("needs a closure")

    master = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(CheckpointError, match="cannot tell which state Picky keeps .*needs a closure"):
        probe_template(Picky([master], lr=0.1), 0, master)


def test_hyperparameters_go_out_as_json_and_come_back_into_the_groups():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    saved_from = torch.optim.AdamW([{"params": [a], "lr": torch.tensor(0.01)}, {"params": [b], "weight_decay": 0.0}],
                                   lr=0.02, betas=(0.8, 0.95), weight_decay=0.1)
    saved = json.loads(json.dumps(group_hyperparameters(saved_from)))
    assert saved[0]["lr"] == pytest.approx(0.01) and saved[1]["lr"] == 0.02
    assert saved[1]["weight_decay"] == 0.0
    c, d = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    lr = torch.tensor(0.5)
    target = torch.optim.AdamW([{"params": [c], "lr": lr}, {"params": [d]}], lr=0.5, foreach=False)
    check_groups(saved, target)
    restore_hyperparameters(saved, target)
    first, second = target.param_groups
    assert first["lr"] is lr and lr.item() == pytest.approx(0.01)  # a tensor lr is filled in place
    assert first["betas"] == (0.8, 0.95) and isinstance(first["betas"], tuple)
    assert second["lr"] == 0.02 and second["weight_decay"] == 0.0
    assert first["foreach"] is False  # implementation flags stay this engine's
    saved[0]["betas"] = [0.9, 0.99]  # a plain JSON list (a DeepSpeed import's): a tuple in the group again
    restore_hyperparameters(saved, target)
    assert first["betas"] == (0.9, 0.99) and isinstance(first["betas"], tuple)
    with pytest.raises(CheckpointError, match="has 2 parameter groups, this engine's has 1"):
        check_groups(saved, torch.optim.AdamW([c]))


def test_a_tensor_hyperparameter_comes_back_whole():
    """A group's vector hyperparameter (a custom optimizer's per-group tensor) is saved and restored as the tensor it
    was; only a scalar tensor is filled in place from a saved number."""
    saved = json.loads(json.dumps(group_hyperparameters(torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(2))], "scale": torch.tensor([1.0, 2.0])}], lr=0.1))))
    target = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "scale": torch.tensor([5.0, 6.0])}],
                             lr=0.1)
    restore_hyperparameters(saved, target)
    assert torch.equal(target.param_groups[0]["scale"], torch.tensor([1.0, 2.0]))
