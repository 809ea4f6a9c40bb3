"""The batch-size triple: train_batch_size = micro batch x accumulation steps x data-parallel size.

As in DeepSpeed, at least `train_batch_size` or `train_micro_batch_size_per_gpu` must be
given; the missing ones are derived and must come out as whole numbers:

=========================  ===========================================================
given                      derived
=========================  ===========================================================
all three                  checked: tbs == micro * accumulation * dp
tbs, micro                 accumulation = tbs / (micro * dp)
tbs, accumulation          micro = tbs / (accumulation * dp)
micro, accumulation        tbs = micro * accumulation * dp
tbs                        accumulation = 1, micro = tbs / dp
micro                      accumulation = 1, tbs = micro * dp
accumulation only, none    error naming the keys to add
=========================  ===========================================================
"""
from __future__ import annotations

from typing import Optional

from .base import ConfigError

__all__ = ["resolve_batch_triple", "check_batch_partial", "TBS", "MICRO", "GAS"]

TBS = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


def _check_positive(values: dict[str, Optional[int]]) -> None:
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected a positive integer, got {value!r}", key=key)
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}", key=key)


def _values(tbs, micro, gas) -> str:
    def show(value):
        return "(not set)" if value is None else value

    return f"{TBS}={show(tbs)}, {MICRO}={show(micro)}, {GAS}={show(gas)}"


def check_batch_partial(tbs: Optional[int], micro: Optional[int], gas: Optional[int],
                        dp_world_size: Optional[int] = None) -> None:
    """Checks that hold for any data-parallel size: positive values, and micro x accumulation dividing tbs.

    The error names all three values, and `dp_world_size` when the caller knows it.
    """
    _check_positive({TBS: tbs, MICRO: micro, GAS: gas})
    if tbs is None:
        return
    per_rank = (micro or 1) * (gas or 1)
    if tbs % per_rank:
        dp = f"dp_world_size={dp_world_size}" if dp_world_size is not None else "dp_world_size not known yet"
        raise ConfigError(f"impossible batch sizes: {_values(tbs, micro, gas)} ({dp}): {TBS} must equal "
                          f"{MICRO} x {GAS} x dp_world_size, but {tbs} is not divisible by {per_rank} "
                          f"({MICRO} x {GAS}, an unset one counting as 1), so no data-parallel size fits",
                          key=TBS)


def resolve_batch_triple(tbs: Optional[int], micro: Optional[int], gas: Optional[int],
                         dp_world_size: int) -> tuple[int, int, int]:
    """(train_batch_size, micro batch per rank, accumulation steps), all ints; ConfigError if impossible."""
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ConfigError(f"dp_world_size must be a positive integer, got {dp_world_size!r}", key="dp_world_size")
    _check_positive({TBS: tbs, MICRO: micro, GAS: gas})
    dp = dp_world_size

    def exact(numerator: int, denominator: int, derived: str) -> int:
        if numerator % denominator:
            raise ConfigError(f"cannot derive {derived}: {_values(tbs, micro, gas)} with dp_world_size={dp} do not "
                              f"divide exactly ({numerator} / {denominator}); {TBS} must equal "
                              f"{MICRO} x {GAS} x dp_world_size", key=derived)
        return numerator // denominator

    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * dp:
            raise ConfigError(f"inconsistent batch sizes: {_values(tbs, micro, gas)} with dp_world_size={dp}: "
                              f"{micro} x {gas} x {dp} = {micro * gas * dp}, not {tbs}", key=TBS)
        return tbs, micro, gas
    if tbs is not None and micro is not None:
        return tbs, micro, exact(tbs, micro * dp, GAS)
    if tbs is not None and gas is not None:
        return tbs, exact(tbs, gas * dp, MICRO), gas
    if micro is not None:
        gas = gas if gas is not None else 1
        return micro * gas * dp, micro, gas
    if tbs is not None:
        return tbs, exact(tbs, dp, MICRO), 1
    if gas is not None:
        raise ConfigError(f"{GAS}={gas} alone does not fix the batch size; add {TBS} or {MICRO}", key=TBS)
    raise ConfigError(f"no batch size given: set {TBS} or {MICRO} (or both); "
                      f"'auto' counts as not set", key=TBS)
