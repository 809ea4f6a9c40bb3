"""zerotrain: ZeRO-sharded training of PyTorch models too large for one device.

`zerotrain.initialize` mirrors `deepspeed.initialize`, so an existing DeepSpeed
training loop ports by changing its import.
"""
from __future__ import annotations

import argparse

from . import accelerator, checkpointing, compression, dist, moe, ops, pipe, runtime, utils  # DeepSpeed's paths (port.paths)
from .dist import init_distributed
from .initialize import initialize
from .pretrained import from_pretrained
from .version import __version__

__all__ = ["initialize", "init_distributed", "add_config_arguments", "from_pretrained", "dist", "accelerator", "checkpointing",
           "compression", "moe", "ops", "pipe", "runtime", "utils", "__version__"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed`, `--deepspeed_config` (and its deprecated `--deepscale*`) and our own
    `--zerotrain_config` to `parser`; `initialize(args=parser.parse_args(), ...)` reads the config path."""
    group = parser.add_argument_group("zerotrain", "zerotrain (DeepSpeed-compatible) configuration")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed-style training (a flag for the script; zerotrain ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed-style JSON config file")
    group.add_argument("--zerotrain_config", default=None, type=str,
                       help="zerotrain JSON config file (the same format as --deepspeed_config)")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
