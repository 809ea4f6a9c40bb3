"""The fp16 loss scaler (zerotrain.precision.LossScaler) follows DeepSpeed's DynamicLossScaler: checked against
DeepSpeed's own class (the `dev` extra installs deepspeed; it runs on CPU) on the same overflow sequences."""
from __future__ import annotations

import types

import pytest

from zerotrain.config import load_config
from zerotrain.precision import LossScaleError, LossScaler


def scaler(**fp16) -> LossScaler:
    return LossScaler.from_config(load_config({"train_batch_size": 8, "fp16": dict(enabled=True, **fp16)}).fp16)


def scales_after(s: LossScaler, overflows: str, until_raise: bool = False) -> list:
    """Feed a pattern ("x" overflow, "." clean step); return the scale after each update (with `until_raise`,
    "raised" ends the list where the update raised at the minimum scale)."""
    out = []
    for mark in overflows:
        try:
            s.update(mark == "x")
        except LossScaleError:
            if not until_raise:
                raise
            return out + ["raised"]
        out.append(s.scale)
    return out


def test_from_config_dynamic_and_disabled():
    s = scaler(initial_scale_power=5, loss_scale_window=7, hysteresis=3, min_loss_scale=0.5)
    assert (s.scale, s.dynamic, s.window, s.hysteresis, s.hysteresis_left, s.min_scale) == (32.0, True, 7, 3, 3, 0.5)
    off = LossScaler.from_config(load_config({"train_batch_size": 8}).fp16)
    assert (off.scale, off.dynamic) == (1.0, False)


def deepspeed_scales(overflows: str, power: int, window: int, hysteresis: int, consecutive: bool,
                     minimum: float) -> list:
    """DeepSpeed's own DynamicLossScaler (what its ZeRO optimizers use, raising at the minimum scale as its engine
    sets it up) on the same overflow pattern; "raised" where it raised."""
    from deepspeed.runtime.fp16 import loss_scaler  # the dev extra has it: fails, never skips
    reference = loss_scaler.DynamicLossScaler(init_scale=2.0 ** power, scale_window=window, min_scale=minimum,
                                              delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                              raise_error_at_min_scale=True)
    out = []
    for mark in overflows:
        try:
            reference.update_scale(mark == "x")
        except Exception:  # noqa: BLE001 - DeepSpeed raises a plain Exception at the minimum scale
            return out + ["raised"]
        out.append(reference.cur_scale)
    return out


@pytest.fixture
def deepspeed_logging_rank(monkeypatch):
    """DeepSpeed's scaler asks deepspeed.comm for the rank only to decide who logs an overflow; it is not about
    collectives, so without a process group it is rank 0."""
    from deepspeed.runtime.fp16 import loss_scaler  # the dev extra has it: fails, never skips
    monkeypatch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))


PATTERNS = ["xxxx", "x.x", "x.x.x", ".xx", "......", "x...", "x..", "x..x.", ".xx...", "xxxxx", "..x.....x..xx.......",
            "".join("x" if (i * 7) % 11 < 3 else "." for i in range(60))]


@pytest.mark.parametrize("window,hysteresis,consecutive", [(1000, 3, False), (1000, 2, True), (3, 1, False),
                                                          (2, 2, False), (2, 2, True), (1, 2, False), (4, 3, True)])
def test_scale_sequence_equals_deepspeeds_dynamic_loss_scaler(deepspeed_logging_rank, window, hysteresis,
                                                              consecutive):
    for pattern in PATTERNS:
        for power, minimum in ((10, 1.0), (3, 2.0)):
            fp16 = dict(initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                        consecutive_hysteresis=consecutive, min_loss_scale=minimum)
            want = deepspeed_scales(pattern, power, window, hysteresis, consecutive, minimum)
            assert scales_after(scaler(**fp16), pattern, until_raise=True) == want, (pattern, fp16)


def test_window_doubles_on_the_clean_step_after_a_full_window():
    """The hand-derived case (DeepSpeed: the (window + 1)-th clean step since the start or the last overflow)."""
    s = scaler(initial_scale_power=4, hysteresis=1, loss_scale_window=3)
    assert scales_after(s, ".......") == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0]
    assert scales_after(s, "x....") == [32.0, 32.0, 32.0, 32.0, 64.0]


def test_doubling_refills_hysteresis():
    s = scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    assert scales_after(s, "x...") == [16.0, 16.0, 16.0, 32.0]  # absorbed, then a window of clean steps
    assert s.hysteresis_left == 2
    assert scales_after(s, "x") == [32.0]  # absorbed again thanks to the refill


def test_overflow_at_min_loss_scale_raises_as_deepspeed():
    """The scale halves down to min_loss_scale; the next overflow that would lower it raises (DeepSpeed's
    DynamicLossScaler with raise_error_at_min_scale, its engine's setting), after hysteresis is used up."""
    s = scaler(initial_scale_power=3, hysteresis=1, min_loss_scale=2, loss_scale_window=1000)
    assert scales_after(s, "xx") == [4.0, 2.0]
    with pytest.raises(LossScaleError, match=r"optimizer step 2 .*fp16.min_loss_scale \(2\)"):
        s.update(True)
    absorbed = scaler(initial_scale_power=1, hysteresis=2, min_loss_scale=2, loss_scale_window=1000)
    assert scales_after(absorbed, "x.") == [2.0, 2.0]  # at the floor, but hysteresis absorbs one overflow
    with pytest.raises(LossScaleError):
        absorbed.update(True)
    # A floor below the scale: halving stops at the floor without raising.
    floor = scaler(initial_scale_power=2, hysteresis=1, min_loss_scale=3, loss_scale_window=1000)
    assert scales_after(floor, "x") == [3.0]


def test_static_loss_scale_never_changes():
    s = scaler(loss_scale=128, loss_scale_window=1, hysteresis=1)
    assert not s.dynamic
    assert scales_after(s, "x.x.xx....") == [128.0] * 10
    assert s.iteration == 10
    one = scaler(loss_scale=1.0)  # a static scale of 1 (fp16 unscaled) is static too, not DeepSpeed's dynamic rule
    assert not one.dynamic and scales_after(one, "x....") == [1.0] * 5


def test_state_dict_round_trips():
    s = scaler(initial_scale_power=6, hysteresis=2, loss_scale_window=4)
    scales_after(s, "x..x.")
    again = scaler(initial_scale_power=6, hysteresis=2, loss_scale_window=4)
    again.load_state_dict(s.state_dict())
    assert scales_after(again, "...x") == scales_after(s, "...x")
