"""Tensor parallelism (Megatron-style layers applied by a plan) and an expert-parallel MoE layer.

    topology = zerotrain.topology.Topology.build(tp_size=2)
    tp = zerotrain.parallel.tensor_parallel_comm(topology)
    apply_tensor_parallel(model, GPT_PLAN, tp)

A model that brings no plan gets its own (a Hugging Face model's `base_model_tp_plan`) or an
inferred one: `resolve_plan(model, tp_size)` (see `autotp`).

Every split parameter carries `tp_slice` (a :class:`TensorSlice`): where its local piece
sits in the full tensor; expert weights carry `ep_slice` likewise.
"""
from __future__ import annotations

from typing import Optional

from ..comm import Comm, CommCounters
from ..topology import Topology
from .gather import assemble_full_tensors
from .autotp import resolve_plan
from .moe import ExpertParallelMoE
from .plan import GPT_PLAN, Column, Row, Style, SumGrad, Vocab, apply_tensor_parallel
from .slices import TensorSlice, split_slice, tensor_slice_of
from .tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["tensor_parallel_comm", "apply_tensor_parallel", "resolve_plan", "assemble_full_tensors", "GPT_PLAN", "Column", "Row", "Vocab", "SumGrad", "Style",
           "TensorSlice", "split_slice", "tensor_slice_of", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "ExpertParallelMoE"]


def tensor_parallel_comm(topology: Topology, counters: Optional[CommCounters] = None) -> Comm:
    """Collectives over this rank's tensor-parallel group (`Comm.tensor_parallel`)."""
    return Comm.tensor_parallel(topology, counters)
