"""When stage-3 parameters are gathered and released.

- Forward: a module's pre-hook gathers its direct parameters (prefetching what
  comes next); its post-hook releases them. A module called twice gathers twice.
- Backward: tensors that autograd saves are packed by `saved_tensors_hooks`: a
  saved parameter (or a view of one) is stored as a reference, not as the full
  tensor, so releasing after forward really frees memory; unpacking in backward
  gathers it again. No module backward hooks are needed, so in-place ops on
  module outputs and parameters used by several modules (tied weights) just work.
- Activation checkpointing (zerotrain.checkpointing, non-reentrant): the checkpointed forward saves
  nothing, so no parameter is packed there; the recompute in backward runs the module hooks
  again (gather, then release after the module; requests recorded as "recompute"), and the
  tensors it saves are held by torch's checkpoint until that segment's backward is done.
- After a parameter's gradient has been handed to the reducer it is released, unless the
  recorded order says it is used again soon (`stage3_max_reuse_distance`, see fetch.py).
- The same pack hook adds up the bytes of the other tensors a forward saves (each storage once):
  `saved_activation_bytes`, what the micro-batch's graph holds until its backward frees it (the
  memory budget's first-pass reserve reads it, `budget.FirstPassReserve`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..param_hooks import weak_hook
from .fetch import ParamFetcher
from .partition import PartitionedParam, ZeroParameter


@dataclass
class _SavedParam:
    part: PartitionedParam
    view: Optional[tuple]  # (size, stride, storage_offset) when a view of the parameter was saved


class Stage3Hooks:
    """Installs the module and autograd hooks that drive a ParamFetcher."""

    def __init__(self, module: torch.nn.Module, fetcher: ParamFetcher):
        self.fetcher = fetcher
        self._handles = []
        self._saved: dict[int, int] = {}  # this micro-step's saved storages: data pointer -> bytes
        for submodule in module.modules():
            parts = [p._zero for p in submodule.parameters(recurse=False) if isinstance(p, ZeroParameter)]
            if not parts:
                continue
            self._handles.append(submodule.register_forward_pre_hook(self._make_pre_hook(parts)))
            self._handles.append(submodule.register_forward_hook(self._make_post_hook(parts)))
        for part in fetcher.parts:
            if part.param.requires_grad:
                # Runs after the reducer's own hook (registered earlier) has taken the gradient.
                # held weakly: the parameter keeps its hook where the collector cannot see (`zero.param_hooks`)
                self._handles.append(part.param.register_post_accumulate_grad_hook(weak_hook(self._release)))

    def _make_pre_hook(self, parts: list[PartitionedParam]):
        def pre_hook(module, args):
            # A module forward inside a backward is an activation-checkpoint recompute: recorded as
            # such, so prefetch at the end of forward does not run into it (see fetch.py).
            self.fetcher.fetch(parts, reason="recompute" if torch._C._current_graph_task_id() != -1 else "forward")
            self.fetcher.hold(parts)
        return pre_hook

    def _make_post_hook(self, parts: list[PartitionedParam]):
        def post_hook(module, args, output):
            self.fetcher.unhold_and_release(parts)
        return post_hook

    def _release(self, param: ZeroParameter) -> None:
        """A parameter's gradient is taken: its gathered copy may go."""
        self.fetcher.release(param._zero)

    # --- saved tensors -------------------------------------------------------
    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def saved_activation_bytes(self) -> int:
        """Bytes of the tensors this micro-step's forwards saved for backward besides parameters (persistent
        ones included) and views of them, each storage once: what their graphs keep alive until backward frees
        them."""
        return sum(self._saved.values())

    def forget_saved(self) -> None:
        """The micro-step's backward is done: the next forward's saved tensors are counted afresh."""
        self._saved = {}

    def _pack(self, tensor: torch.Tensor):
        if type(tensor) is ZeroParameter:
            return tensor if tensor._zero.persistent else _SavedParam(tensor._zero, None)
        base = tensor._base
        if type(base) is ZeroParameter:  # (None when the tensor is no view)
            if base._zero.persistent:
                return tensor
            return _SavedParam(base._zero, (tensor.size(), tensor.stride(), tensor.storage_offset()))
        try:
            storage = tensor.untyped_storage()
            self._saved[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage (float8): its own bytes
            self._saved[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        self.fetcher.fetch([saved.part], reason="backward")
        param = saved.part.param
        if saved.view is None:
            return param
        size, stride, offset = saved.view
        with torch._C.DisableTorchFunctionSubclass():
            return param.detach().as_strided(size, stride, offset)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
