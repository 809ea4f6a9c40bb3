"""build_optimizer: the config's optimizer block as a torch optimizer."""
import pytest
import torch

from zerotrain.config import ConfigError, load_config
from zerotrain.optim import build_optimizer


def opt_cfg(type_="AdamW", **params):
    return load_config({"train_batch_size": 1, "optimizer": {"type": type_, "params": params}}).optimizer


def tensors(dtype=torch.float32):
    torch.manual_seed(0)
    return [torch.randn(300, dtype=dtype, requires_grad=True), torch.randn(7, 11, dtype=dtype, requires_grad=True)]


def test_no_optimizer_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer: no optimizer given in the config and none passed to initialize"):
        build_optimizer(None, [{"params": tensors()}])


@pytest.mark.parametrize("type_, params, cls, weight_decay", [
    ("Adam", {}, torch.optim.AdamW, 0.0),  # DeepSpeed's FusedAdam / DeepSpeedCPUAdam: tests/test_optim_defaults.py
    ("AdamW", {}, torch.optim.AdamW, 0.0),
    ("AdamW", {"torch_adam": True}, torch.optim.AdamW, 0.01),  # torch's own AdamW, as DeepSpeed builds it
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam, 0.0),
    ("SGD", {}, torch.optim.SGD, 0.0),
])
def test_type_and_torch_defaults(type_, params, cls, weight_decay):
    opt = build_optimizer(opt_cfg(type_, **params), [{"params": tensors()}])
    assert type(opt) is cls
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["weight_decay"] == weight_decay
    if cls is not torch.optim.SGD:
        assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8


def test_params_and_group_overrides():
    a, b = tensors()
    opt = build_optimizer(opt_cfg("AdamW", lr=0.1, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.0, amsgrad=True),
                          [{"params": [a]}, {"params": [b], "lr": 0.5, "weight_decay": 0.2}])
    first, second = opt.param_groups
    assert (first["lr"], first["betas"], first["eps"], first["weight_decay"], first["amsgrad"]) == \
           (0.1, (0.8, 0.9), 1e-6, 0.0, True)
    assert (second["lr"], second["weight_decay"]) == (0.5, 0.2)
    sgd = build_optimizer(opt_cfg("SGD", lr=0.3, momentum=0.9, nesterov=True, weight_decay=1e-4), [a, b])
    group = sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"], group["weight_decay"]) == (0.3, 0.9, True, 1e-4)


def test_fused_by_default_on_cpu_unless_turned_off():
    assert build_optimizer(opt_cfg("AdamW"), [{"params": tensors()}]).defaults["fused"] is True
    assert not build_optimizer(opt_cfg("AdamW", fused=False), [{"params": tensors()}]).defaults["fused"]
    assert build_optimizer(opt_cfg("Adam", adam_w_mode=False), [{"params": tensors()}]).defaults["fused"] is True


def test_fused_true_on_unsupported_params_names_the_key():
    ints = [torch.zeros(3, dtype=torch.int64)]
    assert not build_optimizer(opt_cfg("AdamW"), [{"params": [torch.zeros(3, device="meta")]}]).defaults["fused"]
    with pytest.raises(ConfigError, match="optimizer.params.fused"):
        build_optimizer(opt_cfg("AdamW", fused=True), [{"params": ints}])


def _train(opt_type, fused, dtype, extra=None, steps=8):
    params = tensors(dtype)
    torch.manual_seed(1)
    grads = [[torch.randn_like(p) for p in params] for _ in range(steps)]
    opt = build_optimizer(opt_cfg(opt_type, lr=1e-2, weight_decay=0.1, fused=fused, **(extra or {})),
                          [{"params": params}])
    assert bool(opt.defaults.get("fused")) is fused
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("opt_type, extra", [("AdamW", None), ("Adam", {"adam_w_mode": False}),
                                             ("AdamW", {"amsgrad": True})])
def test_fused_matches_default_implementation(opt_type, extra):
    for dtype in (torch.float32, torch.float64):
        fused = _train(opt_type, True, dtype, extra)
        plain = _train(opt_type, False, dtype, extra)
        for f, p in zip(fused, plain):
            assert ((f - p).norm() / p.norm()).item() <= 1e-6
            torch.testing.assert_close(f, p, rtol=1e-6, atol=1e-7 if dtype == torch.float32 else 0.0)
