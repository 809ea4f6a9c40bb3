"""`zerotrain.compression`: only `helper` (DeepSpeed 0.19.8 keeps `deepspeed.compression.helper` as a
deprecated shim over `deepspeed.utils.module_utils`; its compression library itself is gone)."""
from . import helper

__all__ = ["helper"]
