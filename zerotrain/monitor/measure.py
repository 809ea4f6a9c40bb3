"""What a step's record measures beyond the loss: memory of this rank, the device's peak FLOP/s, the
model's parameter count (for MFU).

Peak FLOP/s are the vendors' dense tensor-core figures for bf16/fp16; fp32 training and unknown devices
(CPUs included) have no known peak, so no MFU is reported, unless `ZEROTRAIN_PEAK_TFLOPS` names the
peak per device in TFLOP/s.
"""
from __future__ import annotations

import os
import resource
import sys
from typing import Optional

import torch

__all__ = ["memory_bytes", "memory_kind", "peak_flops", "parameter_count", "PEAK_TFLOPS_ENV"]

PEAK_TFLOPS_ENV = "ZEROTRAIN_PEAK_TFLOPS"

# Dense bf16/fp16 tensor-core TFLOP/s by a substring of torch.cuda.get_device_name(), most specific first
# (vendor data sheets; SXM figures where a part comes in several forms).
_PEAK_TFLOPS_16BIT = (
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4),
    ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0), ("A10G", 125.0),
    ("A10", 125.0), ("L4", 121.0), ("V100", 125.0), ("MI300X", 1307.4), ("MI250X", 383.0),
)


def memory_kind(device: torch.device) -> str:
    """What `memory_bytes` measures on `device`."""
    return "cuda_max_allocated" if device.type == "cuda" else "peak_rss"


def memory_bytes(device: torch.device) -> int:
    """This process's memory high-water mark: CUDA's max allocated bytes on a GPU, peak RSS otherwise."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """The device's peak FLOP/s for `precision` ("bf16", "fp16", "fp32"), or None when not known."""
    override = os.environ.get(PEAK_TFLOPS_ENV)
    if override:
        try:
            return float(override) * 1e12
        except ValueError:
            raise ValueError(f"{PEAK_TFLOPS_ENV}={override!r} is not a number (TFLOP/s per device)") from None
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    for part, tflops in _PEAK_TFLOPS_16BIT:
        if part in name:
            return tflops * 1e12
    return None


def parameter_count(module: torch.nn.Module) -> int:
    """Parameters of the whole model, also when ZeRO-3 holds only shards (`ds_numel` is the full size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())
