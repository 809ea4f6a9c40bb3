"""`zerotrain.dist`: the `deepspeed.comm` functions a training script calls, over the world or a group.

`zerotrain.comm` is the internal collectives package, so `deepspeed.comm.X` becomes
`zerotrain.dist.X` (`from zerotrain import dist`). Every collective here goes through
:class:`zerotrain.comm.Comm`, the one caller of torch.distributed collectives, so it is counted and a
failure names the collective and rank. `group` may be None (the world), a torch process group (e.g.
`engine.data_parallel_group`) or a `zerotrain.comm.Comm` (e.g. `engine.comm`).
"""
from __future__ import annotations

import datetime
import gc
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as _torch_dist

from .comm import Comm, release_groups
from .topology import default_device, init_distributed as _init_distributed

ReduceOp = _torch_dist.ReduceOp
Group = Union[None, _torch_dist.ProcessGroup, Comm]

__all__ = ["init_distributed", "is_initialized", "destroy_process_group", "get_rank", "get_world_size",
           "get_local_rank", "barrier", "all_reduce", "broadcast", "all_gather", "ReduceOp"]


def init_distributed(dist_backend: Optional[str] = None, timeout: Union[float, datetime.timedelta, None] = None,
                     **unused: Any) -> None:
    """Start torch.distributed from the launcher's environment (a world of one without one); NCCL on CUDA,
    gloo on CPU. DeepSpeed's other arguments (ports, MPI discovery) do not apply: the launcher sets them."""
    import warnings

    auto = "nccl" if torch.cuda.is_available() else "gloo"
    if dist_backend is not None and dist_backend != auto:
        warnings.warn(f"init_distributed(dist_backend={dist_backend!r}) has no effect: zerotrain uses {auto} here")
    ignored = sorted(k for k, v in unused.items() if v is not None and k not in ("verbose", "dist_init_required"))
    if ignored:
        warnings.warn(f"init_distributed: {ignored} have no effect in zerotrain (the launcher's environment "
                      "variables set the rendezvous)")
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    _init_distributed(1800.0 if seconds is None else float(seconds))


def is_initialized() -> bool:
    return _torch_dist.is_available() and _torch_dist.is_initialized()


def destroy_process_group() -> None:
    """Tear torch.distributed down at the end of a run (nothing when it is not running).

    Then the garbage collector runs: a process group lives while anything holds it, and what still holds one
    here is often garbage in a reference cycle (a finished script's namespace under `zerotrain launch`, an
    engine's parts). Collected now, its groups are destroyed and gloo's worker threads joined while the
    interpreter still runs them; left to the interpreter's exit, a worker that drops its last collective's
    tensors there cannot take the GIL and the process aborts ("terminate called without an active exception").
    """
    if is_initialized():
        _torch_dist.destroy_process_group()
        release_groups()
        gc.collect()


def _comm(group: Group) -> Comm:
    if isinstance(group, Comm):
        return group
    if not is_initialized():
        raise RuntimeError("zerotrain.dist: torch.distributed is not started; call zerotrain.init_distributed() "
                           "or zerotrain.initialize() first")
    if group is None:
        group = _torch_dist.group.WORLD
    return Comm(group, _torch_dist.get_rank(group), _torch_dist.get_world_size(group))


def get_rank(group: Group = None) -> int:
    """This process's rank in `group` (the world by default); 0 before torch.distributed starts."""
    if isinstance(group, Comm):
        return group.rank
    return _torch_dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Group = None) -> int:
    if isinstance(group, Comm):
        return group.size
    return _torch_dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK from the launcher; 0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Group = None, async_op: bool = False):
    """In-place all-reduce of `tensor` over `group`."""
    return _comm(group).all_reduce(tensor, op=op, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Group = None) -> None:
    """`src`'s `tensor` on every rank of `group` (`src` is a rank within the group)."""
    _comm(group).broadcast(tensor, src=src)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None) -> list[torch.Tensor]:
    """torch's form: `tensor_list[r]` receives rank r's `tensor` (same shape on every rank)."""
    comm = _comm(group)
    if len(tensor_list) != comm.size:
        raise ValueError(f"all_gather needs a list of {comm.size} tensors, got {len(tensor_list)}")
    output = torch.empty((comm.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather(output.view(-1), tensor.contiguous().view(-1))
    for target, row in zip(tensor_list, output):
        target.copy_(row)
    return tensor_list


def barrier(group: Group = None) -> None:
    """Wait until every rank of `group` gets here (through zerotrain.comm: torch's barrier on gloo, an all-reduce
    of one element on the device elsewhere)."""
    comm = _comm(group)
    if _torch_dist.get_backend(comm.group) == "gloo":
        comm.barrier()
    else:
        comm.all_reduce(torch.zeros(1, device=default_device()))
