"""zerotrain: ZeRO-sharded training of PyTorch models too large for one device.

`zerotrain.initialize` mirrors `deepspeed.initialize`, so an existing DeepSpeed
training loop ports by changing its import.
"""
from __future__ import annotations

from .initialize import initialize

__version__ = "0.1.0"

__all__ = ["initialize", "__version__"]
