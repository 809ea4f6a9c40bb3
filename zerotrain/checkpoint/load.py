"""Loading a checkpoint onto any topology: read what this rank needs, validate, agree, then apply.

Each rank reads, for every piece of its slots (`CheckpointState.slots()` records),
that range of the whole tensor from the files (`TensorReader.read_range`): fp32
masters from the master-weights files when the checkpoint has them (exact resume
of bf16/fp16 training), else from the model files; optimizer states from
`name/<key>` of the optimizer files. So a checkpoint written at any world size and
stage loads into any other: the layout of the writer never matters. Tensor parallelism
too: a split parameter's records are ranges of this rank's slice, mapped through its
TensorSlice to runs of the whole tensor in the files (`split.RunsRead`), so any
tensor-parallel degree loads a checkpoint written at any other.

Two phases. `prepare` validates everything the load will read, touching nothing in
the engine: the manifest, every needed file's size, the checksums (with
`checkpoint.verify_on_load`: each rank computes the crc32 of an equal byte range of
the needed files, `integrity.checksum_share`), every safetensors header, and for every
range this rank will read, that the tensor exists with the expected shape; small state
(trainer state, RNG, optimizer scalars) is read here. All ranks then agree, through one
all-gather of their outcomes and checksum pieces, that every rank succeeded and every
file's whole crc32 matches the manifest (`integrity.check_pieces`), and only then does
`apply` read each range straight into the engine's own tensors (no staging copy of the
state: after the checks, only an I/O error of the disk itself can interrupt it). A
bad checkpoint raises the same CheckpointError on every rank, naming the file or
tensor, and leaves model, optimizer and counters untouched.

Speed: the checksum pass is the load's one read from the disk (through the page cache);
`apply` then copies the bytes from memory straight into the engine's tensors, on as many
threads as this host has cores per rank (`directio.copy_threads`; a copy is CPU-bound, more
threads only cost CPU). Without checksums the reads go to the disk, `directio.READ_THREADS`
at once. A resume before the first step (the optimizer holds no state yet: a run resuming at
start-up) reads the optimizer states once: `prepare` makes the new state tensors and plans the
reads into them (`LoadPlan.direct`). So does a load into an engine that has them (a rollback
in the same process), when a second copy of them fits what the host can spare now
(`CheckpointState.load_copy_bytes`, the engine's share rule; else the checksum pass and the
copy as above): the new tensors replace the optimizer's after the verdict, as DeepSpeed's load
holds a second copy of what it reads (run 33: at 500M parameters the checksum pass's pages no
longer stay cached, and the copy read every byte a second time). The ranks all-gather those
byte ranges, each rank reads its ranges straight into its new tensors with the crc32 computed
on the landed bytes (`reader.TensorReader.plan_checked`, `directio.CheckedReads`: O_DIRECT,
READ_THREADS requests in flight; the ranges another rank also reads counted once:
`integrity.claimed_ranges`), and the
checksum pass covers only the other bytes (weights, headers, scalars), at the same time on its own
thread, shared out so that each rank's direct reads plus its share are equal
(`integrity.balanced_share`). The verdict then judges every file from pieces that must cover it exactly
once; a refused load drops the new tensors, which nothing else holds yet. The optimizer's
scalar states (one `step` per parameter, read while planning) are requested from the kernel
before the checksum pass starts (`reader.prefetch_small_tensors`), so that planning does not
wait on single small reads behind another rank's checksum stream.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch

from .deepspeed_dir import convert_deepspeed, deepspeed_tag_dir
from .format import MASTER, MODEL, OPTIMIZER, CheckpointError, crc32, read_json, rng_file
from .loco import loco_file, read_loco, restore_loco
from .optim_state import StateTemplate, check_groups, make_scalar, probe_template, restore_hyperparameters
from .plan import extra_tensors
from .directio import READ_THREADS, CheckedReads, copy_threads, run_parallel
from .integrity import Intervals, check_pieces, claimed_ranges
from .reader import TensorReader, prefetch_small_tensors
from .slots import CheckpointState, aliased_slots, sharded_names
from .split import RunsRead, expected_shape, tensor_slices
from .source import HUGGING_FACE, ZEROTRAIN, Source, needed_files, open_source, resolve, verify
from .state import apply_trainer_state, decode, restore_rng
from ..lora import base_weight_name, is_adapter_weight

logger = logging.getLogger("zerotrain")


@dataclass
class Read:
    """Elements [start, start+count) of tensor `name` go to [offset, offset+count) of a slot tensor."""

    reader: TensorReader
    name: str
    start: int
    count: int
    offset: int

    def into(self, target: torch.Tensor) -> None:
        self.reader.read_into(self.name, self.start, self.count, target[self.offset:self.offset + self.count])


@dataclass
class SlotLoad:
    weights: list                        # Reads into the master (or, for a frozen slot, the model shard)
    states: Optional[dict] = None        # key -> Reads left for `apply`; None: leave the optimizer state alone
    scalars: dict = field(default_factory=dict)
    template: Optional[StateTemplate] = None
    fresh: dict = field(default_factory=dict)  # key -> a state tensor this load made (the optimizer had none)


@dataclass
class LoadPlan:
    """Everything a load will do, validated; holds the open files until it is applied or dropped."""

    path: str
    source: Source
    slots: list
    extras: list                         # (name, Read of the whole tensor)
    rng: Optional[dict]
    load_optimizer: bool
    files: contextlib.ExitStack
    loco: Optional[dict] = None          # this rank's saved LoCo error buffers, when it has some
    cached: bool = False                 # the checksum pass put every byte in the page cache: copies, not reads
    direct: list = field(default_factory=list)  # (Read, fresh state tensor): read with their crc32 before the verdict
    direct_read: bool = False            # `read_direct` filled them (else `apply` refuses: torch.empty memory)

    def direct_ranges(self) -> list[tuple[str, int, int]]:
        """(file name, first byte, end byte) of every read into a fresh state tensor, in order."""
        return [read.reader.byte_range(read.name, read.start, read.count) for read, _ in self.direct]

    def read_direct(self, claims: list, threads: int = READ_THREADS) -> list:
        """Read every `direct` range straight into its fresh state tensor, computing the crc32 of its `claims`
        (`integrity.claimed_ranges`, one list per read) as the bytes land, `threads` requests in flight
        (`directio.CheckedReads`: O_DIRECT, the disk's queue kept deep); the crc32 pieces."""
        reads = CheckedReads(crc32, threads)
        for (read, target), claim in zip(self.direct, claims):
            read.reader.plan_checked(reads, read.name, read.start, read.count,
                                     target[read.offset:read.offset + read.count], claim)
        try:
            pieces = reads.run()
        except OSError as error:
            raise CheckpointError(f"cannot read the optimizer states of {self.path}: {error}") from error
        self.direct_read = True
        return pieces


def _name_candidates(module: torch.nn.Module, name: str, hugging_face: bool) -> list[str]:
    candidates = [name]
    base = base_weight_name(name)  # a PEFT-wrapped model loading its base model (a model directory or checkpoint)
    if base != name:
        candidates.append(base)
        name, module = base, getattr(module, "get_base_model", lambda: module)()
    if not hugging_face:
        return candidates
    prefix = getattr(module, "base_model_prefix", "") or ""
    if prefix and name.startswith(prefix + "."):
        candidates.append(name[len(prefix) + 1:])
    elif prefix:
        candidates.append(f"{prefix}.{name}")
    return candidates


def _find(reader: TensorReader, module, name: str, hugging_face: bool) -> Optional[str]:
    return next((c for c in _name_candidates(module, name, hugging_face) if reader.has(c)), None)


def _record_read(reader: TensorReader, stored: str, record, slices: dict):
    """Check tensor `stored` has the whole shape of `record`'s parameter; the read of the record's range."""
    tensor_slice = slices.get(record.name)
    reader.check(stored, expected_shape(record.full_shape, tensor_slice, record.name))
    if tensor_slice is None:
        return Read(reader, stored, record.param_start, record.numel, record.shard_start)
    return RunsRead(reader, stored, tensor_slice, record.param_start, record.numel, record.shard_start)


def _check_model_fits(model: TensorReader, module, slots, slices: dict, hugging_face: bool, path: str,
                      base_only: bool = False, masters: Optional[TensorReader] = None) -> None:
    """Every parameter this rank loads is in the model weights with its shape, else one error naming the first
    mismatching weight and how many mismatch (a checkpoint of another model is named by its weights, not by
    the first optimizer state that happens to be read)."""
    problems: list[str] = []
    seen: set[str] = set()
    for slot in slots:
        for record in slot.records:
            if record.name in seen:
                continue
            seen.add(record.name)
            if masters is not None and slot.master is not None and masters.has(record.name):
                continue  # a trained adapter weight: in the master files only (plan.TensorPlan.adapter)
            name = _find(model, module, record.name, hugging_face)
            if name is None and base_only and is_adapter_weight(record.name):
                continue  # a LoRA adapter on its base model's weights: it keeps its initialisation
            if name is None:
                problems.append(f"tensor {record.name!r} is missing from the model weights of {path}")
                continue
            try:
                model.check(name, expected_shape(record.full_shape, slices.get(record.name), record.name),
                            floating=False)
            except CheckpointError as error:
                problems.append(str(error))
    if problems:
        more = f" ({len(problems)} of {len(seen)} model weights this rank loads do not match)" \
            if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}: is this a checkpoint of another model?")


class _Templates:
    """The optimizer state template of each master, probed once per (group, device, dtype)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.group_of = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
        self.cache: dict = {}

    def __call__(self, master: torch.Tensor) -> StateTemplate:
        if id(master) not in self.group_of:
            raise CheckpointError("a master shard is in no optimizer group")
        group = self.group_of[id(master)]
        if self.optimizer.state.get(master):
            return probe_template(self.optimizer, group, master)  # read off the existing state: no probe
        key = (group, master.device, master.dtype)
        if key not in self.cache:
            self.cache[key] = probe_template(self.optimizer, group, master)
        return self.cache[key]


def _plan_states(slot, reader: TensorReader, templates: _Templates, slices: dict) -> SlotLoad:
    template = templates(slot.master)
    load = SlotLoad([], {key: [] for key in template.elementwise}, {}, template)
    for record in slot.records:
        for key in template.elementwise:
            load.states[key].append(_record_read(reader, f"{record.name}/{key}", record, slices))
        for key in template.scalars:
            name = f"{record.name}/{key}"
            reader.check(name, ())
            value = float(reader.read(name).item())
            if key in load.scalars and load.scalars[key] != value:
                raise CheckpointError(f"optimizer state {name!r} is {value} but other parameters of the same shard "
                                      f"have {load.scalars[key]}; they cannot share one optimizer state")
            load.scalars[key] = value
    for key in template.scalars:
        if key not in load.scalars:  # a shard holding only padding: any parameter's value will do
            name = next((n for n in reader.weight_map if n.endswith("/" + key)), None)
            if name is None:
                raise CheckpointError(f"optimizer state {key!r} is missing from {reader.directory}")
            load.scalars[key] = float(reader.read(name).item())
    return load


def open_checked(path: str, load_optimizer_states: bool, load_module_only: bool) -> tuple[Source, list]:
    """The source at `path` with every file it needs present at its manifest size (a zerotrain checkpoint;
    any other source: no files listed); (source, names of the files to checksum)."""
    source = open_source(path, load_module_only)
    if source.kind == ZEROTRAIN and load_optimizer_states and not load_module_only:
        prefetch_small_tensors(path, sorted(source.files_of(OPTIMIZER)))
    if source.kind != ZEROTRAIN:
        return source, []
    names = needed_files(source, load_optimizer_states, load_module_only)
    verify(source, names, 0, 1, checksums=False)  # sizes only: the checksums come after the ranges are known
    return source, names


def _copy_bytes(slots, optimizer) -> int:
    """Bytes of the per-element optimizer states in host memory that reading into new tensors would copy."""
    total = 0
    for slot in slots:
        if slot.master is None or slot.master.device.type != "cpu":
            continue
        for value in (optimizer.state.get(slot.master) or {}).values():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == slot.master.numel():
                total += value.numel() * value.element_size()
    return total


def _direct_reads(load: SlotLoad, slot, optimizer, replace: bool) -> list:
    """Make the state tensors the optimizer does not have yet (a resume before the first step), and with
    `replace` new ones for those it has too, and take the reads that can go straight into them out of
    `load.states`: (Read, tensor) each, read with their crc32 before the verdict (`LoadPlan.read_direct`). A
    failed verdict drops the tensors: nothing to roll back; `apply` puts them in place of the optimizer's (the
    old ones are then freed).

    A tensor that only such reads fill is made with `torch.empty`, and only the elements no read covers (a
    shard's padding) are zeroed: its memory is first touched by the read itself, not by a zeroing pass first
    (measured, run 23's `fresh` against `inplace_new`: 0.63-0.71x)."""
    if load.states is None or slot.master.device.type != "cpu":
        return []
    current = optimizer.state.get(slot.master) or {}
    direct = []
    for key, reads in load.states.items():
        dtype = load.template.elementwise[key]
        if _fits(current.get(key), slot.master, dtype) and not replace:
            continue  # the optimizer's own tensor: written only after the verdict
        tensor = torch.empty(slot.master.numel(), dtype=dtype, device=slot.master.device)
        straight = [read for read in reads if type(read) is Read and
                    read.reader.can_read_checked(read.name, tensor[read.offset:read.offset + read.count])]
        if len(straight) < len(reads):  # some read goes through a conversion after the verdict: zeros as before
            tensor.zero_()
        else:
            for begin, end in Intervals((read.offset, read.offset + read.count) for read in reads).gaps(tensor.numel()):
                tensor[begin:end].zero_()
        load.fresh[key] = tensor
        direct += [(read, tensor) for read in straight]
        load.states[key] = [read for read in reads if not any(read is taken for taken in straight)]
    return direct


def prepare(state: CheckpointState, source: Source, sharded: set[str], load_optimizer_states: bool,
            load_module_only: bool) -> LoadPlan:
    """Validate everything this rank will read (names, shapes) from `source` (`open_checked`); touch no
    engine state. With `checkpoint.verify_on_load`, the state tensors a load makes (the optimizer has none
    yet) are made here, and the reads into them planned as `LoadPlan.direct`."""
    path = source.path
    hugging_face = source.kind == HUGGING_FACE
    load_optimizer = load_optimizer_states and not load_module_only and source.kind == ZEROTRAIN
    verifying = source.kind == ZEROTRAIN and bool(state.config.checkpoint.verify_on_load)
    direct: list = []
    module = state.module
    files = contextlib.ExitStack()
    try:
        model = files.enter_context(TensorReader(path, source.maps[MODEL], "model weights"))
        masters = files.enter_context(TensorReader(path, source.maps.get(MASTER, {}), "master weights"))
        optim = files.enter_context(TensorReader(path, source.maps.get(OPTIMIZER, {}), "optimizer states"))
        slices = tensor_slices(module)
        # checkpoint.adapters_only: the checkpoint holds only the trainable parameters; the frozen ones keep what
        # the model has (its base, loaded from the model directory first)
        adapters_only = bool(source.kind == ZEROTRAIN and (source.trainer_state or {}).get("adapters_only"))
        # a pipeline's tied copies read the owner's entries (CheckpointState.aliases)
        all_slots = aliased_slots(state.slots(), state.aliases)
        loaded_slots = [slot for slot in all_slots if not (adapters_only and slot.master is None)]
        base_only = hugging_face or load_module_only  # a model's weights, maybe the base of a LoRA-wrapped one
        _check_model_fits(model, module, loaded_slots, slices, hugging_face, path, base_only, masters)
        if load_optimizer:
            check_groups(source.optimizer_meta.get("param_groups", []), state.optimizer)
        slot_loads = []
        templates = _Templates(state.optimizer) if load_optimizer else None  # forward-only engines have none
        # states the optimizer has: into new tensors too (verifying) when their second copy fits what the host
        # can spare now
        replace_states = _copy_bytes(all_slots, state.optimizer) <= state.load_copy_bytes()
        for slot in all_slots:
            frozen = slot.master is None  # a partitioned frozen parameter (stage 3): model dtype, no optimizer
            load = SlotLoad([])
            if frozen and adapters_only:
                slot_loads.append(load)
                continue
            if load_optimizer and not frozen:
                load = _plan_states(slot, optim, templates, slices) if optim.weight_map else SlotLoad([], {})
                if verifying and load.states:
                    direct += _direct_reads(load, slot, state.optimizer, replace_states)
            for record in slot.records:
                reader = masters if masters.has(record.name) and not frozen else model
                name = _find(reader, module, record.name, hugging_face)
                if name is None and base_only and is_adapter_weight(record.name):
                    continue  # see _check_model_fits
                if name is None:
                    raise CheckpointError(f"tensor {record.name!r} is missing from the model weights of {path}")
                load.weights.append(_record_read(reader, name, record, slices))
            slot_loads.append(load)
        extras = []
        for name, tensor in extra_tensors(module, sharded) if not adapters_only else ():
            found = _find(model, module, name, hugging_face)
            if found is None:
                if hugging_face and not isinstance(tensor, torch.nn.Parameter):
                    logger.warning("buffer %s is not in %s; keeping the model's own value", name, path)
                    continue
                raise CheckpointError(f"tensor {name!r} is missing from the model weights of {path}")
            tensor_slice = slices.get(name)  # a frozen split parameter (stages 0-2): this rank's slice of it
            model.check(found, tuple(tensor.shape) if tensor_slice is None else tensor_slice.full_shape,
                        floating=False)
            extras.append((name, Read(model, found, 0, tensor.numel(), 0) if tensor_slice is None else
                           RunsRead(model, found, tensor_slice, 0, tensor.numel(), 0)))
        rng = None
        if source.kind == ZEROTRAIN and not load_module_only and \
                rng_file(state.topology.rank) in source.manifest["files"]:
            rng = read_json(os.path.join(path, rng_file(state.topology.rank)))
        loco = None
        if source.kind == ZEROTRAIN and not load_module_only and \
                loco_file(state.topology.rank) in source.manifest["files"]:
            loco = read_loco(os.path.join(path, loco_file(state.topology.rank)))
    except BaseException:
        files.close()
        raise
    return LoadPlan(path, source, slot_loads, extras, rng, load_optimizer, files, loco, verifying, direct)


def _fits(current, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the optimizer's `current` state tensor can take the loaded values in place."""
    return torch.is_tensor(current) and current.shape == master.shape and current.dtype == dtype


def _state_tensor(current, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if _fits(current, master, dtype):
        return current  # written in place: no second copy of the state in memory
    return torch.zeros(master.numel(), dtype=dtype, device=master.device)


def _no_grad(function, *args):
    """`function(*args)` as a task for a worker thread, under no_grad (grad mode is per thread: the
    in-place writes into masters that require grad must not be recorded)."""
    def task():
        with torch.no_grad():
            return function(*args)
    return task


def _extra_read(read, target: torch.Tensor) -> None:
    """Read a whole (unsharded) tensor into the model's own parameter or buffer."""
    target = target.data if isinstance(target, torch.nn.Parameter) else target
    if isinstance(read, RunsRead):
        local = torch.empty(target.numel(), dtype=target.dtype)
        read.into(local)
        target.copy_(local.reshape(target.shape))
    elif target.is_contiguous():
        read.reader.read_into(read.name, 0, target.numel(), target.reshape(-1))
    else:
        target.copy_(read.reader.read(read.name).reshape(target.shape))


def apply(state: CheckpointState, plan: LoadPlan, load_lr_scheduler_states: bool, load_module_only: bool) -> None:
    """Carry out a validated plan: read each range straight into the engine's tensors (the reads run on
    several threads; each writes its own range of its own tensor)."""
    optimizer = state.optimizer
    if plan.direct and not plan.direct_read:
        raise CheckpointError(f"loading {plan.path}: the reads straight into new optimizer states were planned but "
                              f"not done (the checksum stage was skipped)")
    targets = dict(state.module.state_dict(keep_vars=True))
    reads: list = []  # (Read, destination tensor)
    with plan.files, torch.no_grad():
        for slot, load in zip(state.slots(), plan.slots):
            if slot.master is None:
                reads += [(read, slot.model_shard) for read in load.weights]
                continue
            reads += [(read, slot.master) for read in load.weights]
            if load.states is None:
                continue
            if not load.states and not load.scalars:
                optimizer.state.pop(slot.master, None)  # saved before the first step: a fresh state
                continue
            current = optimizer.state.get(slot.master, {})
            restored = {}
            for key, key_reads in load.states.items():
                restored[key] = load.fresh[key] if key in load.fresh else \
                    _state_tensor(current.get(key), slot.master, load.template.elementwise[key])
                reads += [(read, restored[key]) for read in key_reads]
            restored.update({key: make_scalar(load.template, key, value) for key, value in load.scalars.items()})
            optimizer.state[slot.master] = restored
        tasks = [_no_grad(read.into, target) for read, target in reads]
        tasks += [_no_grad(_extra_read, read, targets[name]) for name, read in plan.extras]
        topology = state.topology
        run_parallel(tasks, copy_threads(min(topology.world_size, (topology.ranks_per_node or topology.dp_size)
                                             * topology.tp_size)) if plan.cached else READ_THREADS)
        state.publish()  # every rank's model weights current after masters and frozen shards were written
    if plan.source.kind != ZEROTRAIN:
        return
    if plan.load_optimizer:
        restore_hyperparameters(plan.source.optimizer_meta.get("param_groups", []), optimizer)
    if not load_module_only:
        apply_trainer_state(state, plan.source.trainer_state, load_lr_scheduler_states)
        if plan.rng is not None:
            restore_rng(plan.rng)
        restore_loco(state.loco, plan.loco, plan.path, state.topology.rank)
        saved_world = plan.source.trainer_state.get("topology", {}).get("world_size")
        if saved_world != state.topology.world_size:
            logger.info("checkpoint %s was written by %s ranks, loaded on %s: ranks without a saved RNG state "
                        "keep their own", plan.path, saved_world, state.topology.world_size)


def load_checkpoint(state: CheckpointState, load_dir: str, tag: Optional[str] = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load a checkpoint written at any world size and stage (call on every rank); returns (path, client_state).

    Returns (None, None) with a warning when `load_dir` holds no checkpoint and no `latest`
    (as DeepSpeed does), so "resume if there is something to resume" needs no special case.
    """
    deepspeed_path = deepspeed_tag_dir(load_dir, tag)
    if deepspeed_path is not None:  # a DeepSpeed checkpoint: converted once (rank 0), then loaded as ours
        return _load_deepspeed(state, deepspeed_path, load_optimizer_states, load_lr_scheduler_states,
                               load_module_only)
    with state.resident(True):  # NVMe-offloaded states and parameters in memory; written back after
        return _load_resident(state, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                              load_module_only)


def _load_deepspeed(state: CheckpointState, path: str, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                    load_module_only: bool):
    """Load DeepSpeed checkpoint `path`: rank 0 writes it as a zerotrain checkpoint in a temporary directory beside
    it (on the file system every rank reads it from), every rank loads that (resharded onto this topology) and
    rank 0 removes it. Returns (path, client_state) as DeepSpeed's load_checkpoint does."""
    comm = state.world
    parent = os.path.dirname(os.path.abspath(path))
    temp, message = None, None
    if comm.rank == 0:
        try:
            try:
                temp = tempfile.mkdtemp(prefix=".zerotrain-import-", dir=parent)
            except OSError:  # a read-only checkpoint directory: the local temporary directory (one node)
                temp = tempfile.mkdtemp(prefix="zerotrain-import-")
            convert_deepspeed(path, temp)
        except Exception as error:  # noqa: BLE001 - every rank must learn it
            message = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    temp, message = comm.all_gather_object((temp, message))[0]
    try:
        if message is not None:
            raise CheckpointError(f"cannot import DeepSpeed checkpoint {path}: {message}")
        with state.resident(True):
            _, client_state = _load_resident(state, temp, None, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
    finally:
        comm.all_gather_object(None)  # every rank has read the converted files
        if comm.rank == 0 and temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return path, client_state


def _load_resident(state: CheckpointState, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                   load_module_only):
    comm = state.world
    sharded = set().union(*comm.all_gather_object(sorted(sharded_names(state.slots()))))
    path, source, names, plan, error, checked = None, None, [], None, None, []
    try:
        path = resolve(load_dir, tag)
        if path is not None:
            source, names = open_checked(path, load_optimizer_states, load_module_only)
            plan = prepare(state, source, sharded, load_optimizer_states, load_module_only)
    except Exception as caught:  # noqa: BLE001 - every rank must learn of it before anyone applies
        error = caught
    if state.config.checkpoint.verify_on_load:  # the same on every rank: so is this collective
        error = _checksum(state, source, names, plan, checked, error)
    message = None if error is None else str(error) if isinstance(error, CheckpointError) else \
        f"{type(error).__name__}: {error}"
    outcomes = comm.all_gather_object((path, message, checked))
    paths = {p for p, _, _ in outcomes}
    # every rank joins the same pieces: the same verdict everywhere; a corrupt file explains any other error
    failures = [(r, message) for r, (_, message, _) in enumerate(outcomes) if message]
    corrupt = check_pieces(path, [share for _, _, shares in outcomes for share in shares], complete=not failures) \
        if len(paths) == 1 and path is not None else None
    if failures or corrupt or len(paths) > 1:
        if plan is not None:
            plan.files.close()
    if corrupt:
        raise CheckpointError(f"cannot load checkpoint from {load_dir}: {corrupt}") from error
    if failures:
        failed_rank, message = failures[0]
        where = f" (rank {failed_rank})" if comm.size > 1 else ""
        raise CheckpointError(f"cannot load checkpoint from {load_dir}{where}: {message}") from error
    if len(paths) > 1:
        raise CheckpointError(f"ranks resolved different checkpoints in {load_dir}: {[p for p, _, _ in outcomes]}")
    if path is None:
        logger.warning("no checkpoint to load in %s (no 'latest' file); starting from scratch", load_dir)
        return None, None
    apply(state, plan, load_lr_scheduler_states, load_module_only)
    client_state = {}
    if plan.source.kind == ZEROTRAIN:
        client_state = decode(plan.source.trainer_state.get("client_state") or {})
    return path, client_state


def _checksum(state: CheckpointState, source: Optional[Source], names: list, plan: Optional[LoadPlan], checked: list,
              error: Optional[BaseException]) -> Optional[BaseException]:
    """This rank's part of the verified load's checksums, appended to `checked` (also when planning failed: a
    corrupt file explains any other error): the reads straight into fresh state tensors (`LoadPlan.direct`,
    each rank's ranges all-gathered first), with the crc32 of the bytes this rank claims computed as they land
    (`integrity.claimed_ranges`: overlapping reads are counted once), and an equal share of every byte no rank
    reads that way (`integrity.checksum_share`), mapped through the page cache for `apply`'s copies. Together
    the ranks' pieces cover every needed file exactly once. Returns the first error (`error` if set)."""
    comm = state.world
    mine = plan.direct_ranges() if plan is not None and error is None else []
    everyone = comm.all_gather_object(mine)
    if source is None or not names:
        return error
    try:
        skip: dict = {}
        for ranges in everyone:
            for name, begin, end in ranges:
                skip.setdefault(name, Intervals()).add(begin, end)
        loads = [sum(end - begin for _, begin, end in ranges) for ranges in everyone]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotrain-checksum") as pool:
            # the checksum pass (the page cache's readahead, one stream) and the reads straight into new
            # states (O_DIRECT, several requests) at once: the disk's queue holds both (run 27)
            shared = pool.submit(verify, source, names, comm.rank, comm.size, True, skip, loads)
            pieces: list = []
            try:
                if mine:
                    lower = [entry for ranges in everyone[:comm.rank] for entry in ranges]
                    pieces = plan.read_direct(claimed_ranges(mine, lower))
            finally:
                share = shared.result()  # its error first: a corrupt or short file explains a failed read
                checked.append(share)
        share["pieces"] = share["pieces"] + pieces
    except Exception as caught:  # noqa: BLE001 - reported to every rank with the outcomes
        return error or caught
    return error
