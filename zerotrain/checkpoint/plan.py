"""Save planning: which rank writes which tensor, into which file, in which round.

Every rank describes what it holds (`local_layout`: its slots' shard records and
optimizer state keys, from `engine.sharded_slots()`); the descriptions are
all-gathered and every rank computes the same `SavePlan` from them:

* each tensor name (with its master copy and optimizer states) is assigned to one
  writer rank, balanced by bytes: a name goes to the rank that already holds most of
  it when that keeps the rank within 10% of an even share, otherwise to the least
  loaded rank, so each rank writes about 1/N of the bytes and few bytes move;
* each writer's names are cut into safetensors files of at most `max_file_bytes`,
  numbered globally in Hugging Face's `model-0000i-of-0000n` style;
* every rank writes the pieces it holds in place, at their offsets in the shared files
  (`write`): no bytes move between ranks, except for tensor-parallel (or expert-parallel)
  split tensors, whose slices are strided in the whole tensor: each writer's names are
  cut into rounds of about `round_bytes`; in a round every rank sends the pieces it holds
  of the writers' split tensors in one all-to-all, so a writer receives at most about
  `round_bytes` at a time and no rank ever holds the whole model.

Tensor parallelism: a split parameter's records are ranges of its *local* tensor; its
plan has the whole shape, the TensorSlice of every tensor-parallel rank and pieces from
each of them (`Piece.tp_rank`), which its writer joins into the whole tensor (`split`).
A parameter replicated over the tensor-parallel ranks is taken from one of them.
Experts split over the ranks of each expert-parallel group (`ep_slice`) are planned alike, with
the rank's position in its expert-parallel group as the holder of each slice (`Piece.tp_rank`
then names that position); the expert-data-parallel replicas of a slice hold it partitioned
(stages 1-2: every replica's pieces are taken) or whole (stage 0: one replica's). With tensor
parallelism every tensor-parallel rank holds the same experts as its peers (experts are not split
by it): only tensor-parallel rank 0's ranks are holders, so each expert is saved once.

Partitioned frozen parameters (stage 3) are slots without a master: only their model
file entry is written. Tensors outside every slot (frozen parameters at stages 0-2,
persistent buffers) are whole on every rank; they are assigned for balance and need
no exchange (with pipeline parallelism each stage's are listed by the stage's first rank
and written by one of its ranks). A tensor named in `CheckpointState.aliases` (a tied
layer's copy on a later pipeline stage) is left out: its owner's is saved. Tied tensors appear once,
under their first name in `state_dict` order, as Hugging Face saves them.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field
import torch

from .format import MASTER, MODEL, OPTIMIZER, CheckpointError, dtype_name, itemsize, numel_of, shard_file, torch_dtype
from .optim_state import split_state
from .slots import CheckpointState
from .split import expert_params, expected_shape, refuse_split_extras, tensor_slices
from ..lora import base_weight_name, is_adapter_weight

MAX_FILE_BYTES = 5 * 1024 ** 3
ROUND_BYTES = 256 * 1024 ** 2
_LOCALITY_SLACK = 1.10


@dataclass(frozen=True)
class Piece:
    """Elements [param_start, param_start+numel) of a tensor (of slice holder `tp_rank`'s local slice, when
    it is split: the tensor-parallel rank, or the expert-parallel rank for an expert), at shard_start of
    `rank`'s slot `slot`."""

    rank: int
    slot: int
    param_start: int
    numel: int
    shard_start: int
    tp_rank: int = 0


@dataclass
class TensorPlan:
    name: str
    shape: tuple
    dtype: torch.dtype
    trainable: bool
    states: dict = field(default_factory=dict)   # per-element optimizer state key -> dtype
    scalars: dict = field(default_factory=dict)  # scalar optimizer state key -> dtype
    pieces: list = field(default_factory=list)   # sorted by (tp_rank, param_start); one holder's when replicated;
    replicated: bool = False                     # empty: the tensor is whole on every rank
    writer: int = 0
    slices: dict = field(default_factory=dict)   # slice holder -> TensorSlice; empty: not split
    expert: bool = False                         # split over expert-parallel ranks (holders: ep ranks)
    group: int = -1                              # the optimizer param group of its master (-1: not trainable)

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    @property
    def model_key(self) -> str:
        """The tensor's name in the model weight files. A frozen base weight of a PEFT-wrapped model is stored
        under the base model's name (``base_model.model.X.base_layer.weight`` -> ``X.weight``), so
        ``from_pretrained(checkpoint)`` finds the base there and PEFT's adapter files beside it (transformers
        reads the weights under the base names and then loads ``adapter_model.safetensors``); the loader tries
        both names. Trainable tensors keep their own names: their masters and optimizer states are keyed by them."""
        if self.trainable or is_adapter_weight(self.name):
            return self.name
        return base_weight_name(self.name)

    @property
    def adapter(self) -> bool:
        """A trained PEFT adapter weight (LoRA A/B, trainable-token rows): not in the model weight files, which
        hold the base model's names only (``from_pretrained(checkpoint)`` then loads them with no unexpected key,
        and the adapter from ``adapter_model.safetensors`` beside them); its fp32 value is in the master files."""
        return self.trainable and is_adapter_weight(self.name)

    def kinds(self, master_separate: bool) -> list[tuple[str, torch.dtype]]:
        """(source kind, dtype) of every per-element tensor saved for this name, in write order."""
        if not self.trainable:
            return [("model", self.dtype)]
        kinds = [] if self.adapter else [("model", self.dtype)]
        if master_separate or self.adapter:
            kinds.append(("master", torch.float32))
        kinds += [(f"state:{key}", dtype) for key, dtype in sorted(self.states.items())]
        return kinds

    @property
    def in_place(self) -> bool:
        """Whether each holder writes its own pieces at their places in the file (no exchange): every tensor
        but a tensor-parallel or expert-parallel split one, whose slices are strided in the whole tensor and
        joined by its writer (`split.assemble_whole`) from pieces sent to it."""
        return not self.slices

    def nbytes(self, master_separate: bool) -> int:
        return self.numel * sum(itemsize(dtype) for _, dtype in self.kinds(master_separate))


@dataclass
class FileSpec:
    kind: str                # MODEL, MASTER or OPTIMIZER
    name: str                # file name inside the checkpoint directory
    writer: int
    entries: list            # (key, dtype, shape) in write order


@dataclass
class SavePlan:
    world: int
    master_separate: bool
    tensors: dict            # name -> TensorPlan, in state_dict order
    files: list              # FileSpec
    rounds: list             # [{writer: [names]}]
    splits: list             # per round: splits[sender][receiver] bytes exchanged (split tensors only)

    @property
    def master_files(self) -> bool:
        """Whether the checkpoint has master weight files (separate fp32 masters, or adapter weights)."""
        return any(spec.kind == MASTER for spec in self.files)

    def weight_map(self, kind: str) -> dict[str, str]:
        return {key: spec.name for spec in self.files if spec.kind == kind for key, _, _ in spec.entries}

    def total_size(self, kind: str) -> int:
        return sum(numel_of(shape) * itemsize(dtype) for spec in self.files if spec.kind == kind
                   for _, dtype, shape in spec.entries)

    def param_groups(self) -> list[list[str]]:
        """The trainable tensors of each optimizer param group, in state_dict order (recorded in trainer_state.json:
        what an export to another layout, e.g. DeepSpeed's flat groups, needs to rebuild the groups)."""
        groups: list[list[str]] = [[] for _ in range(1 + max((t.group for t in self.tensors.values()), default=-1))]
        for name, tensor in self.tensors.items():
            if tensor.trainable and tensor.group >= 0:
                groups[tensor.group].append(name)
        return groups

    def names_of(self, writer: int) -> list[str]:
        return [name for name, t in self.tensors.items() if t.writer == writer]

    def transfers(self, round_index: int, sender: int, receiver: int):
        """(name, kind, piece, nbytes) that `sender` sends `receiver` in a round, in canonical order."""
        for name in self.rounds[round_index].get(receiver, []):
            tensor = self.tensors[name]
            if not tensor.pieces or tensor.in_place:
                continue
            for kind, dtype in tensor.kinds(self.master_separate):
                size = itemsize(dtype)
                for piece in tensor.pieces:
                    if piece.rank == sender:
                        yield name, kind, piece, piece.numel * size


def extra_tensors(module: torch.nn.Module, sharded: set[str]) -> list[tuple[str, torch.Tensor]]:
    """State outside the slots (frozen parameters, persistent buffers), each tensor once under its first name."""
    seen, extras = set(), []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue  # tied: saved under its first name
        seen.add(id(tensor))
        if name not in sharded and torch.is_tensor(tensor):
            extras.append((name, tensor))
    return extras


def state_dict_order(module: torch.nn.Module) -> list[str]:
    seen, order = set(), []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            order.append(name)
    return order


def local_layout(state: CheckpointState, slots, rank: int) -> dict:
    """What this rank holds, as plain data: records, dtypes and optimizer state keys of each slot,
    and the TensorSlice of each tensor-parallel split parameter among them."""
    described, sharded = [], set(state.aliases)  # aliases: another rank saves the owner's tensor
    split = tensor_slices(state.module)
    group_of = {id(p): index for index, group in enumerate(state.optimizer.param_groups) for p in group["params"]}
    for slot in slots:
        elementwise, scalars = {}, {}
        if slot.master is not None:
            elementwise, scalars = split_state(state.optimizer.state.get(slot.master, {}), slot.master)
        records = [(r.name, tuple(int(s) for s in r.full_shape), int(r.param_start), int(r.numel), int(r.shard_start))
                   for r in slot.records if r.name not in state.aliases]
        sharded.update(r[0] for r in records)
        described.append({
            "trainable": slot.master is not None,
            "group": group_of.get(id(slot.master), -1) if slot.master is not None else -1,
            "replicated": bool(slot.replicated), "numel": int(slot.model_shard.numel()),
            "model_dtype": dtype_name(slot.model_shard.dtype), "records": records,
            "states": {k: dtype_name(v.dtype) for k, v in sorted(elementwise.items())},
            "scalars": {k: dtype_name(v.dtype) if torch.is_tensor(v) else "float64" for k, v in sorted(scalars.items())},
        })
    # Tensors outside the slots are whole on every rank, listed by rank 0; with pipeline parallelism each stage
    # holds its own layers', listed by the stage's first rank and written by one of the stage's ranks.
    topology = state.topology
    stage_world = topology.world_size // topology.pp_size
    lists = rank == 0 if topology.pp_size == 1 else rank % stage_world == 0
    extras = []
    if lists and not state.config.checkpoint.adapters_only:  # adapters_only: no frozen weights, no buffers
        extras = [(name, tuple(t.shape), dtype_name(t.dtype), name in split)
                  for name, t in extra_tensors(state.module, sharded)]
    experts = {name for name, _ in expert_params(state.module)}  # frozen ones too: refused by name
    return {"slots": described, "extras": extras, "order": state_dict_order(state.module) if lists else [],
            "extras_ranks": list(range(rank, rank + stage_world)) if lists and topology.pp_size > 1 else None,
            "tp_rank": int(state.topology.tp_rank),
            "dp_rank": int(state.topology.dp_rank), "ep_rank": int(state.ep_rank),
            "experts": sorted(experts),
            "slices": {name: split[name] for name in sorted(sharded) if name in split}}


def layout_digest(layout: dict) -> str:
    return hashlib.sha1(pickle.dumps(layout)).hexdigest()


def build_plan(layouts: list[dict], max_file_bytes: int = MAX_FILE_BYTES, round_bytes: int = ROUND_BYTES) -> SavePlan:
    """The one plan every rank computes from the all-gathered layouts."""
    world = len(layouts)
    tensors: dict[str, TensorPlan] = {}
    holders: dict[str, dict[int, list[Piece]]] = {}
    for rank, layout in enumerate(layouts):
        experts = set(layout.get("experts", ()))
        for index, slot in enumerate(layout["slots"]):
            states = {k: torch_dtype(v) for k, v in slot["states"].items()}
            scalars = {k: torch_dtype(v) for k, v in slot["scalars"].items()}
            for name, shape, param_start, numel, shard_start in slot["records"]:
                if name in experts and layout.get("tp_rank", 0) != 0:
                    continue  # experts are not split by tensor parallelism: TP rank 0's copy is saved
                tp_rank = _expert_rank(layout) if name in experts else layout.get("tp_rank", 0)  # slice holder
                tensor_slice = layout.get("slices", {}).get(name)
                shape = expected_shape(shape, tensor_slice, name)
                tensor = tensors.get(name)
                if tensor is None:
                    tensor = tensors[name] = TensorPlan(name, shape, torch_dtype(slot["model_dtype"]),
                                                        slot["trainable"], states, scalars,
                                                        replicated=slot["replicated"], expert=name in experts,
                                                        group=slot.get("group", -1))
                elif tensor.shape != shape or tensor.states != states or tensor.scalars != scalars or \
                        tensor.slices.get(tp_rank, tensor_slice) != tensor_slice or \
                        tensor.expert != (name in experts):
                    raise CheckpointError(f"ranks disagree about parameter {name!r} (shape, tensor-parallel slice, "
                                          f"or optimizer state keys {sorted(tensor.states)} vs {sorted(states)}); "
                                          f"cannot save")
                if tensor_slice is not None:
                    tensor.slices[tp_rank] = tensor_slice
                holders.setdefault(name, {}).setdefault(rank, []).append(
                    Piece(rank, index, param_start, numel, shard_start, tp_rank))
    refuse_split_extras([extra[0] for extra in layouts[0]["extras"]
                         if extra[0] not in tensors and len(extra) > 3 and extra[3]],
                        set(layouts[0].get("experts", ())))
    writers: dict[str, list[int]] = {}  # extras only some ranks hold (a pipeline stage's): who may write them
    for layout in layouts:  # rank 0 (each stage's first rank with a pipeline) lists every name outside its own
        for name, shape, dtype, *_ in layout["extras"]:  # slots; other ranks' slots hold some of them
            if name not in tensors:
                tensors[name] = TensorPlan(name, tuple(shape), torch_dtype(dtype), False)
                if layout.get("extras_ranks") is not None:
                    writers[name] = layout["extras_ranks"]
    order = {name: i for i, name in enumerate(name for layout in layouts for name in layout["order"])}
    tensors = dict(sorted(tensors.items(), key=lambda item: (order.get(item[0], len(order)), item[0])))
    master_separate = any(t.dtype != torch.float32 for t in tensors.values() if t.trainable)

    _assign_writers(tensors, holders, world, master_separate, writers)
    tp_ranks = sorted({layout.get("tp_rank", 0) for layout in layouts})
    ep_ranks = sorted({_expert_rank(layout) for layout in layouts})
    for name, tensor in tensors.items():
        if name in holders:
            tensor.pieces = _choose_pieces(tensor, holders[name], ep_ranks if tensor.expert else tp_ranks)
            _check_coverage(tensor)

    files = _plan_files(tensors, world, master_separate, max_file_bytes)
    rounds = _plan_rounds(tensors, world, master_separate, round_bytes)
    splits = [[[0] * world for _ in range(world)] for _ in rounds]
    for index, chunk in enumerate(rounds):
        for receiver, names in chunk.items():
            for name in names:
                tensor = tensors[name]
                for _, dtype in tensor.kinds(master_separate) if tensor.pieces and not tensor.in_place else ():
                    for piece in tensor.pieces:
                        splits[index][piece.rank][receiver] += piece.numel * itemsize(dtype)
    return SavePlan(world, master_separate, tensors, files, rounds, splits)


def _expert_rank(layout: dict) -> int:
    """The holder of a rank's expert slices: its position in its expert-parallel group."""
    return layout.get("ep_rank", layout.get("dp_rank", 0))


def _assign_writers(tensors: dict, holders: dict, world: int, master_separate: bool,
                    writers: dict[str, list[int]]) -> None:
    sizes = {name: t.nbytes(master_separate) for name, t in tensors.items()}
    cap = sum(sizes.values()) / world * _LOCALITY_SLACK
    loads = [0] * world
    for name in sorted(tensors, key=lambda n: (-sizes[n], n)):
        tensor = tensors[name]
        least = min(writers.get(name, range(world)), key=lambda r: (loads[r], r))
        writer = least
        if name in holders and not tensor.replicated:
            held = {r: sum(p.numel for p in ps) for r, ps in holders[name].items()}
            local = max(sorted(held), key=lambda r: held[r])
            if loads[local] + sizes[name] <= cap:
                writer = local
        tensor.writer = writer
        loads[writer] += sizes[name]


def _choose_pieces(tensor: TensorPlan, holders: dict[int, list[Piece]], tp_ranks: list[int]) -> list[Piece]:
    """The pieces the writer assembles: of every slice holder in `tp_ranks` (tensor-parallel ranks, or
    expert-parallel ranks for an expert) when the tensor is split, else of one (the writer's, when it holds
    some); within that, one rank's when the slot is replicated (a tensor-parallel slice replicated over
    the data-parallel ranks, or experts replicated over their expert-data-parallel group at stage 0)."""
    by_tp: dict[int, dict[int, list[Piece]]] = {}
    for rank, pieces in holders.items():
        by_tp.setdefault(pieces[0].tp_rank, {})[rank] = pieces
    if tensor.slices:
        missing = [r for r in tp_ranks if r not in tensor.slices]
        if missing:
            what = "expert-parallel ranks (experts)" if tensor.expert else "tensor-parallel ranks"
            raise CheckpointError(f"parameter {tensor.name!r} is split over {what} "
                                  f"{sorted(tensor.slices)} but not over {missing}; cannot save")
        groups = sorted(by_tp)
    else:
        writer_holds = holders.get(tensor.writer)
        groups = [writer_holds[0].tp_rank if writer_holds else min(by_tp)]
    chosen = []
    for group in groups:
        ranks = by_tp[group]
        if tensor.replicated:
            chosen += ranks[tensor.writer] if tensor.writer in ranks else ranks[min(ranks)]
        else:
            chosen += [piece for pieces in ranks.values() for piece in pieces]
    return sorted(chosen, key=lambda p: (p.tp_rank, p.param_start))


def _check_coverage(tensor: TensorPlan) -> None:
    """Each local tensor (the whole tensor when not split) is covered exactly once by the pieces."""
    groups: dict[int, list[Piece]] = {}
    for piece in tensor.pieces:
        groups.setdefault(piece.tp_rank, []).append(piece)
    for tp_rank, pieces in groups.items():
        tensor_slice = tensor.slices.get(tp_rank)
        holder = "expert-parallel" if tensor.expert else "tensor-parallel"
        what = repr(tensor.name) if tensor_slice is None else f"{holder} rank {tp_rank}'s slice of {tensor.name!r}"
        expected = numel_of(tensor_slice.local_shape) if tensor_slice is not None else tensor.numel
        position = 0
        for piece in pieces:
            if piece.param_start != position:
                raise CheckpointError(f"the shards of {what} do not cover it: elements from {position} "
                                      f"are {'missing' if piece.param_start > position else 'held twice'}")
            position += piece.numel
        if position != expected:
            raise CheckpointError(f"the shards of {what} cover {position} of its {expected} elements")


def _file_entries(tensor: TensorPlan, kind: str) -> list:
    if kind == MODEL:
        return [] if tensor.adapter else [(tensor.model_key, tensor.dtype, tensor.shape)]
    if not tensor.trainable:
        return []
    if kind == MASTER:
        return [(tensor.name, torch.float32, tensor.shape)]
    entries = [(f"{tensor.name}/{key}", dtype, tensor.shape) for key, dtype in sorted(tensor.states.items())]
    return entries + [(f"{tensor.name}/{key}", dtype, ()) for key, dtype in sorted(tensor.scalars.items())]


def _plan_files(tensors: dict, world: int, master_separate: bool, max_file_bytes: int) -> list[FileSpec]:
    files: list[FileSpec] = []
    separate = master_separate or any(t.adapter for t in tensors.values())
    for kind in ((MODEL, MASTER, OPTIMIZER) if separate else (MODEL, OPTIMIZER)):
        chunks: list[tuple[int, list]] = []
        for writer in range(world):
            current, size = [], 0
            for tensor in tensors.values():
                if tensor.writer != writer:
                    continue
                entries = _file_entries(tensor, kind)
                nbytes = sum(numel_of(shape) * itemsize(dtype) for _, dtype, shape in entries)
                if current and size + nbytes > max_file_bytes:
                    chunks.append((writer, current))
                    current, size = [], 0
                current += entries
                size += nbytes
            if current:
                chunks.append((writer, current))
        files += [FileSpec(kind, shard_file(kind, i, len(chunks)), writer, entries)
                  for i, (writer, entries) in enumerate(chunks)]
    return files


def _plan_rounds(tensors: dict, world: int, master_separate: bool, round_bytes: int) -> list[dict]:
    per_writer: list[list[list[str]]] = []
    for writer in range(world):
        chunks, current, size = [], [], 0
        for name, tensor in tensors.items():
            if tensor.writer != writer:
                continue
            nbytes = tensor.nbytes(master_separate)
            if current and size + nbytes > round_bytes:
                chunks.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            chunks.append(current)
        per_writer.append(chunks)
    count = max((len(chunks) for chunks in per_writer), default=0)
    return [{w: per_writer[w][k] for w in range(world) if k < len(per_writer[w])} for k in range(count)]

