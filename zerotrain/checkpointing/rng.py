"""Named random-number-generator states, so tensor-parallel dropout differs per rank yet replays exactly.

DeepSpeed/Megatron call it `CudaRNGStatesTracker`: besides the default generator (seeded alike on
every tensor-parallel rank, for dropout outside tensor-parallel regions), the tracker keeps named
states; `with tracker.fork():` runs its body on the "model-parallel-rng" state (seeded per
tensor-parallel rank, for dropout inside a tensor-parallel region) and advances that state, not the
default one. Activation checkpointing snapshots every tracked state at a checkpoint's forward and
restores it for the recompute, so the recomputed dropout masks equal the forward's.

Device-agnostic: the states are those of the accelerator's default generator when there is one
(CUDA here), else of the CPU generator (where CPU dropout draws from).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from .settings import settings as _state

__all__ = ["RNGStatesTracker", "CudaRNGStatesTracker", "get_rng_tracker", "get_cuda_rng_tracker",
           "model_parallel_manual_seed", "model_parallel_cuda_manual_seed", "MODEL_PARALLEL_RNG", "rng_device_type"]

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's and Megatron's name
_TP_SEED_OFFSET = 2718  # DeepSpeed's offset: the tensor-parallel seed is seed + 2718 + tp_rank


def rng_device_type() -> str:
    """The device type whose default generator dropout draws from: the accelerator's, else "cpu"."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator().type
    return "cpu"


def _get_state(device_type: str) -> torch.Tensor:
    if device_type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device_type).get_rng_state()


def _set_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device_type).set_rng_state(state)


def _seed(device_type: str, seed: int) -> None:
    if device_type == "cpu":
        torch.random.default_generator.manual_seed(seed)
    else:
        torch.get_device_module(device_type).manual_seed(seed)


class RNGStatesTracker:
    """Named generator states of one device type (see module docstring)."""

    def __init__(self, device_type: Optional[str] = None):
        self.device_type = device_type or rng_device_type()
        self.states: dict[str, torch.Tensor] = {}
        self.seeds: set[int] = set()

    def reset(self) -> None:
        self.states.clear()
        self.seeds.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (what checkpointing snapshots at a forward)."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name` started from `seed` (the default generator is left as it was)."""
        if seed in self.seeds:
            raise ValueError(f"RNG tracker: seed {seed} already exists")
        if name in self.states:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds.add(seed)
        current = _get_state(self.device_type)
        _seed(self.device_type, seed)
        self.states[name] = _get_state(self.device_type)
        _set_state(self.device_type, current)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the body on state `name`, advance it, and give the default generator back unchanged."""
        if name not in self.states:
            raise KeyError(f"RNG tracker: state {name!r} is not added (call model_parallel_manual_seed first)")
        current = _get_state(self.device_type)
        _set_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device_type)
            _set_state(self.device_type, current)


CudaRNGStatesTracker = RNGStatesTracker  # DeepSpeed's name (not CUDA-only here)

_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (DeepSpeed: `get_cuda_rng_tracker`)."""
    if _TRACKER.device_type != rng_device_type() and not _TRACKER.states:
        _TRACKER.device_type = rng_device_type()
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_manual_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Seed the default generator with `seed` (the same on every tensor-parallel rank) and track
    "model-parallel-rng" from `seed + 2718 + tp_rank` (DeepSpeed's `model_parallel_cuda_manual_seed`).

    `tp_rank` defaults to the tensor-parallel rank given to `zerotrain.checkpointing.configure`, else 0.
    """
    if tp_rank is None:
        tp_rank = _state.tp_rank()
    tracker = get_rng_tracker()
    tracker.reset()
    _seed(tracker.device_type, seed)
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


model_parallel_cuda_manual_seed = model_parallel_manual_seed
