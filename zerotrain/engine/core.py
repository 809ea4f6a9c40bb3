"""The training step over the engine's parts: forward, backward(loss), step() and their counters.

A micro-step is a forward and a backward; at the accumulation boundary `step()` takes the optimizer
step, which reads top-down: the gradients are final (the reducer's shards) -> overflow check -> the
master optimizer's step (global norm, unscale and clip, update, publish) -> the parameter store's flush
-> the scheduler -> the loss scaler -> the reducer's bookkeeping and zeroing -> the counters. A
checkpoint's failure is raised and its fence honoured before anything changes the slots. Nothing here
branches on the ZeRO stage or on forward-only: the parts (`EngineParts`) differ instead.
"""
from __future__ import annotations

import contextlib
import logging
import math
import warnings
from typing import Any, Optional

import torch

from ..monitor import WallClockTimers
from .parts import EngineParts

__all__ = ["EngineCore"]

logger = logging.getLogger("zerotrain")


class EngineCore:
    """The micro-step / step state machine over `parts` (the engine's training half)."""

    _inside_no_sync = False
    _step_applied = False
    _boundary_override: Optional[bool] = None  # set_gradient_accumulation_boundary's value, once called
    # budget.FirstPassReserve (set by the facade): the first pass's activations out of the parameter cache
    first_pass_reserve = None

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.config = parts.config
        self.topology = parts.topology
        self.micro_steps = 0
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self._backward_done = False
        self.checkpointer = None  # created by the first save_checkpoint
        self.timers = WallClockTimers(parts.config.wall_clock_breakdown, parts.topology.device)  # fwd/bwd/step
        # a forward-only engine runs its module under no_grad (ForwardPasses brackets it, also under generate)
        self._forward = self._forward_only if parts.forward_only else self._training_forward

    # --- forward ------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    forward = __call__

    def _training_forward(self, *args, **kwargs):
        # wall_clock_breakdown times training forwards only (an evaluation would land in the next step's)
        with self.timers("fwd") if torch.is_grad_enabled() else contextlib.nullcontext():
            parts = self.parts
            parts.zero_optimizer.before_model_use()  # super_offload: undo speculative weights first
            return parts.weights.forward(args, kwargs)

    def _forward_only(self, *args, **kwargs):
        with torch.no_grad():
            return self.parts.module(*args, **kwargs)

    # --- backward -----------------------------------------------------------
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next step() will update the weights: by the micro-step count, or as last set by
        `set_gradient_accumulation_boundary`."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary (accelerate's loop calls it before every backward and step()s only at
        the boundary): the following backward reduces, and step() updates, only when `is_boundary`. Each
        backward still scales the loss by 1/gradient_accumulation_steps, as in DeepSpeed."""
        self._boundary_override = bool(is_boundary)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` scaled by 1/accumulation (and the fp16 loss scale), reducing gradients;
        `scale_wrt_gas=False` (DeepSpeed's flag): not by 1/accumulation, for a loss that is already the whole
        batch's (a loop that divided it itself, a GradCache surrogate)."""
        parts = self.parts
        parts.zero_optimizer.refuse_training("engine.backward()")  # forward-only: NoOptimizerError
        scale = parts.loss_scaler.scale / (self.gradient_accumulation_steps() if scale_wrt_gas else 1)
        scaled = loss * scale if scale != 1.0 else loss
        # inside no_sync() (stages 0-1) gradients stay local until the next backward outside it
        boundary = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        with self.timers("bwd"):
            parts.zero_optimizer.before_model_use()
            norm_first = boundary and parts.zero_optimizer.takes_norm_first_pass()
            if norm_first:
                if self.first_pass_reserve is not None:
                    self.first_pass_reserve.hold(parts.weights.saved_activation_bytes())
                self._norm_pass(scaled)
            parts.reducer.begin_backward(boundary=boundary)
            with self.timers("bwd_inner"):
                try:
                    scaled.backward(retain_graph=retain_graph)
                except RuntimeError as error:
                    if norm_first and "second time" in str(error):
                        raise RuntimeError(
                            "the model's backward cannot run twice over one graph (its second pass failed: "
                            f"{str(error).splitlines()[0]}); set zero_optimization.offload_optimizer."
                            "norm_first_pass: false to spill the gradients to disk for clipping instead") from error
                    raise
            with self.timers("bwd_allreduce"):  # the reductions still in flight after autograd
                parts.reducer.end_backward()
            parts.weights.end_micro_step()
        self._backward_done = True
        return loss

    def _norm_pass(self, scaled: torch.Tensor) -> None:
        """The first of a boundary's two backwards (`MasterOptimizer.takes_norm_first_pass`: NVMe offload with
        clipping): over the graph retained for the second, the buckets reduced as usual, each final shard only
        summed into the global norm and dropped; the norm fixes the clip of the step the second pass streams."""
        parts = self.parts
        parts.zero_optimizer.begin_norm_pass()
        parts.reducer.begin_backward(boundary=True)
        with self.timers("bwd_inner"):
            scaled.backward(retain_graph=True)
        with self.timers("bwd_allreduce"):
            parts.reducer.end_backward()
        parts.reducer.zero()
        parts.zero_optimizer.end_norm_pass(parts.loss_scaler.scale)

    @contextlib.contextmanager
    def external_backward(self, micro_steps: int = 1):
        """Gradients made outside `backward()` (a pipeline schedule's backward passes, which scale the loss
        themselves and may add into `.grad` directly: zero-bubble's weight passes) accumulate inside the block
        and are reduced once when it exits, as one accumulation-boundary backward; the next `step()` at the
        boundary updates. The block may adjust the gradients before the reduce (tied weights). Stages 0-1 only:
        their reducer keeps a full buffer until the boundary (stages 2-3 reduce inside every backward).
        `micro_steps`: the micro-batches the block's gradients stand for; the micro-step count advances by all
        but the last on exit (the `step()` after it counts the last, as after a `backward()`)."""
        parts = self.parts
        parts.zero_optimizer.refuse_training("engine.external_backward()")
        if parts.stage >= 2:
            raise RuntimeError(f"external_backward() needs ZeRO stage 0 or 1, not {parts.stage}: stages 2 and 3 "
                               "reduce gradients during every backward, through hooks")
        parts.zero_optimizer.before_model_use()
        parts.reducer.begin_backward(boundary=False)  # hooks only fold gradients into the buffer
        yield
        parts.reducer.end_backward()
        with self.timers("bwd_allreduce"):
            parts.reducer.begin_backward(boundary=True)  # no backward runs: end_backward reduces every bucket
            parts.reducer.end_backward()
        parts.weights.end_micro_step()
        self.micro_steps += micro_steps - 1
        self._backward_done = True

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside skip the gradient reduction; the next backward outside reduces the sum.

        As in DeepSpeed: refused at ZeRO stages 2-3 (their gradients are partitioned during every
        backward), not re-entrant, and step() inside raises. The micro-step count does not advance,
        so the loss scale stays 1/gradient_accumulation_steps per backward: gradients add up.
        """
        if self.parts.stage >= 2:
            raise RuntimeError(f"no_sync() is incompatible with ZeRO stage {self.parts.stage}: stages 2 and 3 "
                               "reduce and partition gradients during every backward (DeepSpeed refuses it too)")
        if self._inside_no_sync:
            raise RuntimeError("no_sync() is not re-entrant")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    # --- step ---------------------------------------------------------------
    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary, update the weights."""
        self.parts.zero_optimizer.refuse_training("engine.step()")  # forward-only: NoOptimizerError
        if self.checkpointer is not None:  # a failed background save raises here, on every rank
            self.checkpointer.raise_if_failed()
        if self._inside_no_sync:
            raise RuntimeError("engine.step() inside engine.no_sync() is not allowed (as in DeepSpeed): "
                               "leave the context and run one more backward first")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        with self.timers("step"):
            if boundary:
                if not self._backward_done:
                    raise RuntimeError("engine.step() at an accumulation boundary without engine.backward() before it")
                self._take_model_step()
        self.micro_steps += 1
        if boundary:
            self.timers.close_step()
            self._after_step()

    def _take_model_step(self) -> None:
        parts = self.parts
        optimizer, loss_scaler = parts.zero_optimizer, parts.loss_scaler
        grad_shards = parts.reducer.grad_shards
        # fp16 (dynamic scale) and bf16 with DeepSpeed's `check_grad_overflow`: a non-finite gradient skips the step
        check = loss_scaler.dynamic or (self.config.bf16.enabled and self.config.bf16.check_grad_overflow)
        overflow = check and optimizer.has_overflow(grad_shards)
        scale_before = loss_scaler.scale
        if overflow:
            self.skipped_steps += 1
            logger.info("step %d: gradient overflow, skipped; loss scale %g -> lower", self.global_steps, loss_scaler.scale)
        else:
            optimizer.step(grad_shards, loss_scaler.scale)  # global norm, unscale + clip, update, publish
            if parts.param_store is not None:
                parts.param_store.flush()  # updated shards are in host memory / written (OffloadIOError else)
            if parts.lr_scheduler is not None:
                parts.lr_scheduler.step()
        self._step_applied = not overflow
        loss_scaler.update(overflow)
        # LoCo: count the step, drop the error on overflow, follow a loss-scale change.
        parts.reducer.after_optimizer_step(overflow, scale_before, loss_scaler.scale)
        parts.reducer.zero()
        self._backward_done = False
        if not overflow and not math.isfinite(optimizer.last_grad_norm or 0.0):
            warnings.warn(f"step {self.global_steps}: the gradient norm is {optimizer.last_grad_norm}; "
                          f"the weights are now non-finite (fp16, or bf16.check_grad_overflow: true, skip such "
                          f"steps)", RuntimeWarning, stacklevel=3)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self._after_model_step()

    @property
    def gradients_pending(self) -> bool:
        """A backward's gradients are held that no optimizer step has applied yet (inside an accumulation cycle,
        or a backward without its step): what a checkpoint saved now would not hold."""
        return self._backward_done

    def _after_model_step(self) -> None:
        """After the optimizer step's counters advanced (a report); nothing here."""

    def _after_step(self) -> None:
        """After a boundary step() closed its timers (a monitor event); nothing here."""

    def zero_grad(self) -> None:
        """Drop gradients, but never in the middle of an accumulation cycle (DeepSpeed loops call it freely)."""
        if self.micro_steps % self.gradient_accumulation_steps() == 0:
            self.parts.reducer.zero()
            self._backward_done = False

    def was_step_applied(self) -> bool:
        """True when the last step() updated the weights (False between accumulation boundaries and on an
        fp16 overflow)."""
        return self._step_applied

    # --- the module's mode ------------------------------------------------------
    def train(self, mode: bool = True) -> Any:
        self.parts.module.train(mode)
        return self

    def eval(self) -> Any:
        return self.train(False)

    @property
    def training(self) -> bool:
        """The module's training mode (DeepSpeed's engine is an nn.Module: `engine.training`)."""
        return self.parts.module.training
