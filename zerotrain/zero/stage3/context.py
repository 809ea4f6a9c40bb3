"""User-facing stage-3 context managers: `zero.Init()` and `zero.GatheredParameters()`.

`Init` partitions every parameter as soon as the module that owns it finishes
its `__init__`, so a model larger than one rank's memory can be built: at most
one module's parameters are ever whole. Initializers that a parent module runs
later on an already partitioned parameter (`normal_`, `zero_`, ...) act on the
local shard (see `partition.ZeroParameter`). Given a config whose `offload_param` is on
NVMe, Init writes each shard to the NVMe parameter store as it partitions it (the store
`zerotrain.offload.param_store` registers), so host memory during the build holds one
module's parameters and the store's buffer pool, not the model's shards; `initialize`
adopts that store.

`GatheredParameters(params, modifier_rank=None)` gathers parameters for user code;
with `modifier_rank`, that rank's values are broadcast on exit and written back
into every rank's shard and fp32 master, after waiting for any asynchronous
checkpoint still copying those shards (the engine's fence, `PartitionedParam.owner.fence`).

Init hands every parameter it partitions one owner (`owner.ParamOwner`) holding its store; the
engine gives them its own when it adopts them.

Parts above `zero` extend what Init does while it is active through `register_init_extension` (as
`zerotrain.pretrained` routes transformers' `from_pretrained` to a partitioned load), never by being imported here.
"""
from __future__ import annotations

import contextlib
import functools
import json
from typing import Callable, ContextManager, Iterable, Optional, Union

import torch

from ...comm import Comm
from ...sharding import ShardGroup
from ...topology import Topology
from ..interfaces import ParamStore
from .fetch import gather_standalone
from .owner import ParamOwner
from .partition import (PartitionedParam, ZeroParameter, partition_parameter, state_dict_placeholders,
                        wait_for_snapshots)


class Init:
    """Partition parameters at construction time (DeepSpeed's `zero.Init`).

    With tensor parallelism, pass the training config (`config` or DeepSpeed's `config_dict_or_path`):
    its `tensor_parallel.autotp_size` makes Init partition over the data-parallel ranks of the grid, as
    the engine does; `initialize` gathers each layer the plan splits, one at a time, to slice it."""

    def __init__(self, config: Optional[Union[dict, str]] = None, dtype: Optional[torch.dtype] = None,
                 enabled: bool = True, timeout_seconds: float = 1800.0,
                 config_dict_or_path: Optional[Union[dict, str]] = None, **unused):
        self.enabled = enabled
        self.dtype = dtype
        self.timeout_seconds = timeout_seconds
        config = config if config is not None else config_dict_or_path
        if config is not None and not isinstance(config, dict):
            with open(config) as handle:
                config = json.load(handle)
        self.config = config or {}
        self.tp_size = _tensor_parallel_size(self.config)
        self.store = None  # offload_param nvme: where each shard goes as it is partitioned (while inside)
        self.owner = ParamOwner()  # of every parameter it partitions (with the store)
        threshold = (self.config.get("zero_optimization") or {}).get("stage3_param_persistence_threshold", 100_000)
        # "auto" (HF Trainer configs): offload every shard; initialize gives the persistent ones back.
        self.persistence_threshold = int(threshold) if isinstance(threshold, (int, float)) else 0
        self._patched: list[tuple[type, object]] = []
        self._extensions = contextlib.ExitStack()
        self.comm: Optional[Comm] = None

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        topology = Topology.build(self.timeout_seconds, tp_size=self.tp_size)
        self.comm = Comm.data_parallel(topology)
        self.device = topology.device
        if _param_store_factory is not None:
            self.store = _param_store_factory(self.config, self.comm.rank)
        self.owner = ParamOwner(store=self.store)
        self.wrap_new_classes()
        try:
            for extension in _extensions:
                self._extensions.enter_context(extension(self))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def wrap_new_classes(self) -> None:
        """Partition the parameters of module classes defined since Init was entered, too (a model class whose
        module is first imported inside it, as transformers' Auto classes import theirs)."""
        wrapped = {cls for cls, _ in self._patched}
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__ and cls not in wrapped:
                original = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(original)
                self._patched.append((cls, original))

    def __exit__(self, *exc) -> None:
        self._extensions.close()
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        # the parts' owner keeps the store (initialize adopts it and engine.close closes it), not this context
        store, self.store, self.owner = self.store, None, ParamOwner()
        if store is None:
            return
        if exc[0] is not None:  # the model being built is lost: its file and I/O threads go now, not at exit
            store.close()
            return
        store.flush()  # every shard on disk (a failed write raises here, naming file and rank)

    def _wrap(self, original):
        init = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            # Partition when the outermost __init__ of this object returns (subclass chains
            # may still set up weights after super().__init__()).
            depth = module.__dict__.get("_zerotrain_init_depth", 0)
            object.__setattr__(module, "_zerotrain_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_zerotrain_init_depth", depth)
            if depth == 0:
                init._partition(module)
        return wrapped

    def _partition(self, module: torch.nn.Module) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, ZeroParameter):
                continue
            with torch.no_grad():
                if self.dtype is not None and param.is_floating_point():
                    param.data = param.data.to(self.dtype)
                param.data = param.data.to(self.device)
            part = partition_parameter(name, param, ShardGroup.over(self.comm, True), owner=self.owner)
            if self.store is not None and part.numel > self.persistence_threshold:
                self.store.add(part)  # to NVMe now: host memory holds one module's shards, not the model's
        state_dict_placeholders(module)


_param_store_factory: Optional[Callable[[dict, int], Optional[ParamStore]]] = None
_extensions: list[Callable[["Init"], ContextManager]] = []


def register_init_extension(extension: Callable[["Init"], ContextManager]) -> None:
    """Add a context that every `Init` enters (given the Init) after it starts partitioning and leaves before it
    stops: how a part above `zero` changes what happens inside Init (registered once, on that part's import)."""
    if extension not in _extensions:
        _extensions.append(extension)


def register_param_store_factory(factory: Callable[[dict, int], Optional[ParamStore]]) -> None:
    """Set what builds the store Init writes shards to, from (config dict, rank); None from it: no store.
    `zerotrain.offload.param_store` registers its NVMe store on import (zero sits below offload)."""
    global _param_store_factory
    _param_store_factory = factory


def check_init_partitions(module: torch.nn.Module, dp_size: int) -> None:
    """Refuse a model built under zero.Init for another data-parallel size than the engine's (a tensor-parallel
    job whose Init was not given the config), naming the parameter and the fix."""
    for name, param in module.named_parameters():
        if isinstance(param, ZeroParameter) and param._zero.partitions != dp_size:
            raise ValueError(f"parameter {name} was partitioned by zero.Init over {param._zero.partitions} ranks, "
                             f"but ZeRO shards over the {dp_size} data-parallel ranks of the tensor_parallel grid: "
                             f"pass the training config to zero.Init(config=...) so it reads tensor_parallel")


def _tensor_parallel_size(config: dict) -> int:
    """`tensor_parallel.autotp_size` of a config dict (1 without one). Read here, not through
    zerotrain.config: zero sits below config, and this key (with offload_param) is all Init needs of it."""
    return max(1, int((config.get("tensor_parallel") or {}).get("autotp_size", 1)))  # DeepSpeed's 0: no AutoTP


def _all_module_classes() -> list[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


@contextlib.contextmanager
def GatheredParameters(params: Union[torch.nn.Parameter, Iterable[torch.nn.Parameter]],
                       modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
    """Gather partitioned parameters for the body; write `modifier_rank`'s changes back on exit."""
    if isinstance(params, torch.Tensor):
        params = [params]
    parts: list[PartitionedParam] = [p._zero for p in params if isinstance(p, ZeroParameter)]
    if not enabled or not parts:
        yield
        return
    experts = [part.names[0] for part in parts if part.group.expert]
    if experts and modifier_rank is not None:  # each expert-parallel rank holds other experts: no one modifier
        raise NotImplementedError(f"GatheredParameters(modifier_rank={modifier_rank}) on expert-parallel parameters "
                                  f"{experts[:4]} is not supported (read-only gathers are)")
    fetcher = parts[0].owner.fetcher
    if fetcher is not None:
        fetcher.fetch(parts, reason="user")
        fetcher.hold(parts)
        comm = fetcher.comm
    else:
        comm = parts[0].group.comm
        for part in parts:
            if not part.gathered:
                gather_standalone(part, comm)
    try:
        yield
        if modifier_rank is not None:
            wait_for_snapshots(parts)  # an async save may still be copying these shards and masters
            for part in parts:
                full = part.flat_param
                comm.broadcast(full, src=modifier_rank)
                part.write_full(full[:part.numel])
            if fetcher is not None:
                fetcher.weights_written()
    finally:
        if fetcher is not None:
            fetcher.unhold_and_release(parts)
        else:
            for part in parts:
                part.release()
