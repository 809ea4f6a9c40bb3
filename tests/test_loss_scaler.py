"""The fp16 loss scaler (zerotrain.precision.LossScaler) follows DeepSpeed's DynamicLossScaler rules."""
from __future__ import annotations

from zerotrain.config import load_config
import pytest

from zerotrain.precision import LossScaleError, LossScaler


def scaler(**fp16) -> LossScaler:
    return LossScaler.from_config(load_config({"train_batch_size": 8, "fp16": dict(enabled=True, **fp16)}).fp16)


def scales_after(s: LossScaler, overflows: str) -> list[float]:
    """Feed a pattern ("x" overflow, "." clean step); return the scale after each update."""
    out = []
    for mark in overflows:
        s.update(mark == "x")
        out.append(s.scale)
    return out


def test_from_config_dynamic_and_disabled():
    s = scaler(initial_scale_power=5, loss_scale_window=7, hysteresis=3, min_loss_scale=0.5)
    assert (s.scale, s.dynamic, s.window, s.hysteresis, s.hysteresis_left, s.min_scale) == (32.0, True, 7, 3, 3, 0.5)
    off = LossScaler.from_config(load_config({"train_batch_size": 8}).fp16)
    assert (off.scale, off.dynamic) == (1.0, False)


def test_hysteresis_lowers_only_after_that_many_overflows():
    """hysteresis=3: two overflows are absorbed, the third halves; later ones halve each time."""
    s = scaler(initial_scale_power=10, hysteresis=3, loss_scale_window=1000)
    assert scales_after(s, "xxxx") == [1024.0, 1024.0, 512.0, 256.0]


def test_hysteresis_is_not_reset_by_clean_steps_unless_consecutive():
    """DeepSpeed: a clean step refills the hysteresis only with consecutive_hysteresis (or at a doubling)."""
    plain = scaler(initial_scale_power=10, hysteresis=2, loss_scale_window=1000)
    assert scales_after(plain, "x.x") == [1024.0, 1024.0, 512.0]
    consecutive = scaler(initial_scale_power=10, hysteresis=2, loss_scale_window=1000, consecutive_hysteresis=True)
    assert scales_after(consecutive, "x.x.x") == [1024.0] * 5
    assert scales_after(consecutive, ".xx") == [1024.0, 1024.0, 512.0]  # two in a row: lowered


def test_window_doubles_after_clean_steps():
    """The scale doubles after every loss_scale_window clean steps since the start or the last overflow."""
    s = scaler(initial_scale_power=4, hysteresis=1, loss_scale_window=3)
    assert scales_after(s, "......") == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0]
    # An overflow halves and restarts the window count.
    assert scales_after(s, "x...") == [32.0, 32.0, 32.0, 64.0]


def test_doubling_refills_hysteresis():
    s = scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    assert scales_after(s, "x..") == [16.0, 16.0, 32.0]  # absorbed, then one window of clean steps
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


def test_state_dict_round_trips():
    s = scaler(initial_scale_power=6, hysteresis=2, loss_scale_window=4)
    scales_after(s, "x..x.")
    again = scaler(initial_scale_power=6, hysteresis=2, loss_scale_window=4)
    again.load_state_dict(s.state_dict())
    assert scales_after(again, "...x") == scales_after(s, "...x")
