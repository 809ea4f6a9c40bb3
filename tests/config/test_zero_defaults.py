"""The `zero_optimization` block's defaults are DeepSpeed 0.19's own (its pydantic models, by field name or alias).

The project's rule: defaults are DeepSpeed's. Each key both schemas know is compared with DeepSpeed's default; the
differences are listed here with their reason, so a default that drifts (or a new key with another default) fails.
"""
from __future__ import annotations

import importlib.util

import pytest

from zerotrain.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

# key -> why zerotrain's default differs from DeepSpeed's
DIFFERENT = {
    # docs/configuration.md: page-locked buffers help GPU runs only and take memory the OS cannot swap
    "zero_optimization.offload_param.pin_memory": "not pinned unless asked",
    "zero_optimization.offload_optimizer.pin_memory": "not pinned unless asked",
}


def _defaults(model) -> dict:
    out = {}
    for name, field in model.model_fields.items():
        if field.default_factory is None:
            out[name] = field.default
            if field.alias:
                out[field.alias] = field.default
    return out


@pytest.mark.parametrize("ours, theirs, prefix", [
    (ZeroConfig, "deepspeed.runtime.zero.config:DeepSpeedZeroConfig", "zero_optimization"),
    (OffloadParamConfig, "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig",
     "zero_optimization.offload_param"),
    (OffloadOptimizerConfig, "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig",
     "zero_optimization.offload_optimizer"),
])
def test_defaults_are_deepspeeds(ours, theirs, prefix):
    module, _, name = theirs.partition(":")
    deepspeed_defaults = _defaults(getattr(importlib.import_module(module), name))
    compared = 0
    for key, value in _defaults(ours).items():
        if key not in deepspeed_defaults:
            continue  # zerotrain's own key
        compared += 1
        if f"{prefix}.{key}" in DIFFERENT:
            assert value != deepspeed_defaults[key], f"{prefix}.{key} is DeepSpeed's default again: drop it from DIFFERENT"
            continue
        assert value == deepspeed_defaults[key], f"{prefix}.{key}: ours {value!r}, DeepSpeed's {deepspeed_defaults[key]!r}"
    assert compared >= 5
