"""The accelerator object (`deepspeed.accelerator.real_accelerator`'s names): one per process, CUDA or CPU."""
from __future__ import annotations

import os
from typing import Any, Optional, Union

import torch

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]


class Accelerator:
    """DeepSpeed's accelerator interface over torch, for `device_type` "cuda" or "cpu"."""

    def __init__(self, device_type: Optional[str] = None):
        self._name = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if self._name not in ("cuda", "cpu"):
            raise ValueError(f"zerotrain.accelerator: device type {self._name!r} is not supported (cuda or cpu)")
        self._cuda = self._name == "cuda"

    # --- the device ----------------------------------------------------------
    def device_name(self, device_index: Optional[int] = None) -> str:
        """"cuda" / "cuda:N", or "cpu" (DeepSpeed's CPU accelerator ignores the index too)."""
        if self._cuda and device_index is not None:
            return f"cuda:{device_index}"
        return self._name

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: Optional[int] = None) -> Any:
        """A context manager selecting the device (torch.cuda.device); None on the CPU, as DeepSpeed's."""
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    # --- random numbers ------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        (torch.cuda.manual_seed if self._cuda else torch.manual_seed)(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def seed(self) -> None:
        (torch.cuda.seed if self._cuda else torch.seed)()

    def get_rng_state(self, device_index: Optional[int] = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    @property
    def default_generator(self) -> Any:
        return (lambda index: torch.cuda.default_generators[index]) if self._cuda else \
            (lambda index: torch.default_generator)

    # --- memory --------------------------------------------------------------
    def _memory(self, name: str, device_index: Optional[Union[int, torch.device]] = None) -> int:
        return int(getattr(torch.cuda, name)(device_index)) if self._cuda else 0

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return self._memory("memory_allocated", device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return self._memory("max_memory_allocated", device_index)

    def memory_reserved(self, device_index: Optional[int] = None) -> int:
        return self._memory("memory_reserved", device_index)

    def max_memory_reserved(self, device_index: Optional[int] = None) -> int:
        return self._memory("max_memory_reserved", device_index)

    def total_memory(self, device_index: Optional[int] = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    # --- tensor types (Megatron's get_accelerator().FloatTensor(...)) --------
    def _tensor(self, dtype: torch.dtype):
        device = self._name

        def make(*args: Any) -> torch.Tensor:
            if len(args) == 1 and not isinstance(args[0], int):
                return torch.as_tensor(args[0], dtype=dtype, device=device)
            return torch.empty(*args, dtype=dtype, device=device)
        return make

    @property
    def FloatTensor(self):  # noqa: N802 (DeepSpeed's names)
        return self._tensor(torch.float32)

    @property
    def HalfTensor(self):  # noqa: N802
        return self._tensor(torch.float16)

    @property
    def BFloat16Tensor(self):  # noqa: N802
        return self._tensor(torch.bfloat16)

    @property
    def DoubleTensor(self):  # noqa: N802
        return self._tensor(torch.float64)

    @property
    def LongTensor(self):  # noqa: N802
        return self._tensor(torch.int64)

    @property
    def IntTensor(self):  # noqa: N802
        return self._tensor(torch.int32)

    @property
    def ByteTensor(self):  # noqa: N802
        return self._tensor(torch.uint8)

    @property
    def BoolTensor(self):  # noqa: N802
        return self._tensor(torch.bool)

    def __repr__(self) -> str:
        return f"zerotrain.accelerator.Accelerator({self._name!r})"


_accelerator: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """This process's accelerator: CUDA when torch sees a GPU, else the CPU (DS_ACCELERATOR=cpu|cuda forces one)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator(os.environ.get("DS_ACCELERATOR") or None)
    return _accelerator


def set_accelerator(accelerator: Accelerator) -> None:
    """Replace this process's accelerator (DeepSpeed's `set_accelerator`)."""
    global _accelerator
    _accelerator = accelerator
