"""config.base in-process: which DeepSpeed-only values warn, warnings silenced for a launcher, and the rank that warns."""
from __future__ import annotations

import warnings

import pytest

from zerotrain.config import ConfigWarning, load_config
from zerotrain.config.base import job_rank, quiet_warnings

BASE = {"train_batch_size": 8}


def _config_warnings(config: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# DeepSpeed-only key -> (where it goes, DeepSpeed's default: what zerotrain does anyway, another value)
DEEPSPEED_ONLY = {
    "gradient_predivide_factor": ("", 1.0, 2.0),
    "gradient_allreduce_op": ("", "mean", "sum"),
    "managed_gradient_accumulation": ("", True, False),
    "fp32_optimizer_states": ("optimizer.params", True, False),
    "set_grad_none": ("optimizer.params", True, False),
}


@pytest.mark.parametrize("key", sorted(DEEPSPEED_ONLY))
def test_a_deepspeed_only_key_warns_unless_it_says_what_zerotrain_does_anyway(key):
    where, same, other = DEEPSPEED_ONLY[key]
    path = f"{where}.{key}" if where else key

    def config(value):
        if not where:
            return dict(BASE, **{key: value})
        return dict(BASE, optimizer={"type": "AdamW", "params": {key: value}})

    assert not [m for m in _config_warnings(config(same)) if path in m]
    said = [m for m in _config_warnings(config(other)) if path in m]
    assert len(said) == 1 and "zerotrain does not implement; it is ignored" in said[0], said


def test_quiet_warnings_silences_config_warnings_inside_the_block_only():
    noisy = dict(BASE, gradient_predivide_factor=2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_warnings():
            load_config(noisy)
    assert not [w for w in caught if issubclass(w.category, ConfigWarning)]
    assert _config_warnings(noisy)


def test_rank_0_alone_warns_and_a_bad_rank_variable_counts_as_rank_0(monkeypatch):
    noisy = dict(BASE, gradient_predivide_factor=2.0)
    monkeypatch.setenv("RANK", "1")
    assert job_rank() == 1 and not _config_warnings(noisy)
    monkeypatch.setenv("RANK", "not-a-number")
    assert job_rank() == 0 and _config_warnings(noisy)
