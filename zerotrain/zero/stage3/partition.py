"""Stage-3 parameter partitioning: each parameter keeps only its 1/N shard.

A partitioned parameter is flattened, padded to ceil(numel/N)·N elements and cut
into N equal chunks; rank r keeps chunk r (`PartitionedParam.shard`). Between
uses the parameter's `.data` is a one-element placeholder broadcast to the full
shape (no memory, but the right shape for autograd's checks); a gather fills a full buffer of
ceil(numel/N)·N elements and the parameter becomes a view of its head, so a
gather needs no copy-out.

Partitioned parameters are switched to the `ZeroParameter` class, whose
`__torch_function__` makes them safe to touch while released: an in-place
element-wise op (`zero_`, `fill_`, `copy_`, `mul_`, ...) is applied to the local shard
only; a random fill (`normal_`, `uniform_`, ...) or a shape-dependent initializer
(`kaiming_*`, `xavier_*`, ...) runs on a transient full tensor and keeps this rank's
chunk, so the values are torch's for the same generator state (`torch.nn.init` functions, which
pass the tensor by keyword, included); on a persistent (always whole) parameter such an op runs
on the full copy and the result is taken into the shard and master; any other use gathers the parameter on
demand (for a weight used outside its module's forward, such as a tied output
head in a user's loss). Before an engine owns the parameter (zero.Init construction, when
nothing can gather yet), `param[index] = value` and an in-place initializer on `param[index]`
(transformers zeroes an embedding's padding row so) write this rank's chunk of the result.
"""
from __future__ import annotations

import enum
import itertools
import os
import weakref
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten

from ...callsite import stacklevel_outside
from ...sharding import ShardGroup
from ..flat import ShardLayout
from .owner import Fence, ParamOwner

__all__ = ["Fence", "PartitionedParam", "ZeroParameter", "ZeroParamStatus", "partition_parameter",
           "state_dict_placeholders", "wait_for_snapshots"]


def wait_for_snapshots(parts) -> None:
    """Wait on the fence of every engine owning one of `parts` (none before an engine adopted them)."""
    fences = [part.owner.fence for part in parts if part.owner.fence is not None]
    for fence in {id(fence): fence for fence in fences}.values():
        fence.wait()

# In-place element-wise ops that can run on the shard alone (initializers, mostly).
_SHARD_SAFE_INPLACE = {
    "normal_", "uniform_", "zero_", "fill_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_", "erfinv_",
    "exponential_", "bernoulli_", "random_", "constant_",
}
# Ops whose values depend on the element's position in the full tensor: random fills (each element
# is the next draw of the generator) and initializers that need the full shape (fan-in/out). They
# run on a transient full-shaped tensor and keep this rank's chunk, so with the same generator state
# on every rank the parameter gets exactly the values torch gives the unpartitioned tensor.
_FULL_TENSOR_INITS = {
    "normal_", "uniform_", "exponential_", "bernoulli_", "random_", "geometric_", "log_normal_", "cauchy_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "trunc_normal_",
    "orthogonal_", "sparse_", "eye_", "dirac_",
}
_INITIALIZERS = _SHARD_SAFE_INPLACE | _FULL_TENSOR_INITS


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's status of a partitioned parameter (`param.ds_status`): whole here, or only its shard."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ids = itertools.count()  # DeepSpeed's `ds_id`: a number per partitioned parameter, unique in the process


class PartitionedParam(ShardLayout):
    """One parameter's layout and shard: the ShardLayout of a single parameter that stores only its shard.

    What it reaches beyond itself (the fetcher, the fence, the parameter store holding an offloaded shard, the
    fp32 master) comes from its one `owner` (`owner.ParamOwner`), which its builder hands it."""

    def __init__(self, name: str, param: torch.nn.Parameter, group: ShardGroup,
                 group_index: int = 0, shard: Optional[torch.Tensor] = None, full_shape: Optional[tuple] = None,
                 owner: Optional[ParamOwner] = None):
        super().__init__(0, [name], [param], [tuple(full_shape if full_shape is not None else param.shape)],
                         group_index, group)
        if shard is None:
            flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
            flat[:self.numel].copy_(param.data.reshape(-1))
            shard = self.shard_of(flat).clone()
        # None while an offload_param store (`owner.store`, zerotrain.offload.param_store) keeps the shard
        self._shard: Optional[torch.Tensor] = shard
        self.flat_param: Optional[torch.Tensor] = None  # the gathered full buffer, while gathered
        self.persistent = False
        # zero.Init's or a lone one until an engine adopts the parameter (`partition_module`): then the engine's
        self.owner: ParamOwner = owner if owner is not None else ParamOwner()
        self.empty = self._placeholder()
        self.saving_state_dict = False  # set while its module's state_dict() saves it (see state_dict_placeholders)
        param.__class__ = ZeroParameter
        param._zero = self
        param.ds_shape = torch.Size(self.shapes[0])  # DeepSpeed's names for the full shape and size
        param.ds_numel = self.numel
        param.ds_id = next(_ids)

    # --- storage ----------------------------------------------------------
    def _placeholder(self) -> torch.Tensor:
        """What a released parameter holds: one element broadcast to the full shape.

        It keeps the parameter's shape (autograd checks a gradient against it when
        accumulating) while holding no memory; writing into it fails loudly.
        """
        return torch.empty((), dtype=self.dtype, device=self.device).expand(self.shapes[0])

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk (training dtype). Offloaded: its host copy, read in from NVMe if needed;
        change it through `write_shard`, not in place."""
        return self._shard if self._shard is not None else self.owner.store.host_shard(self)

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        if self._shard is None:
            raise RuntimeError(f"parameter {self.names[0]}: its shard is offloaded; use write_shard()")
        self._shard = value

    def local_shard(self) -> torch.Tensor:
        return self.shard

    def device_shard(self) -> torch.Tensor:
        """The shard on the training device, for a gather (offloaded: copied in, or read from NVMe)."""
        return self._shard if self._shard is not None else self.owner.store.device_shard(self)

    def write_shard(self, values: torch.Tensor) -> None:
        """Take new shard values (cast to the training dtype), wherever the shard lives."""
        if self._shard is None:
            self.owner.store.write(self, values)
        elif values.data_ptr() != self._shard.data_ptr():
            self._shard.copy_(values)

    def detach_shard(self) -> torch.Tensor:
        """Hand the shard to an offload store (which keeps it from now on: the owner's `store`)."""
        shard, self._shard = self._shard, None
        return shard

    def restore_shard(self, shard: Optional[torch.Tensor]) -> None:
        """Take the shard back from the store that kept it (None: the store dropped it, the model no longer
        holds this parameter)."""
        self._shard = shard

    @property
    def store(self):
        """The parameter store keeping the shard (its owner's, offload_param); None while the shard is here."""
        return self.owner.store if self._shard is None else None

    @property
    def master(self) -> Optional[torch.Tensor]:
        """The fp32 master (its owner's master optimizer's; NVMe: a placeholder); None without one."""
        return self.owner.master_of(self)

    def fetch_for_access(self) -> None:
        """Gather now for use outside a module's forward (released again after the next backward)."""
        if self.owner.fetcher is None:
            raise RuntimeError(f"parameter {self.names[0]} is partitioned (ZeRO-3) and no engine owns it yet; "
                               "use zerotrain.zero.GatheredParameters to read it")
        self.owner.fetcher.fetch([self], reason="access")

    @property
    def offloaded(self) -> bool:
        return self._shard is None

    def shard_extent(self):
        """Where the NVMe parameter store keeps the shard (`interfaces.ShardExtent`), or None (not in one)."""
        return self.owner.store.shard_extent(self) if self._shard is None else None

    def lend_shard_extent(self) -> None:
        """Lend the shard's extent to the optimizer until the next `write_shard` (`ParamStore.lend`)."""
        if self._shard is not None:
            raise RuntimeError(f"parameter {self.names[0]}: its shard is not offloaded; no extent to lend")
        self.owner.store.lend(self)

    @property
    def shard_in_device_memory(self) -> bool:
        """True when `local_shard()` is a lasting tensor in device memory (an fp32 master may share it)."""
        return self._shard is not None or self.owner.store.shares_device_memory(self)

    @property
    def keeps_full_copy(self) -> bool:
        return self.persistent

    @property
    def param(self) -> torch.nn.Parameter:
        return self.params[0]

    @property
    def gathered(self) -> bool:
        return self.flat_param is not None

    def bind(self, flat: torch.Tensor) -> None:
        """Make the parameter a view of a full gathered buffer."""
        self.flat_param = flat
        self.param.data = flat[:self.numel].view(self.shapes[0])

    def release(self) -> None:
        """Drop the full buffer; the parameter keeps only its shard."""
        if self.persistent:
            return
        self.flat_param = None
        self.param.data = self.empty

    def to_(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move or cast the shard (the module's own .to() would gather)."""
        store = None
        if self._shard is None:
            if (device, dtype) == (self.device, self.dtype):
                return
            store = self.owner.store  # written out by zero.Init: back in memory to cast, then back into the store
            store.remove(self)
        self.shard = self.shard.to(device=device, dtype=dtype)
        self.dtype, self.device = dtype, device
        self.empty = self._placeholder()
        if self.flat_param is not None:
            self.bind(self.flat_param.to(device=device, dtype=dtype))
        else:
            self.param.data = self.empty
        if store is not None:  # one shard in host memory at a time, and the engine adopts (and closes) the store
            store.add(self)

    def state_dict_value(self) -> torch.Tensor:
        """What `module.state_dict()` holds for this parameter: its values while gathered (persistent, or inside
        GatheredParameters), else DeepSpeed's placeholder, an empty tensor: never a gather, so a state_dict()
        called on one rank only (a rank-0 save) cannot wait on the others."""
        self.saving_state_dict = False
        if self.gathered:
            with torch._C.DisableTorchFunctionSubclass():
                return self.param.detach()
        if not _warned_placeholders:
            _warned_placeholders.append(True)
            import warnings
            warnings.warn(f"state_dict() of a ZeRO-3 model: partitioned parameters such as {self.names[0]} are "
                          "empty placeholders (as in DeepSpeed); for whole weights use engine.full_state_dict() or "
                          "engine.save_16bit_model() (collective), or call state_dict() inside "
                          "zerotrain.zero.GatheredParameters(model.parameters()) on every rank",
                          stacklevel=stacklevel_outside(os.path.dirname(torch.__file__)))
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def write_master(self, values: torch.Tensor) -> None:
        """New values for the fp32 master, wherever the master optimizer keeps it (NVMe: in its files)."""
        self.owner.write_master(self, values)

    def write_full(self, full: torch.Tensor) -> None:
        """Take new full values: keep this rank's chunk in the shard (and the fp32 master)."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        flat[:self.numel].copy_(full.reshape(-1))
        self.write_shard(self.shard_of(flat))
        master = self.master
        if master is not None and (self._shard is None or master.data_ptr() != self._shard.data_ptr()):
            self.write_master(self.shard_of(flat))
        if self.gathered:
            self.flat_param.copy_(flat)


_warned_placeholders: list = []  # one warning per process


_placeholder_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def state_dict_placeholders(module: torch.nn.Module) -> None:
    """Make `state_dict()` of `module` and its submodules communication-free for partitioned parameters, as
    DeepSpeed's: a released one is saved as an empty placeholder (`PartitionedParam.state_dict_value`) instead
    of being gathered, which would hang a state_dict() called on one rank only. A state_dict pre-hook on each
    module holding partitioned parameters marks them for the `detach()` that `Module._save_to_state_dict`
    calls next; the post-hook clears the marks (keep_vars=True: no detach, the parameters themselves)."""
    for owner in module.modules():
        if not _own_parts(owner) or owner in _placeholder_modules:
            continue
        _placeholder_modules.add(owner)
        owner.register_state_dict_pre_hook(_mark_saving)
        owner.register_state_dict_post_hook(_unmark_saving)


def _own_parts(module: torch.nn.Module) -> list:
    return [p._zero for p in module.parameters(recurse=False) if isinstance(p, ZeroParameter)]


def _mark_saving(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    for part in _own_parts(module):
        part.saving_state_dict = not keep_vars


def _unmark_saving(module: torch.nn.Module, state_dict, prefix: str, local_metadata) -> None:
    for part in _own_parts(module):
        part.saving_state_dict = False


def _zero_params_in(args, kwargs) -> list:
    flat, _ = tree_flatten((args, kwargs))
    return [item for item in flat if isinstance(item, ZeroParameter)]


# Methods that read metadata or register hooks: never worth a gather (a released
# parameter reports its full shape; `param.ds_shape` / `ds_numel` say the same).
_NO_GATHER = {
    "__get__", "__set__", "__delete__", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "numel", "nelement", "size", "dim", "ndimension", "element_size", "is_floating_point", "is_complex",
    "get_device", "is_contiguous", "data_ptr", "untyped_storage", "__repr__", "__format__",
    "__hash__", "__eq__", "__reduce_ex__", "__deepcopy__", "_is_view",
}


class ZeroParameter(torch.nn.Parameter):
    """A parameter whose full value exists only while gathered (see module docstring)."""

    _zero: PartitionedParam

    @property
    def ds_status(self) -> ZeroParamStatus:
        """DeepSpeed's name: AVAILABLE while whole (gathered, or persistent), NOT_AVAILABLE while only the shard
        is here (DeepSpeed-Chat gathers exactly the NOT_AVAILABLE ones before reading them)."""
        return ZeroParamStatus.AVAILABLE if self._zero.gathered else ZeroParamStatus.NOT_AVAILABLE

    @classmethod
    def __torch_function__(cls, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes `tensor=`
        if name == "detach" and isinstance(target, ZeroParameter) and target._zero.saving_state_dict:
            return target._zero.state_dict_value()
        if name not in _NO_GATHER:
            released = [p for p in _zero_params_in(args, kwargs) if not p._zero.gathered]
            initializer = name in _INITIALIZERS and isinstance(target, ZeroParameter)
            if released:
                if name in _INDEXING and len(released) == 1 and released[0] is args[0] \
                        and released[0]._zero.owner.fetcher is None:
                    return _index_unowned(name, released[0]._zero, args[1:])
                if initializer and not target._zero.gathered and len(released) == 1:
                    rest = {key: value for key, value in kwargs.items() if value is not target}
                    if name in _FULL_TENSOR_INITS:
                        return _apply_to_full_then_shard(func, target._zero, args[1:], rest)
                    return _apply_to_shard(func, target._zero, args[1:], rest)
                for param in released:
                    param._zero.fetch_for_access()
            elif initializer and target._zero.persistent:
                return _apply_to_persistent(func, target._zero, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if result is target and name not in _RETURNS_SELF and not name.endswith("_"):
            # `p.cpu()` / `p.to(same device)` / `p.contiguous()` return the parameter itself: hand out a plain
            # tensor instead (a view, still differentiable to it), so `torch.save({k: v.cpu()})` pickles tensors,
            # not a parameter carrying process groups, and it keeps the gathered values after the release.
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.view_as(result, result)
        return result


# Methods and operators that return the parameter itself by design (in-place operators, attribute access).
_RETURNS_SELF = {"__get__", "__set__", "__delete__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                 "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                 "__irshift__", "__imatmul__"}

# Indexing a released parameter no engine owns yet (zero.Init construction), e.g. transformers'
# `init.zeros_(embedding.weight[padding_idx])`: see `_index_unowned`.
_INDEXING = {"__getitem__", "__setitem__"}


def _local_full(part: PartitionedParam, flat: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A transient full-shaped tensor holding this rank's shard in place and zeros elsewhere (no gather);
    given the padded `flat` it views, its chunk is refreshed from the shard (which may have changed since)."""
    if flat is None:
        flat = torch.zeros(part.padded_numel, dtype=part.dtype, device=part.device)
    part.shard_of(flat).copy_(part.shard)
    return flat[:part.numel].view(part.shapes[0])


def _index_unowned(name: str, part: PartitionedParam, rest: tuple):
    """`param[index] = value`, or `param[index]` as a `ShardSlice` that an initializer writes in place,
    on a parameter partitioned by zero.Init before an engine owns it (so no gather is possible: nothing
    fetches yet). Both work on `_local_full`: an assignment or an in-place initializer overwrites (or
    scales) the indexed elements one by one, so this rank's chunk of the result is exact without the
    other ranks' values; `write_full` keeps that chunk. Reading a slice's values is refused."""
    wait_for_snapshots([part])
    full = _local_full(part)
    if name == "__setitem__":
        index, value = rest
        value = value.data if isinstance(value, ZeroParameter) else value
        with torch._C.DisableTorchFunctionSubclass():
            full[index] = value
        part.write_full(full)
        return None
    with torch._C.DisableTorchFunctionSubclass():
        view = full[rest[0]]
    piece = view.as_subclass(ShardSlice)
    piece._zero_slice = (part, full)
    return piece


class ShardSlice(torch.Tensor):
    """`param[index]` of a parameter zero.Init partitioned, before an engine owns it: an in-place initializer
    on it (`zero_`, `fill_`, `normal_`, `torch.nn.init.*`, ...) writes this rank's chunk of the result into the
    shard (transformers zeroes an embedding's padding row this way); any other use raises."""

    _zero_slice: tuple

    @classmethod
    def __torch_function__(cls, func: Callable, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _NO_GATHER and name not in ("__repr__", "__format__"):  # metadata; printing would show zeros
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        target = args[0] if args else kwargs.get("tensor")
        others = [item for item in tree_flatten((args[1:], kwargs))[0]
                  if isinstance(item, (ShardSlice, ZeroParameter)) and item is not target]
        if name in _INITIALIZERS and isinstance(target, ShardSlice) and not others:
            part, full = target._zero_slice
            _local_full(part, full._base if full._base is not None else full)  # the shard's current values
            with torch._C.DisableTorchFunctionSubclass():
                func(*args, **kwargs)
            part.write_full(full)
            return target
        part = next(item for item in tree_flatten((args, kwargs))[0] if isinstance(item, ShardSlice))._zero_slice[0]
        raise RuntimeError(f"{name} on a slice of parameter {part.names[0]}, which zero.Init partitioned and no engine "
                           "owns yet: only in-place initializers (zero_, fill_, normal_, torch.nn.init.*) or an "
                           "assignment `param[index] = value` can change it here; to read it use "
                           "zerotrain.zero.GatheredParameters")


def _apply_to_full_then_shard(func: Callable, part: PartitionedParam, rest: tuple, kwargs: dict):
    """Run a position-dependent initializer on a transient full tensor; keep this rank's chunk.

    No gather: the old values are overwritten anyway. Each rank draws the whole tensor from its
    own generator, as torch would, so the shards together are torch's tensor when the ranks'
    generators agree (seeded alike, as for any data-parallel init)."""
    wait_for_snapshots([part])  # a pending async checkpoint copy reads this shard and master first
    full = torch.empty(part.shapes[0], dtype=part.dtype, device=part.device)
    with torch._C.DisableTorchFunctionSubclass():
        func(full, *rest, **kwargs)
    part.write_full(full)
    return part.param


def _apply_to_persistent(func: Callable, part: PartitionedParam, args: tuple, kwargs: dict):
    """An in-place initializer on a persistent (always whole) parameter: run it on the full copy,
    then take the result into the shard and the master, so the next step does not overwrite it."""
    wait_for_snapshots([part])
    with torch._C.DisableTorchFunctionSubclass():
        result = func(*args, **kwargs)
        with torch.no_grad():
            part.write_full(part.param.data.clone())
    return result


def _apply_to_shard(func: Callable, part: PartitionedParam, rest: tuple, kwargs: dict):
    """Run an in-place element-wise op on the shard; full-shaped tensor operands are cut to the chunk."""
    wait_for_snapshots([part])  # a pending async checkpoint copy reads this shard and master first
    start, end = part.shard_bounds()

    def chunk_of(value):
        if torch.is_tensor(value) and value.numel() == part.numel:
            flat = torch.zeros(part.padded_numel, dtype=value.dtype, device=value.device)
            flat[:part.numel].copy_(value.reshape(-1))
            return flat[start:end]
        return value

    rest = tuple(chunk_of(value) for value in rest)
    shard = part.shard
    with torch._C.DisableTorchFunctionSubclass():
        func(shard, *rest, **kwargs)
        # Padding stays zero whatever the op did to it.
        valid = max(0, min(end, part.numel) - start)
        shard[valid:].zero_()
    part.write_shard(shard)  # offloaded: back to the host copy or the file
    master = part.master
    if master is not None and master.data_ptr() != shard.data_ptr():
        part.write_master(shard)
    return part.param


def partition_parameter(name: str, param: torch.nn.Parameter, group: ShardGroup,
                        owner: Optional[ParamOwner] = None) -> PartitionedParam:
    """Partition one full parameter in place over `group`: keep this rank's shard, release the rest. `owner`:
    what it reaches beyond itself (zero.Init's, with its parameter store); a lone one if not given."""
    part = PartitionedParam(name, param, group, owner=owner)
    part.release()
    return part

