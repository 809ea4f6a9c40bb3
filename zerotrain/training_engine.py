"""`TrainingEngine`: the engine as a training loop sees it, the one interface trainers are written against.

`zerotrain.trainer.Trainer` and the embedding trainer (`zerotrain.embedding`) drive an engine only through
the members declared here; they never import the engine, read its parts or probe it by name. The
engine `zerotrain.initialize` returns has every member (`tests/test_architecture.py` checks that no
trainer probes the engine with `getattr`/`hasattr`, and `tests/test_training_engine.py` that the engine
has every member), so anything written against this Protocol (the Hugging Face Trainer subclass, a
pipeline engine) runs on it.

Optional capabilities are real members with neutral defaults (no grad norm, no timers, no background
save, no communication counted, no sequence parallelism): a stand-in engine for tests or another engine
subclasses the Protocol to inherit them, and a trainer calls them without asking first. The module
imports nothing at run time beyond the standard library (the types are for checkers only), so depending
on it costs nothing.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Optional, Protocol

if TYPE_CHECKING:  # types only: importing this module stays free
    import torch

    from zerotrain.comm import CommCounters
    from zerotrain.config import ZeroTrainConfig
    from zerotrain.monitor.memory_timeline import MemoryTimeline
    from zerotrain.parallel.sequence import SequenceParallel
    from zerotrain.topology import Topology

__all__ = ["TrainingEngine"]


class TrainingEngine(Protocol):
    """What a training loop calls on the engine: DeepSpeed's step API plus what the loop reports.

    Required: the forward (``engine(x, y) -> (logits, loss)`` for the built-in GPT, ``engine(**batch)`` a
    Hugging Face output), ``backward``/``step`` per micro-batch (``step`` applies the update at the
    accumulation boundary), the batch triple, the learning rate, the step and sample counters, the config,
    the topology (rank, data-parallel size and group, device) and checkpoint saving.
    """

    config: ZeroTrainConfig  # steps_per_print, precision, the monitor blocks
    topology: Topology  # rank, data_parallel_size, dp_group, tp_size, world_size, device
    module: Any  # the model (its parameter count for MFU)
    global_steps: int  # optimizer steps taken (a resumed engine starts where it was)
    global_samples: int  # samples consumed by those steps, over all data-parallel ranks
    # bytes sent in the library's collectives since the engine was built; None: not counted
    counters: Optional[CommCounters] = None
    # Ulysses sequence parallelism: each rank runs `sequence_parallel.shard(batch)`; None: off
    sequence_parallel: Optional[SequenceParallel] = None
    loss_scale: float = 1.0  # the fp16 loss scale (reported only under fp16)

    # -- the step -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward through the engine."""
        ...

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any:
        """Back-propagate one micro-batch's loss (scaled by 1 / gradient_accumulation_steps unless
        `scale_wrt_gas=False`, as DeepSpeed's)."""
        ...

    def step(self) -> None:
        """End one micro-step; at the accumulation boundary, the optimizer step."""
        ...

    def gradient_accumulation_steps(self) -> int:
        ...

    def train_micro_batch_size_per_gpu(self) -> int:
        ...

    def train_batch_size(self) -> int:
        ...

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group for the next update."""
        ...

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the next backward/step ends an accumulation cycle (DeepSpeed's; a loop that counts its own
        micro-batches, as the Hugging Face Trainer does)."""
        ...

    def was_step_applied(self) -> bool:
        """Whether the last boundary `step()` updated the weights (False when fp16 overflowed and it skipped)."""
        ...

    # -- DeepSpeed's accessors ------------------------------------------------------------

    def zero_optimization_stage(self) -> int:
        ...

    def bfloat16_enabled(self) -> bool:
        ...

    def fp16_enabled(self) -> bool:
        ...

    # -- the model's weights --------------------------------------------------------------

    def full_state_dict(self, trainable_only: bool = False) -> dict:
        """Full fp32 weights on CPU by parameter name, on global rank 0 ({} elsewhere); collective."""
        ...

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The weights in the training dtype, gathered whole on global rank 0 (DeepSpeed's); collective."""
        ...

    # -- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None) -> Optional[str]:
        """Save (every rank); the checkpoint's path, None when the save failed and the config says go on."""
        ...

    def wait_checkpoint(self) -> None:
        """Block until a background save has committed (or raise its error); nothing to do by default."""

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> Any:
        """Load a checkpoint (every rank); (path, client_state)."""
        ...

    def last_save(self) -> tuple[bool, Optional[float]]:
        """(still being written in the background, seconds training paused for it) of the latest save."""
        return False, None

    # -- the run's lifecycle (zerotrain.run) ----------------------------------------------

    def claim_save_dir(self, save_dir: str) -> None:
        """Take `save_dir` for this job (one job per save directory), before training; collective."""

    def close(self) -> None:
        """Commit pending saves and release the engine's threads and files (the end of a run)."""

    # -- modes and optional reports -------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where this rank's batches go."""
        return self.topology.device

    @property
    def training(self) -> bool:
        """The model's training mode (False after ``eval()``)."""
        return True

    def train(self, mode: bool = True) -> Any:
        """Training mode on (dropout active); no mode to switch by default."""
        return self

    def eval(self) -> Any:
        """Evaluation mode; no mode to switch by default."""
        return self

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last step (before clipping); None: not measured."""
        return None

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds per phase of the last step (``wall_clock_breakdown``); none by default."""
        return {}

    def offload_stats(self) -> dict:
        """Offload counters for the step record (speculative steps, rollbacks, NVMe bytes); none by default."""
        return {}

    def progress_printing(self, enabled: bool) -> ContextManager[Any]:
        """A context in which the engine's own ``steps_per_print`` lines are on or off (a loop that reports
        its own turns them off)."""
        return contextlib.nullcontext()

    def watch_memory(self, timeline: Optional[MemoryTimeline]) -> None:
        """Mark the engine's phase boundaries in `timeline` (None: stop); nothing to mark by default."""
