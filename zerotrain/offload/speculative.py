"""SuperOffload-style overlap: the CPU step of each bucket runs during the rest of backward.

When the reducer reports a bucket's gradient shard final (`shard_ready_callbacks`, at the
accumulation boundary), a background thread copies it to the host, unscales it by the
loss scale alone and steps that bucket's masters and states, while backward goes on with
the later buckets (torch kernels release the GIL). The step is speculative: the global
gradient norm and the overflow flag are not known yet. After backward the engine asks:

- `has_overflow()` true: every speculative update is rolled back; the step is skipped.
- `step()`: with the norm known, if clipping changes the multiplier (or the loss scale
  moved) the updates are rolled back and redone with the clipped gradients by the plain
  offload path; otherwise they stand, the device-resident buckets are stepped, and the
  weights are published.

So a run with `super_offload` computes exactly what the plain offload run computes, with
gradient clipping on (DeepSpeed turns speculation off then) and on CPU-only machines.

With zerotrain's CPU Adam kernel (groups on fused Adam/AdamW) a bucket's speculative update is
one out-of-place pass (`CpuAdamStepper.step_to`): it reads the master, the states and the reduced
gradient times 1/loss_scale (no copy, no `mul_`), writes the new master and states into the bucket's
spare buffers (non-temporal stores) and casts the new weights into the model shard (a CPU shard).
The current masters and states are not touched until `step()` keeps the update by swapping the
buffers in (`swap_in`: no copy; the master stays the same tensor object). So a rollback copies
nothing (it recasts the model shard from the unchanged master), and a committed step publishes
only the all-gather. The model shard's weights are no longer needed by the backward still running
(those gradients are final), and the engine calls `before_model_use()` before any
forward/backward, which drops pending speculative updates that wrote shards: a model used again
before `step()` sees the last step's weights.

A failing update (an exception in the background thread) on any rank is agreed on with one
all-reduce of per-rank flags at the engine's first synchronizing call of the step
(`has_overflow()` or `step()`): every rank rolls back and raises `SpeculationError` naming the
failing ranks, instead of the healthy ranks waiting out the comm timeout.

Rollback, measured (`benchmarks/offload_rollback.py`, 50M fp32 parameters, 1 thread, best of 3;
Mon Nov 23 2026, RESULTS_offload.md):

    zerotrain kernel step in place           26-35 ms
    save a copy + step in place              70-88 ms  (the speculative step until Nov 23 evening)
    step out of place (spare buffers)        48-58 ms  (now; rollback: nothing to restore)
    restore a saved copy                     44-55 ms  (only on rollback) -- bitwise exact
    invert AdamW (m, v, decoupled decay)    273-288 ms (only on rollback) -- NOT exact in fp32:
        exp_avg max rel err 3.6e-2 (44% of elements differ: m' - (1-b1) g cancels),
        param 1.2e-4, exp_avg_sq 1.6e-7

Stepping out of place is exact, moves the fewest bytes during backward (the Adam step's own 28 B per
parameter; the save copied 24 B more) and makes a rollback free. It costs host memory for one spare
set of masters and states (12 bytes per offloaded parameter with Adam), as the saved copy did.
Optimizers the kernel does not take (other types, non-fused groups) still save a copy and step in place.

Policy (`offload_optimizer.super_offload_speculation`): "adaptive" (default) speculates only when
the previous step was neither clipped nor overflowed: clipping and overflows come in runs (early
training clips every step), and a speculation that will be redone only costs. Since every step's
norm is known, speculation resumes by itself after the first step that needed no clipping.
"always" speculates every step (what the rollback tests exercise).

`stats` counts: `speculative_steps` (optimizer steps that started speculatively), `not_speculated`
(steps the adaptive policy ran without speculation),
`bucket_updates` (speculative bucket updates), `committed` (speculative steps kept),
`rollbacks` (steps rolled back), split by cause into `overflow_rollbacks`, `clip_redos`
and `other_rollbacks` (loss scale moved, the model used again before the step, a failing update),
`rollback_seconds`, and `norm_buckets_ahead` (buckets whose share of the gradient norm the background
thread summed during backward, as each gradient became final, speculating or not: `step()` then only
adds them up, in the same order, so the norm is bit for bit the one computed after backward) and
`overflow_buckets_ahead` (buckets the fp16 overflow check did not read again: a finite sum of squares
over the whole shard proves every element finite).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from ..zero.stage3.partition import Fence
from .cpu_optimizer import OffloadOptimizer, host_empty, tensor_bytes
from .partial import SubsetStepper


class _Backup:
    """One bucket's master and optimizer state as they were before its speculative update."""

    def __init__(self) -> None:
        self.master: Optional[torch.Tensor] = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.others: dict = {}
        self.fresh = True

    def save(self, master: torch.Tensor, state: Optional[dict]) -> None:
        if self.master is None:
            self.master = torch.empty_like(master)
        self.master.copy_(master)
        self.fresh = not state
        kept, self.others = {}, {}
        for key, value in (state or {}).items():
            if torch.is_tensor(value):
                buffer = self.tensors.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                    buffer = torch.empty_like(value)
                kept[key] = buffer.copy_(value)
            else:
                self.others[key] = value
        self.tensors = kept

    def restore(self, master: torch.Tensor, optimizer_state: dict) -> None:
        master.copy_(self.master)
        if self.fresh:
            optimizer_state.pop(master, None)
            return
        state = optimizer_state[master]
        for key in [k for k in state if k not in self.tensors and k not in self.others]:
            del state[key]
        for key, saved in self.tensors.items():
            current = state.get(key)
            if torch.is_tensor(current) and current.shape == saved.shape and current.dtype == saved.dtype:
                current.copy_(saved)
            else:
                state[key] = saved.clone()
        state.update(self.others)

    def nbytes(self) -> int:
        tensors = list(self.tensors.values()) + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


class SpeculationError(RuntimeError):
    """A speculative CPU update failed on some rank; every rank rolled its step back and raises this."""


class SuperOffloadOptimizer(OffloadOptimizer):
    """CPU offload whose per-bucket steps start during backward and are validated after it."""

    kind = "cpu+super_offload"

    keeps_reduced_gradients = True  # a clipped redo starts again from them

    def __init__(self, *args, loss_scale: Callable[[], float] = lambda: 1.0, speculation: str = "adaptive",
                 fence: Optional[Fence] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fence = fence  # the engine's checkpoint fence: pending async snapshot copies of its slots
        if speculation not in ("adaptive", "always"):
            raise ValueError(f"speculation must be 'adaptive' or 'always', got {speculation!r}")
        self._adaptive = speculation == "adaptive"
        self._speculate_next = True  # adaptive: false after a clipped or overflowed step
        if self.reducer is None:
            raise ValueError("super_offload needs the gradient reducer's shard-ready callbacks")
        self._loss_scale = loss_scale
        self._stepper = SubsetStepper(self.optimizer)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerotrain-superoffload")
        self._futures: dict[int, Future] = {}
        self._saved: set[int] = set()  # buckets stepped in place after saving a copy (`_backups`)
        self._pending: dict[int, bool] = {}  # buckets stepped into `_spare` -> whether their state was fresh
        self._spare: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._norm_terms: dict[int, Future] = {}  # bucket -> GlobalGradients.bucket_terms of its final gradient
        self._scale: Optional[float] = None
        self._backups: dict[int, _Backup] = {}
        self._written: set[int] = set()  # buckets whose model shard a speculative update wrote
        self._agreed = False  # has_overflow() already agreed on this step's speculation failures
        self.stats.update(speculative_steps=0, bucket_updates=0, committed=0, rollbacks=0, overflow_rollbacks=0,
                          clip_redos=0, other_rollbacks=0, rollback_seconds=0.0, not_speculated=0,
                          norm_buckets_ahead=0, overflow_buckets_ahead=0)

    # --- during backward -----------------------------------------------------
    def _on_shard_ready(self, index: int) -> None:
        grad = self.reducer.grad_shards[index]
        if not self.offloaded[index] or grad is None:
            return
        if grad.device.type == "cpu":  # its share of the norm, off the critical path (speculating or not)
            self._norm_terms[index] = self._worker.submit(self.gradients.bucket_terms, index, grad)
        if not self._speculate_next:
            return
        scale = float(self._loss_scale())
        if index in self._futures or (self._scale is not None and scale != self._scale):
            self._rollback("other_rollbacks")  # a second boundary backward without a step in between
        if not self._futures:
            self.stats["speculative_steps"] += 1
        self._scale = scale
        self.host_grads.start(index, grad)
        native = self.cpu_adam.supports(self.masters[index], self.buckets[index].group_index)
        if native and self.model_shard_target(index) is not None:
            self._written.add(index)  # known before it runs: before_model_use() must wait for it
        self._futures[index] = self._worker.submit(self._speculate, index, grad, 1.0 / scale, native)

    def _speculate(self, index: int, grad: torch.Tensor, multiplier: float, native: bool) -> None:
        """Background thread: step one bucket with the gradient unscaled (no clip), so that dropping the step
        is exact and cheap.

        With the CPU Adam kernel the step is written out of place, into this bucket's spare buffers
        (`_spare`): the masters and states keep their values until `step()` swaps the buffers in, so a
        rollback copies nothing. It reads the reduced gradient times `multiplier` (no copy of it, no
        `mul_`) and also casts the new weights into the model shard, so a committed step publishes nothing
        more for it. Other optimizers take torch's step in place on an unscaled copy, after saving a copy."""
        master = self.masters[index]
        group_index = self.buckets[index].group_index
        if native:
            fresh = not self.optimizer.state.get(master)
            spare = self._spare.get(index)
            if spare is None:
                pin = master.is_pinned()
                spare = self._spare[index] = tuple(host_empty(master.numel(), pin) for _ in range(3))
            target = self.model_shard_target(index) if index in self._written else None
            self._pending[index] = fresh  # before the step: a rollback drops the state a fresh step created
            self.cpu_adam.step_to(master, self.kernel_gradient(index, grad), group_index, spare, multiplier,
                                  copy_to=target)
        else:
            if self._fence is not None:  # an async save may still be copying this master and its states
                self._fence.wait()       # (step() fences later)
            host = self.host_gradient(index, grad, multiplier)
            self._backups.setdefault(index, _Backup()).save(master, self.optimizer.state.get(master))
            self._saved.add(index)
            master.grad = host
            try:
                self._stepper.step([master], [group_index])
            finally:
                master.grad = None
        self.stats["bucket_updates"] += 1

    def grad_norm(self, grad_shards: list[torch.Tensor]) -> float:
        """The global norm, with the squares of the buckets whose gradients became final during backward
        already summed by the background thread (the same terms in the same order: the same bits)."""
        terms = {index: job.result() for index, job in self._norm_terms.items()}
        self._norm_terms.clear()
        self.stats["norm_buckets_ahead"] += len(terms)
        return self.gradients.norm(grad_shards, terms)

    def before_model_use(self) -> None:
        """Called by the engine before a forward or backward: pending speculative updates that wrote model
        weights are rolled back (exactly), so a repeated boundary forward/backward before `step()` sees the
        weights of the last step, as without speculation; `step()` then updates those buckets itself."""
        self._drop_norm_terms()
        if self._written:
            self._rollback("other_rollbacks")

    # --- after backward: validate ----------------------------------------------
    def _settle(self) -> None:
        """Wait for the speculative updates and agree with every rank on whether one failed anywhere.

        One all-reduce of a per-rank failure flag (at the engine's first synchronizing call of the step,
        `has_overflow()` or `step()`). If any rank's update failed, every rank rolls its speculative
        step back and raises `SpeculationError` naming the failing ranks: without the agreement the
        healthy ranks would wait in the next collective until the comm timeout."""
        error = None
        for future in self._futures.values():
            try:
                future.result()
            except BaseException as failure:  # noqa: BLE001 - re-raised below after the rollback
                error = error or failure
        self._agreed = True
        here = int(self.comm.rank) if self.comm is not None else 0
        failed = [here] if error is not None else []
        if self.comm is not None and self.comm.size > 1:
            flags = torch.zeros(self.comm.size, dtype=torch.float32, device=self.device)
            flags[self.comm.rank] = float(error is not None)
            self.comm.all_reduce(flags)
            failed = [rank for rank, flag in enumerate(flags.tolist()) if flag > 0]
        if not failed:
            return
        self._rollback("other_rollbacks")
        self._agreed = False
        if error is not None:
            raise SpeculationError(f"super_offload: the speculative CPU update failed on rank(s) {failed}; "
                                   f"here (rank {here}): {error!r}; the step was rolled back on every rank") from error
        raise SpeculationError(f"super_offload: the speculative CPU update failed on rank(s) {failed}; rank {here} "
                               f"rolled its own speculative step back, so every rank's state is as before the step")

    def _rollback(self, cause: str) -> None:
        for future in self._futures.values():
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - what it did is undone below either way
                pass
        start = time.perf_counter()
        for index in self._saved:
            self._backups[index].restore(self.masters[index], self.optimizer.state)
        for index, fresh in self._pending.items():  # out-of-place steps: the current buffers never changed
            if fresh:
                self.optimizer.state.pop(self.masters[index], None)
        for index in self._written:  # the model shard held cast(master) before the update: cast it again
            self.buckets[index].local_shard().copy_(self.masters[index])
        self.stats["rollback_seconds"] += time.perf_counter() - start
        if self._futures:
            self.stats["rollbacks"] += 1
            self.stats[cause] += 1
        self._forget()

    def _drop_norm_terms(self) -> None:
        for job in self._norm_terms.values():
            try:
                job.result()
            except BaseException:  # noqa: BLE001 - recomputed by grad_norm() if needed
                pass
        self._norm_terms.clear()

    def _forget(self) -> None:
        self._drop_norm_terms()
        self._futures.clear()
        self._saved.clear()
        self._pending.clear()
        self._written.clear()
        self._scale = None
        self._agreed = False  # what has_overflow() agreed on was about the updates just forgotten
        self.host_grads.reset()

    def known_finite(self) -> set[int]:
        """The buckets whose norm terms (summed during backward) prove them finite: not read again."""
        finite = {index for index, job in self._norm_terms.items()
                  if self.gradients.terms_prove_finite(index, job.result())}
        self.stats["overflow_buckets_ahead"] += len(finite)
        return finite

    def has_overflow(self, grad_shards: list[torch.Tensor]) -> bool:
        self._settle()
        overflow = super().has_overflow(grad_shards)
        if overflow:
            self._rollback("overflow_rollbacks")
            self._speculate_next = not self._adaptive
        return overflow

    def step(self, grad_shards: list[torch.Tensor], loss_scale: float) -> None:
        if not self._agreed:
            self._settle()
        self._agreed = False
        norm = self.grad_norm(grad_shards) / loss_scale
        self.last_grad_norm = norm
        multiplier = self.multiplier(norm, loss_scale)
        if self._futures and (self._scale != loss_scale or multiplier != 1.0 / loss_scale):
            self._rollback("clip_redos" if self._scale == loss_scale else "other_rollbacks")
        done = set(self._futures)
        if done:
            self.stats["committed"] += 1
        for index in self._pending:  # keep the out-of-place steps: swap their buffers in
            self._spare[index] = self.cpu_adam.swap_in(self.masters[index], self._spare[index])
        if not self._speculate_next:
            self.stats["not_speculated"] += 1
        # Clipping (or a skipped step) tends to repeat: adaptive mode speculates again only after a step
        # that needed neither, since a speculative update would be redone anyway.
        self._speculate_next = not self._adaptive or multiplier == 1.0 / loss_scale
        self.shards_written = set(self._written)  # committed speculative updates already wrote these shards
        self._forget()
        # Device-resident buckets, and any offloaded one not speculated (or rolled back), in one fused call.
        self.update(grad_shards, multiplier, [i for i in range(len(self.buckets)) if i not in done])
        self.stats["steps"] += 1
        self.publish_after_update()

    # --- accounting ----------------------------------------------------------
    def memory_split(self) -> dict[str, int]:
        split = super().memory_split()
        split["host_buffers"] += sum(backup.nbytes() for backup in self._backups.values())
        split["host_buffers"] += sum(tensor_bytes(spare) for spare in self._spare.values())
        return split

    def close(self) -> None:
        self._rollback("other_rollbacks")
        self._worker.shutdown(wait=True)
