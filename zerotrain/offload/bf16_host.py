"""bf16 masters and optimizer states in host memory: CPU offload with `bf16.bf16_master_weights_and_grads`
(and `bf16.bf16_optimizer_states`), as NVMe offload stores its records (`nvme_records.py`).

An offloaded bucket's master is a bf16 host tensor (2 bytes per parameter instead of 4) and, with
`bf16_optimizer_states`, Adam's moments are bf16 too: 6 bytes per Adam parameter in host memory instead of
12. The step runs in fp32 on a chunk at a time (an fp32 working copy of the chunk's master and states in one
scratch buffer, `CHUNK_NUMEL` elements per tensor, so the transient is a few MiB whatever the bucket), with
zerotrain's CPU Adam kernel where it applies and the torch optimizer's own step otherwise (on fp32 copies of
the whole bucket), and is stored back rounded stochastically (`stochastic_round.py`: round to nearest
stalls) with a seed of (rank, bucket, chunk, optimizer step, which tensor), the NVMe records' seeds, so a
resumed run at the same world size rounds as the uninterrupted one. The model then gets the stored bf16
master, so model and master agree.

Checkpoints see fp32 (`widened`): inside it the masters and per-element states are fp32 copies of the bf16
values (exact), and on exit what is there is narrowed back (exact for values a bf16 run saved; a checkpoint
of fp32 masters is rounded to nearest, as NVMe's records do).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch

from .cpu_adam import CpuAdamStepper, adam_step
from .partial import SubsetStepper
from .stochastic_round import round_bf16_, rounding_seed

__all__ = ["Bf16HostStates", "CHUNK_NUMEL"]

CHUNK_NUMEL = 1 << 20  # elements per fp32 working copy: 4 MiB per tensor


class Bf16HostStates:
    """The step and the checkpoint view of offloaded buckets whose masters (and per-element fp32 states, with
    `state_dtype` bf16) are stored in bf16 in host memory. `optimizer` is the torch optimizer over the masters
    (its `state[master]` holds the stored states), `rank` seeds the rounding."""

    def __init__(self, optimizer: torch.optim.Optimizer, cpu_adam: CpuAdamStepper, rank: int,
                 state_dtype: Optional[torch.dtype]):
        self.optimizer, self.cpu_adam, self.rank = optimizer, cpu_adam, rank
        self.state_dtype = state_dtype
        self._scratch: Optional[torch.Tensor] = None
        self._stepper = SubsetStepper(optimizer)
        self._shadows: dict[int, torch.Tensor] = {}  # per bucket: the stable key of the torch step's shadow
        self.widened = False

    @staticmethod
    def initial_master(shard: torch.Tensor) -> torch.Tensor:
        """A bucket's bf16 master from its model shard (rounded to nearest)."""
        return shard.detach().to(device="cpu", dtype=torch.bfloat16, copy=True).reshape(-1)

    def _narrow_state(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.state_dtype) if self.state_dtype is not None and value.dtype == torch.float32 else value

    def step(self, index: int, master: torch.Tensor, grad: torch.Tensor, group_index: int, multiplier: float,
             copy_to: Optional[torch.Tensor]) -> None:
        """One optimizer step of bucket `index`'s bf16 `master` with `grad * multiplier` (`grad` unchanged);
        the stored (rounded) weights also go to `copy_to` when given."""
        state = self.optimizer.state[master]
        if self.cpu_adam.supports_group(group_index) and set(state) <= {"step", "exp_avg", "exp_avg_sq"}:
            self._kernel_step(index, master, grad, group_index, multiplier, state)
        else:
            self._torch_step(index, master, grad, group_index, multiplier)
        if copy_to is not None:
            copy_to.copy_(master)

    def _kernel_step(self, index, master, grad, group_index, multiplier, state) -> None:
        numel = master.numel()
        if not state:  # what torch's fused step creates, the moments in the stored dtype
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros(numel, dtype=self.state_dtype or torch.float32)
        state["step"].add_(1)
        step, hyper = int(state["step"]), self.cpu_adam.hyper(group_index)  # the seed: the step (checkpointed)
        width = min(CHUNK_NUMEL, numel)
        if self._scratch is None or self._scratch.numel() < 4 * width:
            self._scratch = torch.empty(4 * width, dtype=torch.float32)
        for number, start in enumerate(range(0, numel, CHUNK_NUMEL)):
            count = min(CHUNK_NUMEL, numel - start)
            views = [self._scratch[i * width:i * width + count] for i in range(4)]
            stored = [master.narrow(0, start, count), state["exp_avg"].narrow(0, start, count),
                      state["exp_avg_sq"].narrow(0, start, count)]
            # fp32 working copies of bf16 tensors; an fp32 state is stepped in place
            work = [view.copy_(s) if s.dtype != torch.float32 else s for view, s in zip(views, stored)]
            g = grad.narrow(0, start, count)
            if not (g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous()):
                g = views[3].copy_(g)
            adam_step(work[0], g, work[1], work[2], state["step"], multiplier=multiplier, **hyper)
            for which, (value, target) in enumerate(zip(work, stored)):
                if target.dtype == torch.bfloat16:
                    round_bf16_(value, target, rounding_seed(self.rank, index, number, step, which))

    def _torch_step(self, index, master, grad, group_index, multiplier) -> None:
        """The torch optimizer's step on fp32 copies of the whole bucket (optimizers the kernel does not run)."""
        shadow = self._shadows.setdefault(index, torch.empty(0))
        shadow.data = master.float()
        shadow.grad = grad.to(device="cpu", dtype=torch.float32, copy=True).mul_(multiplier)
        old = self.optimizer.state.get(master, {})
        wide = {k: (v.float() if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v) for k, v in old.items()}
        states = {shadow: wide}
        try:
            self._stepper.step([shadow], [group_index], state=states)
        finally:
            shadow.grad = None
        after = states[shadow]
        step = int(after.get("step", 0))  # a tensor or a number (0: an optimizer that counts no steps)
        new, which = {}, 1
        for key, value in sorted(after.items()):  # the per-element states in key order: the records' layout
            if torch.is_tensor(value) and value.numel() == master.numel() and value.dim() == 1:
                if value.dtype == torch.float32 and self.state_dtype is not None:
                    value = self._round(value, torch.empty(value.numel(), dtype=self.state_dtype), index, step, which)
                which += 1
            new[key] = value
        self._round(shadow.data, master, index, step, 0)
        shadow.data = torch.empty(0)
        self.optimizer.state[master] = new

    def _round(self, value: torch.Tensor, out: torch.Tensor, index: int, step: int, which: int) -> torch.Tensor:
        """`value` (fp32) into bf16 `out`, rounded stochastically chunk by chunk with the kernel path's seeds."""
        for number, start in enumerate(range(0, value.numel(), CHUNK_NUMEL)):
            count = min(CHUNK_NUMEL, value.numel() - start)
            round_bf16_(value.narrow(0, start, count).contiguous(), out.narrow(0, start, count),
                        rounding_seed(self.rank, index, number, step, which))
        return out

    # --- checkpoints: fp32 views ------------------------------------------------------------
    @contextmanager
    def widen(self, masters: list[torch.Tensor], write_back: bool):
        """Masters and per-element states of `masters` as fp32 copies of the stored values while inside; on exit
        narrowed back (`write_back`: what is there then, e.g. a loaded checkpoint; else the stored tensors as they
        were)."""
        if self.widened:
            yield
            return
        kept = []
        for master in masters:
            state = self.optimizer.state.get(master, {})
            kept.append((master.data, dict(state)))
            master.data = master.data.float()
            for key, value in state.items():
                if torch.is_tensor(value) and value.dtype == torch.bfloat16 and value.numel() == master.numel():
                    state[key] = value.float()
        self.widened = True
        try:
            yield
        finally:
            self.widened = False
            for master, (data, state) in zip(masters, kept):
                if write_back:
                    master.data = master.data.to(torch.bfloat16)
                    current = self.optimizer.state.get(master)
                    if current:
                        for key, value in current.items():
                            if torch.is_tensor(value) and value.numel() == master.numel() and value.dim() == 1:
                                current[key] = self._narrow_state(value)
                else:
                    master.data = data
                    self.optimizer.state[master] = state
