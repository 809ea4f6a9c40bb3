"""Where the model's weights live, as the engine sees them: whole on every rank in flat buckets (stages
0-2, `FlatWeights`) or partitioned per parameter and gathered for use (stage 3, `PartitionedWeights`).

The engine calls the same methods on either, so it does not branch on the stage: how a forward is
bracketed, where a micro-step ends, the frozen slots a checkpoint saves, how loaded values reach the
shards and masters, which bytes the weights hold on the device.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..sharding import ShardRecord, ShardedSlot
from ..zero.stage3 import GatheredParameters
from ..zero.stage3.fetch import ParamFetcher
from ..zero.stage3.setup import Stage3Model

__all__ = ["Weights", "FlatWeights", "PartitionedWeights"]


class Weights:
    """The interface (stages 0-2 implement it directly; `PartitionedWeights` overrides what stage 3 does)."""

    partitioned = False  # no rank holds whole parameters (module_state_dict refuses; save_16bit_model gathers)
    fetcher: Optional[ParamFetcher] = None  # stage 3's gatherer; None where weights are whole
    stage3: Optional[Stage3Model] = None
    frozen: tuple = ()  # stage 3's partitioned frozen parameters (consolidate joins them)

    def __init__(self, module: torch.nn.Module, buckets: list) -> None:
        self.module = module
        self.buckets = buckets

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """One training forward of the module."""
        return self.module(*args, **kwargs)

    def end_micro_step(self) -> None:
        """After a backward: nothing to release."""

    def saved_activation_bytes(self) -> int:
        """Bytes the micro-step's forwards saved for backward (parameters not counted); 0 where they are not
        counted (only stage 3 packs its saved tensors)."""
        return 0

    def frozen_slots(self) -> list[ShardedSlot]:
        """Frozen parameters as slots without a master: the tensor-parallel slices (whole on each data-parallel
        rank), so a save joins every tensor-parallel rank's slice (a LoRA base split by tensor parallelism);
        other frozen parameters are whole on every rank and saved as they are."""
        in_buckets = {id(p) for b in self.buckets for p in b.params}
        slots, seen = [], set()
        for name, param in self.module.named_parameters():
            if id(param) in in_buckets or id(param) in seen or getattr(param, "tp_slice", None) is None:
                continue
            seen.add(id(param))
            record = ShardRecord(name, tuple(param.shape), 0, param.numel(), 0)
            slots.append(ShardedSlot(records=[record], master=None, model_shard=param.data.view(-1),
                                     replicated=True))
        return slots

    def load(self, values: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], names: list[str],
             masters: list[torch.Tensor]) -> bool:
        """Write `values` (the model's names) into the weights and into the fp32 masters (under no_grad); the
        masters from the given values themselves, not their training-dtype cast. Returns whether the masters
        must still be published into the weights."""
        for name in names:
            expected[name].data.copy_(values[name].to(expected[name].dtype))
        for bucket, master in zip(self.buckets, masters):
            flat = torch.zeros(bucket.padded_numel, dtype=torch.float32, device=bucket.device)
            for name, view in bucket.unflatten(flat).items():
                view.copy_(values[name] if name in values else expected[name].detach())
            master.copy_(bucket.shard_of(flat))
        return True

    def refresh(self) -> None:
        """Make the frozen weights current after their slots were written: they are the slots here."""

    def device_bytes(self) -> int:
        """Parameter bytes on the device: the flat buckets and every parameter outside them."""
        in_buckets = {id(p) for b in self.buckets for p in b.params}
        held = sum(b.flat_param.numel() * b.flat_param.element_size() for b in self.buckets)
        return held + sum(p.numel() * p.element_size() for p in self.module.parameters() if id(p) not in in_buckets)

    def watch(self, phase: Callable) -> None:
        """Tell the gatherer where its blocking gathers begin and end (nothing gathers here)."""

    def gather_stats(self) -> dict:
        """Counters of the gatherer (gathers, prefetches, bytes held); {} where nothing gathers."""
        return {}


FlatWeights = Weights


class PartitionedWeights(Weights):
    """Stage 3: each parameter partitioned over its group, gathered by the fetcher around its use."""

    partitioned = True

    def __init__(self, module: torch.nn.Module, stage3: Stage3Model) -> None:
        super().__init__(module, stage3.trainable)
        self.stage3 = stage3
        self.fetcher = stage3.fetcher
        self.frozen = stage3.frozen

    def forward(self, args: tuple, kwargs: dict) -> Any:
        fetcher = self.fetcher
        fetcher.begin_micro_step()
        with self.stage3.hooks.saved_tensors_hooks():
            output = self.module(*args, **kwargs)
        fetcher.end_forward(backward_follows=torch.is_grad_enabled())
        return output

    def end_micro_step(self) -> None:
        self.fetcher.end_micro_step()
        self.stage3.hooks.forget_saved()

    def saved_activation_bytes(self) -> int:
        return self.stage3.hooks.saved_activation_bytes()

    def frozen_slots(self) -> list[ShardedSlot]:
        """This rank's shards of each frozen parameter."""
        return [ShardedSlot(records=part.shard_records(), master=None, model_shard=part.shard,
                            replicated=part.partitions == 1) for part in self.stage3.frozen]

    def load(self, values: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], names: list[str],
             masters: list[torch.Tensor]) -> bool:
        """The gathered values are written back to every shard and master (nothing left to publish)."""
        params = [expected[n] for n in names if isinstance(expected[n], torch.nn.Parameter)]
        with GatheredParameters(params, modifier_rank=0):
            for name in names:
                expected[name].data.copy_(values[name].to(expected[name].dtype))
        return False

    def refresh(self) -> None:
        self.stage3.refresh_frozen()

    def device_bytes(self) -> int:
        return self.stage3.device_param_bytes()

    def watch(self, phase: Callable) -> None:
        self.fetcher.phase = phase

    def gather_stats(self) -> dict:
        return dict(self.fetcher.stats)
